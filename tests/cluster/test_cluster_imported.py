"""Grouped reads of objects another tool put into the bucket, and grouping without tags.

Three node daemons, a controller, PostgreSQL and moto behind a byte-counting
proxy (``tests/cluster.py``).  The objects are PUT straight into the bucket
(as a training job elsewhere or ``aws s3 cp`` would): they have no manifest
when the nodes first read them.  Checked: three nodes reading one such object
in a tagged round make S3 send it about once and record its manifest (a
second read of it, pools warm, reads nothing from S3); a chunk corrupted on
the fabric along the chain is detected and fetched again; an object
overwritten between two rounds is never read as a mix of its versions; with
``-o autogroup`` (the default) untagged opens form a round of their own,
while a lone reader reads alone.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pgserver
import pytest
from cluster import (
    CHUNK,
    FRAME_CHUNK,
    GROUP,
    GROUP_SIZE,
    READERS_TIMEOUT_S,
    FrameTamperer,
    MiB,
    Timed,
    assert_clean,
    cold_pools,
    delta,
    read_counters,
    read_sha,
    route_peers_through,
)
from fileio import sha

pytestmark = pytest.mark.skipif(not pgserver.installed(), reason=pgserver.SKIP_REASON)

OBJECT_BYTES = 64 * MiB  # 8 chunks
FAST_IMPORT = {"import_ttl": "0.5"}  # objects put into the bucket show up at the next listing
SEE_TIMEOUT_S = 20.0
HASHED_TIMEOUT_S = 20.0


def put_object(c, key: str, data: bytes) -> None:
    """PUT ``key`` straight into the bucket, as another tool would (not through the proxy: uncounted)."""
    c.s3.client().put_object(Bucket=c.bucket, Key=key, Body=data)


def wait_visible(c, nodes, name: str, size: int) -> None:
    """Every node in ``nodes`` lists ``name`` with ``size`` (its directory re-imported)."""
    deadline = time.monotonic() + SEE_TIMEOUT_S
    for i in nodes:
        while True:
            parent, _, base = c.path(i, name).rpartition("/")
            try:
                if base in os.listdir(parent) and os.stat(c.path(i, name)).st_size == size:
                    break
            except FileNotFoundError:
                pass
            assert time.monotonic() < deadline, f"{name} ({size} bytes) not seen on {c.name(i)}\n{c.logs()}"
            time.sleep(0.2)


def tag(path: str, job: str, size: int | None) -> None:
    os.setxattr(path, GROUP, job.encode())
    if size is not None:
        os.setxattr(path, GROUP_SIZE, str(size).encode())


def imported(c, job: str | None, data: bytes, name: str = "hub/model.bin") -> str:
    """``name`` PUT into the bucket by another tool, seen by every node; tagged for 3 readers unless ``job`` is None."""
    parent = c.path(0, name.rpartition("/")[0])
    if not os.path.isdir(parent):
        os.mkdir(parent)
    put_object(c, name, data)
    wait_visible(c, range(3), name, len(data))
    if job is not None:
        tag(c.path(0, name), job, 3)
        time.sleep(1.1)  # the other nodes' cached attributes and tags expire
    return name


def read_at_once(c, nodes, name: str) -> tuple[dict, float]:
    """Every node in ``nodes`` reads ``name`` in full, released together: ({node: (bytes, sha)}, wall s)."""
    barrier = threading.Barrier(len(nodes))

    def reader(i: int):
        barrier.wait(30)
        return read_sha(c.path(i, name))

    readers = [Timed(reader, i) for i in nodes]
    start = time.monotonic()
    for r in readers:
        r.start()
    got = {c.name(i): r.outcome(READERS_TIMEOUT_S) for i, r in zip(nodes, readers)}
    return got, time.monotonic() - start


def wait_hashed(c, nodes, count: int) -> dict:
    """Wait until the nodes together recorded ``count`` manifests of imported objects; per node."""
    deadline = time.monotonic() + HASHED_TIMEOUT_S
    while True:
        hashed = {c.name(i): c.status(i)["persist"]["objects_hashed"] for i in nodes}
        if sum(hashed.values()) >= count or time.monotonic() > deadline:
            return hashed
        time.sleep(0.2)


def test_imported_object_read_by_three_nodes_in_one_round(make_cluster):
    """A tagged round of an object with no manifest: S3 sends it about once, its manifest is recorded,
    and a second read with warm pools costs S3 nothing."""
    c = make_cluster(node_options={**FAST_IMPORT, "autogroup": "off"})
    data = os.urandom(OBJECT_BYTES)
    want = (len(data), sha(data))
    imported(c, "job-import", data)
    before, s3_before = read_counters(c), c.s3_sent_bytes()
    got, wall_s = read_at_once(c, range(3), "hub/model.bin")
    s3_sent = c.s3_sent_bytes() - s3_before
    d = delta(read_counters(c), before)
    print(f"\n[imported] 3 readers of {len(data) >> 20} MiB in {wall_s:.2f} s; S3 sent {s3_sent / len(data):.3f}x; {d}")
    for node, outcome in got.items():
        assert outcome == want, f"{node} read other bytes than the object holds"
    for i in range(3):
        assert d[i]["read_rounds"] == 1, f"{c.name(i)} joined {d[i]['read_rounds']} read rounds\n{c.logs()}"
    assert len(data) <= s3_sent <= 1.05 * len(data), f"S3 sent {s3_sent / len(data):.3f}x the object (want <= 1.05)"
    assert sum(v["chunks_from_chain"] for v in d.values()) >= 8, f"chunks passed along the chain: {d}"
    hashed = wait_hashed(c, range(3), 1)
    assert sum(hashed.values()) == 1, f"manifests recorded per node: {hashed} (want exactly one)"

    # pools warm: the chunks took their content keys, so nothing comes from S3
    s3_before = c.s3_sent_bytes()
    for i in range(3):
        assert read_sha(c.path(i, "hub/model.bin")) == want
    warm = c.s3_sent_bytes() - s3_before
    assert warm < 64 * 1024, f"a warm second read made S3 send {warm} bytes"
    assert_clean(c)


def test_corrupt_chunk_along_an_imported_objects_chain_is_refetched(make_cluster, pg_server):
    """A relay in front of n0 flips one byte of one CHUNK frame n0 sends: the receiver drops it and refetches."""
    c = make_cluster(node_options={**FAST_IMPORT, "autogroup": "off"})
    data = os.urandom(OBJECT_BYTES)
    want = (len(data), sha(data))
    imported(c, "job-corrupt", data)
    tamper = FrameTamperer(c.nodes[0].options["fabric"])
    try:
        route_peers_through(c, pg_server, "n0", tamper.address)
        got, _ = read_at_once(c, range(3), "hub/model.bin")
        for node, outcome in got.items():
            assert outcome == want, f"{node} read other bytes than the object holds"
        flipped = [f for f in tamper.flipped if f[0] == FRAME_CHUNK]
        assert flipped, f"n0 sent no chunk through the relay: {tamper.flipped}, {tamper.connections} connection(s)"
        corrupt = {c.name(i): c.status(i)["cluster"]["fabric_counters"].get("n0", {}).get("corrupt_frames", 0)
                   for i in (1, 2)}
        assert sum(corrupt.values()) == 1, f"corrupt frames from n0 counted by n1, n2: {corrupt}"
        print(f"\n[imported-corrupt] flipped {tamper.flipped}; detected by {corrupt}")
    finally:
        tamper.close()


def test_object_overwritten_between_rounds_is_never_read_mixed(make_cluster):
    """Version 1 read by three nodes (manifest recorded), then another tool overwrites the object:
    every later read returns version 2 whole, or fails; never a mix of the two."""
    c = make_cluster(node_options={**FAST_IMPORT, "autogroup": "off"})
    v1, v2 = os.urandom(OBJECT_BYTES), os.urandom(OBJECT_BYTES)
    imported(c, "job-over", v1)
    got, _ = read_at_once(c, range(3), "hub/model.bin")
    assert all(g == (len(v1), sha(v1)) for g in got.values()), got
    assert sum(wait_hashed(c, range(3), 1).values()) == 1
    versions = {sha(v1): "v1", sha(v2): "v2"}
    # node 1 keeps the object open while it is replaced: its reads may fail, never mix
    with open(c.path(1, "hub/model.bin"), "rb", buffering=0) as held:
        head = held.read(MiB)
        put_object(c, "hub/model.bin", v2)
        time.sleep(1.0)  # the listings expire and show the new etag
        try:
            whole = head + held.read()
            seen = versions.get(hashlib.sha256(whole).hexdigest(), "a mix")
            assert seen != "a mix", "a handle open across the overwrite read a mix of the versions"
        except OSError as exc:
            print(f"\n[imported-overwrite] the handle open across the overwrite failed, as allowed: {exc!r}")
    for i in range(3):  # every node comes to read v2, whole; before that v1 whole, or an error
        deadline = time.monotonic() + SEE_TIMEOUT_S
        while True:
            try:
                seen = versions.get(read_sha(c.path(i, "hub/model.bin"))[1], "a mix")
            except OSError as exc:
                seen = f"error {exc.errno}"
            assert seen != "a mix", f"{c.name(i)} read a mix of the object's versions\n{c.logs()}"
            if seen == "v2":
                break
            assert time.monotonic() < deadline, f"{c.name(i)} still reads {seen} after the overwrite\n{c.logs()}"
            time.sleep(0.3)
    assert c.get_object("hub/model.bin") == v2, "the mount changed the object"


def test_autogroup_forms_a_round_without_tags(make_cluster):
    """Untagged: three nodes opening one object at once share one read round; a lone reader reads alone."""
    c = make_cluster(node_options=FAST_IMPORT)  # autogroup is on by default
    data, lone = os.urandom(OBJECT_BYTES), os.urandom(2 * CHUNK)
    imported(c, None, data)
    imported(c, None, lone, "hub/lone.bin")
    freed = cold_pools(c)
    before, s3_before = read_counters(c), c.s3_sent_bytes()
    got, wall_s = read_at_once(c, range(3), "hub/model.bin")
    s3_sent = c.s3_sent_bytes() - s3_before
    d = delta(read_counters(c), before)
    print(f"\n[autogroup] freed {freed}; 3 untagged readers of {len(data) >> 20} MiB in {wall_s:.2f} s; "
          f"S3 sent {s3_sent / len(data):.3f}x; {d}")
    for node, outcome in got.items():
        assert outcome == (len(data), sha(data)), f"{node} read other bytes than the object holds"
    assert sum(v["read_rounds"] for v in d.values()) >= 2, f"no read round formed without tags: {d}\n{c.logs()}"
    assert len(data) <= s3_sent <= 1.05 * len(data), f"S3 sent {s3_sent / len(data):.3f}x the object (want <= 1.05)"

    before = read_counters(c)
    assert read_sha(c.path(2, "hub/lone.bin")) == (len(lone), sha(lone))
    d = delta(read_counters(c), before)
    assert d[2]["read_rounds"] == 0 and d[2]["chunks_from_chain"] == 0, f"a lone reader joined a round: {d[2]}"
    assert_clean(c)
