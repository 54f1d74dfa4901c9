#!/usr/bin/python3
"""Unit test of tests/chaos/history_check.py (issue 36): hand-made histories, one that holds
every invariant and one that breaks each of them; the checker must pass the first and name the
broken invariant in each other. Pure Python, no daemons."""
import pathlib
import sys
import unittest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import history_check  # noqa: E402

A, B = "a" * 64, "b" * 64


def setup(tol=1, keep=3):
    return {"type": "setup", "jobs": {"j": {"tolerance": tol, "keep": keep, "world": 1}}}


def op(op, t, ok=True, answer=None, process="r0", **args):
    return {"type": "op", "process": process, "op": op, "args": args, "t_call": t, "t_ans": t + 0.5, "ok": ok,
            "answer": answer or {}}


def saved(step, t, sha=A):
    return [op("save", t, job="j", step=step, rank=0, sha256=sha),
            op("wait", t + 1, job="j", step=step, level="staged"),
            op("wait", t + 2, job="j", step=step, level="protected")]


def fault(fid, phase, t, kind="kill", nodes=("n1",), lost=False):
    return {"type": "fault", "phase": phase, "id": fid, "kind": kind, "nodes": list(nodes), "lost": lost, "t": t}


def heal(t, ok=True):
    return {"type": "heal", "ok": ok, "t": t}


def load(step, t, ok=True, sha=A, process="r0"):
    return op("load", t, ok=ok, answer={"sha256": sha} if ok else {"error": "NotFound"}, process=process,
              job="j", step=step, rank=0)


def latest(t, step, process="r0"):
    return op("latest", t, answer={"step": step}, process=process, job="j", level="protected")


class HistoryCheckTest(unittest.TestCase):
    def kinds(self, records):
        v, _ = history_check.check(records)
        return sorted({x.split(":")[0] for x in v}), v

    def test_good_history_passes(self):
        h = [setup()] + saved(1, 0) + [latest(3, 1), fault(1, "start", 4, lost=True), load(1, 5, ok=False),
                                        fault(1, "end", 6), heal(7), load(1, 8), latest(9, 1)]
        h += saved(2, 10) + [latest(13, 2), load(2, 14)]
        kinds, v = self.kinds(h)
        self.assertEqual(kinds, [], v)

    def test_wrong_bytes(self):
        kinds, _ = self.kinds([setup()] + saved(1, 0) + [load(1, 5, sha=B)])
        self.assertEqual(kinds, ["bytes"])

    def test_acknowledged_version_not_restorable(self):
        kinds, v = self.kinds([setup()] + saved(1, 0) + [load(1, 5, ok=False)])
        self.assertEqual(kinds, ["durable"], v)

    def test_loss_within_tolerance_still_requires_the_version(self):
        h = [setup(tol=1)] + saved(1, 0) + [fault(1, "start", 4, lost=True), fault(1, "end", 5), heal(6),
                                            load(1, 7, ok=False)]
        kinds, _ = self.kinds(h)
        self.assertEqual(kinds, ["durable"])

    def test_loss_beyond_tolerance_excuses_the_version(self):
        h = [setup(tol=1)] + saved(1, 0) + [fault(1, "start", 4, nodes=("n1", "n2"), lost=True),
                                            fault(1, "end", 5), heal(6), load(1, 7, ok=False)]
        kinds, v = self.kinds(h)
        self.assertEqual(kinds, [], v)

    def test_two_losses_with_a_heal_between_are_within_tolerance(self):
        h = [setup(tol=1)] + saved(1, 0) + [fault(1, "start", 4, lost=True), fault(1, "end", 5), heal(6),
                                            fault(2, "start", 7, nodes=("n2",), lost=True), fault(2, "end", 8),
                                            heal(9), load(1, 10, ok=False)]
        kinds, _ = self.kinds(h)
        self.assertEqual(kinds, ["durable"])

    def test_failed_heal_keeps_the_loss(self):
        h = [setup(tol=1)] + saved(1, 0) + [fault(1, "start", 4, lost=True), fault(1, "end", 5), heal(6, ok=False),
                                            fault(2, "start", 7, nodes=("n2",), lost=True), fault(2, "end", 8),
                                            heal(9), load(1, 10, ok=False)]
        kinds, v = self.kinds(h)
        self.assertEqual(kinds, [], v)

    def test_retention_excuses_old_versions(self):
        h = [setup(keep=2)] + saved(1, 0) + saved(2, 10) + saved(3, 20) + [load(1, 30, ok=False)]
        kinds, v = self.kinds(h)
        self.assertEqual(kinds, [], v)

    def test_never_staged_version_restored(self):
        h = [setup(), op("save", 0, job="j", step=5, rank=0, sha256=A), load(5, 2)]
        kinds, _ = self.kinds(h)
        self.assertEqual(kinds, ["staged"])

    def test_never_saved_rank_restored(self):
        kinds, _ = self.kinds([setup(), load(7, 2)])
        self.assertEqual(kinds, ["staged"])

    def test_latest_goes_back(self):
        h = [setup()] + saved(1, 0) + saved(2, 10) + [latest(20, 2, "r0"), latest(22, 1, "r1")]
        kinds, _ = self.kinds(h)
        self.assertEqual(kinds, ["monotonic"])

    def test_latest_goes_back_to_none(self):
        h = [setup()] + saved(1, 0) + [latest(20, 1), latest(22, None)]
        kinds, _ = self.kinds(h)
        self.assertEqual(kinds, ["monotonic"])

    def test_concurrent_latest_may_differ(self):
        a = latest(20, 2, "r0")
        b = latest(20.2, 1, "r1")  # called before a answered (20.5): either order is linearizable
        kinds, v = self.kinds([setup()] + saved(1, 0) + saved(2, 10) + [a, b])
        self.assertEqual(kinds, [], v)

    def test_history_file_round_trip(self):
        import json
        import tempfile
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            for r in [setup()] + saved(1, 0) + [load(1, 5, sha=B)]:
                f.write(json.dumps(r) + "\n")
        v, stats = history_check.check(history_check.load_history(f.name))
        pathlib.Path(f.name).unlink()
        self.assertEqual(len(v), 1)
        self.assertEqual(stats["acked_protected"], 1)


if __name__ == "__main__":
    unittest.main()
