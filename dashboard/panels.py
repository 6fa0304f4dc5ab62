"""What each panel of the dashboard says, as rich Text built from a RunState.

Pure functions (state in, Text out): each main-view panel (mainpanels.py) calls
its own under the feed's lock, at its own pace, and shows the result; the rank
detail screen does the same for its panels.
"""

from __future__ import annotations

import statistics

from rich.text import Text

from ddtop.core.contract import describe_exit
from ddtop.core.events import RUN_WIDE, EventKind, RunEvent, epoch_words
from ddtop.core.rankview import (
    DEAD,
    FINISHED,
    RUNNING,
    SILENT,
    STALLED,
    STARTING,
    UNREACHED,
    RankState,
    RankView,
)
from ddtop.core.scalars import SCALAR_WIDTH, compact
from ddtop.core.scalars import line as scalars_line
from ddtop.core.state import RunState
from ddtop.core.strategy_names import comm_ops
from ddtop.core.summary import LOST, rate_words
from ddtop.core.text import count_of, lost_words, num, seconds, size, traceback_tail
from ddtop.dashboard import format as fmt
from ddtop.dashboard.feed import Feed

STATE_STYLE: dict[RankState, str] = {
    RUNNING: "green", STALLED: "bold yellow", SILENT: "magenta", UNREACHED: "bold magenta",
    DEAD: "bold red", FINISHED: "blue", STARTING: "dim", LOST: "bold red"}
STATUS_STYLE = {"starting": "dim", "running": "bold green", "stopping": "yellow",
                "restarting": "bold yellow", "succeeded": "bold blue", "failed": "bold red",
                "stopped": "yellow", LOST: "bold red"}
EVENT_STYLE: dict[EventKind, str] = {
    "error": "bold red", "warning": "yellow", "exit": "red", "restart": "bold yellow",
    "checkpoint": "cyan", "epoch_end": "bold", "join": "dim", "status": "blue",
    "stopped": "yellow", "stop_requested": "yellow", "resumed": "cyan"}
BAR_WIDTH = 30
MIN_BAR = 8  # a progress bar narrower than this is left out
SHARE_ROW_TEXT = 44  # a step-breakdown row's cells besides its bar, its note included
WAITING_S = 1.0  # inside a collective this long: the ranks wait, their numbers compared


def header(state: RunState, now: float, note: str = "", width: int | None = None) -> Text:
    """The run in a few lines; the progress line fitted to `width` cells where given (the
    bar shorter, then gone, then fewer words), so that elapsed time and ETA stay."""
    done, total = state.progress()
    fraction = done / total if total else 0.0
    world = state.world_size or len(state.ranks)
    n_nodes = fmt.nodes(state)
    text = Text()
    text.append("ddtop ", "bold")
    text.append(f"run {state.run}  ")
    text.append(f" {state.status} ", f"reverse {STATUS_STYLE.get(state.status, '')}")
    if note:
        text.append(f"  {note}", "bold yellow")
    what = state.program or f"{state.model or '?'} on {state.dataset or '?'}"
    if state.strategy:
        what += f" · strategy {state.strategy}"
    text.append(f"\n{what} · {state.backend or '?'} · "
                f"{count_of(world, 'rank')} on {count_of(n_nodes, 'node')} · "
                f"restarts {state.restarts} · {lost_words(state.telemetry_loss())}")
    text.append("\n")
    # The furthest epoch a rank is in; "-" where none knows its own (a script's
    # sampler never set_epoch'd), left out where nothing at all is known.
    known = [v.epoch for v in state.ranks.values() if v.epoch is not None]
    furthest = fmt.epoch_text(max(known) if known else None)
    epochs = (f" · epoch {furthest}/{state.epochs}" if state.epochs
              else f" · epoch {furthest}" if known else "")
    eta = state.eta(now)
    rate = rate_words(state.throughput(now), state.status)
    timing = (f" · elapsed {seconds(state.elapsed(now))}"
              f"{' · ETA ' + seconds(eta) if eta is not None else ''}")
    steps = f" step {done}/{total or '?'}"
    # The whole line, then shorter ones, the first that fits (elapsed and ETA kept).
    lines = [f"{steps} ({100 * fraction:.1f}%){epochs} · {rate}{timing}",
             f"{steps} ({100 * fraction:.1f}%){epochs} · {rate.replace(' on average', ' avg')}"
             f"{timing}",
             f"{steps}{epochs} · {rate.replace(' on average', ' avg')}{timing}"]
    room = None if width is None else width - 1  # (the header's left padding)
    line = next((x for x in lines if room is None or len(x) + MIN_BAR <= room
                 or len(x) <= room), lines[-1])
    bar = BAR_WIDTH if room is None else min(BAR_WIDTH, room - len(line))
    if bar >= MIN_BAR:
        text.append(fmt.bar(fraction, bar), "green")
    text.append(line if bar >= MIN_BAR else line.lstrip())
    agg = state.aggregate
    if agg is None and state.program:  # a user's script: its ddtop.log scalars instead
        text.append("\nscalars: ")
        text.append(scalars_line(state.scalars) or "none logged (ddtop.log)",
                    "" if state.scalars else "dim")
    elif agg is None:
        text.append("\nglobal: ")
        text.append("no metric sync yet", "dim")
    else:
        text.append("\nglobal: ")
        text.append(f"loss {agg.train_loss:.4f} acc {100 * agg.train_accuracy:.2f}%", "bold")
        if agg.val_loss is not None and agg.val_accuracy is not None:
            text.append(f" · val loss {agg.val_loss:.4f} acc {100 * agg.val_accuracy:.2f}%")
        text.append(f" (step {agg.global_step})", "dim")
    slowest, skew, slow = state.stragglers()
    if slowest is not None:
        text.append(f" · slowest rank {slowest} (+{1000 * skew:.1f} ms/step, the others wait "
                    "for it)")
    if slow:
        text.append(f" · stragglers: {', '.join(map(str, slow[:8]))}"
                    f"{'…' if len(slow) > 8 else ''}", "bold yellow")
    cause = state.straggler_causes(slow).get(slowest) if slowest is not None else None
    if cause is not None:
        text.append(f" · {cause[1]}", "yellow")
    return text


