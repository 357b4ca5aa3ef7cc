"""The control plane: group rounds (dedup, plan, answers), the controller on the fabric, its CLI.

``FakeMeta`` stands in for the metadata engine: it has only the calls the
controller makes (membership and ``chunk_sources``), so these tests run
without a database and fast.
"""

import collections
import logging
import os
import signal
import subprocess
import sys
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from mounting import REPO

from aiturbofs import chunk
from aiturbofs._errors import AuthFailed, InvalidArgument, RemoteError
from aiturbofs._limits import AUTOGROUP_WINDOW_S, CHUNK_BYTES, READ_AHEAD_CHUNKS
from aiturbofs.controller import ControllerServer, EmbeddedController, RoundKeeper
from aiturbofs.fabric import MemoryNetwork, MemoryTransport, TcpTransport
from aiturbofs.messages import FirstReader, ToController, decode, encode
from aiturbofs.planner import NodeSpec

SECRET = b"correct horse battery staple 42!"
WRONG = b"incorrect horse battery staple 0"
GB = 1e9
TEST_TIMEOUT_S = 20

pytestmark = pytest.mark.fail_after(TEST_TIMEOUT_S)


@dataclass
class Row:
    name: str
    address: str
    state: str
    heartbeat_ns: int
    info: dict


@dataclass
class Source:
    backend_key: str
    offset: int
    length: int
    etag: str | None


class FakeMeta:
    """The metadata calls the controller makes, in memory."""

    def __init__(self, sources=None, rows=()):
        self.sources = dict(sources or {})
        self.rows = {r.name: r for r in rows}
        self.heartbeats = collections.Counter()

    async def chunk_sources(self, keys):
        return {k: self.sources[k] for k in keys if k in self.sources}

    async def nodes(self):
        return [self.rows[n] for n in sorted(self.rows)]

    async def upsert_node(self, name, address, info, now_ns):
        self.rows[name] = Row(name, address, "alive", now_ns, dict(info))

    async def node_heartbeat(self, name, now_ns, info=None):
        self.heartbeats[name] += 1
        return name in self.rows

    async def set_node_state(self, name, state):
        self.rows[name].state = state
        return True


def key(label) -> bytes:
    return chunk.digest(f"chunk {label}".encode())


def body(node, labels, *, group="job", group_size=None, replicas=2, ino=None, length=CHUNK_BYTES):
    """A report of a file whose chunks are ``key(label)`` (None: a hole)."""
    keys = [chunk.HOLE if lab is None else key(lab) for lab in labels]
    return {"op": "report", "node": node, "group": group, "group_size": group_size, "replicas": replicas,
            "file": {"ino": ino or abs(hash((node, tuple(labels)))) % 10**9 + 1, "path": f"{node}.bin",
                     "size": length * len(keys), "chunks": [k.hex() for k in keys], "lengths": [length] * len(keys)}}


def members(n, *, send=25 * GB, snic=12.5 * GB, dram=1 << 40):
    return {f"n{i}": NodeSpec(send, send, snic, dram) for i in range(1, n + 1)}


async def report(keeper, b) -> dict:
    """``keeper``'s answer to the report ``b``, both as they cross the fabric."""
    return encode(await keeper.report(b["node"], decode(b, ToController)))


async def report_all(keeper, bodies) -> list[dict]:
    """Report ``bodies`` in this order (each queued before the next is sent); their answers."""
    answers = [None] * len(bodies)

    async def one(i, b):
        answers[i] = await report(keeper, b)

    async with trio.open_nursery() as nursery:
        for i, b in enumerate(bodies):
            nursery.start_soon(one, i, b)
            await trio.testing.wait_all_tasks_blocked()
    return answers


def holders_after_staging(bodies, answers) -> dict[bytes, set[str]]:
    """Chunk -> its writers plus every node the answers stage it to."""
    out = collections.defaultdict(set)
    for b, a in zip(bodies, answers):
        keys = [bytes.fromhex(h) for h in b["file"]["chunks"]]
        for k in keys:
            if k != chunk.HOLE:
                out[k].add(b["node"])
        for idx, dst in a["stage"]:
            out[keys[idx]].add(dst)
    return out


# --- RoundKeeper ---------------------------------------------------------------------------------


