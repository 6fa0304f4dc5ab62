"""The telemetry wire: every message kind, and `encode` / `decode` to ZeroMQ frames.

One frame per message: a msgpack map (msgspec), never pickle. Every message
carries the schema version `v`, the run id, the sender's rank, its per-rank
sequence number `seq` (gaps are telemetry loss) and its wall-clock time `t`.
Field meanings and units are documented in docs/telemetry.md; change the two
together, and bump SCHEMA_VERSION for any change a reader would misread.

`decode` trusts nothing: malformed, oversized, wrong-version and wrong-run
frames raise a `WireError` subclass, which callers count and drop.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import msgspec
from msgspec import UNSET, UnsetType

from ddtop.core.bounds import MAX_JOB_RANKS, MAX_MACHINE_RANKS

SCHEMA_VERSION = 1
# Larger frames are refused unread; error events keep their traceback under it.
MAX_FRAME_BYTES = 64 * 1024
MAX_TRACEBACK_CHARS = 16 * 1024
# A Scalars message (ddtop.log) carries at most this many keys of at most this
# many characters; a frame over either limit is refused as malformed.
MAX_SCALAR_KEYS = 64
MAX_SCALAR_KEY_CHARS = 64
# Keys are printed as they are (terminal, logs): names only, no control characters.
SCALAR_KEY_PATTERN = r"^[A-Za-z0-9_.:/@+-]+$"
ScalarKey = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SCALAR_KEY_CHARS,
                                        pattern=SCALAR_KEY_PATTERN)]
# A script's name and arguments, as a hello carries them; printable characters only.
MAX_PROGRAM_CHARS = 200
ProgramText = Annotated[str, msgspec.Meta(max_length=MAX_PROGRAM_CHARS,
                                          pattern=r"^[^\x00-\x1f\x7f]*$")]

# An epoch as a step or heartbeat carries it, counted from 0; None where the rank
# does not know it (a user's script whose DistributedSampler was never given
# set_epoch and that gave ddtop.init no epochs). Earlier senders sent 0 there.
MAX_EPOCH = 1 << 62
Epoch = Annotated[int, msgspec.Meta(ge=0, le=MAX_EPOCH)]

# A --strategy name as a hello carries it: short, printable.
StrategyName = Annotated[str, msgspec.Meta(max_length=32, pattern=r"^[a-z0-9_-]*$")]

# Where a rank is (a heartbeat's phase): in one of a training step's phases, or at
# work outside the steps (setting up, checkpointing, evaluating), or done.
StepPhase = Literal["data", "forward", "backward", "optimizer", "metric_sync"]
Phase = Literal["setup", StepPhase, "checkpoint", "evaluation", "done"]
STEP_PHASES: tuple[StepPhase, ...] = get_args(StepPhase)
# What an Aggregate covers: a mid-epoch metric sync, or a whole epoch.
Scope = Literal["sync", "epoch"]
# `restart`: a restart as journals written before the Restarting message carry it;
# shown as it is, and kept out of the timeline.
EventType = Literal["checkpoint", "epoch_end", "warning", "error", "resumed", "info", "stopped",
                    "restart", "stop_requested"]
# A run as a whole, as the daemon announces it (RunStatus).
RunStatusName = Literal["starting", "running", "stopping", "restarting", "succeeded", "failed",
                        "stopped"]
# The statuses after which nothing more happens.
FINAL_STATUSES: tuple[RunStatusName, ...] = ("succeeded", "failed", "stopped")
# A node of a multi-node job, as node 0's hub sees it (daemon/hub.py), and as
# the hub's events about it say (their data's "node_state").
NodeState = Literal["up", "unreachable", "lost", "done"]
# Nodes a job may have, as the events about them may number them.
MAX_NODES = 1 << 16


class NodeNews(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What an event says of a node (`Event.node`): the hub's events about a node,
    and a node's own event naming its ranks. Typed from the daemon that writes it to
    the fold that reads it; a frame whose news is not whole (a state no hub says, a
    node or rank out of bounds, a field of the wrong kind or unknown) is refused at
    decode, as any malformed message."""

    node: Annotated[int, msgspec.Meta(ge=0, lt=MAX_NODES)]
    node_state: NodeState
    ranks: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=MAX_JOB_RANKS)]],
                     msgspec.Meta(max_length=MAX_MACHINE_RANKS)] = []
    host: Annotated[str, msgspec.Meta(max_length=255)] = ""
    # Said by a node of its own ranks, for its own view: not the job's news (the
    # hub does not take it from a forwarder).
    local: bool = False


