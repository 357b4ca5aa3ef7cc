"""The differential torture suite: random operations of several processes against an oracle.

Four processes (tests/torture.py) each run random operations on files of their own: creates with
O_TRUNC, pwrites at random offsets, appends, truncates, writes through a shared mapping, renames,
links, unlinks of open files, chmod, copies; much of the content is the same chunks in every file
and process, so deduplication is hot.  Under a small DRAM budget, on each data path, over file://
and S3: every read a worker does is checked as it goes; then every name must be exact through the
mount, in the backend after ``aiturbo wait`` (and ``aiturbo verify`` finds nothing), and through a
remount with a fresh state dir.  The kill -9 variant kills the daemon at a random moment and
restarts it: every name an operation in flight did not touch is exact, the others hold one of that
operation's commit points, and nothing else is ever served.

Seeds are fixed here; ``scripts/soak.py`` runs random ones for as long as asked and prints a
failing seed's replay command.  A seed that ever failed is added to CASES.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import secrets
import signal
import subprocess
import sys
import time

import pytest
import torture
from mounting import aiturbo
from s3server import S3Server
from torture import allows

TORTURE = torture.__file__  # the workers' program, run as a script

pytestmark = pytest.mark.slow  # ten minutes in all on a 2-core host: over a minute per case of random operations

WORKERS = 4
OPS = 60
# (backend, dram, spill dir, seed): each on every data path.  A seed that ever failed is added here.
CASES = [("file", "64M", True, 1), ("file", "64M", True, 2), ("s3", "64M", False, 1), ("file", "1G", False, 2)]
KILL_SEEDS = [11, 12]
# scripts/soak.py: one seed of its own on each kind of case, and more operations
if os.environ.get("AITURBOFS_TORTURE_SEED"):
    _seed = int(os.environ["AITURBOFS_TORTURE_SEED"])
    CASES = sorted({(b, d, s, _seed) for b, d, s, _ in CASES})
    KILL_SEEDS = [_seed]
OPS = int(os.environ.get("AITURBOFS_TORTURE_OPS", OPS))


def run_workers(root: str, seed: int, out_dir: str, *, ops: int = OPS, workers: int = WORKERS,
                kill_after_s: float | None = None, kill=None) -> list[dict]:
    """Run the workers on ``root``; with ``kill_after_s``, call ``kill()`` that long after they started."""
    procs = []
    for w in range(workers):
        out = os.path.join(out_dir, f"oracle-{seed}-{w}.pickle")
        procs.append((out, subprocess.Popen([sys.executable, TORTURE, root, str(w),
                                             str(seed), str(ops), out], stderr=subprocess.PIPE, text=True)))
    if kill_after_s is not None:
        deadline = time.monotonic() + kill_after_s
        while time.monotonic() < deadline and any(p.poll() is None for _, p in procs):
            time.sleep(0.05)
        kill()
    results = []
    for out, p in procs:
        _, err = p.communicate(timeout=600)
        if p.returncode == -signal.SIGBUS and kill_after_s is not None and os.path.exists(out + ".cut"):
            out += ".cut"  # killed by a store through a mapping of the dead mount: what it left says so
        else:
            assert p.returncode == 0, f"a worker failed (seed {seed}):\n{err[-4000:]}"
        with open(out, "rb") as f:
            results.append(pickle.load(f))
    tally = os.environ.get("AITURBOFS_TORTURE_TALLY")  # scripts/soak.py sums these
    if tally:
        with open(tally, "a") as f:
            f.write(json.dumps({"seed": seed, "ops": sum(r["ops"] for r in results),
                                "bytes": sum(r["bytes"] for r in results), "kills": int(kill_after_s is not None)}) + "\n")
    return results


def expected(results: list[dict]) -> tuple[dict, dict]:
    """(exact, maybe) by path relative to the root: what each name must hold (None: absent), and the
    states allowed for the names of an operation a kill cut."""
    exact, maybe = {}, {}
    for w, r in enumerate(results):
        exact.update({f"w{w}/{n}": s for n, s in r["oracle"].items()})
        maybe.update({f"w{w}/{n}": s for n, s in r["maybe"].items()})
    return exact, maybe


def read_tree(root: str, *, modes: bool = True):
    def read(path: str):
        p = os.path.join(root, path)
        try:
            with open(p, "rb") as f:
                data = f.read()
            return data, (os.stat(p).st_mode & 0o7777 if modes else None)
        except FileNotFoundError:
            return None
    return read


def differences(exact: dict, maybe: dict, read, *, modes: bool = True) -> list[str]:
    """Every name whose state ``read`` gives is not the oracle's (or, cut by a kill, none of the allowed)."""
    bad = []
    for path, want in sorted(exact.items()):
        got = read(path)
        if not allows(want, got, modes):
            bad.append(f"{path}: {describe(got)}, want {describe(want)}")
    for path, allowed in sorted(maybe.items()):
        got = read(path)
        if not any(allows(a, got, modes) for a in allowed):
            bad.append(f"{path}: {describe(got)}, want one of {[describe(a) for a in allowed]}")
    return bad