async def test_identical_files_upload_each_chunk_once():
    keeper = RoundKeeper(FakeMeta(), members(3), backend_bw=100 * GB, window_s=5, wait_max_s=10)
    bodies = [body(f"n{i}", range(8), group_size=3) for i in (1, 2, 3)]
    answers = await report_all(keeper, bodies)
    assert len({a["round"] for a in answers}) == 1 and answers[0]["round"] == "job#1"
    for idx in range(8):
        uploaders = [a for a in answers if str(idx) in a["persist"]]
        assert len(uploaders) == 1
        assert all(idx in a["wait"] for a in answers if a is not uploaders[0])
    assert answers[0]["persist"] and not answers[1]["persist"] and not answers[2]["persist"]  # the first reporter
    a = answers[0]
    assert (a["files"], a["unique_bytes"], a["total_bytes"], a["durable_bytes"]) == (3, 8 * CHUNK_BYTES, 24 * CHUNK_BYTES, 0)
    assert all(a["stage"] == [] and a["copy"] == {} for a in answers)  # 3 writers already exceed 2 replicas
    assert sorted(a["holders"]) == ["n1", "n2", "n3"] and a["holders"][0] == "n1"
    assert keeper.stats()["job"]["rounds"] == 1 and keeper.stats()["job"]["unique_bytes"] == 8 * CHUNK_BYTES


async def test_partly_identical_files_and_holes():
    keeper = RoundKeeper(FakeMeta(), members(2), backend_bw=100 * GB, window_s=5, wait_max_s=10)
    bodies = [body("n1", ["a", "b", None, "c"], group_size=2), body("n2", ["a", "b", "d", None, "e"], group_size=2)]
    a1, a2 = await report_all(keeper, bodies)
    assert set(a1["persist"]) == {"0", "1", "3"} and a1["wait"] == []
    assert set(a2["persist"]) == {"2", "4"} and a2["wait"] == [0, 1]  # a, b: n1's file uploads them
    assert a1["unique_bytes"] == 5 * CHUNK_BYTES and a1["total_bytes"] == 7 * CHUNK_BYTES
    # Every chunk is written by one node only: replicas=2 needs one copy each.
    for k, nodes in holders_after_staging(bodies, (a1, a2)).items():
        assert len(nodes) >= 2, k.hex()
    for a, b in ((a1, bodies[0]), (a2, bodies[1])):
        for idx, dst in a["stage"]:
            assert dst != b["node"] and b["file"]["chunks"][idx] != chunk.HOLE.hex()
        assert set(a["persist"].values()) <= set(a["holders"])


async def test_durable_chunks_are_copied_not_planned():
    src = Source("ckpt/step1/a.bin", 3 * CHUNK_BYTES, CHUNK_BYTES, '"etag1"')
    keeper = RoundKeeper(FakeMeta({key("a"): src}), members(2), backend_bw=100 * GB, window_s=5, wait_max_s=10)
    bodies = [body("n1", ["a", "b"], group_size=2), body("n2", ["b", "a"], group_size=2)]
    a1, a2 = await report_all(keeper, bodies)
    want = {"backend_key": "ckpt/step1/a.bin", "offset": 3 * CHUNK_BYTES, "length": CHUNK_BYTES, "etag": '"etag1"'}
    assert a1["copy"] == {"0": want} and a2["copy"] == {"1": want}
    assert a1["persist"] == {"1": a1["persist"]["1"]} and a2["wait"] == [0] and a2["persist"] == {}
    assert a1["durable_bytes"] == CHUNK_BYTES and a1["unique_bytes"] == 2 * CHUNK_BYTES
    staged = {bodies[i]["file"]["chunks"][idx] for i, a in enumerate((a1, a2)) for idx, _ in a["stage"]}
    assert key("a").hex() not in staged  # durable: no replicas needed


async def test_everything_durable_needs_no_plan():
    src = Source("old.bin", 0, CHUNK_BYTES, None)
    keeper = RoundKeeper(FakeMeta({key("a"): src}), {}, backend_bw=GB, window_s=0.05, wait_max_s=1)
    (a,) = await report_all(keeper, [body("n1", ["a"])])
    assert "error" in a  # n1 is not a member: its writer is not alive
    keeper.members["n1"] = NodeSpec(GB, GB, GB, 0)
    (a,) = await report_all(keeper, [body("n1", ["a", None])])
    assert a["copy"] == {"0": {"backend_key": "old.bin", "offset": 0, "length": CHUNK_BYTES, "etag": None}}
    assert a["persist"] == {} and a["stage"] == [] and a["makespan_s"] == 0.0


async def test_group_size_closes_a_round_at_once():
    keeper = RoundKeeper(FakeMeta(), members(2), backend_bw=100 * GB, window_s=5, wait_max_s=10)
    start = trio.current_time()
    answers = await report_all(keeper, [body("n1", ["a"], group_size=2), body("n2", ["b"], group_size=2)])
    assert trio.current_time() - start < 2 and [a["files"] for a in answers] == [2, 2]