def node_news(node: int, state: NodeState, ranks: list[int], host: str,
              local: bool = False) -> NodeNews:
    """NodeNews as the daemon says it (its host cut to the bound, its ranks to a
    machine's)."""
    return NodeNews(node=node, node_state=state, ranks=sorted(ranks)[:MAX_MACHINE_RANKS],
                    host=host[:255], local=local)


# A collective's signature (training/collectives.py), what the ranks of its process
# group must agree on: its group, the group's own count, the dtype and elements of
# its input. Empty (or 0, -1) where the sender does not know it (DDP's buckets, an
# older sender): such a collective is never compared (core/desync.py).
GroupName = Annotated[str, msgspec.Meta(max_length=64, pattern=r"^[^\x00-\x1f\x7f]*$")]
RanksText = Annotated[str, msgspec.Meta(max_length=128, pattern=r"^[0-9,.-]*$")]
DtypeName = Annotated[str, msgspec.Meta(max_length=32, pattern=r"^[A-Za-z0-9_]*$")]
ScriptLine = Annotated[str, msgspec.Meta(max_length=160, pattern=r"^[^\x00-\x1f\x7f]*$")]


class Collective(msgspec.Struct, frozen=True, kw_only=True):
    """One collective call of a rank: its per-rank sequence number, op, payload,
    and its signature where known."""

    seq: int
    op: str
    bytes: int
    group: GroupName = ""  # "world", or torch's name of a sub-group ("1", "2", ...)
    group_size: Annotated[int, msgspec.Meta(ge=0, le=MAX_JOB_RANKS)] = 0
    group_ranks: RanksText = ""  # "0-3", "2,3"; cut at 128 characters ("...")
    group_seq: Annotated[int, msgspec.Meta(ge=0)] = 0  # the group's collectives here, from 1
    dtype: DtypeName = ""  # "float32"; "" without a tensor (barrier, object collectives)
    count: Annotated[int, msgspec.Meta(ge=-1)] = -1  # elements of its input (per rank)
    # A blocking send or recv: the other rank (global); -1 unknown (a recv from
    # anyone) or not point-to-point. Not its group's collective: its group_seq is 0.
    peer: Annotated[int, msgspec.Meta(ge=-1, lt=MAX_JOB_RANKS)] = -1
    # The group's description where one was given: new_group(group_desc=...), or a
    # DeviceMesh's for its dimension ("mesh_tp"); "" for the world and unnamed groups.
    group_desc: GroupName = ""

    def group_words(self) -> str:
        """The group as words name it: "world", "[2,3]", "[2,3] (tp)"."""
        if self.group == "world":
            return "world"
        desc = self.group_desc.removeprefix("mesh_")
        return f"[{self.group_ranks}]" + (f" ({desc})" if desc else "")


# Every COUNTS_EVERY global steps a rank takes the count of collectives it entered on
# each of its groups (training/collectives.py), and its next Step message carries the
# counts taken since (at most MAX_COUNTS): core/desync.py compares them across ranks
# at the same step, so a rank that skipped a collective is named even when the
# backend paired the rest silently.
COUNTS_EVERY = 4
MAX_COUNTS = 8
MAX_COUNTED_GROUPS = 64


class GroupCounts(msgspec.Struct, frozen=True, array_like=True):
    """At the end of `global_step`, the collectives entered on each group, by name."""

    global_step: Annotated[int, msgspec.Meta(ge=0)]
    counts: Annotated[list[tuple[GroupName, Annotated[int, msgspec.Meta(ge=0)]]],
                      msgspec.Meta(max_length=MAX_COUNTED_GROUPS)]


class _Header(msgspec.Struct, kw_only=True):
    v: int = SCHEMA_VERSION
    run: str
    rank: int
    seq: int = 0
    t: float = 0.0
    dropped: int = 0  # messages this rank failed to send since its last one that went out


class Hello(_Header, tag="hello", tag_field="kind", kw_only=True):
    local_rank: int
    host: str
    pid: int
    device: str
    backend: str
    world_size: int
    config_digest: str
    model: str
    dataset: str
    epochs: int
    global_batch: int
    # A user's own script: its file name and arguments ("" for the built-in
    # trainer) and, if known, how many optimizer steps the run will take
    # (ddtop.init; the built-in trainer from its config). Absent (UNSET: not even
    # encoded) from senders of an earlier version.
    program: ProgramText | UnsetType = UNSET
    total_steps: Annotated[int, msgspec.Meta(ge=0, le=1 << 62)] | UnsetType = UNSET
    # How the built-in trainer synchronises gradients (--strategy: ddp, allreduce,
    # hooks, hooks-async, ring, fsdp); absent from a user's script.
    strategy: StrategyName | UnsetType = UNSET
    # True: every collective of torch.distributed this rank enters is seen
    # (zero-code), so a rank that reports none has not communicated. Absent:
    # not known (the built-in trainer, the API alone, an earlier sender).
    collectives: bool | UnsetType = UNSET


