"""The cluster's control messages: every one round-trips, the wire shape stays, bad frames raise one error."""

import dataclasses
import itertools
import json
import types
import typing
from typing import Any

import pytest

from aiturbofs import messages as m
from aiturbofs._errors import InvalidArgument, MalformedMessage


def _declared(base: type) -> list[type]:
    """The dataclasses of ``aiturbofs.messages`` that are ``base``s, in declaration order."""
    return [v for v in vars(m).values()
            if isinstance(v, type) and issubclass(v, base) and dataclasses.is_dataclass(v)]


def _sample(tp, counter, *, minimal: bool):
    """A value of annotated type ``tp`` (each scalar a new one, so swapped fields would show)."""
    n = next(counter)
    if tp is str:
        return f"s{n}"
    if tp is int:
        return n
    if tp is float:
        return n + 0.5
    if tp is bool:
        return n % 2 == 0
    if tp is Any:
        return {"k": [n, f"s{n}", None, {"x": 1.5}]}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        if minimal:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _sample(inner, counter, minimal=minimal)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_sample(args[0], counter, minimal=minimal) for _ in range(2))
        return tuple(_sample(a, counter, minimal=minimal) for a in args)
    if origin is dict:
        return {f"{n}": _sample(args[1], counter, minimal=minimal)}
    assert dataclasses.is_dataclass(tp), tp
    return _build(tp, counter, minimal=minimal)


