"""What a run's telemetry is in TensorBoard: each message folded as points, pure.

The layout, under DIR/<run id>/ (docs/monitoring.md#tensorboard says why):

    rank0/, rank1/, ...  one folder per rank, the same tags in each, so TensorBoard
                         (which calls a folder a "run") draws every rank as a line on
                         one chart per tag and its run selector picks ranks:
        step/seconds            a step's time (Step.step_s / steps)
        step/compute_seconds    of it, outside communication ((step_s - comm_s) / steps)
        step/comm_seconds       of it, communicating (comm_s / steps)
        step/comm_share         comm_s / step_s, 0..1
        train/loss              the loss the rank reported (when it did)
        train/samples_per_second  the samples of the message over the steps' time
        log/<key>               a script's ddtop.log scalars, as the rank logged them
    run/                 the run as a whole:
        global/train_loss, global/train_accuracy, global/val_loss, global/val_accuracy
                                the metric syncs every rank derived together (Aggregate)
        events                  text: every event of the fold (joins, failures, exits,
                                restarts, warnings, checkpoints, the status), and when
                                stragglers are named or a hang is found, and when they end

One point per Step message of a rank (its values summed over `steps` steps, read
per step); the x axis is the global step, the wall time the sender's clock when
it happened. Events and the straggler and hang lines are read from the RunState
the message was folded into (the caller folds it first): stragglers and hangs at
most once every CHECK_S of the run's time, as the printer's lines do.
"""

from __future__ import annotations

import statistics

import msgspec

from ddtop.core import wire
from ddtop.core.printer import new_events
from ddtop.core.state import RunState

RUN_FOLDER = "run"
SPREAD_FOLDER = "ranks"  # ranks/max, ranks/median, ranks/min
CONFIG_FOLDER = ""  # the run's own folder: the HParams session
EVENTS_TAG = "events"
# A folder's later lives (after a restart or a resume): <folder>/restart<n>.
LIFE = "restart"
# The run's lines of one step, in one text (TensorBoard keeps one a step): a rule between.
LINE_BREAK = "\n\n---\n\n"
# The most lines one step's text holds (rewritten as it grows): the rest are counted.
MAX_STEP_LINES = 200
# Stragglers and hangs are read from the state at most this often (receiver time, s):
# each reading goes over every rank.
CHECK_S = 1.0


def rank_folder(rank: int) -> str:
    return f"rank{rank}"


class Scalars(msgspec.Struct, frozen=True):
    """Values of one folder at one step: one TensorBoard event."""

    folder: str
    step: int
    wall: float
    values: tuple[tuple[str, float], ...]


class Text(msgspec.Struct, frozen=True):
    """A line of text of one folder at one step (the text plugin renders markdown)."""

    folder: str
    step: int
    wall: float
    tag: str
    text: str


class HParams(msgspec.Struct, frozen=True):
    """The run's configuration, once, for TensorBoard's HParams plugin: its session is
    the run's own folder (DIR/<run id>), its metrics the scalars of the folders in it."""

    folder: str
    trial: str  # the run id
    wall: float
    values: tuple[tuple[str, str | int | float], ...]


Item = Scalars | Text | HParams


def step_values(m: wire.Step) -> tuple[tuple[str, float], ...]:
    """A Step message's values per step; () for one that covers no step."""
    if m.steps <= 0:
        return ()
    steps = m.steps
    values = [("step/seconds", m.step_s / steps),
              ("step/compute_seconds", max(0.0, m.step_s - m.comm_s) / steps),
              ("step/comm_seconds", m.comm_s / steps)]
    if m.step_s > 0:
        values.append(("step/comm_share", min(1.0, m.comm_s / m.step_s)))
    if (loss := m.mean_loss()) is not None:
        values.append(("train/loss", loss))
    if (rate := m.samples_per_s(m.step_s)) is not None:
        values.append(("train/samples_per_second", rate))
    for tag, value in (("memory/rss_bytes", m.rss), ("memory/rss_peak_bytes", m.rss_peak),
                       ("memory/cuda_allocated_bytes", m.cuda_allocated),
                       ("memory/cuda_reserved_bytes", m.cuda_reserved),
                       ("memory/cuda_peak_bytes", m.cuda_peak)):
        if value is not None:
            values.append((tag, float(value)))
    return tuple(values)