async def test_window_closes_a_round_without_group_size():
    keeper = RoundKeeper(FakeMeta(), members(2), backend_bw=100 * GB, window_s=0.1, wait_max_s=10)
    start = trio.current_time()
    answers = await report_all(keeper, [body("n1", ["a"]), body("n2", ["b"])])
    assert 0.1 <= trio.current_time() - start < 2
    assert [a["round"] for a in answers] == ["job#1", "job#1"] and answers[0]["files"] == 2
    (late,) = await report_all(keeper, [body("n1", ["c"])])  # after the close: the next round
    assert late["round"] == "job#2" and late["files"] == 1


async def test_a_round_short_of_its_size_closes_at_the_wait_max(caplog):
    async def main():
        keeper = RoundKeeper(FakeMeta(), members(3), backend_bw=100 * GB, window_s=0.05, wait_max_s=0.3)
        start = trio.current_time()
        answers = await report_all(keeper, [body("n1", ["a"], group_size=3), body("n2", ["b"], group_size=3)])
        assert trio.current_time() - start >= 0.3 and [a["files"] for a in answers] == [2, 2]
        assert keeper.stats()["job"]["short_rounds"] == 1

    with caplog.at_level(logging.WARNING, logger="aiturbofs.controller"):
        await main()
    assert "round_short round=job#1 files=2 of=3" in caplog.text


async def test_replicas_are_satisfied_for_every_chunk():
    keeper = RoundKeeper(FakeMeta(), members(4), backend_bw=100 * GB, window_s=5, wait_max_s=10)
    # Two DP pairs: n1/n2 write the same file, n3/n4 another; every node also writes its own.
    bodies = [body("n1", ["p0", "p1", "p2"], group_size=8, replicas=3, ino=1),
              body("n2", ["p0", "p1", "p2"], group_size=8, replicas=3, ino=2),
              body("n3", ["q0", "q1"], group_size=8, replicas=3, ino=3),
              body("n4", ["q0", "q1"], group_size=8, replicas=3, ino=4)]
    bodies += [body(f"n{i}", [f"own{i}.{j}" for j in range(3)], group_size=8, replicas=3, ino=10 + i)
               for i in range(1, 5)]
    answers = await report_all(keeper, bodies)
    assert {a["round"] for a in answers} == {"job#1"} and answers[0]["replicas"] == 3
    holders = holders_after_staging(bodies, answers)
    assert len(holders) == 17 and all(len(nodes) >= 3 for nodes in holders.values())
    puts = [(bodies[i]["file"]["chunks"][idx], dst) for i, a in enumerate(answers) for idx, dst in a["stage"]]
    assert len(puts) == len(set(puts))  # each transfer is given to exactly one file
    for b, a in zip(bodies, answers):
        mine = {bytes.fromhex(h) for h in b["file"]["chunks"]}
        assert set(a["holders"]) == set().union(*(holders[k] for k in mine)) and a["holders"][0] == b["node"]
        for idx, node in a["persist"].items():
            assert node in holders[bytes.fromhex(b["file"]["chunks"][int(idx)])]


async def test_a_single_writer_spreads_the_upload_over_the_cluster():
    """Rank 0 writes a 16-chunk file: its slow S-NIC alone would take 16x; the plan fans it out."""
    keeper = RoundKeeper(FakeMeta(), members(3, send=25 * GB, snic=1.25 * GB), backend_bw=100 * GB,
                         window_s=0.05, wait_max_s=10)
    b = body("n1", range(16), replicas=1)
    (a,) = await report_all(keeper, [b])
    persisters = collections.Counter(a["persist"].values())
    assert len(a["persist"]) == 16 and len(persisters) > 1, persisters
    staged = {(idx, dst) for idx, dst in a["stage"]}
    for idx, node in a["persist"].items():
        assert node == "n1" or (int(idx), node) in staged  # a persister holds the chunk
    assert a["makespan_s"] < 16 * CHUNK_BYTES / (1.25 * GB) * 0.6
    assert a["lp_bound_s"] <= a["makespan_s"] * (1 + 1e-9)


