"""``aiturbo`` — the operator's command: wait, status, drop-cache.

``aiturbo wait PATH...`` blocks until every regular file under the paths is
durable in the backend (future 1), and so is every directory the backend
keeps, with its symlinks and special files (see docs/design.md, "What the
backend holds"), showing bytes, rate and ETA; it exits 1 naming any broken file, 2 on usage errors (a path not on aiturbofs),
3 when ``--timeout`` passed.  It is ``aiturbofs.wait`` (``_wait.py``) with a progress bar.
``aiturbo status [MOUNTPOINT]`` asks running daemons through their control
sockets.  ``aiturbo controller`` runs the cluster's job controller.
"""

import argparse
import errno
import functools
import glob
import json
import os
import sys

from .._control_client import mount_points
from .._limits import (
    CHUNK_BYTES,
    CONFIG_PATH_DEFAULT,
    CONTROLLER_BACKEND_GBPS_DEFAULT,
    METRICS_CONTROLLER_ADDRESS_DEFAULT,
    STATUS_LIST_MAX,
    VERIFY_CHUNKS_PER_CALL,
)
from .._nursery import open_nursery
from .._version import VersionAction

# Commands for tests: they work, but ``aiturbo --help`` does not list them (``_test_parser``).
TEST_COMMANDS = frozenset({"debug-fault"})


def _files(paths: list[str]) -> list[tuple[str, int]]:
    """(path, size) of what ``aiturbo wait`` waits for under ``paths``: regular files, and the directories
    that have a durability state (size 0)."""
    from .._wait import targets_under

    return [(t.path, t.size) for t in targets_under(paths)]