def run_config(state: RunState, lr: float) -> tuple[tuple[str, str | int | float], ...]:
    """What the run trains and how, as HParams compare runs by: every run has every key
    (an empty text or 0 where not known)."""
    return (("model", state.model), ("dataset", state.dataset), ("program", state.program),
            ("strategy", state.strategy), ("backend", state.backend),
            ("world_size", state.world_size), ("global_batch", state.global_batch),
            ("epochs", state.epochs), ("lr", float(lr)))


def aggregate_values(m: wire.Aggregate) -> tuple[tuple[str, float], ...]:
    values = [("global/train_loss", m.train_loss), ("global/train_accuracy", m.train_accuracy)]
    if m.val_loss is not None:
        values.append(("global/val_loss", m.val_loss))
    if m.val_accuracy is not None:
        values.append(("global/val_accuracy", m.val_accuracy))
    return tuple(values)


class Translator:
    """Messages into items, in the order they are folded. It keeps only what it has
    said: the events it has written, the stragglers and hang it has named, each
    folder's life and its tags' highest steps, and the lines of the newest step.
    `first_life`: the life a writer's folders begin in (above 0: a resumed run's
    daemon, writing beside what the one before it wrote)."""

    def __init__(self, first_life: int = 0) -> None:
        self.step = 0  # the highest global step seen: where the run's own lines go
        self.events_seen = 0
        self.stragglers: list[int] = []
        self.hang: str | None = None
        self.checked_at: float | None = None
        self.steps_written = 0  # Step messages written as points
        self.first_life = first_life
        self.lives: dict[str, int] = {}  # a folder -> the life its points go to now
        self.tops: dict[tuple[str, str], int] = {}  # (folder, tag) -> its highest step, this life
        self.lines: list[str] = []  # the run's lines at self.line_step
        self.line_step = 0
        self.line_wall = 0.0
        self.lines_written = 0  # of self.lines, those in the last Text given
        self.lines_over = 0  # lines at this step past MAX_STEP_LINES: counted
        self.configured = first_life > 0  # the HParams are written (by the first daemon)

    def items(self, message: wire.Message, state: RunState, received: float) -> list[Item]:
        """What `message` (just folded into `state`, received at `received`) adds."""
        wall = message.t if message.t > 0 else received
        out: list[Item] = []
        # A node's summary (daemon/summariser.py): its ranks' messages, each a point.
        for m in message.messages if isinstance(message, wire.NodeSummary) else (message,):
            if isinstance(m, wire.Step) and not self.configured:
                self.configured = True
                out.append(HParams(CONFIG_FOLDER, state.run, m.t if m.t > 0 else wall,
                                   run_config(state, m.lr)))
            out.extend(self._placed(item) for item in self._points(m, state, m.t if m.t > 0
                                                                   else wall))
        events, self.events_seen = new_events(state, self.events_seen)
        for event in events:
            text = f"**{event.type}** · {event.source()}: {event.message}"
            if event.traceback:
                text += "\n\n```\n" + event.traceback + "\n```"
            out.extend(self._line(text, event.t or wall))
        if self.checked_at is None or received - self.checked_at >= CHECK_S:
            self.checked_at = received
            for text in self._check(state, received):
                out.extend(self._line(text, wall))
            out.extend(self._placed(item) for item in self._spread(state, wall))
        return out

    def pending(self) -> list[Item]:
        """The newest step's lines not given yet, as one Text with every line of that
        step (TensorBoard keeps one text a step: the last); the writer asks for it
        before it writes its files, and at the end."""
        if len(self.lines) == self.lines_written:
            return []
        self.lines_written = len(self.lines)
        return [Text(self._life(RUN_FOLDER, self.first_life), self.line_step, self.line_wall,
                     EVENTS_TAG, LINE_BREAK.join(self.lines))]

    def _line(self, text: str, wall: float) -> list[Item]:
        """A line of the run's at the highest step: held with that step's others; the
        lines of the step before, given where some were not yet."""
        out: list[Item] = []
        if self.step != self.line_step:
            out = self.pending()
            self.lines, self.lines_written, self.line_step = [], 0, self.step
            self.lines_over = 0
        if self.lines_over == 0 and len(self.lines) < MAX_STEP_LINES:
            self.lines.append(text)
        else:  # (a step that stands still: a hang, a long set-up) counted, not kept
            self.lines_over += 2 if self.lines_over == 0 else 1  # the last kept gives way
            self.lines[-1] = f"... and {self.lines_over} more lines at this step"
            self.lines_written = min(self.lines_written, len(self.lines) - 1)
        self.line_wall = wall
        return out

    def _placed(self, item: Scalars) -> Scalars:
        """`item` in its folder's life: a new one where a tag of it would step back (a
        restart, a resume), as TensorBoard drops a series' points past a step it is
        given again."""
        base = item.folder
        life = self.lives.get(base, self.first_life)
        if any(item.step < self.tops.get((base, tag), -1) for tag, _ in item.values):
            life += 1
            self.tops = {key: top for key, top in self.tops.items() if key[0] != base}
        self.lives[base] = life
        for tag, _ in item.values:
            self.tops[base, tag] = max(item.step, self.tops.get((base, tag), item.step))
        folder = self._life(base, life)
        return item if folder == base else msgspec.structs.replace(item, folder=folder)

    @staticmethod
    def _life(folder: str, life: int) -> str:
        return folder if life == 0 else f"{folder}/{LIFE}{life}"

    def _points(self, message: wire.Message, state: RunState, wall: float) -> list[Scalars]:
        if isinstance(message, wire.Step | wire.Heartbeat | wire.Aggregate | wire.Scalars):
            self.step = max(self.step, message.global_step)
        if isinstance(message, wire.Step):
            values = step_values(message)
            if values:
                self.steps_written += 1
                return [Scalars(rank_folder(message.rank), message.global_step, wall, values)]
        elif isinstance(message, wire.Aggregate) and state.aggregate is message:
            # Every rank sends the same numbers: the one the fold kept, once.
            return [Scalars(RUN_FOLDER, message.global_step, wall, aggregate_values(message))]
        elif isinstance(message, wire.Scalars) and message.values:
            return [Scalars(rank_folder(message.rank), message.global_step, wall,
                            tuple((f"log/{k}", v) for k, v in message.values.items()))]
        return []

    def _spread(self, state: RunState, wall: float) -> list[Scalars]:
        """The ranks' step time and comm share (each one's newest window) at their max,
        median and min, one folder each (ranks/max, ...): three lines where one per
        rank is a tangle; two ranks at least."""
        seconds = sorted(v.step_time_s for v in state.ranks.values()
                         if v.step_time_s is not None)
        shares = sorted(share for v in state.ranks.values()
                        if (share := v.comm_share) is not None)
        if len(seconds) < 2:
            return []
        out = []
        for name, pick in (("max", lambda xs: xs[-1]), ("median", statistics.median),
                           ("min", lambda xs: xs[0])):
            values = [("step/seconds", float(pick(seconds)))]
            if len(shares) >= 2:
                values.append(("step/comm_share", float(pick(shares))))
            out.append(Scalars(f"{SPREAD_FOLDER}/{name}", self.step, wall, tuple(values)))
        return out

    def _check(self, state: RunState, now: float) -> list[str]:
        """Lines for stragglers named or no longer, and a hang found or over."""
        said: list[str] = []
        _, skew, slow = state.stragglers()
        if slow != self.stragglers:
            said.append(f"**straggler** · ranks {', '.join(map(str, slow))} "
                        f"(+{1000 * skew:.1f} ms/step)" if slow
                        else "**straggler** · none any more")
            self.stragglers = slow
        hang = state.hang(now)
        if hang != self.hang:
            said.append(f"**hang** · {hang}" if hang else "**hang** · over")
            self.hang = hang
        return said
