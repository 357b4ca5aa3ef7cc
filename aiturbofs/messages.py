"""The control messages of a cluster: what nodes and the controller say to each other.

Every control message (``Peer.control``: one JSON object each way) is
declared once here, as a frozen dataclass with its fields in wire order.  A
request names its kind in ``"op"`` (``Join.op == "join"``) and says which end
takes it (``ToController``, ``ToNode``); an answer carries no ``"op"`` (the
asker knows what it asked) and may instead be a ``Refused``
(``{"error": ...}``).  ``encode`` gives the JSON object the fabric sends;
``decode`` (a request) and ``decode_answer`` check a received object field by
field and return its message.

An object that does not fit (an unknown op, a field missing or of the wrong
JSON type) raises ``MalformedMessage``, an ``InvalidArgument``: the fabric
answers it as that one request's error, and both ends go on.  What a field
means beyond its type (a group name's length, a chunk key's hex, who may
speak for a node) is checked by the receiver that uses it.

The names and JSON shapes of the fields are the protocol between releases:
nodes and a controller of two releases talk during a rolling upgrade.  A
receiver ignores fields it does not know; a field with a default may be left
out by the sender (a field added later needs one); a field marked
``OMITTED_WHEN_NONE`` is left out while None.

Nothing here does I/O; this module imports only ``_errors``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from ._errors import MalformedMessage

OMITTED_WHEN_NONE = {"omitted_when_none": True}  # ``field(metadata=...)``: not sent while None

REQUESTS: dict[str, type[Request]] = {}  # op -> its request class, every one (filled as they are declared)


class Message:
    """A control message: a frozen dataclass of JSON-typed fields (see module doc)."""


class Request(Message):
    """A message that asks: ``op`` names its kind on the wire; declare it with ``class X(..., op="x")``."""

    op: ClassVar[str] = ""
    receiver: ClassVar[str] = "control"  # who takes it, for the error naming an op it does not know

    def __init_subclass__(cls, op: str = "", **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if op:
            assert op not in REQUESTS, f"two requests named {op!r}"
            cls.op = op
            REQUESTS[op] = cls


class ToController(Request):
    """A request the controller answers."""

    receiver = "controller"


class ToNode(Request):
    """A request a node answers (from another node)."""

    receiver = "node"


class Answer(Message):
    """The answer to a request (no ``op``: the asker knows what it asked)."""


# ============================================================ nodes -> controller


@dataclass(frozen=True, kw_only=True)
class FromNode(ToController):
    """A request a node makes in its own name: ``node`` must be the name it authenticated with."""

    node: str


@dataclass(frozen=True, kw_only=True)
class Join(FromNode, op="join"):
    """A node joins (or joins again): where peers reach it, its bandwidths (bytes/s) and free DRAM.

    Answered by ``Joined``.
    """

    fabric: str
    dram_free: int
    send_bw: float
    recv_bw: float
    snic_bw: float


@dataclass(frozen=True, kw_only=True)
class Heartbeat(FromNode, op="heartbeat"):
    """A joined node is alive; its free DRAM now and its line of ``aiturbo status``.

    Answered by ``Membership``, or ``Refused`` if the controller does not count it a member (join again).
    """

    dram_free: int | None = None
    summary: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class FileChunks:
    """One file of a round report: its chunk hashes (hex, ``chunk.HOLE`` for a hole) and their lengths."""

    ino: int
    path: str = ""
    size: int
    chunks: tuple[str, ...]
    lengths: tuple[int, ...]
    # read reports: indices of the chunks already in the reporting node's DRAM
    have: tuple[int, ...] | None = field(default=None, metadata=OMITTED_WHEN_NONE)


@dataclass(frozen=True, kw_only=True)
class RoundReport(FromNode):
    """A file of a group's round (``group_size``: files a round waits for; None: the window closes it)."""

    group: str
    group_size: int | None = None
    replicas: int = 1
    file: FileChunks


@dataclass(frozen=True, kw_only=True)
class Report(RoundReport, op="report"):
    """A grouped file closed (future 0): answered with its share of the write round's plan, ``WritePlan``."""


@dataclass(frozen=True, kw_only=True)
class ReadReport(RoundReport, op="read_report"):
    """A grouped file opened for reading: answered with its chains in the read round, ``ReadPlan``."""


@dataclass(frozen=True, kw_only=True)
class ReadJoin(FromNode, op="read_join"):
    """An untagged file opened for reading (its ``auto:`` group): answered by ``FirstReader``."""

    group: str


@dataclass(frozen=True, kw_only=True)
class Leave(FromNode, op="leave"):
    """A node leaves the cluster: answered by ``Ok``."""