class Step(_Header, tag="step", tag_field="kind", kw_only=True):
    """Every step since the previous Step message of this rank, summed."""

    epoch: Epoch | None  # None: not known (see Epoch)
    step: int
    steps_per_epoch: int
    global_step: int
    steps: int
    samples: int
    loss_sum: float
    lr: float
    step_s: float
    data_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    comm_s: float
    comm_bytes: int
    comm_ops: int
    algbw_gbps: float
    busbw_gbps: float
    sync_wait_s: float
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    rss: int | None = None
    # The peaks so far: the process's RSS (getrusage's ru_maxrss) and the CUDA memory
    # allocated on its device (torch.cuda.max_memory_allocated); None where absent.
    rss_peak: Annotated[int, msgspec.Meta(ge=0)] | None = None
    cuda_peak: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # What `loss_sum` is weighted by when it is not `samples`: a script's
    # ddtop.step(loss=...) weighs each loss by its samples if given, else by 1.
    # Absent (UNSET) from the built-in trainer: the weight is `samples`.
    loss_weight: float | UnsetType = UNSET
    # Of `comm_s`, the time that overlapped with the rank's own computation (it
    # did not sit waiting for it): comm_s minus the time blocked in communication.
    # Absent (UNSET) where not measured: a user's script.
    comm_overlap_s: float | UnsetType = UNSET
    # Per step, the time outside the gradient all-reduce, averaged over this
    # message's steps but the longest one (a step the rank was descheduled in);
    # None with fewer than 3 steps, or from senders that do not measure it. What
    # the straggler rule weighs (core/stragglers.py).
    compute_trim_s: float | None = None
    # Each group's count of collectives at the multiples of COUNTS_EVERY among these
    # steps (a sender that signs collectives; absent elsewhere).
    group_counts: Annotated[list[GroupCounts], msgspec.Meta(max_length=MAX_COUNTS)] \
        | UnsetType = UNSET
    # Over these steps (read by the sender thread as it sends: training/hostreadings.py):
    # the seconds the training thread waited for a CPU (run-queue delay, schedstat),
    # and the process's major page faults. Absent where not readable.
    runq_s: Annotated[float, msgspec.Meta(ge=0)] | UnsetType = UNSET
    major_faults: Annotated[int, msgspec.Meta(ge=0)] | UnsetType = UNSET

    def weight(self) -> float:
        """What `loss_sum` is a sum over (the one place the rule is written):
        `loss_weight` where the rank said it, else `samples`."""
        return self.samples if isinstance(self.loss_weight, UnsetType) else self.loss_weight

    def mean_loss(self) -> float | None:
        """The loss per weight unit; None where no loss was reported (weight 0)."""
        weight = self.weight()
        return self.loss_sum / weight if weight else None

    def samples_per_s(self, span: float) -> float | None:
        """Samples a second over `span` seconds; None where no samples were reported
        (a zero-code rank knows its steps, not its batch): missing is not zero."""
        return self.samples / span if self.samples and span > 0 else None


class Heartbeat(_Header, tag="heartbeat", tag_field="kind", kw_only=True):
    phase: Phase
    epoch: Epoch | None  # None: not known (see Epoch)
    global_step: int
    phase_s: float
    coll_started: Collective | None = None
    coll_completed: Collective | None = None
    # In the data phase: whether the rank is inside its data loader (a DataLoader's
    # `__next__`, or a `ddtop.phase("data")` block) or between steps, outside it;
    # absent where not known (another phase, an older sender).
    loader: bool | UnsetType = UNSET
    # Between steps, outside its data loader: where its main thread is in the script,
    # "train.py:88 in main" (its innermost frame outside torch and ddtop).
    at: ScriptLine | UnsetType = UNSET


class Aggregate(_Header, tag="aggregate", tag_field="kind", kw_only=True):
    """Global metrics every rank derived from all_gather_object."""

    scope: Scope
    epoch: int
    global_step: int
    train_loss: float
    train_accuracy: float
    train_samples: int
    val_loss: float | None = None
    val_accuracy: float | None = None
    val_samples: int | None = None