async def test_dedup_mode_gives_each_unique_chunk_to_its_first_files_node():
    """--plan dedup, DP replicas: one uploader per unique chunk, and transfers only to make up the replicas."""
    keeper = RoundKeeper(FakeMeta(), members(4), backend_bw=100 * GB, window_s=5, wait_max_s=10, plan="dedup")
    model = [f"m{j}" for j in range(6)]
    # n3 reports first: the first file, not the lowest node name, uploads the shared chunks.
    order = ("n3", "n1", "n4", "n2")
    bodies = [body(n, [*model, f"{n}.s0", f"{n}.s1"], group_size=4, replicas=2, ino=10 + i)
              for i, n in enumerate(order)]
    answers = await report_all(keeper, bodies)
    assert {a["round"] for a in answers} == {"job#1"} and all(a["plan"] == "dedup" for a in answers)
    assert all(a["makespan_s"] == 0.0 and a["lp_bound_s"] == 0.0 for a in answers)  # nothing was solved
    uploaders = collections.defaultdict(list)  # chunk -> (file position, node that sends the bytes)
    for pos, (b, a) in enumerate(zip(bodies, answers)):
        for idx, node in a["persist"].items():
            uploaders[b["file"]["chunks"][int(idx)]].append((pos, node))
    assert len(uploaders) == 6 + 4 * 2
    for hexkey, ups in uploaders.items():
        first = next(pos for pos, b in enumerate(bodies) if hexkey in b["file"]["chunks"])
        assert ups == [(first, bodies[first]["node"])], (hexkey, ups)
    assert all(answers[0]["persist"][str(j)] == "n3" for j in range(6))
    for a in answers[1:]:
        assert a["wait"] == list(range(6)) and set(a["persist"]) == {"6", "7"}
    # The model chunks have 4 writers (>= 2 replicas): never moved.  Each shard chunk, one writer: one
    # transfer, and both of a file's shard chunks to the same node, as a node alone would place them.
    for b, a in zip(bodies, answers):
        assert sorted(idx for idx, _ in a["stage"]) == [6, 7], a["stage"]
        (dst,) = {dst for _, dst in a["stage"]}
        assert dst != b["node"] and a["holders"] == [b["node"], *sorted({*order} - {b["node"]})]
    holders = holders_after_staging(bodies, answers)
    assert all(len(holders[key(lab)]) == 4 for lab in model)
    assert all(len(nodes) == 2 for k, nodes in holders.items() if k not in {key(lab) for lab in model})
    g = keeper.stats()["job"]
    assert g["plan"] == "dedup" and g["unique_bytes"] == 14 * CHUNK_BYTES and g["bytes"] == 32 * CHUNK_BYTES


async def test_dedup_mode_leaves_a_single_writers_upload_to_it():
    """--plan dedup: rank 0's file is uploaded by rank 0 alone (the LP would spread it, see above)."""
    keeper = RoundKeeper(FakeMeta(), members(3, send=25 * GB, snic=1.25 * GB), backend_bw=100 * GB,
                         window_s=0.05, wait_max_s=10, plan="dedup")
    (a,) = await report_all(keeper, [body("n1", [*range(8), 0, None], replicas=1)])
    assert a["persist"] == {str(i): "n1" for i in range(9)} and a["stage"] == [] and a["wait"] == []
    assert a["holders"] == ["n1"] and a["unique_bytes"] == 8 * CHUNK_BYTES
    (a,) = await report_all(keeper, [body("n2", range(4), replicas=5)])  # more replicas than nodes: all 3
    assert sorted(dst for _, dst in a["stage"]) == ["n1"] * 4 + ["n3"] * 4 and a["replicas"] == 3


async def test_dedup_mode_copies_durable_chunks_and_refuses_unknown_modes():
    src = Source("ckpt/step1/a.bin", 0, CHUNK_BYTES, '"e"')
    keeper = RoundKeeper(FakeMeta({key("a"): src}), members(2), backend_bw=GB, window_s=5, wait_max_s=10,
                         plan="dedup")
    a1, a2 = await report_all(keeper, [body("n1", ["a", "b"], group_size=2), body("n2", ["b", "a"], group_size=2)])
    assert a1["copy"] == {"0": {"backend_key": "ckpt/step1/a.bin", "offset": 0, "length": CHUNK_BYTES, "etag": '"e"'}}
    assert a1["persist"] == {"1": "n1"} and a2["persist"] == {} and a2["wait"] == [0] and "1" in a2["copy"]
    assert a1["stage"] == a2["stage"] == []  # b has two writers, a is durable
    with pytest.raises(InvalidArgument, match="plan mode 'greedy'"):
        RoundKeeper(None, members(1), backend_bw=GB, plan="greedy")


async def test_infeasible_round_answers_every_report_with_an_error(caplog):
    async def main():
        keeper = RoundKeeper(FakeMeta(), members(2, dram=0), backend_bw=100 * GB, window_s=5, wait_max_s=10)
        answers = await report_all(keeper, [body("n1", ["a"], group_size=2), body("n2", ["b"], group_size=2)])
        assert all("error" in a and "replicas" in a["error"] for a in answers)
        assert keeper.stats()["job"]["errors"] == 1

    with caplog.at_level(logging.WARNING, logger="aiturbofs.controller"):
        await main()
    assert "round_failed round=job#1 files=2" in caplog.text