def note(feed: Feed, replay: bool, filter_text: str, problems_only: bool,
         paused: bool) -> str:
    """The header's note: replay speed, the run over, the filter, paused."""
    parts = []
    if feed.replay_controls:
        parts.append(f"replay {'max' if feed.speed == 0 else f'{feed.speed:g}x'} (+/- speed)")
    if feed.finished and not replay:
        parts.append("the run is over: showing its final state")
    if filter_text or problems_only:
        what = ", ".join(([f"'{filter_text}'"] if filter_text else [])
                         + (["problems only"] if problems_only else []))
        parts.append(f"filter: {what}")
    if paused:
        parts.append("PAUSED")
    return " · ".join(parts)


def banner(state: RunState, now: float, connection: str, detail: str) -> Text | None:
    """The one thing that needs attention, or None."""
    if connection in ("connecting", "gone") and detail:
        return Text(f"⚠ {detail}", "bold yellow")
    if state.status == LOST:
        return Text(f"✖ run lost: {state.status_message}", "bold red")
    lost = [k for k, s in sorted(state.node_states.items()) if s in ("lost", "unreachable")]
    if lost and state.status in ("failed", "running", "stopping"):  # a multi-node job
        ranks = ", ".join(str(r) for r, k in sorted(state.rank_nodes.items()) if k in lost)
        what = "lost" if state.node_states[lost[0]] == "lost" else "unreachable"
        return Text(f"✖ node {', '.join(map(str, lost))} {what}: no heartbeat from its daemon"
                    f" (ranks {ranks or '?'})", "bold red")
    failure = state.failure
    if failure is not None and state.status in ("failed", "running", "stopping"):
        msg = f": {failure.message}" if failure.message else ""
        return Text(f"✖ {failure.who()} {failure.how()}{msg}", "bold red")
    hang = state.hang(now)
    if hang:
        return Text(f"⏸ hang: {hang}", "bold yellow")
    return None


