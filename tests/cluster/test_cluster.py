"""Cluster mode end to end: a controller and three node daemons on one host.

Real processes (``aiturbo controller``, ``mount.aiturbo`` x 3) over a private
PostgreSQL (shared metadata) and a moto S3 server on loopback, fabric over
loopback TCP (``tests/cluster.py``).  What is checked is the contract of
docs/design.md for a cluster: close-to-open across nodes before and after
durability; dedup of data-parallel replicas (the backend receives unique
bytes only, counted both by the daemons and by a byte-counting proxy in front
of S3); a rank-0 writer's persist spread over several nodes by the plan; a
node killed -9 after close() loses nothing (replicas=2); a controller killed
mid-round does not hang close(); a node with the wrong secret gets nothing;
a chunk corrupted on the wire is rejected and fetched again elsewhere;
three nodes reading one cold file of a group make storage send it about once
(the fetches spread over the readers, each chunk passed along a chain), also
when one reader is killed -9 mid-read; an ungrouped read is served from a
holder's DRAM rather than from storage (the S3 side counted by the proxy).

Where the backend must not make a file durable yet (to prove a read was
served from the cluster's DRAM, or that a takeover really happened), moto is
frozen with SIGSTOP for a moment; those clusters run with a long import TTL
and list the root once before, so no lookup waits on a frozen S3 listing.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import socket
import struct
import threading
import time
from contextlib import contextmanager

import pgserver
import pytest
from cluster import (
    CHUNK,
    FRAME_CHUNK,
    FRAME_PUT_CHUNK,
    GROUP,
    GROUP_SIZE,
    READERS_TIMEOUT_S,
    Cluster,
    FrameTamperer,
    MiB,
    Timed,
    assert_clean,
    cold_pools,
    delta,
    read_counters,
    read_sha,
    route_peers_through,
    write_secret,
)
from fileio import get, put, sha
from mounting import state, wait_state

from aiturbofs._limits import CLUSTER_SOURCE_WAIT_S, PERSIST_FILES_IN_FLIGHT

pytestmark = pytest.mark.skipif(not pgserver.installed(), reason=pgserver.SKIP_REASON)

DURABLE_WAIT_S = 60.0
NO_REIMPORT = {"import_ttl": "3600"}  # clusters that see a frozen S3 (module doc)


# ============================================================== helpers


def distinct_chunk_bytes(blobs) -> int:
    """Bytes in distinct chunks (by content) over all ``blobs``: what dedup leaves to upload."""
    seen = {}
    for data in blobs:
        for off in range(0, len(data), CHUNK):
            piece = data[off: off + CHUNK]
            seen[hashlib.sha256(piece).digest()] = len(piece)
    return sum(seen.values())


def within(timeout_s: float, fn, *args):
    t = Timed(fn, *args)
    t.start()
    return t.outcome(timeout_s)


@contextmanager
def frozen_s3(c: Cluster):
    """moto stopped with SIGSTOP (requests hang, nothing is lost), thawed on exit whatever happens."""
    pid = c.s3._proc.pid
    os.killpg(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(pid, signal.SIGCONT)


def prime_listings(c: Cluster) -> None:
    """Import the root on every node now, so later lookups need no S3 listing (NO_REIMPORT)."""
    for i in c.live():
        os.listdir(c.path(i))


def wait_durable(c: Cluster, i: int, names, timeout_s: float = DURABLE_WAIT_S) -> float:
    """Wait until every file is durable as node ``i`` sees it; seconds taken."""
    start = time.monotonic()
    for name in names:
        left = max(0.1, timeout_s - (time.monotonic() - start))
        got = wait_state(c.path(i, name), "durable", left)
        assert got == "durable", f"{name} is {got!r} on {c.name(i)} after {timeout_s} s\n{c.logs()}"
    return time.monotonic() - start


def group_dir(c: Cluster, i: int, name: str, job: str, size: int | None) -> str:
    path = c.path(i, name)
    os.mkdir(path)
    os.setxattr(path, GROUP, job.encode())
    if size is not None:
        os.setxattr(path, GROUP_SIZE, str(size).encode())
    return path


def assert_bucket_has(c: Cluster, files: dict[str, bytes]) -> None:
    sizes = c.objects()
    for name, data in files.items():
        assert sizes.get(name) == len(data), f"{name}: bucket has {sizes.get(name)} bytes, want {len(data)}"
        assert sha(c.get_object(name)) == sha(data), f"{name}: bucket bytes differ"


# ============================================================== (a) close-to-open


def test_close_to_open_before_and_after_durable(make_cluster):
    c = make_cluster(node_options=NO_REIMPORT)
    prime_listings(c)
    data = os.urandom(3 * CHUNK + 4321)
    name = "ckpt.bin"
    with frozen_s3(c):  # nothing can become durable: what nodes 1 and 2 read comes from cluster DRAM
        start = time.monotonic()
        within(30, put, c.path(0, name), data)
        close_s = time.monotonic() - start
        s3_sent_before_reads = c.s3_sent_bytes()
        for i in (1, 2):
            path = c.path(i, name)
            assert os.stat(path).st_size == len(data), c.name(i)
            assert state(path) in ("staged", "persisting"), c.name(i)
            got = within(30, get, path)
            assert len(got) == len(data) and sha(got) == sha(data), f"{c.name(i)} read other bytes before durable"
        fetched = {c.name(i): c.status(i)["cluster"]["chunks_fetched"] for i in (1, 2)}
        held = {c.name(i): c.status(i)["cluster"]["replica_files_held"] for i in (1, 2)}
        # moto is stopped, so this mostly proves the proxy relayed nothing late: the reads were served from DRAM
        assert c.s3_sent_bytes() == s3_sent_before_reads, (
            f"S3 sent {c.s3_sent_bytes() - s3_sent_before_reads} bytes while nodes 1 and 2 read a staged file")
    # replicas=2: one of nodes 1 and 2 holds a replica, the other fetched every chunk from a peer
    assert sum(fetched.values()) >= 4, f"chunks fetched from peers: {fetched}; replicas held: {held}"
    durable_s = wait_durable(c, 0, [name])
    for i in (1, 2):
        assert wait_state(c.path(i, name), "durable", 10) == "durable", c.name(i)
    for i in range(3):
        assert os.stat(c.path(i, name)).st_size == len(data)
        assert sha(get(c.path(i, name))) == sha(data), f"{c.name(i)} read other bytes after durable"
    assert_bucket_has(c, {name: data})
    assert c.status_of(c.nodes[0], cli=True)["cluster"]["node"] == "n0"  # the real `aiturbo status --json`
    assert_clean(c)
    print(f"\n[a] close() {close_s:.2f} s for {len(data) >> 20} MiB; fetched from peers {fetched}, "
          f"replicas held {held}; durable {durable_s:.2f} s after S3 thawed")


# ============================================================== (a2) close-to-open beside an open descriptor
# A long-lived reader (a dataloader, a monitor) keeps a descriptor open on node A while node B commits a
# new version.  A fresh open on A must see B's version (content and size) on every data path; the old
# descriptor reads A's version until then, and the node's one version after (docs/design.md, "Semantics").

CTO_DATAPATHS = ["auto", "kernel", "pyfuse3"]  # auto: the kernel session with passthrough where the host has it


def two_nodes(make_cluster, datapath: str) -> Cluster:
    return make_cluster(n=2, node_options={"datapath": datapath})


def read_fd(fd: int) -> bytes:
    """The whole file through ``fd``, from offset 0, in 1 MiB reads (as a dataloader reads)."""
    out = bytearray()
    while piece := os.pread(fd, MiB, len(out)):
        out += piece
    return bytes(out)


def hold_open(c: Cluster, name: str, data: bytes) -> int:
    """A read descriptor on node 0 of ``name``, which holds ``data`` (read once: its pages and chunks are there)."""
    before = c.status(0)["fuse"].get("passthrough_files", 0)  # (pyfuse3 has no such count)
    fd = os.open(c.path(0, name), os.O_RDONLY)
    assert read_fd(fd) == data
    fuse = c.status(0)["fuse"]
    if fuse["datapath"] == "passthrough":  # the case the issue names: the kernel serves the old fd
        assert fuse["passthrough_files"] == before + 1, "the old descriptor is not a passthrough one"
    return fd


def fresh_read(c: Cluster, i: int, name: str) -> tuple[int, bytes]:
    """(size by fstat, bytes) of a fresh open of ``name`` on node ``i``."""
    fd = os.open(c.path(i, name), os.O_RDONLY)
    try:
        return os.fstat(fd).st_size, read_fd(fd)
    finally:
        os.close(fd)


def wait_unpinned(c: Cluster, timeout_s: float = 30.0) -> None:
    """Until no node pins a chunk (replica holds are let go some time after their file became durable)."""
    deadline = time.monotonic() + timeout_s
    while pinned := {c.name(i): n for i in c.live() if (n := c.status(i)["pool"]["pinned_chunks"])}:
        assert time.monotonic() < deadline, f"chunks still pinned after {timeout_s} s: {pinned}"
        time.sleep(0.1)


def describe(data: bytes) -> str:
    return f"{len(data)} bytes starting {data[:8]!r}"


@pytest.mark.parametrize("datapath", CTO_DATAPATHS)
def test_a_rewrite_elsewhere_is_seen_by_a_fresh_open_beside_an_open_fd(make_cluster, datapath):
    c = two_nodes(make_cluster, datapath)
    old, new = b"1" * (CHUNK + 4096), b"2" * CHUNK
    put(c.path(0, "held.bin"), old)
    fd = hold_open(c, "held.bin", old)
    try:
        put(c.path(1, "held.bin"), new)
        size, got = fresh_read(c, 0, "held.bin")
        assert size == len(new), f"a fresh open on n0 has size {size}, n1 wrote {len(new)} ({datapath})"
        assert got == new, f"a fresh open on n0 read {describe(got)}, n1 wrote {describe(new)} ({datapath})"
        assert os.stat(c.path(0, "held.bin")).st_size == len(new)
    finally:
        os.close(fd)
    assert fresh_read(c, 0, "held.bin") == (len(new), new)
    assert_clean(c)


@pytest.mark.parametrize("datapath", CTO_DATAPATHS)
def test_an_append_elsewhere_is_seen_by_a_fresh_open_beside_an_open_fd(make_cluster, datapath):
    c = two_nodes(make_cluster, datapath)
    old, tail = b"1" * (CHUNK + 100), b"3" * 5000
    put(c.path(0, "log.bin"), old)
    fd = hold_open(c, "log.bin", old)
    try:
        with open(c.path(1, "log.bin"), "ab") as f:
            f.write(tail)
        size, got = fresh_read(c, 0, "log.bin")
        assert size == len(old) + len(tail), f"a fresh open on n0 has size {size} after n1's append ({datapath})"
        assert got == old + tail, f"a fresh open on n0 read {describe(got)}, want {describe(old + tail)}"
    finally:
        os.close(fd)
    assert_clean(c)


@pytest.mark.parametrize("datapath", CTO_DATAPATHS)
def test_an_old_fd_reads_one_version_whole_when_another_node_rewrites(make_cluster, datapath):
    """The documented rule: the old descriptor reads its version until an open on its node takes the
    newer one, then that one (the node serves one version of a file); never a mix within a read."""
    c = two_nodes(make_cluster, datapath)
    old, new = b"1" * (CHUNK + 4096), b"2" * (CHUNK + 777)
    put(c.path(0, "dl.bin"), old)
    fd = hold_open(c, "dl.bin", old)
    try:
        put(c.path(1, "dl.bin"), new)
        got = read_fd(fd)
        assert got == old, f"before an open on n0 its old descriptor read {describe(got)} ({datapath})"
        assert fresh_read(c, 0, "dl.bin") == (len(new), new)
        assert os.fstat(fd).st_size == len(new), f"the old descriptor's fstat after a fresh open ({datapath})"
        for off in range(0, len(new), MiB):  # every read is of one version
            piece = os.pread(fd, MiB, off)
            assert piece == new[off: off + MiB], f"old fd at {off}: {describe(piece)} ({datapath})"
        assert read_fd(fd) == new
        put(c.path(1, "dl.bin"), old)  # and back: the old fd follows the node again at its next fresh open
        assert fresh_read(c, 0, "dl.bin") == (len(old), old)
        assert read_fd(fd) == old
    finally:
        os.close(fd)
    assert "BUG" not in c.nodes[0].log()
    assert_clean(c)


@pytest.mark.parametrize("datapath", CTO_DATAPATHS)
def test_an_old_fd_whose_version_is_gone_gets_eio_and_the_log_says_why(make_cluster, datapath):
    """The old descriptor's version durable, then replaced on another node, and no pool holding its chunks:
    its reads fail with EIO and the log says why, never other bytes.  Where the kernel serves the old
    descriptor from the backing file (passthrough), that file still holds the version: it reads on."""
    c = two_nodes(make_cluster, datapath)
    old, new = b"1" * (CHUNK + 4096), b"2" * (CHUNK + 4096)
    put(c.path(0, "gone.bin"), old)
    wait_durable(c, 0, ["gone.bin"])  # the old version's chunks are clean now: drop-cache evicts them
    fd = hold_open(c, "gone.bin", old)
    try:
        put(c.path(1, "gone.bin"), new)
        wait_durable(c, 1, ["gone.bin"])  # the object in the backend is the new version
        wait_unpinned(c)  # the replicas of both versions are let go too
        c.drop_cache()
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # and the kernel's pages of it
        if c.status(0)["fuse"]["datapath"] == "passthrough":
            assert read_fd(fd) == old, f"the passthrough old descriptor ({datapath})"
        else:
            with pytest.raises(OSError) as err:
                read_fd(fd)
            assert err.value.errno == errno.EIO, err.value
            assert "was replaced by version" in c.nodes[0].log(), c.nodes[0].log()[-3000:]
        assert fresh_read(c, 0, "gone.bin") == (len(new), new)
        assert read_fd(fd) == new
    finally:
        os.close(fd)
    assert "BUG" not in c.nodes[0].log()


@pytest.mark.parametrize("datapath", CTO_DATAPATHS)
def test_a_node_writing_the_file_keeps_its_own_view(make_cluster, datapath):
    """Node 0 has a descriptor open for writing (a write not committed yet) when node 1 commits a rewrite:
    node 0's opens keep node 0's view (another node's commit never replaces uncommitted writes), and its
    close commits it as the newest version, which node 1 then reads."""
    c = two_nodes(make_cluster, datapath)
    old, new = b"1" * (CHUNK + 4096), b"2" * CHUNK
    put(c.path(0, "w.bin"), old)
    mine = b"a" * 1000 + old[1000:]
    w = os.open(c.path(0, "w.bin"), os.O_WRONLY)
    try:
        os.pwrite(w, b"a" * 1000, 0)
        put(c.path(1, "w.bin"), new)
        assert fresh_read(c, 0, "w.bin") == (len(mine), mine), f"node 0 lost its own writes ({datapath})"
    finally:
        os.close(w)
    assert fresh_read(c, 0, "w.bin") == (len(mine), mine)
    assert fresh_read(c, 1, "w.bin") == (len(mine), mine), f"node 0's later close is the newest version ({datapath})"
    assert_clean(c)


# ============================================================== (b) DP replicas, dedup


def test_dp_replicas_upload_unique_bytes_once(make_cluster):
    c = make_cluster()
    group_dir(c, 0, "ckpt", "job-dp", 3)
    os.mkdir(c.path(0, "ckpt", "step1"))
    os.mkdir(c.path(0, "ckpt", "step2"))
    same = os.urandom(40 * MiB)
    head = os.urandom(20 * MiB)
    files = {f"ckpt/step1/rank{i}.bin": same for i in range(3)}
    files.update({f"ckpt/step2/rank{i}.bin": head + os.urandom(20 * MiB) for i in range(3)})
    barrier = threading.Barrier(3)
    closes = {}

    def rank(i: int) -> None:
        for step in ("step1", "step2"):
            barrier.wait(30)
            name = f"ckpt/{step}/rank{i}.bin"
            start = time.monotonic()
            put(c.path(i, name), files[name])
            closes[name] = time.monotonic() - start

    writers = [Timed(rank, i) for i in range(3)]
    start = time.monotonic()
    for w in writers:
        w.start()
    for w in writers:
        w.outcome(90)
    write_s = time.monotonic() - start
    durable_s = wait_durable(c, 0, files)
    total = sum(len(d) for d in files.values())
    unique = distinct_chunk_bytes(files.values())
    s3_bytes = c.s3_received_bytes()
    st = c.statuses()
    uploaded = {c.name(i): s["persist"]["bytes_uploaded"] for i, s in st.items()}
    copied = {c.name(i): s["persist"]["bytes_copied"] for i, s in st.items()}
    sent = sum(uploaded.values())
    plans = {c.name(i): s["cluster"]["last_plan"] for i, s in st.items()}
    print(f"\n[b] {len(files)} files, {total >> 20} MiB written, {unique >> 20} MiB in distinct chunks; "
          f"writes+closes {write_s:.2f} s (close() each: {', '.join(f'{v:.2f}' for v in closes.values())} s), "
          f"durable {durable_s:.2f} s later")
    print(f"[b] bytes_uploaded per node {uploaded} = {sent / MiB:.1f} MiB; bytes_copied {copied}; "
          f"S3 received {s3_bytes / MiB:.1f} MiB through the proxy; dedup ratio {total / max(sent, 1):.2f}x "
          f"(ideal {total / unique:.2f}x)")
    print(f"[b] last plans: {plans}")
    for i in range(3):
        for name, data in files.items():
            assert sha(get(c.path(i, name))) == sha(data), f"{name} differs on {c.name(i)}"
    assert_bucket_has(c, files)
    assert abs(sent - unique) <= 0.10 * unique, (
        f"nodes sent {sent} bytes to the backend; unique bytes are {unique} (total {total}): {uploaded}")
    assert unique <= s3_bytes <= 1.10 * unique, (
        f"the S3 server received {s3_bytes} bytes; unique bytes are {unique} (total {total})")
    assert_clean(c)


# ============================================================== (c) rank-0 writer


def test_rank0_writer_persist_is_spread_by_the_plan(make_cluster):
    c = make_cluster()
    group_dir(c, 0, "r0", "job-r0", 1)
    data = os.urandom(64 * MiB)
    name = "r0/model.bin"
    start = time.monotonic()
    put(c.path(0, name), data)
    close_s = time.monotonic() - start
    persist_s = wait_durable(c, 0, [name])
    st = c.statuses()
    uploaded = {c.name(i): s["persist"]["bytes_uploaded"] for i, s in st.items()}
    for_peers = {c.name(i): s["persist"]["bytes_uploaded_for_peers"] for i, s in st.items()}
    plan = st[0]["cluster"]["last_plan"]
    print(f"\n[c] close() {close_s:.2f} s; durable {persist_s:.2f} s after close (measured persist time)")
    print(f"[c] bytes_uploaded per node {uploaded} (for peers {for_peers}); S3 received "
          f"{c.s3_received_bytes() / MiB:.1f} MiB")
    print(f"[c] last_plan on n0: {plan}")
    if plan:
        print(f"[c] plan: lp_bound_s={plan.get('lp_bound_s')} makespan_s={plan.get('makespan_s')} "
              f"plan_s={plan.get('plan_s')} vs measured persist {persist_s:.2f} s")
    assert plan is not None, f"n0 got no round plan for a grouped file: {st[0]['cluster']}\n{c.logs()}"
    assert sha(c.get_object(name)) == sha(data), "bucket object differs"
    spread = [n for n, b in uploaded.items() if b > 0]
    assert len(spread) >= 2, f"only {spread} uploaded; the plan did not spread the persist: {uploaded}"
    assert len(data) <= sum(uploaded.values()) <= 1.10 * len(data), f"uploaded {uploaded} for {len(data)} bytes"
    assert_clean(c)


# ============================================================== (d) kill -9 after close()


def test_kill9_after_close_survivors_persist(make_cluster):
    c = make_cluster(node_options=NO_REIMPORT)
    prime_listings(c)
    files = {"a.bin": os.urandom(2 * CHUNK), "b.bin": os.urandom(CHUNK + 1), "c.txt": os.urandom(100_000)}
    with frozen_s3(c):  # node 1 cannot persist anything before it dies
        for name, data in files.items():
            within(30, put, c.path(1, name), data)
        within(30, os.symlink, "a.bin", c.path(1, "latest"))  # a node: no replica, its row is all of it
        c.kill_node(1)
    killed_at = time.monotonic()
    durable_s = wait_durable(c, 0, files)
    deadline = time.monotonic() + DURABLE_WAIT_S
    while "latest" not in c.objects() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert c.get_object("latest") == b"a.bin", "a survivor did not take over n1's symlink"
    assert os.readlink(c.path(2, "latest")) == "a.bin"
    for name, data in files.items():
        assert sha(get(c.path(0, name))) == sha(data), f"{name} differs on n0"
        assert os.stat(c.path(2, name)).st_size == len(data)
    assert_bucket_has(c, files)
    st = c.statuses()
    for i, s in st.items():
        assert "n1" in s["cluster"]["dead"], f"{c.name(i)} does not list n1 as dead: {s['cluster']['dead']}"
    uploaded = {c.name(i): s["persist"]["bytes_uploaded"] for i, s in st.items()}
    assert sum(uploaded.values()) >= sum(len(d) for d in files.values()), uploaded
    takeovers = [line for i in c.live() for line in c.nodes[i].log().splitlines() if "taken_over path=" in line]
    print(f"\n[d] all {len(files)} files durable {durable_s:.2f} s after kill -9 of n1 "
          f"({time.monotonic() - killed_at:.2f} s incl. checks); uploads by survivors {uploaded}")
    for line in takeovers:
        print(f"[d]   {line}")
    assert_clean(c)


def test_last_replica_lost_before_durable_is_broken(make_cluster):
    """Both holders die before the file is durable: it is broken (EIO), never other bytes."""
    c = make_cluster(node_options=NO_REIMPORT)
    prime_listings(c)
    data = os.urandom(CHUNK + 12345)
    with frozen_s3(c):
        within(30, put, c.path(1, "lost.bin"), data)
        held = {i: c.status(i)["cluster"]["replica_files_held"] for i in (0, 2)}
        holder = max(held, key=held.get)
        assert held[holder] == 1 and sum(held.values()) == 1, f"replica holders of lost.bin: {held}"
        survivor = 2 if holder == 0 else 0
        c.kill_node(1)
        c.kill_node(holder)
    got = wait_state(c.path(survivor, "lost.bin"), "broken", DURABLE_WAIT_S)
    assert got == "broken", f"lost.bin is {got!r} on {c.name(survivor)}\n{c.logs()}"
    with pytest.raises(OSError) as err:
        get(c.path(survivor, "lost.bin"))
    assert err.value.errno == errno.EIO
    assert "died before it was durable" in c.nodes[survivor].log()
    assert "lost.bin" not in c.objects()


def test_a_replica_holder_killed_and_restarted_keeps_its_replica(make_cluster):
    """kill -9 of a replica holder loses nothing it holds: the replica lives in a backing file of its
    own, and the restarted daemon holds it again, so the file survives its owner dying next."""
    c = make_cluster(node_options=NO_REIMPORT)
    prime_listings(c)
    data = os.urandom(CHUNK + 12345)
    with frozen_s3(c):  # nothing becomes durable meanwhile: the replicas are the only other copy
        within(30, put, c.path(1, "kept.bin"), data)
        held = {i: c.status(i)["cluster"]["replica_files_held"] for i in (0, 2)}
        holder = max(held, key=held.get)
        assert held[holder] == 1 and sum(held.values()) == 1, f"replica holders of kept.bin: {held}"
        c.kill_node(holder)
        c.restart_node(holder)
        assert c.status(holder)["cluster"]["replica_files_held"] == 1, c.nodes[holder].log()
        assert "recovered replicas=2" in c.nodes[holder].log()
        c.kill_node(1)  # the owner: only the restarted holder has the bytes now
    wait_durable(c, holder, ["kept.bin"])
    other = 2 if holder == 0 else 0
    assert sha(get(c.path(other, "kept.bin"))) == sha(data)
    assert sha(c.get_object("kept.bin")) == sha(data)
    assert any("taken_over path=kept.bin" in line for line in c.nodes[holder].log().splitlines()), c.nodes[holder].log()


# ============================================================== (e) controller killed mid-round


def test_controller_killed_mid_round(make_cluster):
    c = make_cluster()
    group_dir(c, 0, "grp", "job-e", 3)
    data = os.urandom(2 * CHUNK)
    name = "grp/only.bin"
    closing = threading.Event()
    before = c.status(0)["cluster"]

    def write_then_close() -> float:
        with open(c.path(0, name), "wb") as f:
            f.write(data)
            closing.set()
            start = time.monotonic()
        # close() reported to the controller and waited for a round of 3 that never fills
        return time.monotonic() - start

    t = Timed(write_then_close)
    t.start()
    assert closing.wait(30), "write did not finish"
    time.sleep(1.0)
    assert t.is_alive(), f"close() returned before the round could close (in {t.elapsed_s:.2f} s)"
    c.kill_controller()
    killed_at = time.monotonic()
    close_s = t.outcome(30)
    after_kill_s = time.monotonic() - killed_at
    assert close_s < 30, close_s
    durable_s = wait_durable(c, 0, [name])
    assert sha(get(c.path(1, name))) == sha(data)
    assert sha(c.get_object(name)) == sha(data)
    mid = c.status(0)["cluster"]
    print(f"\n[e] close() returned {close_s:.2f} s after it started ({after_kill_s:.2f} s after the controller died); "
          f"durable {durable_s:.2f} s later; rounds {before['rounds']}->{mid['rounds']}, "
          f"rounds_failed {before['rounds_failed']}->{mid['rounds_failed']}")

    restart = time.monotonic()
    c.restart_controller()
    c.wait_joined()
    rejoin_s = time.monotonic() - restart
    for i in range(3):
        assert c.status(i)["cluster"]["controller_connected"] is True, c.name(i)

    group_dir(c, 0, "grp2", "job-e2", 3)
    files = {f"grp2/rank{i}.bin": os.urandom(CHUNK + 17 * i) for i in range(3)}
    rounds_before = {i: c.status(i)["cluster"] for i in range(3)}
    writers = [Timed(put, c.path(i, f"grp2/rank{i}.bin"), files[f"grp2/rank{i}.bin"]) for i in range(3)]
    for w in writers:
        w.start()
    for w in writers:
        w.outcome(30)
    closes = [round(w.elapsed_s, 2) for w in writers]
    wait_durable(c, 0, files)
    for i in range(3):
        now = c.status(i)["cluster"]
        assert now["rounds"] == rounds_before[i]["rounds"] + 1, f"{c.name(i)}: {rounds_before[i]['rounds']} -> {now['rounds']}"
        assert now["rounds_failed"] == rounds_before[i]["rounds_failed"], c.name(i)
        assert now["last_plan"] and now["last_plan"].get("files") == 3, now["last_plan"]
        for name, d in files.items():
            assert sha(get(c.path(i, name))) == sha(d)
    assert_bucket_has(c, files)
    print(f"[e] controller restarted, all nodes re-joined in {rejoin_s:.2f} s; a 3-writer round closed in {closes} s")
    assert_clean(c)


# ============================================================== (f) wrong secret, garbage


def test_wrong_secret_cannot_join_or_read(make_cluster):
    c = make_cluster(node_options=NO_REIMPORT)
    other = write_secret(os.path.join(c.root, "other-secret"))
    intruder = c.add_node("n3", secret_path=other)  # it mounts: it cannot know the secret is wrong before it connects
    prime_listings(c)
    os.listdir(intruder.mountpoint)
    deadline = time.monotonic() + 10
    while "authentication failed" not in intruder.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    ilog = intruder.log()
    assert "authentication failed" in ilog or "failed to prove" in ilog, ilog[-4000:]
    ist = c.status_of(intruder)["cluster"]
    assert ist["controller_connected"] is False, ist
    assert "rejected a connection" in c.controller.log(), c.controller.log()

    data = os.urandom(2 * CHUNK)
    with frozen_s3(c):  # the bytes exist only in n0's (and one replica's) DRAM
        put(c.path(0, "secret.bin"), data)
        reader = Timed(get, os.path.join(intruder.mountpoint, "secret.bin"))
        reader.start()
        reader.join(8)
        outcome = "still waiting" if reader.is_alive() else (f"error {reader.error!r}" if reader.error else "data")
        assert reader.is_alive() or reader.error is not None, (
            "a node with the wrong secret read a file that existed only in the cluster's DRAM")
        ist = c.status_of(intruder)["cluster"]
        assert ist["chunks_fetched"] == 0, ist
        for peer, counters in ist["fabric_counters"].items():
            assert counters["chunks_received"] == 0, (peer, counters)
        for i in range(3):
            sent = c.status(i)["cluster"]["fabric_counters"].get("n3", {}).get("chunks_sent", 0)
            assert sent == 0, f"{c.name(i)} sent {sent} chunks to n3"
    reader.join(30)
    if not reader.is_alive() and reader.error is None:
        assert sha(reader.result) == sha(data), "n3 read other bytes"
    print(f"\n[f] n3 (other secret): not joined; its read of a file only in cluster DRAM (S3 frozen): {outcome} "
          f"after {reader.elapsed_s:.2f} s")
    fabric = c.nodes[0].options["fabric"]
    host, _, port = fabric.rpartition(":")
    probes = {
        "http": b"GET / HTTP/1.0\r\n\r\n",
        "random": os.urandom(4096),
        "huge frame": struct.pack(">4sBBHQI", b"ATFB", 1, 0x01, 0, 0, 0xFFFFFFFF) + os.urandom(64),
    }
    for what, payload in probes.items():
        with socket.create_connection((host, int(port)), timeout=15) as s:
            start = time.monotonic()
            s.sendall(payload)
            try:
                while s.recv(65536):
                    pass
                ended = "closed"
            except (ConnectionResetError, BrokenPipeError):
                ended = "reset"
            except TimeoutError:
                ended = "still open after 15 s"
            print(f"[f] garbage ({what}) to n0's fabric port: {ended} after {time.monotonic() - start:.2f} s")
            assert ended in ("closed", "reset"), what
    assert c.nodes[0].proc.poll() is None, c.nodes[0].log()
    more = os.urandom(CHUNK + 5)
    put(c.path(1, "after.bin"), more)
    for i in range(3):
        assert sha(get(c.path(i, "after.bin"))) == sha(more), c.name(i)
    wait_durable(c, 0, ["after.bin", "secret.bin"])
    assert sha(get(c.path(0, "secret.bin"))) == sha(data)
    # Not part of the contract checked here: what n3 gets once the file is in the backend.
    try:
        late = "correct bytes" if sha(get(os.path.join(intruder.mountpoint, "secret.bin"))) == sha(data) else "OTHER BYTES"
    except OSError as exc:
        late = repr(exc)
    assert late != "OTHER BYTES"
    print(f"[f] n3 reading the same file once durable (from S3): {late}")
    assert_clean(c)
    # Last, so that a failure here does not hide the checks above: the others
    # must not count a node that failed authentication as a member (a replica
    # target, a holder to fetch from).
    members = {c.name(i): c.status(i)["cluster"]["members"] for i in range(3)}
    assert not [n for n, m in members.items() if "n3" in m], f"n3 (wrong secret) is a member on: {members}"


# ============================================================== (g) corrupt chunk frame


def test_corrupt_chunk_frames_are_rejected_and_refetched(make_cluster, pg_server):
    """A relay that flips one byte in one CHUNK and one PUT_CHUNK frame sits in front of n0."""
    c = make_cluster(node_options=NO_REIMPORT)
    prime_listings(c)
    tamper = FrameTamperer(c.nodes[0].options["fabric"])
    try:
        route_peers_through(c, pg_server, "n0", tamper.address)

        data = os.urandom(2 * CHUNK)
        with frozen_s3(c):
            put(c.path(0, "get.bin"), data)  # replica on n1 or n2 (n0 connects out directly)
            held = {i: c.status(i)["cluster"]["replica_files_held"] for i in (1, 2)}
            readers = [i for i in (1, 2) if not held[i]]
            assert len(readers) == 1, f"replicas held: {held}"
            r = readers[0]
            got = within(30, get, c.path(r, "get.bin"))
            assert sha(got) == sha(data), f"{c.name(r)} read other bytes"
            assert (FRAME_CHUNK, CHUNK + 32) in tamper.flipped, (tamper.flipped, tamper.connections)
            cnt = c.status(r)["cluster"]["fabric_counters"]["n0"]
            assert cnt["corrupt_frames"] == 1, cnt

            puts = {}
            for k in range(12):  # n1 places each file's replica by rendezvous hashing: soon one goes to n0
                name = f"put{k}.bin"
                puts[name] = os.urandom(CHUNK)
                put(c.path(1, name), puts[name])
                if any(t == FRAME_PUT_CHUNK for t, _ in tamper.flipped):
                    break
            assert any(t == FRAME_PUT_CHUNK for t, _ in tamper.flipped), f"no replica of {len(puts)} files went to n0: {tamper.flipped}"
            cnt = c.status(0)["cluster"]["fabric_counters"]["n1"]
            assert cnt["corrupt_frames"] == 1, cnt
            for i in (0, 2):
                for name, d in puts.items():
                    assert sha(within(30, get, c.path(i, name))) == sha(d), f"{name} on {c.name(i)}"
        wait_durable(c, 0, ["get.bin", *puts])
        assert_bucket_has(c, {"get.bin": data, **puts})
        print(f"\n[g] flipped {tamper.flipped} through {tamper.connections} relayed connection(s); "
              f"reader {c.name(r)} re-fetched the chunk from the replica; {len(puts)} put file(s) intact")
    finally:
        tamper.close()


# ============================================================== (h) grouped read: chain broadcast

READ_MODEL_BYTES = 256 * MiB  # the size: 32 chunks; the whole test takes 14-23 s on two cores
KILL_READ_BYTES = 96 * MiB  # 12 chunks: still being read when one reader is killed, and cheaper


def write_group_model(c: Cluster, i: int, dirname: str, job: str, readers: int, data: bytes) -> str:
    """``dirname/model.bin`` written on node ``i`` into a group dir, durable; then tagged for ``readers``.

    The directory carries only the group while the file is written (a one-writer
    round closes after the batching window, instead of waiting for ``readers``
    writers that never come); ``group.size`` is set afterwards, on the directory
    and on the file itself (tags are copied at creation), before any other node
    looks the file up.
    """
    group_dir(c, i, dirname, job, None)
    name = f"{dirname}/model.bin"
    put(c.path(i, name), data)
    wait_durable(c, i, [name])
    for path in (c.path(i, dirname), c.path(i, name)):
        os.setxattr(path, GROUP_SIZE, str(readers).encode())
    assert os.getxattr(c.path(i, name), GROUP) == job.encode()
    return name


def start_readers(c: Cluster, nodes, name: str) -> list[Timed]:
    """One thread per node reading ``name`` in full, released together."""
    barrier = threading.Barrier(len(nodes))

    def reader(i: int) -> tuple[int, str]:
        barrier.wait(30)
        return read_sha(c.path(i, name))

    readers = [Timed(reader, i) for i in nodes]
    for r in readers:
        r.start()
    return readers


def test_grouped_read_fetches_each_chunk_once(make_cluster):
    """Three nodes read one cold file of a group: storage sends it about once, the fetches are spread."""
    c = make_cluster()
    data = os.urandom(READ_MODEL_BYTES)
    want = (len(data), sha(data))
    name = write_group_model(c, 0, "model", "job-read", 3, data)
    freed = cold_pools(c)
    before, s3_before = read_counters(c), c.s3_sent_bytes()
    start = time.monotonic()
    readers = start_readers(c, range(3), name)
    got = {c.name(i): r.outcome(READERS_TIMEOUT_S) for i, r in enumerate(readers)}
    wall_s = time.monotonic() - start
    s3_sent = c.s3_sent_bytes() - s3_before
    d = delta(read_counters(c), before)
    plans = {c.name(i): c.status(i)["cluster"]["last_read_plan"] for i in range(3)}
    size = len(data)
    print(f"\n[h] drop-cache reported freed_bytes {({n: b >> 20 for n, b in freed.items()})} MiB; 3 readers of {size >> 20} MiB "
          f"in {wall_s:.2f} s (each {', '.join(f'{r.elapsed_s:.2f}' for r in readers)} s)")
    print(f"[h] S3 sent {s3_sent / MiB:.1f} MiB = {s3_sent / size:.3f}x the file; per node "
          f"{({c.name(i): v for i, v in d.items()})}")
    print(f"[h] read plans: {plans}")
    for node, outcome in got.items():
        assert outcome == want, f"{node} read {outcome[0]} bytes, other bytes than written"
    for i in range(3):
        assert d[i]["read_rounds"] == 1, f"{c.name(i)} joined {d[i]['read_rounds']} read rounds\n{c.logs()}"
        assert plans[c.name(i)]["readers"] == 3, plans
    assert size <= s3_sent <= 1.25 * size, (
        f"S3 sent {s3_sent} bytes for 3 readers of a {size}-byte file ({s3_sent / size:.2f}x; want 1.0-1.25x)")
    fetched = {c.name(i): d[i]["fetched"] for i in range(3)}
    assert all(0.15 * size <= b <= 0.55 * size for b in fetched.values()), (
        f"storage fetches per node {fetched} not balanced (want 0.15-0.55x of {size} each)")
    chained = [c.name(i) for i in range(3) if d[i]["chunks_from_chain"] > 0]
    assert len(chained) >= 2, f"only {chained} took chunks from a chain predecessor: {d}"
    # what the round fetched and passed along is in each reader's backing file, not in pool buffers
    staged = {c.name(i): (st := c.status(i)["staging"])["allocated_bytes"] + st["disk_allocated_bytes"] for i in range(3)}
    assert all(b >= 0.9 * size for b in staged.values()), f"backing file bytes per node {staged} for a {size}-byte file"
    assert_clean(c)


def test_grouped_read_survives_a_reader_killed_mid_chain(make_cluster):
    """kill -9 of one of three grouped readers right after it served its first chunk: the others finish."""
    c = make_cluster()
    data = os.urandom(KILL_READ_BYTES)
    want = (len(data), sha(data))
    name = write_group_model(c, 0, "model", "job-kill", 3, data)
    cold_pools(c)
    served_before = c.status(1)["cluster"]["chunks_served"]
    readers = start_readers(c, range(3), name)
    deadline = time.monotonic() + 30
    while c.status(1)["cluster"]["chunks_served"] == served_before:
        assert time.monotonic() < deadline, f"n1 served no chunk in 30 s\n{c.logs()}"
        assert readers[1].is_alive(), f"n1 read the whole file before serving a chunk: {readers[1].error!r}"
        time.sleep(0.02)
    c.kill_node(1)
    killed_at = time.monotonic()
    progress = {c.name(i): readers[i].is_alive() for i in (0, 2)}
    s3_before = c.s3_sent_bytes()  # (what n1 fetched before it died is not counted below)
    survivors = {}
    for i in (0, 2):
        survivors[c.name(i)] = readers[i].outcome(READERS_TIMEOUT_S)
    finish_s = time.monotonic() - killed_at
    readers[1].join(10)
    n1 = "still reading" if readers[1].is_alive() else repr(readers[1].error) if readers[1].error else "finished"
    st = read_counters(c)
    s3_sent = c.s3_sent_bytes() - s3_before
    print(f"\n[i] n1 killed -9 after serving its first chunk (survivors still reading: {progress}); "
          f"survivors finished {finish_s:.2f} s later; n1's own reader: {n1}")
    print(f"[i] survivors: {({c.name(i): st[i] for i in (0, 2)})}; S3 sent {s3_sent / MiB:.1f} MiB after the kill")
    for node, outcome in survivors.items():
        assert outcome == want, f"{node} read {outcome[0]} bytes, other bytes than written"
    # each survivor takes a chunk from storage at most once, however its chain broke
    assert s3_sent <= 2.1 * len(data), f"S3 sent {s3_sent} bytes to two readers of {len(data)} bytes"
    assert_clean(c)


def test_ungrouped_read_comes_from_a_holders_dram(make_cluster):
    """The distributed cache: a node reads a durable file from a holder's DRAM, not from storage."""
    c = make_cluster(node_options=NO_REIMPORT)
    prime_listings(c)
    data = os.urandom(4 * CHUNK + 999)
    want = (len(data), sha(data))
    name = "cached.bin"
    with frozen_s3(c):  # the replica stays held, so its holder can be told apart
        within(30, put, c.path(0, name), data)
        held = {i: c.status(i)["cluster"]["replica_files_held"] for i in (1, 2)}
    assert sorted(held.values()) == [0, 1], f"replica holders of {name}: {held}"
    holder = max(held, key=held.get)
    other = 3 - holder
    wait_durable(c, 0, [name])
    cold_pools(c)

    s3_before, fetched_before = c.s3_sent_bytes(), c.status(holder)["persist"]["bytes_fetched"]
    assert within(30, read_sha, c.path(holder, name)) == want, f"{c.name(holder)} read other bytes"
    first = c.s3_sent_bytes() - s3_before
    from_storage = c.status(holder)["persist"]["bytes_fetched"] - fetched_before
    assert len(data) <= first <= 1.10 * len(data), f"first read: S3 sent {first} bytes for {len(data)}"
    assert from_storage == len(data), f"{c.name(holder)} fetched {from_storage} bytes from storage"

    c.drop_cache([other], cli=True)  # the real `aiturbo drop-cache MNT`
    s3_before, before = c.s3_sent_bytes(), c.status(other)
    assert within(30, read_sha, c.path(other, name)) == want, f"{c.name(other)} read other bytes"
    second = c.s3_sent_bytes() - s3_before
    after = c.status(other)
    # from a holder's DRAM: asked directly, or along an autogroup round's chain when the holder's own read
    # was within the window (it heads every chunk then: it has them all)
    from_peers = sum(after["cluster"][k] - before["cluster"][k] for k in ("chunks_fetched", "chunks_from_chain"))
    from_storage = after["persist"]["bytes_fetched"] - before["persist"]["bytes_fetched"]
    print(f"\n[j] holders n0 (dropped) and {c.name(holder)}; {c.name(holder)} read {len(data) >> 20} MiB from S3 "
          f"({first / len(data):.3f}x sent); then {c.name(other)} read it: {from_peers} chunks from peers' DRAM, "
          f"{from_storage} bytes from storage, S3 sent {second} bytes")
    assert second < 0.25 * len(data), f"S3 sent {second} bytes for the second read of a {len(data)}-byte file"
    assert from_peers >= 5 and from_storage == 0, (from_peers, from_storage)
    assert_clean(c)
    # Last, so that a failure here does not hide the checks above: drop-cache
    # reports the bytes it freed, i.e. the node's clean bytes before it ran.
    cached = c.status(other)["pool"]["clean_bytes"]
    freed = c.drop_cache([other])[c.name(other)]
    assert c.status(other)["pool"]["clean_bytes"] == 0
    assert freed == cached, f"drop-cache on {c.name(other)} reported {freed} bytes freed; it held {cached} clean bytes"


# ============================================================== KV-cache files with shared prefixes


def test_kv_cache_files_with_a_shared_prefix_upload_it_once(make_cluster):
    """Agent KV-cache files: one node writes files that share a (chunk-aligned)
    system-prompt prefix; the prefix is uploaded once (later files copy it
    server-side from the first durable one) and other nodes read them all."""
    c = make_cluster()
    group_dir(c, 0, "kv", "kv-cache", None)
    prefix = os.urandom(CHUNK)
    first = prefix + os.urandom(MiB // 2)
    put(c.path(0, "kv", "s0.kv"), first)
    wait_durable(c, 0, ["kv/s0.kv"])
    before = c.s3_received_bytes()
    files = {f"s{i}.kv": prefix + os.urandom(MiB // 2 + i) for i in range(1, 5)}
    for name, data in files.items():
        put(c.path(0, "kv", name), data)
    wait_durable(c, 0, [f"kv/{n}" for n in files])
    sent = c.s3_received_bytes() - before
    tails = sum(len(d) - CHUNK for d in files.values())
    copied = sum(c.status(i)["persist"]["bytes_copied"] for i in c.live())
    assert copied >= len(files) * CHUNK, f"only {copied} bytes copied server-side"
    assert sent <= 1.10 * tails + 64 * 1024, f"S3 received {sent} bytes for {tails} new bytes (the prefix again?)"
    for name, data in {"s0.kv": first, **files}.items():
        assert sha(get(c.path(2, "kv", name))) == sha(data), f"{name} differs on n2"
        assert sha(c.get_object(f"kv/{name}")) == sha(data), f"{name} differs in the bucket"
    assert_clean(c)
    print(f"\n[kv] 4 files of {CHUNK >> 20} MiB shared prefix + ~0.5 MiB: S3 received {sent / MiB:.2f} MiB "
          f"for {tails / MiB:.2f} MiB of new bytes; {copied / MiB:.0f} MiB copied server-side")


def test_many_files_waiting_for_one_source_do_not_stall(make_cluster):
    """More files of one round on one node than it uploads at once, all sharing
    a prefix that one of them uploads: the files waiting for that copy must not
    keep the uploading file queued until their wait runs out (120 s)."""
    c = make_cluster()
    n = PERSIST_FILES_IN_FLIGHT + 2
    group_dir(c, 0, "kv6", "kv-burst", n)
    prefix = os.urandom(2 * CHUNK)
    files = {f"s{i}.kv": prefix + os.urandom(MiB // 4 + i) for i in range(n)}
    threads = [threading.Thread(target=put, args=(c.path(0, "kv6", name), data)) for name, data in files.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = wait_durable(c, 0, [f"kv6/{name}" for name in files])
    assert took < CLUSTER_SOURCE_WAIT_S / 2, f"{n} files took {took:.0f} s to become durable\n{c.nodes[0].log()[-3000:]}"
    for name, data in files.items():
        assert sha(c.get_object(f"kv6/{name}")) == sha(data), f"{name} differs in the bucket"
    assert_clean(c)
    print(f"\n[kv burst] {n} files sharing a {len(prefix) >> 20} MiB prefix on one node: durable in {took:.1f} s")
