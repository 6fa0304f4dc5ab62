"""RunSummary: the one description of how a run stands or how it ended.

It is derived from RunState (`RunState.summary`), never assembled by hand: the
daemon answers `status` with it and writes the last one into run.json
(`RunRecord` adds what only the daemon's process knows); `ddtrain status` and
`list`, the headless summary and the dashboard's banner all read it, under the
same field names. Every type here is a msgspec struct, so what is read back
from a socket or a file is validated, never trusted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cache
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
import msgspec.inspect

from ddtop.core import wire
from ddtop.core.bounds import MAX_JOB_RANKS
from ddtop.core.contract import describe_exit
from ddtop.core.rankview import DEAD, FINISHED, RankState, RankView
from ddtop.core.wire import Restart

if TYPE_CHECKING:
    from ddtop.core.processes import ProcessId

# A run whose daemon is gone although it never reached a final status: it was killed.
LOST: Literal["lost"] = "lost"
Status = wire.RunStatusName | Literal["lost"]
# run.json's layout version: epochs count from 1 (each rank's `epoch`, null where
# not known; `metrics.epoch`), as `ddtrain status --json` and the training log count them.
# A file of another layout (the unreleased ones before it) is unreadable: the run is
# told from its journal.
RECORD_SCHEMA = 3
# Lines of a failed rank's traceback that status, the headless summary and the
# daemon's final report show.
TRACEBACK_TAIL_LINES = 8
# A pid read back from run.json names a process to signal: a positive number no
# larger than Linux's largest (PID_MAX_LIMIT), or the record is unreadable (a
# pid of -1 would signal every process of the user).
PID_MAX = 1 << 22
Pid = Annotated[int, msgspec.Meta(ge=1, le=PID_MAX)]
# The ranks a record may hold: no more than a job can have (a multi-node job's).
WorldSize = Annotated[int, msgspec.Meta(ge=0, le=MAX_JOB_RANKS)]


class Failure(msgspec.Struct, kw_only=True):
    """The rank a failed run is blamed on, and why."""

    rank: int
    pid: int | None = None
    exit_code: int | None = None  # None when killed by a signal
    signal: str | None = None  # e.g. "SIGKILL"
    message: str | None = None  # the rank's own error report
    traceback: str | None = None
    global_step: int = 0  # the last step the rank reported
    # A multi-node job: the node the rank ran on; with `rank` below 0, the node
    # itself is blamed (lost, or failed as a whole: no rank of it is to blame).
    node: int | None = None
    # How it ended, where the exit does not say it: "left early at step 20: ..."
    # (exit code 0 while the others trained), "lost: its daemon ...".
    reason: str | None = None

    def how(self) -> str:
        """'killed by SIGKILL', 'exit code 1' or the reason ('left early at step 20: ...')."""
        return self.reason or describe_exit(self.exit_code, self.signal, short=True)

    def line(self) -> str:
        """'rank 1 exit code 1: RuntimeError: ...', as status, the headless
        summary and the dashboard's banner say it."""
        cause = f": {self.message}" if self.message else ""
        return f"{self.who()} {self.how()}{cause}"

    def who(self) -> str:
        """'rank 3', or in a multi-node job 'rank 3 on node 1', or 'node 1' itself."""
        if self.rank < 0:
            return f"node {self.node}" if self.node is not None else wire.launcher_name(self.rank)
        return f"rank {self.rank}" + (f" on node {self.node}" if self.node is not None else "")


class RankSummary(msgspec.Struct):
    """One rank in a summary. Not kw_only: `of` builds it from positions, four
    times faster than from keywords (16,384 of them in every summary of a big job)."""

    rank: int
    state: RankState
    host: str = ""
    node: int | None = None  # a multi-node job: the node it runs on (daemon/hub.py)
    pid: int | None = None
    # The epoch it is in, counted from 1 as the training log prints it (the wire
    # and RunState count from 0: the summary is where a user reads it); None
    # where not known (a script whose sampler was never set_epoch'd: "-", null).
    epoch: int | None = None
    step: int = 0
    global_step: int = 0
    loss: float | None = None
    samples_per_s: float | None = None
    comm_share: float | None = None
    step_time_s: float | None = None  # its last window's time per step
    exit_code: int | None = None
    signal: str | None = None
    phase: wire.Phase = "setup"
    stopped_by_daemon: bool = False
    last_seen_s: float | None = None
    lost: int = 0  # telemetry messages lost
    # Its memory (CUDA allocated where it uses CUDA, else RSS) and that one's peak so far.
    memory: int | None = None
    memory_peak: int | None = None

    @classmethod
    def of(cls, v: RankView, state: RankState, node: int | None, now: float) -> RankSummary:
        """Rank `v` in `state` at `now` (on `node` of a multi-node job)."""
        # Positional, in the order of the fields above (tests/test_big_summary.py
        # checks every field against the view).
        # No builtin called per rank: RankView.comm_share and max(0, now - last seen),
        # written out.
        seen, comm, step = v.last_seen, v.comm_s, v.step_time_s
        share = None if comm is None or not step else (
            comm / step if comm < step else 1.0)
        ago = None if seen is None else (now - seen if now > seen else 0.0)
        epoch = None if v.epoch is None else v.epoch + 1
        cuda = v.cuda_allocated
        memory, peak = (v.rss, v.rss_peak) if cuda is None else (cuda, v.cuda_peak)
        return cls(v.rank, state, v.host, node, v.pid, epoch, v.step, v.global_step,
                   v.loss, v.samples_per_s, share, step, v.exit_code, v.signal,
                   v.phase, v.stopped_by_daemon, ago, v.lost, memory, peak)