def _build(cls, counter, *, minimal: bool):
    """An instance of ``cls`` with every field set (``minimal``: only the required ones, None where allowed)."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if minimal and has_default:
            continue
        values[f.name] = _sample(hints[f.name], counter, minimal=minimal)
    return cls(**values)


def _over_the_wire(message) -> dict:
    return json.loads(json.dumps(m.encode(message), allow_nan=False))


def _decoded(body: dict, cls):
    return m.decode(body, m.Request) if issubclass(cls, m.Request) else m.decode_answer(body, cls)


MESSAGES = [c for c in _declared(m.Message) if not issubclass(c, m.Request) or c.op]


def test_every_request_is_registered_by_its_op():
    requests = [c for c in _declared(m.Request) if c.op]
    assert {c.op: c for c in requests} == m.REQUESTS
    # the only requests without an op are the bases that share fields
    assert {c for c in _declared(m.Request) if not c.op} == {m.FromNode, m.RoundReport}
    assert all(issubclass(c, (m.ToController, m.ToNode)) for c in requests)


@pytest.mark.parametrize("minimal", [False, True], ids=["every-field", "required-only"])
@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_every_message_round_trips(cls, minimal):
    message = _build(cls, itertools.count(1), minimal=minimal)
    body = _over_the_wire(message)
    if issubclass(cls, m.Request):
        assert next(iter(body)) == "op" and body["op"] == cls.op
    else:
        assert "op" not in body
    assert _decoded(body, cls) == message
    assert m.encode(_decoded(body, cls)) == body


# --- the wire shape: exactly the objects the nodes and the controller have always sent -----------------

HEX = "ab" * 32
LISTING = {"node": "n1", "fabric": "10.0.0.1:7387", "state": "alive"}

WIRE = [
    (m.Join(node="n1", fabric="10.0.0.1:7387", dram_free=1 << 30, send_bw=25e9, recv_bw=25e9, snic_bw=12.5e9),
     {"op": "join", "node": "n1", "fabric": "10.0.0.1:7387", "dram_free": 1 << 30, "send_bw": 25e9,
      "recv_bw": 25e9, "snic_bw": 12.5e9}),
    (m.Heartbeat(node="n1", dram_free=5, summary={"pool_used": 1, "metrics": None}),
     {"op": "heartbeat", "node": "n1", "dram_free": 5, "summary": {"pool_used": 1, "metrics": None}}),
    (m.Report(node="n1", group="job", group_size=None, replicas=2,
              file=m.FileChunks(ino=7, path="a.bin", size=9, chunks=(HEX, HEX), lengths=(8, 1))),
     {"op": "report", "node": "n1", "group": "job", "group_size": None, "replicas": 2,
      "file": {"ino": 7, "path": "a.bin", "size": 9, "chunks": [HEX, HEX], "lengths": [8, 1]}}),
    (m.ReadReport(node="n2", group="load", group_size=3, replicas=2,
                  file=m.FileChunks(ino=7, path="a.bin", size=9, chunks=(HEX,), lengths=(9,), have=(0,))),
     {"op": "read_report", "node": "n2", "group": "load", "group_size": 3, "replicas": 2,
      "file": {"ino": 7, "path": "a.bin", "size": 9, "chunks": [HEX], "lengths": [9], "have": [0]}}),
    (m.ReadJoin(node="n2", group="auto:7:1:etag"), {"op": "read_join", "node": "n2", "group": "auto:7:1:etag"}),
    (m.Leave(node="n2"), {"op": "leave", "node": "n2"}),
    (m.Status(), {"op": "status"}),
    (m.Hold(ino=7, keys=(HEX,)), {"op": "hold", "ino": 7, "keys": [HEX]}),
    (m.UploadPart(backend_key="ckpt/a.bin", token="t", index=3, key=HEX, length=8, holders=("n1", "n2")),
     {"op": "upload_part", "backend_key": "ckpt/a.bin", "token": "t", "index": 3, "key": HEX, "length": 8,
      "holders": ["n1", "n2"]}),
    (m.Joined(ok=True, heartbeat_s=1.0, nodes=(m.NodeListing(node="n1", fabric="10.0.0.1:7387", state="alive"),)),
     {"ok": True, "heartbeat_s": 1.0, "nodes": [LISTING]}),
    (m.Membership(nodes=(m.NodeListing(node="n1", fabric="10.0.0.1:7387", state="alive"),), dead=("n3",)),
     {"nodes": [LISTING], "dead": ["n3"]}),
    (m.WritePlan(round="job#1", plan="lp", files=2, replicas=2, lp_bound_s=0.5, makespan_s=0.75, plan_s=0.01,
                 cached=False, unique_bytes=16, total_bytes=24, durable_bytes=8, stage=((1, "n2"),),
                 holders=("n1", "n2"), persist={"1": "n2"},
                 copy={"0": m.DurableSource(backend_key="old.bin", offset=0, length=8, etag=None)}, wait=(2,)),
     {"round": "job#1", "plan": "lp", "files": 2, "replicas": 2, "lp_bound_s": 0.5, "makespan_s": 0.75,
      "plan_s": 0.01, "cached": False, "unique_bytes": 16, "total_bytes": 24, "durable_bytes": 8,
      "stage": [[1, "n2"]], "holders": ["n1", "n2"], "persist": {"1": "n2"},
      "copy": {"0": {"backend_key": "old.bin", "offset": 0, "length": 8, "etag": None}}, "wait": [2]}),
    (m.ReadPlan(round="load#1", files=2, readers=2, total_bytes=16, unique_bytes=8, fetch_bytes={"n1": 8},
                chains={"0": ("n1", "n2")}),
     {"round": "load#1", "files": 2, "readers": 2, "total_bytes": 16, "unique_bytes": 8, "fetch_bytes": {"n1": 8},
      "chains": {"0": ["n1", "n2"]}}),
    (m.FirstReader(first=False), {"first": False}),
    (m.Ok(), {"ok": True}),
    (m.Receipt(receipt='"etag-3"'), {"receipt": '"etag-3"'}),
    (m.Refused(error="not joined"), {"error": "not joined"}),
    (m.ControllerStatus(nodes=({**LISTING, "seen_s_ago": 0.5},), groups={"job": {"rounds": 1}}, read_groups={}),
     {"nodes": [{**LISTING, "seen_s_ago": 0.5}], "groups": {"job": {"rounds": 1}}, "read_groups": {}}),
]


@pytest.mark.parametrize(("message", "body"), WIRE, ids=[type(message).__name__ for message, _ in WIRE])
def test_the_wire_shape_stays_as_it_was(message, body):
    """Byte for byte (fields in the same order), so nodes and a controller of another release understand it."""
    assert json.dumps(m.encode(message)) == json.dumps(body)
    assert _decoded(body, type(message)) == message


def test_the_wire_cases_cover_every_message():
    assert {type(message) for message, _ in WIRE} == set(MESSAGES)


def test_fields_a_receiver_does_not_know_are_ignored_and_defaults_fill_the_rest():
    """A newer sender may add fields; an older one may leave out those with defaults."""
    assert m.decode({"op": "heartbeat", "node": "n1", "cpu": 3}, m.ToController) == m.Heartbeat(node="n1")
    report = m.decode({"op": "report", "node": "n1", "group": "g", "file": {"ino": 1, "size": 0, "chunks": [],
                                                                               "lengths": []}}, m.ToController)
    assert (report.group_size, report.replicas, report.file.path, report.file.have) == (None, 1, "", None)
    assert m.decode({"op": "hold", "ino": 3}, m.ToNode) == m.Hold(ino=3, keys=())
    plan = m.decode_answer({"round": "g#1", "files": 1, "total_bytes": 0, "unique_bytes": 0, "fetch_bytes": {}},
                           m.ReadPlan)
    assert isinstance(plan, m.ReadPlan) and (plan.readers, plan.chains) == (1, {})


def _report(**changes) -> dict:
    body = {"op": "report", "node": "n1", "group": "job", "group_size": None, "replicas": 2,
            "file": {"ino": 7, "path": "a.bin", "size": 8, "chunks": [HEX], "lengths": [8]}}
    file = {**body["file"], **changes.pop("file", {})}
    return {**body, **changes, "file": file}


MALFORMED = [
    ("unknown op", {"op": "frobnicate"}, m.Request, "unknown control op 'frobnicate'"),
    ("no op", {"node": "n1"}, m.Request, "unknown control op None"),
    ("op not a string", {"op": ["join"]}, m.Request, "unknown control op"),
    ("a node's op at the controller", {"op": "hold", "ino": 1}, m.ToController, "unknown controller op 'hold'"),
    ("a controller op at a node", {"op": "status"}, m.ToNode, "unknown node op 'status'"),
    ("not an object", ["op", "join"], m.Request, "JSON object"),
    ("missing field", {"op": "leave"}, m.ToController, "leave: node is missing"),
    ("missing nested field", {**_report(), "file": {"size": 8, "chunks": [HEX], "lengths": [8]}}, m.ToController,
     "report: file.ino is missing"),
    ("null for a required field", _report(file={"ino": None}), m.ToController,
     "report: file.ino must be an integer, not null"),
    ("wrong type", {"op": "hold", "ino": "7"}, m.ToNode, "hold: ino must be an integer, not a string"),
    ("bool is no integer", _report(group_size=True), m.ToController, "report: group_size must be an integer or null"),
    ("int is no bool", {"ok": 1, "heartbeat_s": 1, "nodes": []}, m.Joined, "Joined: ok must be true or false"),
    ("float is no integer", {"op": "hold", "ino": 7.0}, m.ToNode, "hold: ino must be an integer, not a number"),
    ("wrong item", _report(file={"chunks": [HEX, 5]}), m.ToController, r"report: file.chunks\[1\] must be a string"),
    ("list for an object", {**_report(), "file": [1]}, m.ToController, "report: file must be an object"),
    ("pair of the wrong length", {"round": "r", "plan": "lp", "files": 1, "replicas": 1, "lp_bound_s": 0,
                                  "makespan_s": 0, "plan_s": 0, "cached": False, "unique_bytes": 0,
                                  "total_bytes": 0, "durable_bytes": 0, "stage": [[1, "n2", 3]]},
     m.WritePlan, r"WritePlan: stage\[0\] must be a list of 2, not a list of 3"),
    ("object for a string map", {"round": "r", "files": 1, "total_bytes": 0, "unique_bytes": 0,
                                 "fetch_bytes": {"n1": "8"}}, m.ReadPlan, r"ReadPlan: fetch_bytes\['n1'\]"),
    ("error of the wrong type", {"error": None}, m.Receipt, "answer: error must be a string, not null"),
    ("answer missing a field", {}, m.Receipt, "Receipt: receipt is missing"),
]


@pytest.mark.parametrize(("body", "kind", "message"), [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_messages_raise_one_error(body, kind, message):
    with pytest.raises(MalformedMessage, match=message) as caught:
        if issubclass(kind, m.Request):
            m.decode(body, kind)
        else:
            m.decode_answer(body, kind)
    assert isinstance(caught.value, InvalidArgument)  # the fabric answers it as the request's error