class Event(_Header, tag="event", tag_field="kind", kw_only=True):
    type: EventType
    message: str
    data: dict[str, str | int | float | bool | None] = {}
    traceback: str | None = None
    node: NodeNews | None = None  # what it says of a node of a multi-node job


class Scalars(_Header, tag="scalars", tag_field="kind", kw_only=True):
    """A rank's newest custom scalars (ddtop.log), by name; the daemon aggregates
    them across ranks. Bounded: MAX_SCALAR_KEYS keys of MAX_SCALAR_KEY_CHARS."""

    values: Annotated[dict[ScalarKey, float], msgspec.Meta(max_length=MAX_SCALAR_KEYS)]
    global_step: int = 0  # the rank's optimizer steps when it logged them


class Bye(_Header, tag="bye", tag_field="kind", kw_only=True):
    exit_code: int


class RankExit(_Header, tag="rank_exit", tag_field="kind", kw_only=True):
    """From the daemon (rank -1): a rank's process has exited; what the OS said."""

    exited: int  # the rank whose process exited
    pid: int | None  # None: never known (a torchrun rank that exited before its hello)
    exit_code: int | None  # None when killed by a signal
    signal: str | None  # e.g. "SIGKILL"
    stopped_by_daemon: bool = False
    message: str | None = None  # the rank's own error report, when it wrote one
    traceback: str | None = None  # its last lines
    # The daemon blames the run's failure on this rank (its pick among ranks
    # that failed together; sent before the others' exits).
    culprit: bool = False
    # How it ended in words, where the exit code does not say it: "left early at
    # step 20: ..." (an exit 0 while the others trained: core/blame.py), or a
    # node's end in a multi-node job.
    reason: str | None = None
    left_early: bool = False  # exit code 0 before its work was done (blame.left_early)
    # `exited` below 0 (DAEMON_RANK): not a rank but this node of a multi-node job,
    # lost or failed as a whole (the hub's culprit; no rank of it exited by itself).
    node: int | None = None


class Restart(msgspec.Struct, kw_only=True):
    """One restart after a failure (`--max-restarts`): which rank, why, from where.
    Sent in a Restarting message; RunState.timeline and run.json keep it as it is."""

    restart: int  # 1, 2, ...
    rank: int  # the rank that failed
    reason: str  # how it ended, in words: "was killed by SIGKILL"
    pid: int | None = None
    exit_code: int | None = None  # None when killed by a signal
    signal: str | None = None
    global_step: int | None = None  # the last step it reported
    checkpoint: str | None = None  # resumed from; None: restarted from the start
    time: float | None = None  # wall clock


class Restarting(_Header, tag="restart", tag_field="kind", kw_only=True):
    """From the daemon (rank -1): the ranks are started again after a failure."""

    message: str
    restart: Restart


class RunStatus(_Header, tag="run_status", tag_field="kind", kw_only=True):
    """From the daemon (rank -1): the run as a whole changed state."""

    status: RunStatusName
    world_size: int
    restarts: int = 0
    message: str = ""
    # With a final status: the exit code `ddtrain start --foreground` returns
    # (0, 1, 2 for bad input, 130 or 128+N when stopped by signal N).
    exit_code: int | None = None


class RankAccount(msgspec.Struct, array_like=True):
    """A rank's telemetry accounting as its node's daemon keeps it (totals)."""

    rank: int
    received: int
    lost: int
    duplicates: int
    dropped: int  # what the rank could not send


# What a node daemon sums up for the hub, by rank (daemon/summariser.py).
Summed = Hello | Step | Heartbeat | Aggregate | Event | Scalars | Bye


class NodeSummary(_Header, tag="node_summary", tag_field="kind", kw_only=True):
    """From node K's daemon (as rank -1) to the hub, and relayed by it: its ranks'
    messages since its previous summary, summed up (daemon/summariser.py): per
    rank every Step merged into one, the newest Heartbeat and Scalars, and at
    once what cannot wait (hellos, events, byes, new global metrics); with each
    rank's accounting. Folded without the ranks' sequence numbers (a summary
    leaves most of them out by design): `accounts` says what was lost."""

    node: int
    messages: list[Summed] = []
    accounts: list[RankAccount] = []


# The `rank` the daemon uses for what it says itself (RankExit, Restarting, RunStatus, Event).
DAEMON_RANK = -1
# A RankExit's `exited` for the command `ddtrain watch` ran (not a rank itself),
# and for a watch without a command, waiting for ranks started elsewhere.
COMMAND_RANK = -2
WATCH_RANK = -3