def rank_summaries(views: Mapping[int, RankView], states: Mapping[int, RankState],
                   nodes: Mapping[int, int], now: float) -> list[RankSummary]:
    """Each rank of `states` in its state at `now` (a rank never heard from: its
    number and state alone), in the order of `states`."""
    of, get, node = RankSummary.of, views.get, nodes.get
    return [of(get(r) or RankView(rank=r), st, node(r), now) for r, st in states.items()]


class ScalarSummary(msgspec.Struct, kw_only=True):
    """One ddtop.log key across ranks, from each rank's newest value. mean, min and
    max are over finite values (None when there are none); `nonfinite` counts
    ranks whose newest value is NaN or infinite."""

    name: str
    mean: float | None = None
    min: float | None = None
    min_rank: int | None = None
    max: float | None = None
    max_rank: int | None = None
    ranks: int = 0  # ranks that logged it
    nonfinite: int = 0

    def line(self) -> str:
        """'grad_norm: mean 2 (min 1 rank 0, max 3 rank 1)'."""
        if self.mean is None:
            return f"{self.name}: not finite on {self.nonfinite} of {self.ranks} ranks"
        spread = ("" if self.min == self.max else
                  f" (min {self.min:.6g} rank {self.min_rank}, "
                  f"max {self.max:.6g} rank {self.max_rank})")
        return f"{self.name}: mean {self.mean:.6g}{spread}"


class RunSummary(msgspec.Struct, kw_only=True):
    run_id: str
    status: Status = "starting"
    # With a final status: the exit code of `ddtrain start --foreground` for the run.
    exit_code: int | None = None
    world_size: WorldSize = 0
    model: str = ""
    dataset: str = ""
    backend: str = ""
    restarts: int = 0
    timeline: list[Restart] = []
    failure: Failure | None = None
    global_step: int = 0  # done by the slowest rank
    total_steps: int = 0
    # Running: the ranks' rates summed; ended: the run's average; None where no rank
    # reported its samples (a zero-code run).
    samples_per_s: float | None = None
    telemetry_loss: float = 0.0  # the fraction of telemetry messages lost (0..1), not a loss
    rejected: dict[str, int] = {}
    journal_dropped: int = 0  # records the daemon could not write to its journal (a full disk)
    slowest_rank: int | None = None
    skew_s: float = 0.0
    stragglers: list[int] = []
    # Each straggler's cause in words, by rank (core/causes.py): "input: 44 ms/step ...".
    straggler_causes: dict[int, str] = {}
    # The ranks whose memory creeps, in words (core/memcreep.py), by rank.
    memory_creeping: dict[int, str] = {}
    hang: str | None = None
    alone: str | None = None  # ranks of the world that never communicated, in words (alone.py)
    # The folders of the evidence gathered (daemon/evidence.py), oldest first.
    evidence: list[str] = []
    # The newest global metrics, as the ranks sent them but for `epoch`, counted
    # from 1 (user_epochs), as metrics.jsonl and the ranks' own lines count it.
    metrics: wire.Aggregate | None = None
    program: str = ""  # a user's own script, else ""
    scalars: list[ScalarSummary] = []  # ddtop.log keys, aggregated across ranks
    ranks: list[RankSummary] = []
    started: float | None = None
    updated: float | None = None  # time of the newest message folded


class ProcessRecord(msgspec.Struct, kw_only=True):
    """A process the daemon started for the current attempt, as the OS knows it."""

    rank: int  # -1: not a rank but an agent running ranks (torchrun)
    pid: Pid | None
    # Its start time, clock ticks after boot (/proc/<pid>/stat field 22): with the
    # pid and the record's boot_id it names this one process, never a later one
    # given the same pid. None: unknown (written before it was kept).
    start_ticks: int | None = None

    @classmethod
    def of(cls, rank: int, pid: int | None, identity: ProcessId | None) -> ProcessRecord:
        return cls(rank=rank, pid=pid, start_ticks=identity.start if identity else None)