def cmd_wait(args) -> int:
    """``aiturbo wait``: ``aiturbofs.wait`` with a progress bar; exit 0 durable, 1 broken, 2 not on
    aiturbofs (or no answer from the daemon), 3 timed out."""
    from tqdm import tqdm

    from .._wait import BrokenFiles, WaitTimeout, wait

    bars: list = []

    def progress(done: int, total: int) -> None:
        if not bars:
            bars.append(tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="durable",
                             disable=args.quiet, file=sys.stderr))
        bars[0].update(done - bars[0].n)

    try:
        wait(args.paths, timeout=args.timeout or None, progress=progress)
    except WaitTimeout as exc:
        print(f"aiturbo wait: timed out; {len(exc.paths)} file(s) not durable yet, e.g. {exc.paths[0]}", file=sys.stderr)
        return 3
    except BrokenFiles as exc:
        _close(bars)
        for path in exc.paths:
            print(f"aiturbo wait: broken: {path}", file=sys.stderr)
        return 1
    except ConnectionError as exc:
        print(f"aiturbo wait: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"aiturbo wait: {exc.filename or ''}: {exc.strerror} (is it on an aiturbofs mount?)", file=sys.stderr)
        return 2
    finally:
        _close(bars)
    return 0


def _close(bars: list) -> None:
    while bars:
        bars.pop().close()


def cmd_verify(args) -> int:
    """Check every durable file under the paths against its backend object (see persist/_verify.py);
    with ``--repair``, upload the files found wrong again from copies held in the mount."""
    try:
        files = [(path, size) for path, size in _files(args.paths) if not os.path.isdir(path)]
        points = mount_points()
        mounts = {path: _mount_of(path, points) for path, _ in files}
        sockets = {path: _sockets(mount)[0] for path, mount in mounts.items()}
    except OSError as exc:
        print(f"aiturbo verify: {exc.filename or ''}: {exc.strerror} (is it on an aiturbofs mount?)", file=sys.stderr)
        return 2
    try:
        found = _verify_files(files, sockets, args.quiet)
        if not args.repair or not found:
            return 1 if found else 0
        queued = []
        for path in found:
            answer = _call(sockets[path], {"cmd": "repair", "ino": os.stat(path).st_ino})
            if answer["missing"]:
                print(f"aiturbo verify: {path}: not repaired: no copy of chunks "
                      f"{', '.join(map(str, answer['missing']))} is held in the mount or by a peer", file=sys.stderr)
            elif answer["changed"]:
                print(f"aiturbo verify: {path}: not repaired: it changed meanwhile (now {answer['state']})",
                      file=sys.stderr)
            else:
                queued.append(path)
        if not queued:
            return 1
        print(f"aiturbo verify: re-uploading {len(queued)} file(s) from the mount's copies", file=sys.stderr)
        waited = cmd_wait(argparse.Namespace(paths=queued, timeout=0, quiet=args.quiet))
        still = _verify_files([(path, os.stat(path).st_size) for path in queued], sockets, args.quiet)
        print(f"aiturbo verify: {len(queued) - len(still)} of {len(found)} file(s) repaired", file=sys.stderr)
        return 1 if waited or still or len(queued) < len(found) else 0
    except _ControlError as exc:
        print(f"aiturbo verify: {exc}", file=sys.stderr)
        return 2


class _ControlError(Exception):
    """A daemon did not answer a control request, or refused it."""


def _call(sock: str, request: dict) -> dict:
    from ..node._control import call

    try:
        answer = call(sock, request)
    except OSError as exc:
        raise _ControlError(f"{sock}: {exc.strerror or exc}") from exc
    if not answer.get("ok"):
        raise _ControlError(f"{request.get('cmd')}: {answer.get('error')}")
    return answer


def _verify_files(files: list[tuple[str, int]], sockets: dict[str, str], quiet: bool) -> dict[str, list[str]]:
    """Verify each file chunk by chunk (``sockets``: its daemon's, by path); print and return the problems
    found, by path."""
    from tqdm import tqdm

    checked = skipped = unhashed = 0
    found: dict[str, list[str]] = {}
    with tqdm(total=sum(size for _, size in files), unit="B", unit_scale=True, unit_divisor=1024, desc="verified",
              disable=quiet, file=sys.stderr) as bar:
        for path, size in files:
            sock, ino, first, n = sockets[path], os.stat(path).st_ino, 0, None
            while n is None or first < n:
                answer = _call(sock, {"cmd": "verify", "ino": ino, "first": first, "count": VERIFY_CHUNKS_PER_CALL})
                n = answer["chunks"]
                for p in answer["problems"]:
                    chunks = f" (chunks {', '.join(map(str, p['chunks']))})" if p["chunks"] else ""
                    found.setdefault(path, []).append(f"backend object {p['path']!r}: {p['what']}{chunks}")
                    print(f"aiturbo verify: {path}: {found[path][-1]}", file=sys.stderr)
                if answer["state"] != "durable":
                    break
                bar.update(min(size, (first + VERIFY_CHUNKS_PER_CALL) * CHUNK_BYTES) - min(size, first * CHUNK_BYTES))
                first += VERIFY_CHUNKS_PER_CALL
            if answer["state"] != "durable":
                skipped += 1
                bar.update(size)
            else:
                checked += 1
                unhashed += not answer.get("hashed", True)
    problems = sum(map(len, found.values()))
    print(f"aiturbo verify: {checked} durable file(s) checked, {problems} problem(s); {skipped} not durable "
          f"(skipped){f'; {unhashed} imported and never read whole (size checked only)' if unhashed else ''}",
          file=sys.stderr)
    return found


def _mount_of(path: str, points: list[str]) -> str:
    """The mount point of ``points`` that ``path`` is on (the longest one above it)."""
    target = os.path.abspath(path)
    above = [p for p in points if target == p or target.startswith(p.rstrip("/") + "/")]
    if not above:
        raise OSError(errno.EINVAL, "not on an aiturbofs mount", path)
    return max(above, key=len)


def _sockets(mountpoint: str | None) -> list[str]:
    from ..node import control_socket
    from ..node._paths import RUN_ROOT

    if mountpoint:
        return [control_socket(mountpoint)]
    return sorted(glob.glob(os.path.join(RUN_ROOT, "*.sock")))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def _print_status(s: dict, clusters_shown: set) -> None:
    """One daemon's status, on one screen; a cluster's node table once per cluster."""
    pool, p = s["pool"], s["persist"]
    print(f"{s['mountpoint']}  <-  {s['backend']}   (up {s['uptime_s']:.0f} s)   metrics {s.get('metrics') or 'off'}")
    b = s.get("backend_state") or {"available": True}
    if not b["available"]:
        print(f"  backend  unavailable since {b['since']}: {b['reason']} (writes are staged; persisted when it answers)")
    print(f"  pool     {_human(pool['used_bytes'])} used of {_human(pool['budget_bytes'])}: "
          f"dirty {_human(pool['dirty_bytes'])}, clean {_human(pool['clean_bytes'])}, "
          f"open {_human(pool['open_bytes'])}, spilled {_human(pool['spilled_bytes'])}"
          + (f", {pool['waiting_writers']} writer(s) waiting" if pool["waiting_writers"] else ""))
    if pool.get("disk_dirty_bytes") or pool.get("disk_clean_bytes"):
        print(f"  on disk  files the kernel wrote: dirty {_human(pool['disk_dirty_bytes'])}, "
              f"clean {_human(pool['disk_clean_bytes'])} (page cache, outside the budget)")
    staging = s.get("staging")
    if staging:
        print(f"  staging  {staging['dir']}: {_human(staging['allocated_bytes'])} in backing files (DRAM if a tmpfs)")
    f = s.get("fuse")
    if f:
        print(f"  fuse     {f['datapath']} data path; kernel passthrough "
              f"{'available' if f['passthrough_available'] else 'unavailable'}: {f['passthrough']}")
        if "requests" in f:
            print(f"           {f['requests']} requests ({f['read']} READ, {f['write']} WRITE); "
                  f"{f['passthrough_files']} file(s) handed to the kernel")
    print(f"  persist  queue {p['queue']}, durable {p['files_durable']}, broken {p['files_broken']}, "
          f"uploaded {_human(p['bytes_uploaded'])}, retries {p['retries']}"
          + (f", copied server-side {_human(p['bytes_copied'])}" if p.get("bytes_copied") else ""))
    _print_list("queued", p["queued"], p["queue"])
    c = s.get("cluster")
    if c:
        ctl = c["controller"] or "none"
        if c["controller"]:
            ctl += " (connected)" if c["controller_connected"] else " (UNREACHABLE)"
        print(f"  cluster  node {c['node']} at {c['fabric']} ({c['transport']}), replicas {c['replicas']}, "
              f"controller {ctl}")
        print(f"           rounds {c['rounds']} ({c['rounds_failed']} without a plan), replicated {_human(c['bytes_replicated'])}, "
              f"holding replicas of {c['replica_files_held']} file(s)")
        nodes = s.get("nodes") or []
        members = frozenset((n["node"], n["fabric"]) for n in nodes)  # names alone: two test clusters share them
        if members and members not in clusters_shown:
            clusters_shown.add(members)
            _print_nodes(nodes)
    for name, g in s.get("groups", {}).items():
        print(f"  group {name}: {g['files']} file(s), {_human(g['bytes'])}, {g['chunks']} chunks, {g['distinct_chunks']} distinct")
    if s["errors"]:
        _print_list("recent errors", s["errors"][-STATUS_LIST_MAX:], len(s["errors"]))


def _print_list(title: str, items: list, total: int) -> None:
    if not items:
        return
    print(f"  {title}:")
    for item in items[:STATUS_LIST_MAX]:
        print(f"    {item}")
    if total > STATUS_LIST_MAX:
        print(f"    ... {total - STATUS_LIST_MAX} more")


_NODE_COLUMNS = "  {:<12} {:<5} {:>5} {:>21} {:>9} {:>5} {:>7} {:>6} {:>9}  {}"


def _print_nodes(nodes: list[dict]) -> None:
    """One line per node of the cluster, from the summaries the nodes last sent."""
    print(_NODE_COLUMNS.format("NODE", "STATE", "SEEN", "POOL USED / BUDGET", "DIRTY", "QUEUE", "DURABLE", "BROKEN",
                               "UPLOADED", "METRICS"))
    for n in nodes:
        known = "pool_used" in n  # a node that never sent a summary (an older daemon, or just joined)
        pool = f"{_human(n['pool_used'])} / {_human(n['pool_budget'])}" if known else "-"
        print(_NODE_COLUMNS.format(
            n["node"][:12], n["state"], f"{n['seen_s_ago']:.0f}s", pool,
            _human(n["dirty"]) if known else "-", n.get("queue", "-"), n.get("durable", "-"), n.get("broken", "-"),
            _human(n["uploaded"]) if known else "-", n.get("metrics") or "-"))


def cmd_status(args) -> int:
    from ..node._control import call

    code = 0
    shown = 0
    clusters_shown: set = set()
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
            _print_status(s, clusters_shown)
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
    from ..node._metrics import controller_endpoint
    from ..node._sdnotify import READY, notify
    from ._journal import log_to_stderr

    missing = [f"--{name.replace('_', '-')}" for name in ("listen", "meta", "secret_file") if not getattr(args, name)]
    if missing:
        print(f"aiturbo controller: {', '.join(missing)} missing: give them, or set them in the [controller] table "
              "of a config file named with --config FILE", file=sys.stderr)
        return 2
    try:
        from ..controller import run_controller
    except AiturboError as exc:  # the planner's extra is not installed
        print(f"aiturbo controller: {exc}", file=sys.stderr)
        return 1
    log_to_stderr(args.log_level.upper())  # in the journal's format under systemd

    async def serve():
        async with open_nursery() as nursery:
            address = await nursery.start(functools.partial(
                run_controller, args.listen, args.meta, args.secret_file, backend_gbps=args.backend_gbps,
                plan=args.plan, metrics=controller_endpoint(args.metrics)))
            print(f"controller listening on {address}", flush=True)
            notify(READY)  # under systemd (Type=notify): nodes may join from now on

    try:
        trio.run(serve)
    except AiturboError as exc:
        print(f"aiturbo controller: {exc}", file=sys.stderr)
        return 1
    return 0


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``aiturbo`` parser and its ``controller`` subparser (whose flags a config file may set)."""
    p = argparse.ArgumentParser(prog="aiturbo", description="Operate aiturbofs mounts.")
    p.add_argument("-V", "--version", action=VersionAction)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait", help="block until files are durable in the backend, with progress")
    w.add_argument("paths", nargs="+", help="files or directories on an aiturbofs mount")
    w.add_argument("--timeout", type=float, default=0, help="give up after this many seconds (exit 3)")
    w.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    v = sub.add_parser(
        "verify", help="check durable files' backend objects against their recorded chunk hashes (a scrub)",
        description="For every durable file under PATHs, read each of its objects in the backend and check "
                    "its size and every chunk's BLAKE3 against the manifest the file recorded.  Reports each "
                    "missing object, wrong size and differing chunk by path (and in the daemon's log and its "
                    "aiturbo_verify_problems metric).  Files not yet durable are skipped (see aiturbo wait).  "
                    "Exit 0: every object exact (or, with --repair, repaired); 1: problems found (and not "
                    "repaired); 2: a path is not on an aiturbofs mount, or the daemon did not answer.")
    v.add_argument("paths", nargs="+", help="files or directories on an aiturbofs mount")
    v.add_argument("--repair", action="store_true",
                   help="upload each file found wrong again from the copies of its chunks held in the mount "
                        "(DRAM, spill or a peer's pool), wait until it is durable and verify it again; names "
                        "the files it could not repair")
    v.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    st = sub.add_parser("status", help="pool use, persist queue and recent errors of running daemons")
    st.add_argument("mountpoint", nargs="?", help="default: every daemon on this host")
    st.add_argument("--json", action="store_true")
    dc = sub.add_parser("drop-cache", help="evict clean (durable) chunks from a daemon's DRAM pool")
    dc.add_argument("mountpoint")
    ct = sub.add_parser(
        "controller", help="run the job controller of a cluster (membership, group rounds, write plans)",
        description="Run the cluster's job controller: nodes (mount.aiturbo in cluster mode) join it over the "
                    "fabric, heartbeat, and report the files of their group rounds; it deduplicates each round "
                    "and answers with the staging and persist plan.  Membership is kept in the metadata engine, "
                    "so a restarted controller picks up the cluster again.  Stops cleanly on SIGTERM or SIGINT.")
    ct.add_argument("--config", metavar="FILE",
                    help="read these settings from the [controller] table of a TOML config file "
                         f"(e.g. {CONFIG_PATH_DEFAULT}); flags given here override it")
    ct.add_argument("--listen", metavar="HOST:PORT",
                    help="fabric address to serve nodes on ([v6addr]:port for IPv6; port 0 picks a free one)")
    ct.add_argument("--meta", metavar="URL",
                    help="metadata engine shared with the nodes, e.g. postgresql://host/db or sqlite:///abs/path.db")
    ct.add_argument("--secret-file", metavar="FILE",
                    help="the cluster secret the nodes also use (mode 0600, owned by this user, >= 16 bytes)")
    ct.add_argument("--backend-gbps", type=float, default=CONTROLLER_BACKEND_GBPS_DEFAULT, metavar="G",
                    help="aggregate backend bandwidth in Gbit/s the planner assumes (default %(default)s)")
    ct.add_argument("--plan", default="lp", choices=["lp", "dedup"],
                    help="how write rounds are planned: lp (default) dedups chunks across the round's files and "
                         "lets the LP plan spread staging transfers and uploads over the nodes; dedup only dedups: "
                         "each unique chunk is uploaded by the node of the first file holding it, with no "
                         "transfers beyond the replicas (for measuring what the plan adds)")
    ct.add_argument("--metrics", metavar="HOST:PORT",
                    help="serve Prometheus metrics at http://HOST:PORT/metrics, or off (default "
                         f"{METRICS_CONTROLLER_ADDRESS_DEFAULT}; if taken, an ephemeral loopback port, logged)")
    ct.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                    help="log verbosity on stderr (default %(default)s)")
    cf = sub.add_parser("config", help="check a TOML config file")
    cfs = cf.add_subparsers(dest="config_cmd", required=True)
    cc = cfs.add_parser("check", help="validate a config file and print the effective settings",
                        description="Validate a config file (its [mount] and [controller] tables) and print the "
                                    "effective settings, one a line, values the file does not set marked (default).  "
                                    "Exit 0 when valid, 1 listing every problem.")
    cc.add_argument("file", nargs="?", default=CONFIG_PATH_DEFAULT, help="the file (default %(default)s)")
    return p, ct


def _test_parser() -> argparse.ArgumentParser:
    """The commands for tests, apart: ``aiturbo --help`` and its errors name only the commands for users."""
    p = argparse.ArgumentParser(prog="aiturbo", description="Commands for tests.")
    sub = p.add_subparsers(dest="cmd", required=True)
    df = sub.add_parser("debug-fault", help="make a handler raise once; the mount needs -o debug_faults")
    df.add_argument("mountpoint")
    df.add_argument("handler")
    return p


def controller_actions() -> dict:
    """The flags of `aiturbo controller` a config file's [controller] table may set, by dest."""
    from ._config import controller_actions as actions

    return actions(_parser()[1])


def main(argv: list[str] | None = None) -> int:
    from ._config import check
    from ._config import controller_actions as actions

    p, ct = _parser()
    words = sys.argv[1:] if argv is None else argv
    if not words:
        # No command: the help, on stdout (readable through a pager), but not exit 0, as nothing was done
        # (2: argparse's usage error, which a missing command is; git exits 1 here).
        p.print_help()
        return 2
    if words[0] in TEST_COMMANDS:
        args = _test_parser().parse_args(words)
        return cmd_simple(args, {"cmd": "debug-fault", "handler": args.handler})
    args = p.parse_args(argv)
    if args.cmd == "config":
        return check(args.file, actions(ct), sys.stdout, sys.stderr)
    if args.cmd == "controller" and args.config:
        # the file's [controller] table becomes the defaults, so flags given still win
        from .._errors import AiturboError
        from ._config import load_config

        try:
            ct.set_defaults(**load_config(args.config, actions(ct)).controller)
        except AiturboError as exc:
            for line in str(exc).splitlines():
                print(f"aiturbo controller: {line}", file=sys.stderr)
            return 1
        args = p.parse_args(argv)
    if args.cmd == "verify":
        return cmd_verify(args)
    if args.cmd == "wait":
        return cmd_wait(args)
    if args.cmd == "status":
        return cmd_status(args)
    if args.cmd == "controller":
        return cmd_controller(args)
    assert args.cmd == "drop-cache", args.cmd
    return cmd_simple(args, {"cmd": "drop-cache"})


if __name__ == "__main__":
    sys.exit(main())
