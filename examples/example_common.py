"""What the example trainers (train_gpt.py, train_moe.py) share: synthetic data,
argument parsing helpers and their JSON-lines output."""
import argparse
import json
import sys

import torch


def batch(gen, batch_size, seq, vocab):
    """Synthetic token streams with structure to learn: arithmetic sequences mod vocab, 10% noise."""
    start = torch.randint(0, vocab, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 8, (batch_size, 1), generator=gen)
    toks = (start + stride * torch.arange(seq + 1)) % vocab
    noise = torch.rand(batch_size, seq + 1, generator=gen) < 0.1
    toks = torch.where(noise, torch.randint(0, vocab, (batch_size, seq + 1), generator=gen), toks)
    return toks[:, :-1], toks[:, 1:]


def positive(name):
    """An argparse type: an integer >= 1, with `name` in its error message."""
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}")
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v
    return parse


def emit(**kw):
    """One JSON object on a line of stdout (the examples' event stream)."""
    print(json.dumps(kw), flush=True)


def crash(rank, step, log):
    """--crash-at: says so, closes the loss log and SIGKILLs this process (a node failure)."""
    import os
    import signal
    emit(event="crash", rank=rank, step=step, pid=os.getpid())
    if log:
        log.close()
    os.kill(os.getpid(), signal.SIGKILL)


def run(main, argv, program):
    """Exit status of main(argv): ckpt errors are printed as one line and exit 1."""
    import ckpt
    try:
        return main(argv)
    except ckpt.Error as e:
        print(f"{program}: ckpt error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
