"""The control plane and the node plane as typed messages: every request a
daemon's control socket answers, every reply, and what node daemons tell the hub.

    request  ping | status | snapshot | stop | stacks   any client (core/control.py)
             node                                      a node daemon's heartbeat, to the hub only
    reply    Reply: `ok`, and `error` when not ok; each request's reply adds its fields
    forward  [NODE_HEADER, node number, message frame]  on the hub's `nodes` socket

A request is a msgpack map whose `op` names its kind (the tag of a msgspec
tagged union), a reply a msgpack map with `ok`: the maps of before, but that a
field at its default may be left out (the receiver reads the default). Every
bound (a text's length, a number's range) is written once, in the types below,
and a field of the wrong kind or out of its bounds refuses the whole message,
never a part of it. What only the receiver knows (the job's nodes, its world
size) it checks itself (daemon/requests.py, daemon/hub.py).

One decoder per socket: REQUESTS on a daemon's control socket, HUB_REQUESTS
on a hub's (the node heartbeat too), `decode_reply` on a client's socket by
the request it sent (a node daemon's: NodeHeartbeat). Anything undecodable is
one of `wire.UNTRUSTED_ERRORS`, turned here into a one-line `BadRequest` or
`ProtocolError`, never a traceback.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, ClassVar, Protocol, TypeAlias, TypeVar, get_args

import msgspec

from ddtop.core import wire
from ddtop.core.blame import Cause
from ddtop.core.bounds import MAX_JOB_RANKS, MAX_MACHINE_RANKS, MAX_NNODES
from ddtop.core.summary import Pid, RunSummary
from ddtop.core.summary import Status as StatusName  # a run's status; Status: the request

MAX_REQUEST_BYTES = 16384  # a node daemon's heartbeat lists its ranks
MAX_HOST_CHARS = 255  # a node's host name
MAX_HEADLINE_CHARS = 1000  # a node's final headline
MAX_HOW_CHARS = 500  # how a node's blamed rank ended, in words
MAX_REPORT_CHARS = 1000  # that rank's own error report
MAX_ENDPOINT_CHARS = 299  # where node daemons forward to
MAX_NODE_DIGITS = 6  # a forward's node number (int() refuses over 4,300 digits)
DEFAULT_STOP_TIMEOUT_S = 30.0
NODE_HEADER = b"ddtop-node/1"  # heads every forward
OPS = "ping, status, snapshot, stop or stacks"
NOT_A_REQUEST = "expected a msgpack map with a string 'op'"

Seconds = Annotated[float, msgspec.Meta(ge=0, le=sys.float_info.max)]  # finite, >= 0
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_JOB_RANKS)]  # a rank of the job
NodeNumber = Annotated[int, msgspec.Meta(ge=1, lt=MAX_NNODES)]  # node 0 is the hub
ExitCode = Annotated[int, msgspec.Meta(ge=-255, le=255)]  # negative: killed by that signal
Host = Annotated[str, msgspec.Meta(max_length=MAX_HOST_CHARS)]
Headline = Annotated[str, msgspec.Meta(max_length=MAX_HEADLINE_CHARS)]
# A tcp:// endpoint, or "" in a reply that names none (a refusal).
ForwardTo = Annotated[str, msgspec.Meta(max_length=MAX_ENDPOINT_CHARS, pattern=r"^(tcp://|$)")]


# -- requests ---------------------------------------------------------------------------
# A rank detail open on a dashboard: its rank's every step for this long (renewed
# while it stays open), for at most MAX_FOCUS ranks at a time.
FOCUS_S = 10.0
MAX_FOCUS = 16


class Request(msgspec.Struct, tag_field="op", kw_only=True, omit_defaults=True):
    """A request on a daemon's control socket; `op`, its tag, names its kind."""

    # The error a request of this kind with a bad argument is answered (not counted
    # as a bad request: it is one, asked wrongly); "" for `op: why` in msgspec's words.
    refusal: ClassVar[str] = ""


class Ping(Request, tag="ping"):
    """The run id, the relay's sequence number, the endpoints (PingReply)."""


class Status(Request, tag="status"):
    """The run's summary (StatusReply)."""


class Snapshot(Request, tag="snapshot"):
    """The whole RunState, for a dashboard that just subscribed (SnapshotReply)."""