async def test_a_dead_nodes_report_leaves_the_open_round():
    live = members(3)
    keeper = RoundKeeper(FakeMeta(), live, backend_bw=100 * GB, window_s=5, wait_max_s=10)
    answers = {}
    async def one(b):
        answers[b["node"]] = await report(keeper, b)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, body("n2", ["a", "b"], group_size=2))
        await trio.testing.wait_all_tasks_blocked()
        del live["n2"]
        keeper.drop_node("n2")
        nursery.start_soon(one, body("n1", ["a"], group_size=2))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(one, body("n3", ["c"], group_size=2))
    assert "error" in answers["n2"]
    assert answers["n1"]["files"] == 2 and answers["n1"]["persist"] == {"0": answers["n1"]["persist"]["0"]}
    assert answers["n1"]["round"] == answers["n3"]["round"] == "job#2"


async def test_bad_reports_are_refused():
    keeper = RoundKeeper(None, members(1), backend_bw=GB)
    good = body("n1", ["a"])
    for mutate in (lambda b: b.update(group=""), lambda b: b.update(replicas=0),
                   lambda b: b["file"].update(chunks=["xyz"]), lambda b: b["file"].update(lengths=[0]),
                   lambda b: b["file"].update(lengths=[]), lambda b: b.update(group_size=True)):
        bad = {**good, "file": dict(good["file"])}
        mutate(bad)
        with pytest.raises(Exception, match="report:"):
            await report(keeper, bad)


async def test_embedded_controller_plans_rounds_of_one_node():
    ctl = EmbeddedController()
    assert ctl.summary() == {}
    b1, b2 = body("local", ["a", "b"], replicas=2, ino=1), body("local", ["b", "c"], replicas=2, ino=2)
    answers = [None, None]
    async def one(i, b):
        answers[i] = encode(await ctl.report(decode(b, ToController)))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, 0, b1)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(one, 1, b2)
    a1, a2 = answers
    assert a1["replicas"] == 1 and a1["holders"] == ["local"] and a1["stage"] == []
    assert a1["persist"] == {"0": "local", "1": "local"} and a2["wait"] == [0] and a2["persist"] == {"1": "local"}


# --- ControllerServer over the fabric ------------------------------------------------------------


def join_body(node, dram_free=1 << 40):
    return {"op": "join", "node": node, "fabric": f"{node}:7387", "send_bw": 25 * GB, "recv_bw": 25 * GB,
            "snic_bw": 12.5 * GB, "dram_free": dram_free}


@asynccontextmanager
async def cluster(meta=None, **options):
    """A controller on a memory network; ``c.connect(node)`` opens a node's connection to it.

    Call ``connect`` only at the top level of the ``async with`` body: its
    transport lives until the cluster is left.
    """
    network, meta = MemoryNetwork(), meta or FakeMeta()
    server = ControllerServer(meta, backend_bw=100 * GB, **options)
    async with MemoryTransport(network, "controller", SECRET) as transport, trio.open_nursery() as nursery:
        address = await nursery.start(server.run, transport)
        # The nodes' transports close before the controller is cancelled: closing
        # a transport with open peers inside a cancelled scope is not clean.
        async with AsyncExitStack() as clients:

            async def connect(node, secret=SECRET):
                client = await clients.enter_async_context(MemoryTransport(network, node, secret))
                return await client.connect(address)

            yield SimpleNamespace(server=server, meta=meta, connect=connect)
        nursery.cancel_scope.cancel()