@dataclass(frozen=True, kw_only=True)
class Status(ToController, op="status"):
    """What ``aiturbo status`` shows of the controller: answered by ``ControllerStatus``."""


# ============================================================ node -> node


@dataclass(frozen=True, kw_only=True)
class Hold(ToNode, op="hold"):
    """Keep the chunks just put here (hex keys) as replicas of inode ``ino`` until it is durable: ``Ok``."""

    ino: int
    keys: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class UploadPart(ToNode, op="upload_part"):
    """Send part ``index`` (chunk ``key``, hex) of the upload of ``backend_key`` from your pool: ``Receipt``.

    ``token`` is the upload's, ``holders`` the nodes to fetch the chunk from if it is not here.
    """

    backend_key: str
    token: str
    index: int
    key: str
    length: int
    holders: tuple[str, ...] = ()


# ============================================================ answers


@dataclass(frozen=True, kw_only=True)
class Refused(Answer):
    """A request the receiver would not or could not serve, and why (the other answers' alternative)."""

    error: str


@dataclass(frozen=True, kw_only=True)
class Ok(Answer):
    """Done (``Leave``, ``Hold``)."""

    ok: bool = True


@dataclass(frozen=True, kw_only=True)
class NodeListing:
    """A node as the controller knows it."""

    node: str
    fabric: str
    state: str


@dataclass(frozen=True, kw_only=True)
class Joined(Answer):
    """``Join``'s answer: heartbeat every ``heartbeat_s``; the nodes the controller knows."""

    ok: bool = True
    heartbeat_s: float = 1.0
    nodes: tuple[NodeListing, ...]


@dataclass(frozen=True, kw_only=True)
class Membership(Answer):
    """``Heartbeat``'s answer: the live nodes and the names of the dead ones."""

    nodes: tuple[NodeListing, ...]
    dead: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class DurableSource:
    """Where a chunk is durable already: ``length`` bytes at ``offset`` of object ``backend_key``."""

    backend_key: str
    offset: int
    length: int
    etag: str | None = None


@dataclass(frozen=True, kw_only=True)
class WritePlan(Answer):
    """One file's share of a planned write round (``Report``'s answer).

    The round's figures first (the same in every file's answer), then this
    file's part: ``stage`` the (chunk index, node) puts this node makes,
    ``holders`` who holds the file's chunks afterwards (the reporter first),
    and per chunk index (as a string) the node that uploads it (``persist``),
    the durable bytes it is copied from (``copy``), or, in ``wait``, that
    another file of the round uploads it.
    """

    round: str
    plan: str
    files: int
    replicas: int
    lp_bound_s: float
    makespan_s: float
    plan_s: float
    cached: bool
    unique_bytes: int
    total_bytes: int
    durable_bytes: int
    stage: tuple[tuple[int, str], ...] = ()
    holders: tuple[str, ...] = ()
    persist: dict[str, str] = field(default_factory=dict)
    copy: dict[str, DurableSource] = field(default_factory=dict)
    wait: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ReadPlan(Answer):
    """One file's chains in a planned read round (``ReadReport``'s answer).

    ``chains``: per chunk index (as a string) its readers, the head (which
    fetches it from storage or has it in DRAM) first; ``fetch_bytes``: what
    each head fetches from storage in the round.
    """

    round: str
    files: int
    readers: int = 1
    total_bytes: int
    unique_bytes: int
    fetch_bytes: dict[str, int]
    chains: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class FirstReader(Answer):
    """``ReadJoin``'s answer: is the asker the first reader of the version within the window?"""

    first: bool = True


@dataclass(frozen=True, kw_only=True)
class ControllerStatus(Answer):
    """``Status``'s answer: every node with its figures, and the write and read rounds' statistics by group."""

    nodes: tuple[dict[str, Any], ...]
    groups: dict[str, Any]
    read_groups: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class Receipt(Answer):
    """``UploadPart``'s answer: the part's receipt for the uploader (an ETag)."""

    receipt: str


# ============================================================ codec

R = TypeVar("R", bound=Request)
A = TypeVar("A", bound=Answer)


def encode(message: Message) -> dict[str, Any]:
    """The JSON object of ``message`` (``"op"`` first for a request), as the fabric sends it."""
    body: dict[str, Any] = {"op": message.op} if isinstance(message, Request) else {}
    body.update(_plain(message))
    return body


def decode(body: Mapping[str, Any], kind: type[R]) -> R:
    """The request ``body`` holds, which must be a ``kind`` (``ToController``, ``ToNode``, ``Request``).

    ``MalformedMessage`` if its op is not one of ``kind`` or a field does not fit.
    """
    if not isinstance(body, Mapping):
        raise MalformedMessage(f"a control message is a JSON object, not {_json_kind(body)}")
    op = body.get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None or not issubclass(cls, kind):
        raise MalformedMessage(f"unknown {kind.receiver} op {op!r}")
    return _decoder(cls)(body, f"{op}: ")