def comm(state: RunState, now: float, selected: int | None, lines: int) -> Text:
    """Gradient all-reduce per step (median over ranks), the selected rank's numbers,
    and each rank's last collective, laggards first: who the others wait for."""
    text = Text(no_wrap=True, overflow="ellipsis")
    views = [v for v in state.ranks.values() if v.comm_s is not None]
    if views:
        med = statistics.median
        ops = med([v.comm_ops or 0 for v in views])
        nbytes = med([v.comm_bytes or 0 for v in views])
        secs = med([v.comm_s or 0.0 for v in views])
        per_op = nbytes / ops if ops else 0
        text.append(comm_ops(state.strategy) + " ", "bold")
        text.append(f"{ops:.0f} ops of {size(per_op)} = {size(nbytes)} in "
                    f"{fmt.millis(secs)} ms; algbw {med([v.algbw_gbps or 0 for v in views]):.2f}"
                    f" busbw {med([v.busbw_gbps or 0 for v in views]):.2f} GB/s")
        overlaps = [v.comm_overlap_s for v in views if v.comm_overlap_s is not None]
        if overlaps:
            overlap = med(overlaps)
            text.append(f"; overlapped {100 * overlap / secs if secs else 0:.0f}% "
                        f"({fmt.millis(overlap)} ms)")
        text.append("\n")
    else:
        text.append("no step reported yet\n", "dim")
    v = state.ranks.get(selected) if selected is not None else None
    if v is not None and v.comm_s is not None:
        share = 100 * (v.comm_share or 0)
        text.append(f"rank {v.rank}: ", "bold")
        text.append(f"{v.comm_ops or 0:.1f} ops, {size(v.comm_bytes)}, "
                    f"{fmt.millis(v.comm_s)} ms "
                    f"({share:.0f}% of step), busbw {num(v.busbw_gbps, '.2f')} GB/s, "
                    f"sync wait {v.sync_wait_s:.2f} s\n")
    # Each rank's numbers come with its heartbeat, once a second, each rank's at its own
    # moment: while the ranks step, readings a second apart differ by hundreds of
    # collectives and say nothing of who lags. They are compared (laggards first) only
    # while ranks wait inside one, where they stand still; each line says its age.
    live = [r for r in state.ranks.values() if not r.exited and r.bye_code is None]
    waiting = any(r.in_collective and r.phase_elapsed(now) > WAITING_S for r in live)
    if waiting:
        text.append("last collective (started / completed, its age), laggards first\n", "dim")
        # The rank that has not yet started the collective the others are in comes first.
        ordered = sorted(state.ranks.values(), key=lambda r: (
            r.coll_started.seq if r.coll_started else -1,
            r.coll_completed.seq if r.coll_completed else -1, r.rank))
    else:
        text.append("last collective (started / completed, its age): the ranks step, so "
                    "readings a second apart are not compared\n", "dim")
        ordered = sorted(state.ranks.values(), key=lambda r: r.rank)
    for r in ordered[:max(0, lines - len(text.plain.splitlines()))]:
        started = f"{r.coll_started.op} #{r.coll_started.seq}" if r.coll_started else "-"
        completed = f"#{r.coll_completed.seq}" if r.coll_completed else "-"
        inside = r.in_collective and not r.exited and r.bye_code is None
        style = "bold yellow" if inside and r.phase_elapsed(now) > WAITING_S else ""
        age = f"  {seconds(max(0.0, now - r.phase_at))} ago" if r.phase_at is not None and (
            r.coll_started or r.coll_completed) else ""
        text.append(f"rank {r.rank:>4}: {started} / {completed}"
                    f"{'  (inside)' if inside else ''}{age}\n", style)
    return text


def events(state: RunState, lines: int, rank: int | None = None, title: str = "events") -> Text:
    """The newest events; of one rank (its detail): its own and the run's (epochs, the
    status, restarts), every epoch's end included, also one older than the events the
    state keeps (a dashboard attached late to a long run)."""
    text = Text(f"{title}\n", "bold", no_wrap=True, overflow="ellipsis")
    chosen = [e for e in state.events if rank is None or e.rank == rank or e.type in RUN_WIDE]
    if rank is not None:
        kept = {(e.t, e.message) for e in chosen if e.type == "epoch_end"}
        older = [RunEvent(t=m.t, rank=m.rank, type="epoch_end", message=words)
                 for m in state.epochs_done if (m.t, words := epoch_words(m)) not in kept]
        chosen = [*older, *chosen]  # (older than every event kept)
    for event in chosen[-lines:]:
        text.append(f"{fmt.clock(event.t)} ", "dim")
        text.append(event.message, EVENT_STYLE.get(event.type, ""))
        tail = traceback_tail(event.traceback, 1)
        if tail:
            text.append(f"  | {tail[0]}", "red")
        text.append("\n")
    if not chosen:
        text.append("no events yet", "dim")
    return text