class RunRecord(RunSummary, kw_only=True):
    """run.json: the last RunSummary, plus what only the daemon's process knows."""

    schema: int = RECORD_SCHEMA
    processes: list[ProcessRecord] = []
    daemon_pid: Pid | None = None
    # The daemon's start time (as ProcessRecord.start_ticks): a live pid that
    # started at another time is another process, and the run is lost.
    daemon_start_ticks: int | None = None
    boot_id: str = ""  # the boot the start times count from (/proc/sys/kernel/random/boot_id)
    host: str = ""
    ended: float | None = None
    endpoints: dict[str, str] = {}
    master_addr: str = ""
    master_port: int = 0
    max_restarts: int = 0

    def with_summary(self, summary: RunSummary) -> RunRecord:
        """This record's daemon facts with `summary`'s view of the run; a rank
        not heard from yet shows the pid the daemon started it with."""
        fields = msgspec.structs.asdict(summary)
        fields.pop("started")  # the daemon's own start time stays
        pids = {p.rank: p.pid for p in self.processes}
        fields["ranks"] = [r if r.pid is not None or r.rank not in pids
                           else msgspec.structs.replace(r, pid=pids[r.rank])
                           for r in summary.ranks]
        return msgspec.structs.replace(self, **fields)


def ended(status: str) -> bool:
    """The run is over: a final status, or lost with its daemon."""
    return status in (*wire.FINAL_STATUSES, LOST)


def rate_words(samples_per_s: float | None, status: str) -> str:
    """'2,345 samples/s' while the run goes on; once it has ended, its average
    (RunState.throughput): '2,345 samples/s on average'; 'samples/s not reported'
    where no rank reported its samples (a zero-code run): missing is not zero."""
    if samples_per_s is None:
        return "samples/s not reported"
    return f"{samples_per_s:,.0f} samples/s" + (" on average" if ended(status) else "")


def user_epochs(m: wire.Aggregate | None) -> wire.Aggregate | None:
    """Global metrics as a summary holds them: the epoch counted from 1 (the
    wire's counts from 0)."""
    return None if m is None else msgspec.structs.replace(m, epoch=m.epoch + 1)


def metrics_words(m: wire.Aggregate) -> str:
    """A summary's global metrics in words: '(epoch 2, step 1024): train loss 0.1234
    acc 97.00%, val loss ...' (ddtrain status and the headless summary)."""
    val = (f", val loss {m.val_loss:.4f} acc {100 * m.val_accuracy:.2f}%"
           if m.val_loss is not None and m.val_accuracy is not None else "")
    return (f"(epoch {m.epoch}, step {m.global_step}): train loss {m.train_loss:.4f} "
            f"acc {100 * m.train_accuracy:.2f}%{val}")


def as_lost(summary: RunSummary) -> RunSummary:
    """The daemon is gone before the run ended: the run and every rank that had
    not exited are lost (they died with the daemon)."""
    ranks = [r if r.state in (FINISHED, DEAD) else msgspec.structs.replace(r, state=LOST)
             for r in summary.ranks]
    return msgspec.structs.replace(summary, status=LOST, ranks=ranks)


# -- run.json ------------------------------------------------------------------------
_record_decoder = msgspec.json.Decoder(RunRecord)


class _Layout(msgspec.Struct):
    schema: int = 1  # the first layouts may not name theirs


def decode_record(data: bytes) -> RunRecord:
    """run.json as this version writes it; raises ValueError when it is not (another
    layout among them)."""
    try:
        record = _decode_record(data)
    except RecursionError:
        raise ValueError("nested too deeply to be a run.json") from None
    if (layout := record_layout(data)) != RECORD_SCHEMA:
        raise ValueError(f"layout {layout}, this ddtop reads layout {RECORD_SCHEMA}")
    return record


def _decode_record(data: bytes) -> RunRecord:
    try:
        return _record_decoder.decode(data)
    except msgspec.ValidationError as error:
        raw = msgspec.json.decode(data)
        if not isinstance(raw, dict):
            raise
        try:  # perhaps with a NaN (a diverged loss), which JSON wrote as null
            return msgspec.convert(_restore_nan(raw, _record_type()), RunRecord)
        except msgspec.ValidationError:
            raise error from None


def record_layout(data: bytes) -> int:
    """The layout a run.json that decode_record read says it has (1: it names none)."""
    return msgspec.json.decode(data, type=_Layout).schema


def encode_record(record: RunRecord) -> bytes:
    return msgspec.json.format(msgspec.json.encode(record), indent=2) + b"\n"


@cache
def _record_type() -> msgspec.inspect.Type:
    return msgspec.inspect.type_info(RunRecord)


def _restore_nan(value: Any, kind: msgspec.inspect.Type) -> Any:
    """JSON has no NaN nor infinity, so msgspec writes a non-finite float as null:
    read null back as NaN where a float is required (metrics of a run whose loss
    diverged), following structs, lists and optional values."""
    mi = msgspec.inspect
    if isinstance(kind, mi.FloatType):
        return math.nan if value is None else value
    if isinstance(kind, mi.UnionType) and value is not None:
        inner = [t for t in kind.types if not isinstance(t, mi.NoneType)]
        return _restore_nan(value, inner[0]) if len(inner) == 1 else value
    if isinstance(kind, mi.StructType) and isinstance(value, dict):
        return {**value, **{f.encode_name: _restore_nan(value[f.encode_name], f.type)
                            for f in kind.fields if f.encode_name in value}}
    if isinstance(kind, mi.ListType) and isinstance(value, list):
        return [_restore_nan(item, kind.item_type) for item in value]
    return value

