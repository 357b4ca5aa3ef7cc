#!/usr/bin/env python3
"""Run the differential torture suite (tests/system/test_torture.py) with random seeds for as long as asked.

    python scripts/soak.py --minutes 60 [--ops 120] [--datapath passthrough] [--keep-going]

Each round picks a seed and runs every torture case with it (both data paths
unless ``--datapath``; the kill -9 case too).  A failing round prints the
command that replays it and the seed goes into tests/system/test_torture.py's CASES
by hand.  Needs what the test suite needs (root, /dev/fuse, the S3 server of
scripts/setup.sh --test).  Exit status: 0 when every round passed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0, help="how long to run (default 60)")
    ap.add_argument("--ops", type=int, default=120, help="operations per worker and round (default 120)")
    ap.add_argument("--datapath", choices=["passthrough", "kernel", "pyfuse3"], help="only this data path")
    ap.add_argument("--keep-going", action="store_true", help="go on after a failing round")
    ap.add_argument("--seed", type=int, help="the first seed (default: random)")
    args = ap.parse_args()

    rnd = random.Random(args.seed)
    deadline = time.monotonic() + args.minutes * 60
    rounds, failed = 0, []
    fd, tally = tempfile.mkstemp(prefix="aiturbofs-soak-", suffix=".jsonl")
    os.close(fd)
    while time.monotonic() < deadline:
        seed = args.seed if args.seed is not None and rounds == 0 else rnd.randrange(1000, 10**6)
        env = {**os.environ, "AITURBOFS_TORTURE_SEED": str(seed), "AITURBOFS_TORTURE_OPS": str(args.ops),
               "AITURBOFS_TORTURE_TALLY": tally}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "tests/system/test_torture.py"]
        if args.datapath:
            cmd += ["-k", args.datapath]
        started = time.monotonic()
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        rounds += 1
        took = time.monotonic() - started
        summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
        print(f"round {rounds} seed {seed}: {summary} ({took:.0f} s)", flush=True)
        if done.returncode != 0:
            failed.append(seed)
            replay = (f"AITURBOFS_TORTURE_SEED={seed} AITURBOFS_TORTURE_OPS={args.ops} "
                      + " ".join(shlex.quote(c) for c in cmd))
            print(done.stdout[-6000:], file=sys.stderr)
            print(f"replay: (cd {shlex.quote(REPO)} && {replay})", file=sys.stderr, flush=True)
            if not args.keep_going:
                break
    runs = [json.loads(line) for line in open(tally)]
    os.unlink(tally)
    print(f"{rounds} round(s), {len(failed)} failed{': seeds ' + ', '.join(map(str, failed)) if failed else ''}; "
          f"{len(runs)} runs of 4 workers: {sum(r['ops'] for r in runs)} operations, "
          f"{sum(r['bytes'] for r in runs) / 2**30:.1f} GiB written, {sum(r['kills'] for r in runs)} kill -9")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