class Stop(Request, tag="stop"):
    """Stop gracefully, terminating what is left after `timeout` seconds."""

    refusal: ClassVar[str] = "timeout must be a number of seconds >= 0"
    timeout: Seconds = DEFAULT_STOP_TIMEOUT_S


class Stacks(Request, tag="stacks"):
    """The ranks write their stacks (ddtrain stacks): `rank`, or every rank (None)."""

    refusal: ClassVar[str] = "rank must be a rank of this run"
    rank: Rank | None = None


# A bundle's folder name (daemon/evidence.py): "20261207-094412", "20261207-094412-1".
BundleName = Annotated[str, msgspec.Meta(max_length=32, pattern=r"^[0-9-]*$")]


class Evidence(Request, tag="evidence"):
    """Gather the evidence now (ddtrain evidence): every rank's stacks and state, in a
    folder of the run (daemon/evidence.py). `hub`: a node daemon's own request, as the
    hub's bundle of that name asked (its reply to the node's heartbeat)."""

    hub: BundleName = ""


class Focus(Request, tag="focus"):
    """Rank `rank`'s every step for FOCUS_S: a dashboard's open rank detail. A hub
    passes it to the rank's node, which sends that rank's Step messages unmerged
    (daemon/summariser.py); on one machine every step is there anyway."""

    refusal: ClassVar[str] = "rank must be a rank of this run"
    rank: Rank