def decode_answer(body: Mapping[str, Any], kind: type[A]) -> A | Refused:
    """The answer ``body`` holds: a ``kind``, or a ``Refused`` if it holds an ``"error"``.

    ``MalformedMessage`` if a field does not fit.
    """
    if not isinstance(body, Mapping):
        raise MalformedMessage(f"a control answer is a JSON object, not {_json_kind(body)}")
    if "error" in body:
        return _decoder(Refused)(body, "answer: ")
    return _decoder(kind)(body, f"{kind.__name__}: ")


def _plain(value):
    """``value`` as JSON types: dataclasses -> objects (fields ``OMITTED_WHEN_NONE`` left out while None),
    tuples -> lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if v is None and f.metadata.get("omitted_when_none"):
                continue
            out[f.name] = _plain(v)
        return out
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# (JSON value, where it is) -> the field's value; MalformedMessage if it does not fit
_Check = Callable[[Any, str], Any]


_Decoder = Callable[[Mapping[str, Any], str], Any]
_DECODERS: dict[type, _Decoder] = {}


def _decoder(cls: type) -> _Decoder:
    """``(object, prefix) -> cls(...)``, checking each field against its annotation (made once per class).

    ``prefix`` starts the name of each field in errors: ``"report: "`` at the top, ``"report: file."`` inside.
    """
    decoder = _DECODERS.get(cls)
    if decoder is None:
        decoder = _DECODERS[cls] = _make_decoder(cls)
    return decoder


def _make_decoder(cls: type) -> _Decoder:
    hints = typing.get_type_hints(cls)
    fields = [(f.name, _checker(hints[f.name]),
               f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
              for f in dataclasses.fields(cls)]

    def decode_fields(obj: Mapping[str, Any], prefix: str):
        values = {}
        for name, check, required in fields:
            if name in obj:
                values[name] = check(obj[name], prefix + name)
            elif required:
                raise MalformedMessage(f"{prefix}{name} is missing")
        return cls(**values)

    return decode_fields


def _checker(tp, expected: str = "") -> _Check:
    """The check of one annotated field type (the JSON types, tuples, ``X | None``, str-keyed dicts, dataclasses).

    ``expected``: what a value of the wrong type is told it must be (default: ``tp``'s description).
    """
    expected = expected or _describe(tp)

    def wrong(value, where: str):
        raise MalformedMessage(f"{where} must be {expected}, not {_json_kind(value)}")

    if tp is Any:
        return lambda value, where: value
    if tp in _SCALARS:
        fits = _SCALARS[tp]
        return lambda value, where: value if fits(value) else wrong(value, where)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        (inner,) = [a for a in args if a is not type(None)]  # only ``X | None``
        check = _checker(inner, expected)
        return lambda value, where: None if value is None else check(value, where)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _checker(args[0])

        def items(value, where: str):
            if not isinstance(value, (list, tuple)):
                wrong(value, where)
            return tuple(item(v, f"{where}[{i}]") for i, v in enumerate(value))

        return items
    if origin is tuple:
        parts = [_checker(a) for a in args]

        def fixed(value, where: str):
            if not isinstance(value, (list, tuple)) or len(value) != len(parts):
                wrong(value, where)
            return tuple(check(v, f"{where}[{i}]") for i, (check, v) in enumerate(zip(parts, value)))

        return fixed
    if origin is dict:
        assert args[0] is str, "JSON object keys are strings"
        entry = _checker(args[1])

        def entries(value, where: str):
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                wrong(value, where)
            return {k: entry(v, f"{where}[{k!r}]") for k, v in value.items()}

        return entries
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        nested = _decoder(tp)

        def obj(value, where: str):
            if not isinstance(value, Mapping):
                wrong(value, where)
            return nested(value, where + ".")

        return obj
    raise TypeError(f"no JSON form for {tp!r}")  # a declaration above uses a type the codec lacks


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_SCALARS: dict[Any, Callable[[Any], bool]] = {
    str: lambda v: isinstance(v, str),
    int: _is_int,
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    bool: lambda v: isinstance(v, bool),
}


def _describe(tp) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false", Any: "any JSON value"}
    if tp in names:
        return names[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_describe(a) for a in args if a is not type(None)) + " or null"
    if origin is tuple:
        return "a list" if len(args) == 2 and args[1] is Ellipsis else f"a list of {len(args)}"
    return "an object"


def _json_kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__
