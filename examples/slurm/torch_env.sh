#!/bin/sh
# srun ... examples/slurm/torch_env.sh python3 examples/train_torchrun.py
# torch.distributed's env:// variables from Slurm's, for one task per rank started by srun:
# RANK, WORLD_SIZE and LOCAL_RANK from SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID;
# MASTER_ADDR the first node of the job (unless set); MASTER_PORT (unless set) a port derived
# from the job and step ids, so two steps of a job, or two jobs on a node, rarely meet.
# ckpt.Client() then takes rank and world size from torch.distributed and the job from
# SLURM_JOB_ID (kept when the job is requeued; docs/python.md).
set -eu
: "${SLURM_PROCID:?not started by srun}" "${SLURM_NTASKS:?not started by srun}"
export RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS" LOCAL_RANK="${SLURM_LOCALID:-0}"
if [ -z "${MASTER_ADDR:-}" ]; then
  MASTER_ADDR=$(scontrol show hostnames "${SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}" 2>/dev/null | head -n 1)
  export MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
fi
if [ -z "${MASTER_PORT:-}" ]; then
  export MASTER_PORT=$((20000 + (${SLURM_JOB_ID:-0} * 64 + ${SLURM_STEP_ID:-0}) % 20000))
fi
exec "$@"
