"""Check-list helpers for Python tests that drive the daemons and print one line a check
(tests/security/*.py): check() records failures, eventually() polls, finish() prints the
summary, keeps the work directory only when something failed, and gives the exit status."""
import shutil
import time

failures = []


def check(cond, what, detail=""):
    print(("ok   " if cond else "FAIL ") + what + ("" if cond else f"\n     {detail}"))
    if not cond:
        failures.append(what)


def eventually(fn, timeout=30, period=0.5):
    """True once fn() is true, polled every period seconds for at most timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if fn():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(period)  # bounded poll of a real daemon


def finish(work):
    """Exit status of the test; removes `work` unless a check failed."""
    if failures:
        print(f"logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0