def detail(state: RunState, rank: int, now: float, width: int = 80) -> Text:
    """One rank's numbers, its ddtop.log scalars (laid out in `width` cells) and
    its step breakdown."""
    v = state.ranks.get(rank)
    text = Text()
    st = state.rank_states(now).get(rank, STARTING)
    text.append(f"rank {rank} ", "bold")
    text.append(f" {st} ", f"reverse {STATE_STYLE.get(st, '')}")
    if v is None:
        text.append("\nnot heard from yet", "dim")
        return text
    text.append(f"  {v.host or '?'} pid {v.pid or '?'} · {v.device or '?'} · {v.backend or '?'}"
                f" · local rank {v.local_rank}\n")
    ended = v.exited or v.bye_code is not None
    where = "" if ended else f" · now {v.where()} for {v.phase_elapsed(now):.1f} s"
    spe = v.steps_per_epoch
    text.append(f"epoch {fmt.epoch_text(v.epoch)} step {f'{v.step}/{spe}' if spe else v.step} "
                f"(global {v.global_step}){where} · last message "
                f"{seconds(None if v.last_seen is None else now - v.last_seen)} ago\n")
    text.append(f"loss {num(v.loss, '.4f')} · {num(v.samples_per_s, ',.0f')} samples/s · "
                f"lr {num(v.lr, '.2e')} · memory {size(v.memory)}"
                f"{f' (peak {size(peak)})' if (peak := _peak(v)) is not None else ''} · messages "
                f"{v.received} received, {v.lost} lost, {v.duplicates} duplicates, "
                f"{v.sender_dropped} dropped by the rank\n")
    if (creep := v.creep.words()) is not None:
        text.append(creep + "\n", "bold yellow")
    slow = state.stragglers()[2]
    if rank in slow:  # why the mark, and why its row may read better
        cause = state.straggler_causes(slow).get(rank)  # (core/causes.py)
        text.append(f"straggles (+{1000 * v.evidence.excess_s:.1f} ms/step): "
                    f"{cause[1] if cause is not None else 'cause not judged yet'}\n",
                    "bold yellow")
        text.append("the others wait for it in their collectives: the wait is in their step "
                    "time and COMM%, so its own step time and samples/s may read better than "
                    "theirs\n", "yellow")
    if ended:
        how = describe_exit(v.exit_code if v.exit_code is not None else v.bye_code, v.signal,
                            short=True)
        text.append(f"ended: {how}{' (stopped by the daemon)' if v.stopped_by_daemon else ''}"
                    f"{': ' + v.error if v.error else ''}\n", "bold red" if st == DEAD else "")
    if state.scalars:
        text.append("\nscalars (ddtop.log)", "bold")
        text.append("  ▲ the run's highest, ▼ its lowest\n", "dim")
        lines = rank_scalars(state, rank, width)
        text.append("\n".join(lines) + "\n" if lines else "none logged by this rank\n",
                    "" if lines else "dim")
    text.append("per step (ms)\n", "bold")  # (no blank line: whole at 80x24, comm included)
    step = v.step_time_s or 0.0

    # The bars as wide as the detail leaves them (20 at most), so that a row and its
    # note stay whole (80x24: the detail is about 52 cells wide).
    bar = max(4, min(20, width - SHARE_ROW_TEXT))

    def share_row(name: str, value: float | None, note: str = "") -> None:
        share = (value or 0.0) / step if step else 0.0
        text.append(f"{name:>10} {fmt.millis(value):>7} ")
        text.append(fmt.bar(share, bar), "cyan")
        text.append(f" {100 * share:4.0f}%{note}\n")

    for name, value in v.phase_split.items():  # these add up to the step
        share_row(name, value)
    text.append(f"{'step':>10} {fmt.millis(v.step_time_s):>7}\n")
    # DDP all-reduces gradient buckets while backward still runs: this time is
    # part of the phases above, not added to them.
    if v.comm_overlap_s is None:
        share_row("all-reduce", v.comm_s, " (in backward)")
    else:  # measured (the built-in trainer's --strategy)
        overlapped = v.comm_overlap_s / v.comm_s if v.comm_s else 0.0
        share_row("comm", v.comm_s, f" ({100 * overlapped:.0f}% overlapped)")
    for line in traceback_tail(v.traceback, 12):
        text.append(f"  | {line}\n", "red")
    return text


def memory_title(v: RankView | None, charted: list[int]) -> str:
    """The rank detail's memory chart's title (a narrow column: about 25 cells at 80x24):
    what it charts (CUDA allocated where the rank uses CUDA, else its RSS) and the
    newest reading."""
    if v is None or not charted:
        return "memory: not reported"
    return f"memory: {'CUDA' if v.cuda_allocated is not None else 'RSS'} {size(charted[-1])}"


def _peak(v: RankView) -> int | None:
    """The peak of the memory the rank's table shows (CUDA's where it uses CUDA)."""
    return v.cuda_peak if v.cuda_allocated is not None else v.rss_peak


def rank_scalars(state: RunState, rank: int, width: int) -> list[str]:
    """Every ddtop.log scalar `rank` logged, its newest value, marked ▲ / ▼ where
    it is the run's highest / lowest (when the ranks differ); by name, in as many
    columns of 'name value' as fit in `width` cells, filled down each column."""
    cells = []
    for s in state.scalar_summaries():
        value = state.scalars[s.name].get(rank)
        if value is None:
            continue
        mark = ("" if s.min == s.max else "▲" if rank == s.max_rank
                else "▼" if rank == s.min_rank else "")
        cells.append((s.name, compact(value), mark))
    if not cells:
        return []
    name_width = max(len(name) for name, _, _ in cells)
    cell = name_width + 1 + SCALAR_WIDTH + 2
    columns = max(1, (width + 2) // (cell + 2))
    per_column = -(-len(cells) // columns)
    lines = []
    for row in range(per_column):
        parts = [f"{name:<{name_width}} {value:>{SCALAR_WIDTH}} {mark:<1}"
                 for name, value, mark in cells[row::per_column]]
        lines.append("  ".join(parts).rstrip())
    return lines