def describe(state) -> str:
    if state is None:
        return "absent"
    if state[0] == "prefix":
        return f"{describe(state[1:3])} with a prefix of {len(state[4])} bytes at {state[3]}"
    import hashlib
    return f"{len(state[0])} bytes {hashlib.sha256(state[0]).hexdigest()[:12]} mode {state[1]:o}" \
        if state[1] is not None else f"{len(state[0])} bytes {hashlib.sha256(state[0]).hexdigest()[:12]}"


def no_bug_in(mnt) -> None:
    log = mnt.log()
    for marker in ("BUG", "Traceback", "Fatal Python error", "staging invariant"):
        assert marker not in log, f"daemon log has {marker!r}:\n{log[-4000:]}"


@pytest.fixture
def backend_of(request, tmp_path):
    """``backend_of(kind)`` -> (url, options, read(path) of what the backend holds, names(prefix))."""
    def make(kind: str):
        if kind == "s3":
            server: S3Server = request.getfixturevalue("s3_server")
            bucket = server.make_bucket(f"torture-{secrets.token_hex(6)}")
            client = server.client()

            def read(path: str):
                try:
                    return client.get_object(Bucket=bucket, Key=f"pre/{path}")["Body"].read(), None
                except client.exceptions.NoSuchKey:
                    return None
            return f"s3://{bucket}/pre", {"s3_endpoint": server.endpoint}, read
        d = tmp_path / "backend"
        d.mkdir()
        return f"file://{d}", {}, read_tree(str(d), modes=False)
    return make


@pytest.mark.parametrize("backend, dram, spill, seed", CASES)
def test_random_operations_of_four_processes_land_exact(seed, backend, dram, spill, datapath, make_mount,
                                                        backend_of, tmp_path):
    url, opts, stored = backend_of(backend)
    if spill:
        opts["spill"] = str(tmp_path / "spill")
    mnt = make_mount(url, dram=dram, **opts)
    results = run_workers(mnt.mountpoint, seed, str(tmp_path))
    exact, maybe = expected(results)
    assert not maybe
    refused = sum(r["fallocate_refused"] for r in results)
    assert refused == 0 or datapath == "pyfuse3", f"{refused} fallocate calls got EOPNOTSUPP"  # (pyfuse3 has none)
    assert differences(exact, {}, read_tree(mnt.mountpoint)) == [], "the mount serves other bytes or modes"
    done = aiturbo("wait", mnt.mountpoint, check=False, timeout=300)
    assert done.returncode == 0, done.stderr
    assert differences(exact, {}, stored, modes=False) == [], "the backend holds other bytes"
    verified = aiturbo("verify", "-q", mnt.mountpoint, check=False, timeout=300)
    assert verified.returncode == 0, verified.stderr
    no_bug_in(mnt)
    assert mnt.stop() == 0
    assert differences(exact, {}, stored, modes=False) == [], "the backend holds other bytes after unmount"

    fresh = make_mount(url, name="fresh", **opts)
    assert differences(exact, {}, read_tree(fresh.mountpoint, modes=False), modes=False) == [], \
        "a fresh mount serves other bytes"
    no_bug_in(fresh)


@pytest.mark.parametrize("seed", KILL_SEEDS)
def test_a_kill_9_at_a_random_moment_serves_only_what_was_written(seed, datapath, make_mount, tmp_path):
    (tmp_path / "backend").mkdir()
    url = f"file://{tmp_path / 'backend'}"
    mnt = make_mount(url, dram="64M")
    kill_after = random.Random(seed).uniform(1.0, 6.0)
    # Only the daemon dies: the workers' next calls get ENOTCONN (an unmount would send them below it).
    results = run_workers(mnt.mountpoint, seed, str(tmp_path), ops=200, kill_after_s=kill_after,
                          kill=lambda: mnt.proc.kill())
    mnt.kill()  # (clears the dead mount)
    exact, maybe = expected(results)
    mnt.start()  # the same state dir: recovery
    read = read_tree(mnt.mountpoint)
    assert differences(exact, maybe, read) == [], "after kill -9: other bytes or modes"
    served = {path: read(path) for path in {**exact, **maybe}}
    done = aiturbo("wait", mnt.mountpoint, check=False, timeout=300)
    assert done.returncode == 0, done.stderr
    backend = read_tree(str(tmp_path / "backend"), modes=False)
    assert differences(served, {}, backend, modes=False) == [], "the backend holds other bytes than are served"
    verified = aiturbo("verify", "-q", mnt.mountpoint, check=False, timeout=300)
    assert verified.returncode == 0, verified.stderr
    no_bug_in(mnt)