class NodeFailure(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """The rank a node daemon blamed for its failure, as its final heartbeat says."""

    rank: Rank
    cause: Cause  # as blame weighs it (blame.blame_order)
    exit_code: ExitCode = 1
    pid: Pid | None = None
    how: Annotated[str, msgspec.Meta(max_length=MAX_HOW_CHARS)] = "failed"
    message: Annotated[str, msgspec.Meta(max_length=MAX_REPORT_CHARS)] = ""


class NodeFinal(msgspec.Struct, kw_only=True, frozen=True):
    """How a node ended: its status, its headline and the rank it blamed (its last
    heartbeat carries them)."""

    status: StatusName
    message: Headline = ""
    failure: NodeFailure | None = None


class NodeHeartbeat(Request, tag="node"):
    """A node daemon's heartbeat, once a second (daemon/forwarder.py): its ranks, its
    run status, what it could not forward, and at the end how it ended."""

    node: NodeNumber
    status: StatusName
    host: Host = ""
    pid: Pid | None = None
    # The ranks this node runs: rank numbers of the job, as many as one machine starts.
    ranks: Annotated[list[Rank], msgspec.Meta(max_length=MAX_MACHINE_RANKS)] = []
    dropped: Annotated[int, msgspec.Meta(ge=0)] = 0
    message: Headline = ""  # with a final status: NodeFinal's
    failure: NodeFailure | None = None


AnyRequest: TypeAlias = Ping | Status | Snapshot | Stop | Stacks | Evidence | Focus
HubRequest: TypeAlias = AnyRequest | NodeHeartbeat


# -- replies ----------------------------------------------------------------------------
class Reply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Every reply: ok, or not and why. A refusal of any request decodes as the
    reply that request expects, its own fields left at their defaults."""

    ok: bool
    error: str = ""


class PingReply(Reply):
    run: str = ""
    seq: int = 0  # the relay sequence number of the newest accepted message
    endpoints: dict[str, str] = {}  # telemetry, publish, control (and a hub's nodes)


class StatusReply(Reply):
    seq: int = 0
    summary: RunSummary | None = None


class SnapshotReply(Reply):
    seq: int | None = None  # the snapshot holds every message up to it
    state: bytes = b""  # the RunState (state.encode_snapshot)


class StopReply(Reply):
    status: str = ""  # "stopping"


class NodeReply(Reply):
    """The hub's answer to a heartbeat: a stop for every node, where to forward."""

    stop: Seconds | None = None
    nodes: ForwardTo = ""
    # Ranks a dashboard has open: their Step messages unmerged (daemon/summariser.py).
    focus: Annotated[list[Rank], msgspec.Meta(max_length=MAX_FOCUS)] = []
    # The hub's newest bundle of evidence: each node gathers its own ranks' once it
    # sees a new one (daemon/forwarder.py).
    evidence: BundleName = ""


def refused(error: str) -> Reply:
    return Reply(ok=False, error=error)


REPLIES: dict[type[Request], type[Reply]] = {
    Ping: PingReply, Status: StatusReply, Snapshot: SnapshotReply, Stop: StopReply,
    Stacks: Reply, Evidence: Reply, Focus: Reply, NodeHeartbeat: NodeReply}


# -- decoding ---------------------------------------------------------------------------
class ProtocolError(ValueError):
    """Bytes that are not the message expected, in one line."""


class BadRequest(ProtocolError):
    """A request refused: the error its reply says, and whether it is counted in
    `rejected.bad_request` (not a request of a kind this socket takes) or not (a
    known kind with an argument of the wrong kind or out of bounds)."""

    def __init__(self, error: str, counted: bool) -> None:
        super().__init__(error)
        self.error, self.counted = error, counted


class _Op(msgspec.Struct):
    """What is read of a request that did not decode: enough to say why."""

    op: Any = None


_op_decoder = msgspec.msgpack.Decoder(_Op)


class RequestDecoder:
    """One control socket's decoder: the union of the requests it takes."""

    def __init__(self, union: Any) -> None:
        self.kinds: dict[str, type[Request]] = {
            str(kind.__struct_config__.tag): kind for kind in get_args(union)}
        self._decoder: msgspec.msgpack.Decoder[HubRequest] = msgspec.msgpack.Decoder(union)

    def decode(self, body: bytes) -> HubRequest:
        """The request in `body`; BadRequest with its reply's error otherwise."""
        if len(body) > MAX_REQUEST_BYTES:
            raise BadRequest("request too large", counted=True)
        try:
            return self._decoder.decode(body)
        except msgspec.ValidationError as e:
            why = wire.why_refused(e)
        except wire.UNTRUSTED_ERRORS:
            raise BadRequest(NOT_A_REQUEST, counted=True) from None
        try:
            op = _op_decoder.decode(body).op
        except wire.UNTRUSTED_ERRORS:
            op = None
        if not isinstance(op, str):
            raise BadRequest(NOT_A_REQUEST, counted=True)
        kind = self.kinds.get(op)
        if kind is None:
            raise BadRequest(f"unknown op {op[:40]!r}: {OPS}", counted=True)
        raise BadRequest(kind.refusal or f"{op}: {why}", counted=False)


REQUESTS = RequestDecoder(AnyRequest)
HUB_REQUESTS = RequestDecoder(HubRequest)

_encoder = msgspec.msgpack.Encoder()
_reply_decoders: dict[type[Reply], msgspec.msgpack.Decoder[Any]] = {
    kind: msgspec.msgpack.Decoder(kind) for kind in set(REPLIES.values())}
R = TypeVar("R", bound=Reply)


def encode(message: Request | Reply) -> bytes:
    return _encoder.encode(message)


def decode_reply(kind: type[R], body: bytes) -> R:
    """A reply of kind `kind` (REPLIES: the one a request expects); ProtocolError
    if it is not one."""
    try:
        reply: R = _reply_decoders[kind].decode(body)
    except wire.UNTRUSTED_ERRORS as e:
        raise ProtocolError(wire.why_refused(e)) from None
    return reply


# -- node forwards ----------------------------------------------------------------------
def forward_frames(node: int, frame: bytes) -> list[bytes]:
    """A message node `node` folded, as it goes to the hub."""
    return [NODE_HEADER, str(node).encode(), frame]


def forward_node(frames: list[bytes]) -> int | None:
    """The node number heading a forward; None when `frames` is not one (the number
    ASCII digits, at most MAX_NODE_DIGITS of them: no job has a million nodes)."""
    if len(frames) != 3 or frames[0] != NODE_HEADER:
        return None
    number = frames[1]
    if not 0 < len(number) <= MAX_NODE_DIGITS or not number.isdigit():
        return None
    return int(number)


# -- the two sides of a hub -------------------------------------------------------------
class NodeHub(Protocol):
    """What a hub's relay hands on (daemon/hub.Hub): heartbeats and forwards."""

    def request(self, beat: NodeHeartbeat) -> Reply: ...

    def forwarded(self, node: int, message: wire.Message, frame: bytes,
                  received: float) -> None: ...


class HubRelay(Protocol):
    """What the hub asks of its relay (daemon/relay.Relay)."""

    run: str

    def focused(self, now: float) -> list[int]: ...

    def reject(self, reason: str) -> None: ...

    def accept_forwarded(self, message: wire.Message, frame: bytes, received: float
                         ) -> None: ...

    def emit(self, kind: type[wire.RankExit] | type[wire.RunStatus] | type[wire.Event],
             **fields: Any) -> None: ...