def launcher_name(rank: int) -> str:
    """What a RankExit below 0 names without a node: what ran (or awaited) the ranks."""
    return {COMMAND_RANK: "the command", WATCH_RANK: "the watch"}.get(rank, "torchrun's agent")

Message = (Hello | Step | Heartbeat | Aggregate | Event | Scalars | Bye | RankExit | Restarting
           | RunStatus | NodeSummary)
KINDS = {cls.__struct_config__.tag: cls
         for cls in (Hello, Step, Heartbeat, Aggregate, Event, Scalars, Bye, RankExit, Restarting,
                     RunStatus, NodeSummary)}


class WireError(ValueError):
    """A frame that is dropped (and counted) rather than trusted."""

    reason = "malformed"


class Malformed(WireError):
    reason = "malformed"


class Oversized(WireError):
    reason = "oversized"


class WrongVersion(WireError):
    reason = "wrong_version"


class WrongRun(WireError):
    reason = "wrong_run"


# What decoding bytes that nobody vouches for may raise: msgspec's errors, bad
# UTF-8 inside a string (UnicodeDecodeError), an integer of more digits than
# int() takes (ValueError), and nesting deeper than the interpreter's recursion
# limit (RecursionError, e.g. a 5 KB frame of 5,000 nested arrays). Every
# decoder of a frame, a request, a reply or a run file catches exactly these.
UNTRUSTED_ERRORS: tuple[type[Exception], ...] = (msgspec.MsgspecError, ValueError, RecursionError)


class _Envelope(msgspec.Struct):
    """What is read first: enough to refuse a frame before trusting its shape."""

    v: Any = None
    run: Any = None


_encoder = msgspec.msgpack.Encoder()
_envelope = msgspec.msgpack.Decoder(_Envelope)
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> list[bytes]:
    """The ZeroMQ frames of one message."""
    return [_encoder.encode(message)]


def decode(frames: list[bytes], run: str | None = None) -> Message:
    """One message from its frames; `run`, if given, is the only run accepted."""
    if len(frames) != 1:
        raise Malformed(f"expected 1 frame, got {len(frames)}")
    frame = frames[0]
    if len(frame) > MAX_FRAME_BYTES:
        raise Oversized(f"{len(frame)} bytes > {MAX_FRAME_BYTES}")
    try:
        envelope = _envelope.decode(frame)
    except UNTRUSTED_ERRORS as e:
        raise Malformed(why_refused(e)) from None
    if envelope.v != SCHEMA_VERSION:
        raise WrongVersion(f"schema version {_shown(envelope.v)}, expected {SCHEMA_VERSION}")
    if run is not None and envelope.run != run:
        raise WrongRun(f"run {_shown(envelope.run)}, expected {run!r}")
    try:
        message: Message = _decoder.decode(frame)
    except UNTRUSTED_ERRORS as e:
        raise Malformed(why_refused(e)) from None
    return message


def _shown(value: Any) -> str:
    """A received value in an error's words: short, and never a repr of a nested
    structure (as deep as the decoder allowed: repr could go deeper than Python)."""
    if isinstance(value, int | float | str | None):
        return repr(value)[:60]
    return f"a {type(value).__name__}"


def why_refused(error: Exception) -> str:
    """One of UNTRUSTED_ERRORS in a few words (a RecursionError's own are no help)."""
    return "nested too deeply" if isinstance(error, RecursionError) else str(error)[:200]


def algbw_busbw(nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """All-reduce bandwidths in GB/s as nccl-tests defines them:
    algbw = bytes / time; busbw = algbw * 2(n-1)/n."""
    if seconds <= 0:
        return 0.0, 0.0
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * 2 * (world_size - 1) / world_size


# -- relayed frames (daemon PUB -> dashboards) ------------------------------------
# The daemon re-publishes every message it accepted as two frames: its relay
# sequence number (8 bytes, big-endian; 1, 2, 3, ... per run, as in the
# journal) and the message frame exactly as received.
RELAY_TOPIC = b""  # dashboards subscribe to everything


def relay_frames(relay_seq: int, frame: bytes) -> list[bytes]:
    return [relay_seq.to_bytes(8, "big"), frame]


def decode_relayed(frames: list[bytes], run: str | None = None) -> tuple[int, Message]:
    """(relay sequence number, message) from the daemon's PUB socket."""
    if len(frames) != 2 or len(frames[0]) != 8:
        raise Malformed(f"expected [8-byte sequence, message], got {len(frames)} frame(s)")
    return int.from_bytes(frames[0], "big"), decode(frames[1:], run)