async def test_join_heartbeat_and_dead_detection(caplog):
    async def main():
        async with cluster(heartbeat_s=0.05, dead_after_s=0.3) as c:
            n1, n2 = await c.connect("n1"), await c.connect("n2")
            reply = await n1.control(join_body("n1"))
            assert reply["ok"] and reply["heartbeat_s"] == 0.05
            assert reply["nodes"] == [{"node": "n1", "fabric": "n1:7387", "state": "alive"}]
            assert await n2.control({"op": "heartbeat", "node": "n2", "dram_free": 5}) == {"error": "not joined"}
            await n2.control(join_body("n2"))
            assert c.meta.rows["n2"].info["snic_bw"] == 12.5 * GB
            reply = await n1.control({"op": "heartbeat", "node": "n1", "dram_free": 123})
            assert [n["node"] for n in reply["nodes"]] == ["n1", "n2"] and reply["dead"] == []
            assert c.server.members["n1"].dram_free_bytes == 123
            # n1 keeps heartbeating, n2 falls silent.
            for _ in range(12):
                await trio.sleep(0.05)
                reply = await n1.control({"op": "heartbeat", "node": "n1", "dram_free": 123})
            assert reply["dead"] == ["n2"] and [n["node"] for n in reply["nodes"]] == ["n1"]
            assert c.meta.rows["n2"].state == "dead" and c.meta.rows["n1"].state == "alive"
            assert "n2" not in c.server.members
            assert await n2.control({"op": "heartbeat", "node": "n2"}) == {"error": "not joined"}
            assert (await n2.control(join_body("n2")))["ok"] and c.meta.rows["n2"].state == "alive"
            await n2.control({"op": "leave", "node": "n2"})
            assert c.meta.rows["n2"].state == "left" and "n2" not in c.server.members
            status = await n1.control({"op": "status"})
            assert {n["node"]: n["state"] for n in status["nodes"]} == {"n1": "alive", "n2": "left"}
            assert await n1.get_chunk(key("a")) is None and await n1.put_chunk(key("a"), b"chunk a") is False

    with caplog.at_level(logging.WARNING, logger="aiturbofs.controller"):
        await main()
    assert "node_dead node=n2 reason='no heartbeat for" in caplog.text


async def test_reports_over_the_fabric():
    async with cluster(window_s=5, wait_max_s=10) as c:
        peers = {n: await c.connect(n) for n in ("n1", "n2")}
        assert await peers["n1"].control(body("n1", ["a"])) == {"error": "not joined"}
        for n, peer in peers.items():
            await peer.control(join_body(n))
        answers = {}
        async def one(n):
            answers[n] = await peers[n].control(body(n, range(4), group_size=2))
        async with trio.open_nursery() as reports:
            for n in peers:
                reports.start_soon(one, n)
        assert answers["n1"]["round"] == answers["n2"]["round"] == "job#1"
        assert len(answers["n1"]["persist"]) + len(answers["n2"]["persist"]) == 4
        status = await peers["n1"].control({"op": "status"})
        assert status["groups"]["job"]["files"] == 2


async def test_a_dedup_controller_answers_over_the_fabric():
    async with cluster(window_s=5, wait_max_s=10, plan="dedup") as c:
        peers = {n: await c.connect(n) for n in ("n1", "n2")}
        for n, peer in peers.items():
            await peer.control(join_body(n))
        answers = {}
        async def one(n):
            answers[n] = await peers[n].control(body(n, range(4), group_size=2))
        async with trio.open_nursery() as reports:
            reports.start_soon(one, "n1")
            await trio.testing.wait_all_tasks_blocked()
            reports.start_soon(one, "n2")
        assert answers["n1"]["persist"] == {str(i): "n1" for i in range(4)} and answers["n2"]["wait"] == [0, 1, 2, 3]
        assert (await peers["n2"].control({"op": "status"}))["groups"]["job"]["plan"] == "dedup"


async def test_a_node_dying_drops_its_report_from_the_open_round():
    async def beat(peer, node):
        while True:
            await peer.control({"op": "heartbeat", "node": node})
            await trio.sleep(0.05)

    # n1 and n3 beat 20 times per dead_after_s: the round's plan (cvxpy, in a worker thread holding
    # the GIL) once starved this process's trio thread for 0.2 s on a busy 2-core machine, and a
    # live n3 was declared dead (the round planned n1 alone).
    async with cluster(heartbeat_s=0.05, dead_after_s=1.0, window_s=5, wait_max_s=10) as c:
        peers = {n: await c.connect(n) for n in ("n1", "n2", "n3")}
        for n, peer in peers.items():
            await peer.control(join_body(n))
        got = {}
        async def report(n, labels):
            got[n] = await peers[n].control(body(n, labels, group_size=2))
        async with trio.open_nursery() as background:
            background.start_soon(beat, peers["n1"], "n1")
            background.start_soon(beat, peers["n3"], "n3")
            async with trio.open_nursery() as reports:
                reports.start_soon(report, "n2", ["a"])  # n2 never heartbeats: dead, its report dropped
                with trio.fail_after(5):  # n2 is declared dead after dead_after_s
                    while "n2" not in got:
                        await trio.sleep(0.02)
                assert "error" in got["n2"] and "n2" not in c.server.members
                reports.start_soon(report, "n1", ["a"])
                await trio.sleep(0.05)
                reports.start_soon(report, "n3", ["b"])
            background.cancel_scope.cancel()
        assert got["n1"]["files"] == 2 and got["n1"]["round"] == got["n3"]["round"] == "job#2"
        assert c.meta.rows["n2"].state == "dead"


