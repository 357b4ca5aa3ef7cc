"""``aiturbo`` — the operator's command: wait, status, drop-cache.

``aiturbo wait PATH...`` blocks until every regular file under the paths is
durable in the backend (future 1), showing bytes, rate and ETA; it exits 1
naming any broken file, 2 on usage errors (a path not on aiturbofs).
``aiturbo status [MOUNTPOINT]`` asks running daemons through their control
sockets.  ``aiturbo controller`` runs the cluster's job controller.
"""

import argparse
import errno
import functools
import glob
import json
import logging
import os
import sys
import time

from .._limits import CONTROLLER_BACKEND_GBPS_DEFAULT, WAIT_POLL_S

STATE_XATTR = "user.aiturbo.state"


def _files(paths: list[str]) -> list[tuple[str, int]]:
    out = []
    for top in paths:
        if os.path.isfile(top) and not os.path.islink(top):
            out.append((top, os.stat(top).st_size))
            continue
        if not os.path.isdir(top):
            raise FileNotFoundError(errno.ENOENT, "no such file or directory", top)
        for root, _, names in os.walk(top):
            for name in names:
                p = os.path.join(root, name)
                if os.path.isfile(p) and not os.path.islink(p):
                    out.append((p, os.stat(p).st_size))
    return out


def _state(path: str) -> str:
    return os.getxattr(path, STATE_XATTR).decode()


def cmd_wait(args) -> int:
    from tqdm import tqdm

    try:
        files = _files(args.paths)
        pending = dict(files)
        for path in list(pending):
            _state(path)  # fails early for paths outside aiturbofs
    except OSError as exc:
        print(f"aiturbo wait: {exc.filename or ''}: {exc.strerror} (is it on an aiturbofs mount?)", file=sys.stderr)
        return 2
    broken = []
    deadline = time.monotonic() + args.timeout if args.timeout else None
    total = sum(size for _, size in files)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="durable",
              disable=args.quiet, file=sys.stderr) as bar:
        while pending:
            for path, size in list(pending.items()):
                try:
                    state = _state(path)
                except FileNotFoundError:
                    state = "durable"  # removed meanwhile: nothing left to wait for
                if state in ("durable", "broken"):
                    del pending[path]
                    bar.update(size)
                    if state == "broken":
                        broken.append(path)
            if not pending:
                break
            if deadline and time.monotonic() > deadline:
                print(f"aiturbo wait: timed out; {len(pending)} file(s) not durable yet, e.g. {next(iter(pending))}", file=sys.stderr)
                return 3
            time.sleep(WAIT_POLL_S)
    if broken:
        for path in broken:
            print(f"aiturbo wait: broken: {path}", file=sys.stderr)
        return 1
    return 0


def _sockets(mountpoint: str | None) -> list[str]:
    from ..node import control_socket
    from ..node._paths import RUN_ROOT

    if mountpoint:
        return [control_socket(mountpoint)]
    return sorted(glob.glob(os.path.join(RUN_ROOT, "*.sock")))


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def _print_status(s: dict) -> None:
    pool, p = s["pool"], s["persist"]
    print(f"{s['mountpoint']}  <-  {s['backend']}   (up {s['uptime_s']:.0f} s)")
    print(f"  pool     {_human(pool['used_bytes'])} used of {_human(pool['budget_bytes'])}: "
          f"dirty {_human(pool['dirty_bytes'])}, clean {_human(pool['clean_bytes'])}, "
          f"open {_human(pool['open_bytes'])}, spilled {_human(pool['spilled_bytes'])}"
          + (f", {pool['waiting_writers']} writer(s) waiting" if pool["waiting_writers"] else ""))
    print(f"  persist  queue {p['queue']}, durable {p['files_durable']}, broken {p['files_broken']}, "
          f"uploaded {_human(p['bytes_uploaded'])}, retries {p['retries']}"
          + (f", copied server-side {_human(p['bytes_copied'])}" if p.get("bytes_copied") else ""))
    c = s.get("cluster")
    if c:
        ctl = c["controller"] or "none"
        if c["controller"]:
            ctl += " (connected)" if c["controller_connected"] else " (UNREACHABLE)"
        print(f"  cluster  node {c['node']} at {c['fabric']} ({c['transport']}), replicas {c['replicas']}, "
              f"controller {ctl}")
        print(f"           members {', '.join(c['members'])}" + (f"; dead {', '.join(c['dead'])}" if c["dead"] else ""))
        print(f"           rounds {c['rounds']} ({c['rounds_failed']} without a plan), replicated {_human(c['bytes_replicated'])}, "
              f"holding replicas of {c['replica_files_held']} file(s)")
    for path in p["queued"]:
        print(f"           - {path}")
    for name, g in s.get("groups", {}).items():
        print(f"  group {name}: {g['files']} file(s), {_human(g['bytes'])}, {g['chunks']} chunks, {g['distinct_chunks']} distinct")
    if s["errors"]:
        print("  recent errors:")
        for e in s["errors"]:
            print(f"    {e}")


