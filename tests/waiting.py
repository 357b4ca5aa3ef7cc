"""Waiting for what a mount does in the background: a condition polled until it holds, a blocking call in a thread."""

import threading
import time

WAIT_S = 60.0  # generous bound on "becomes durable" for tens of MiB on this machine


def wait_until(predicate, timeout_s: float = WAIT_S, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def in_thread(fn, *args):
    """Run ``fn`` in a thread; returns (thread, box) where box gets 'result' or 'error'."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box