async def test_restart_loads_members_from_the_metadata():
    info = {"send_bw": 25 * GB, "recv_bw": 25 * GB, "snic_bw": 12.5 * GB, "dram_free": 1 << 30}
    meta = FakeMeta(rows=[Row("n1", "n1:7387", "alive", 0, info), Row("n2", "n2:7387", "alive", 0, info),
                          Row("n3", "n3:7387", "dead", 0, info)])
    async with cluster(meta, heartbeat_s=0.05, dead_after_s=0.3) as c:
        assert set(c.server.members) == {"n1", "n2"}
        n1 = await c.connect("n1")
        assert "error" not in await n1.control({"op": "heartbeat", "node": "n1", "dram_free": 1})
        for _ in range(10):  # n2 does not come back
            await trio.sleep(0.05)
            await n1.control({"op": "heartbeat", "node": "n1", "dram_free": 1})
        assert meta.rows["n2"].state == "dead" and set(c.server.members) == {"n1"}


async def test_a_node_cannot_speak_for_another(caplog):
    async def main():
        async with cluster() as c:
            n1 = await c.connect("n1")
            for op in (join_body("n2"), {"op": "heartbeat", "node": "n2"}, body("n2", ["a"]),
                       {"op": "leave", "node": "n2"}):
                with pytest.raises(RemoteError, match="authenticated as 'n1'"):
                    await n1.control(op)
            with pytest.raises(RemoteError, match="unknown controller op"):
                await n1.control({"op": "frobnicate"})
            assert c.meta.rows == {}

    with caplog.at_level(logging.WARNING, logger="aiturbofs.controller"):
        await main()
    assert "join from n1 at" in caplog.text and "claims to be node 'n2'" in caplog.text


async def test_a_malformed_request_fails_alone():
    async with cluster() as c:
        n1 = await c.connect("n1")
        for bad, why in (({"op": "leave"}, "leave: node is missing"),
                         ({**join_body("n1"), "dram_free": "lots"}, "join: dram_free must be an integer"),
                         ({"op": "hold", "ino": 1}, "unknown controller op 'hold'")):
            with pytest.raises(RemoteError, match=f"MalformedMessage: {why}"):
                await n1.control(bad)
        assert c.meta.rows == {}
        assert (await n1.control(join_body("n1")))["ok"]  # the connection and the controller go on


async def test_wrong_secret_is_rejected():
    async with cluster() as c:
        with pytest.raises(AuthFailed):
            await c.connect("n1", WRONG)
        assert c.meta.rows == {}


# --- the CLI ------------------------------------------------------------------------------------


def aiturbo_controller(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "aiturbofs.cli.main", "controller", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=REPO), **kw)


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "aiturbofs.cli.main", "controller", "--help"], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=REPO), check=True).stdout
    for word in ("--listen", "--meta", "--secret-file", "--backend-gbps", "--plan", "--log-level", "SIGTERM"):
        assert word in out


def test_cli_refuses_an_unknown_plan_mode(tmp_path):
    proc = aiturbo_controller("--listen", "127.0.0.1:0", "--meta", f"sqlite:///{tmp_path}/meta.db",
                              "--secret-file", str(tmp_path / "secret"), "--plan", "greedy")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--plan" in err and "'greedy'" in err, err


def test_cli_refuses_a_readable_secret(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o644)
    proc = aiturbo_controller("--listen", "127.0.0.1:0", "--meta", f"sqlite:///{tmp_path}/meta.db",
                              "--secret-file", str(secret))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "group or others" in err and "chmod 600" in err, err
    assert "listening" not in out


def _meta_has_membership() -> bool:
    import inspect

    from aiturbofs.meta._sqlite import SqliteMetaStore

    return not inspect.isabstract(SqliteMetaStore)