def cmd_status(args) -> int:
    from ..node._control import call

    code = 0
    shown = 0
    for path in _sockets(args.mountpoint):
        try:
            s = call(path, {"cmd": "status"})
        except OSError as exc:
            if not args.mountpoint and isinstance(exc, (ConnectionRefusedError, FileNotFoundError)):
                # Listing every daemon: nobody listens on a socket left by a
                # daemon that was killed (-9) or just exited.  It is no running
                # daemon, and reporting it made every later status exit 1.
                continue
            print(f"aiturbo status: {path}: {exc.strerror or exc}", file=sys.stderr)
            code = 1
            continue
        shown += 1
        if args.json:
            print(json.dumps(s))
        else:
            _print_status(s)
    if not shown and not code:
        print("aiturbo status: no running aiturbofs daemon found", file=sys.stderr)
        return 1
    return code


def cmd_simple(args, request: dict) -> int:
    from ..node._control import call

    try:
        answer = call(_sockets(args.mountpoint)[0], request)
    except OSError as exc:
        print(f"aiturbo: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(json.dumps(answer))
    return 0 if answer.get("ok") else 1


def cmd_controller(args) -> int:
    import trio

    from .._errors import AiturboError
    from ..controller import run_controller

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def serve():
        async with trio.open_nursery() as nursery:
            address = await nursery.start(functools.partial(
                run_controller, args.listen, args.meta, args.secret_file, backend_gbps=args.backend_gbps))
            print(f"controller listening on {address}", flush=True)

    try:
        trio.run(serve)
    except AiturboError as exc:
        print(f"aiturbo controller: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="aiturbo", description="Operate aiturbofs mounts.")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait", help="block until files are durable in the backend, with progress")
    w.add_argument("paths", nargs="+", help="files or directories on an aiturbofs mount")
    w.add_argument("--timeout", type=float, default=0, help="give up after this many seconds (exit 3)")
    w.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    st = sub.add_parser("status", help="pool use, persist queue and recent errors of running daemons")
    st.add_argument("mountpoint", nargs="?", help="default: every daemon on this host")
    st.add_argument("--json", action="store_true")
    dc = sub.add_parser("drop-cache", help="evict clean (durable) chunks from a daemon's DRAM pool")
    dc.add_argument("mountpoint")
    df = sub.add_parser("debug-fault", help="(tests) make a handler raise once; needs -o debug_faults")
    df.add_argument("mountpoint")
    df.add_argument("handler")
    ct = sub.add_parser(
        "controller", help="run the job controller of a cluster (membership, group rounds, write plans)",
        description="Run the cluster's job controller: nodes (mount.aiturbo in cluster mode) join it over the "
                    "fabric, heartbeat, and report the files of their group rounds; it deduplicates each round "
                    "and answers with the staging and persist plan.  Membership is kept in the metadata engine, "
                    "so a restarted controller picks up the cluster again.  Stops cleanly on SIGTERM or SIGINT.")
    ct.add_argument("--listen", required=True, metavar="HOST:PORT",
                    help="fabric address to serve nodes on ([v6addr]:port for IPv6; port 0 picks a free one)")
    ct.add_argument("--meta", required=True, metavar="URL",
                    help="metadata engine shared with the nodes, e.g. postgresql://host/db or sqlite:///abs/path.db")
    ct.add_argument("--secret-file", required=True, metavar="FILE",
                    help="the cluster secret the nodes also use (mode 0600, owned by this user, >= 16 bytes)")
    ct.add_argument("--backend-gbps", type=float, default=CONTROLLER_BACKEND_GBPS_DEFAULT, metavar="G",
                    help="aggregate backend bandwidth in Gbit/s the planner assumes (default %(default)s)")
    ct.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                    help="log verbosity on stderr (default %(default)s)")
    args = p.parse_args(argv)
    if args.cmd == "wait":
        return cmd_wait(args)
    if args.cmd == "status":
        return cmd_status(args)
    if args.cmd == "controller":
        return cmd_controller(args)
    if args.cmd == "drop-cache":
        return cmd_simple(args, {"cmd": "drop-cache"})
    return cmd_simple(args, {"cmd": "debug-fault", "handler": args.handler})


if __name__ == "__main__":
    sys.exit(main())