@pytest.mark.skipif(not _meta_has_membership(), reason="the SQLite engine has no membership calls yet")
async def test_cli_serves_nodes_and_stops_on_sigterm(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET + b"\n")
    secret.chmod(0o600)
    proc = aiturbo_controller("--listen", "127.0.0.1:0", "--meta", f"sqlite:///{tmp_path}/meta.db",
                              "--secret-file", str(secret), "--backend-gbps", "10")
    try:
        line = proc.stdout.readline()
        assert line.startswith("controller listening on 127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        address = line.split()[-1]

        async def main():
            async with TcpTransport("n1", SECRET, host="127.0.0.1", port=0) as transport:
                peer = await transport.connect(address)
                assert (await peer.control(join_body("n1")))["ok"]
                assert [n["node"] for n in (await peer.control({"op": "heartbeat", "node": "n1"}))["nodes"]] == ["n1"]

        await main()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "node_joined node=n1" in err and "SIGTERM" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ================================================================ read rounds


async def test_read_round_fetches_each_chunk_once_and_chains_every_reader():
    from aiturbofs.controller._reads import ReadRoundKeeper

    keeper = ReadRoundKeeper(FakeMeta(), members(3), backend_bw=10 * GB)
    labels = [f"m{i}" for i in range(12)]
    bodies = [body(n, labels, group="load", group_size=3, ino=7) for n in ("n1", "n2", "n3")]
    for b in bodies:
        b["op"] = "read_report"
    answers = await report_all(keeper, bodies)
    fetch = answers[0]["fetch_bytes"]
    assert sum(fetch.values()) == 12 * CHUNK_BYTES  # every unique chunk from storage exactly once
    assert sorted(fetch.values()) == [4 * CHUNK_BYTES] * 3  # spread evenly over the readers' S-NICs
    for a in answers:
        assert a["readers"] == 3 and a["files"] == 3
        for idx, chain in a["chains"].items():
            assert sorted(chain) == ["n1", "n2", "n3"], (idx, chain)
    heads = collections.Counter(chain[0] for chain in answers[0]["chains"].values())
    assert heads == {"n1": 4, "n2": 4, "n3": 4}


async def test_read_round_head_is_a_reader_that_has_the_chunk():
    from aiturbofs.controller._reads import ReadRoundKeeper

    keeper = ReadRoundKeeper(FakeMeta(), members(2), backend_bw=10 * GB)
    bodies = [body(n, ["a", "b", "c"], group="load", group_size=2, ino=9) for n in ("n1", "n2")]
    for b in bodies:
        b["op"] = "read_report"
    bodies[1]["file"]["have"] = [0, 1, 2]  # n2 wrote it: all in its DRAM
    answers = await report_all(keeper, bodies)
    assert answers[0]["fetch_bytes"] == {}  # nothing from storage
    assert all(chain == ["n2", "n1"] for chain in answers[0]["chains"].values())


async def test_autogroup_first_reader_reads_at_once_and_heads_what_it_fetched_alone():
    """``join`` tells the first reader of a version within the window that it is first (it reads alone
    at once); the round made of everyone's reports gives it the leading chunks it may have fetched
    meanwhile (its S-NIC rate times the time since its join, plus read-ahead) and spreads the rest.
    The round closes after the window, or at once when every live node reported."""
    from aiturbofs.controller._reads import AUTO_PREFIX, ReadRoundKeeper

    keeper = ReadRoundKeeper(FakeMeta(), members(4, snic=CHUNK_BYTES), backend_bw=10 * GB)  # one chunk/s
    group = f"{AUTO_PREFIX}7:1:etag"
    assert keeper.join("n2", group) == FirstReader(first=True)
    assert keeper.join("n2", group) == FirstReader(first=True)  # asked again: still the first
    assert keeper.join("n1", group) == FirstReader(first=False)
    assert keeper.join("n3", group) == FirstReader(first=False)
    with pytest.raises(InvalidArgument):
        keeper.join("n1", "job")  # tagged groups do not join
    labels = [f"m{i}" for i in range(16)]
    bodies = [body(n, labels, group=group, ino=7) for n in ("n2", "n1", "n3")]
    for b in bodies:
        b["op"] = "read_report"
    start = trio.current_time()
    answers = await report_all(keeper, bodies)
    waited = trio.current_time() - start
    assert AUTOGROUP_WINDOW_S <= waited < AUTOGROUP_WINDOW_S + 1, waited  # the round closed by its window
    head_start = int(waited) + 1 + READ_AHEAD_CHUNKS  # chunks n2 may have fetched alone
    chains = answers[0]["chains"]
    assert all(chains[str(i)][0] == "n2" for i in range(head_start)), chains
    fetch = answers[0]["fetch_bytes"]
    assert sum(fetch.values()) == (16 - head_start) * CHUNK_BYTES  # the rest once each, spread
    assert set(fetch) == {"n1", "n2", "n3"}
    await trio.sleep(AUTOGROUP_WINDOW_S + 0.1)
    assert keeper.join("n3", group) == FirstReader(first=True)  # a new window, a new first reader
    # every live node reads it: the round closes at once, nobody else can come
    everyone = [body(n, labels, group=group, ino=7) for n in ("n3", "n1", "n2", "n4")]
    for b in everyone:
        b["op"] = "read_report"
    start = trio.current_time()
    answers = await report_all(keeper, everyone)
    assert trio.current_time() - start < AUTOGROUP_WINDOW_S / 2 and answers[0]["readers"] == 4
