"""The headless printer: a run's progress as log lines (CI), JSON lines (scripts)
or a progress bar (a terminal), from the same RunState the dashboard shows,
ending with the run's RunSummary and the run's exit code. `ddtrain start
--foreground --headless` hands it the daemon's own state after every poll;
`ddtop --headless` a feed's (dashboard/headless.py).

    --format text    a timestamped line per event and per --interval; on a
                     terminal, a progress bar with the events printed above it
    --format jsonl   {"kind": "event", ...} per event, {"kind": "progress", ...}
                     per interval, and last {"kind": "summary", "status": ...}; each
                     with "schema": JSONL_SCHEMA (as the --summary-json file)

Exit codes: 0 the run succeeded, 1 it failed (or was lost: its daemon was killed),
130 it was stopped, 2 bad input or no run reachable within --wait.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Literal, TextIO

import msgspec

from ddtop.core import manyranks
from ddtop.core.contract import exit_for_status
from ddtop.core.events import RunEvent
from ddtop.core.scalars import line as scalars_line
from ddtop.core.state import RunState
from ddtop.core.summary import (
    LOST,
    TRACEBACK_TAIL_LINES,
    RankSummary,
    RunSummary,
    metrics_words,
    rate_words,
)
from ddtop.core.text import lost_words, num, seconds, stamp, traceback_tail

DEFAULT_INTERVAL_S = 10.0
SUMMARY_ENV = "GITHUB_STEP_SUMMARY"
# How a run ended, as the headless summary reports it (its exit code follows).
Outcome = Literal["succeeded", "failed", "stopped", "lost"]
# The layout of the JSON lines and of --summary-json, in each record's "schema"
# (docs/cli.md lists the fields); a field added keeps it, a field changed bumps it.
JSONL_SCHEMA = 1


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=("text", "jsonl"), default="text",
                        help="headless output: timestamped lines (a progress bar on a "
                        "terminal) or one JSON object per line (default text)")
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, metavar="S",
                        help=f"headless: seconds between progress lines "
                        f"(default {DEFAULT_INTERVAL_S:g})")
    parser.add_argument("--summary-json", type=Path, default=None, metavar="PATH",
                        help="headless: also write the final summary to PATH (a CI artifact)")


def check_output_arguments(args: argparse.Namespace) -> str | None:
    """A one-line error for bad values, or None."""
    if not 0 < args.interval < math.inf:
        return f"--interval must be a number of seconds > 0 (got {args.interval:g})"
    return None if args.summary_json is None else file_problem("--summary-json",
                                                               args.summary_json)


def file_problem(flag: str, path: Path) -> str | None:
    """Why a file could not be written at `path` at the end of a run, found before
    it starts (a folder, a folder that is not there, a place this user cannot write
    to), or None. Tried for real, as root too: a file made for the test is removed."""
    if path.is_dir():
        return f"{flag} {path} is a folder: give the path of a file, e.g. {path / 'summary.json'}"
    if not path.parent.is_dir():
        return (f"{flag} {path}: folder {path.parent} does not exist; create it or pick "
                "another path")
    existed = path.exists()
    if existed and not path.is_file():  # /dev/stdout, a pipe: opened only at the end
        return None if os.access(path, os.W_OK) else f"{flag} {path} cannot be written"
    try:
        with path.open("a"):  # writes nothing
            pass
        if not existed:
            path.unlink()
    except OSError as e:
        return f"{flag} {path} cannot be written ({e.strerror or e}); pick another path"
    return None


class Printer:
    """Turns a RunState into output: `tick(state, now)` often, `finish(state, now)`
    once, each while the caller holds whatever guards the state."""

    def __init__(self, format: str = "text", interval: float = DEFAULT_INTERVAL_S,
                 out: TextIO | None = None, summary_json: Path | None = None,
                 tty: bool | None = None) -> None:
        out = out or sys.stdout  # the one of the time of the call, not of the import
        self.format, self.interval, self.out = format, interval, out
        self.summary_json = summary_json
        self.tty = out.isatty() if tty is None else tty
        self.events_seen = 0
        self.next_progress: float | None = None
        self.progress_bar: Any = None  # rich Progress, on a terminal in text format
        self.task: Any = None

    # -- while the run goes on ------------------------------------------------------
    def tick(self, state: RunState, now: float) -> None:
        events, self.events_seen = new_events(state, self.events_seen)
        for event in events:
            self._event(event)
        if self.progress_bar is not None or (self.format == "text" and self.tty):
            self._bar(state, now)
        elif state.started is not None:
            if self.next_progress is None:
                self.next_progress = now + self.interval
            elif now >= self.next_progress:
                self.next_progress = now + self.interval
                self._progress(state, now)

    def _emit(self, line: str) -> None:
        if self.progress_bar is not None:
            self.progress_bar.console.print(line, markup=False, highlight=False)
        else:
            self.out.write(line + "\n")
            self.out.flush()

    def _json(self, obj: dict[str, Any]) -> None:
        self._emit(json.dumps(obj, default=str, separators=(",", ":")))

    def _event(self, event: RunEvent) -> None:
        if self.format == "jsonl":
            self._json(event_record(event))
            return
        text = f"{stamp(event.t)} [{event.source()}] {event.type}: {event.message}"
        tail = traceback_tail(event.traceback, TRACEBACK_TAIL_LINES)
        self._emit("\n".join([text, *(f"    | {line}" for line in tail)]))

    def _progress(self, state: RunState, now: float) -> None:
        if self.format == "jsonl":
            self._json(progress_record(state, now))
            return
        if not manyranks.many(state.rank_states(now)):
            self._emit(f"{stamp(now)} {progress_text(state, now)}")
            return
        summary = state.summary(now)  # many ranks: their digest under the line
        self._emit("\n".join([f"{stamp(now)} {progress_text(state, now, ranks=False)}",
                              *manyranks.lines(manyranks.digest(summary.ranks,
                                                                summary.stragglers))]))

    def _bar(self, state: RunState, now: float) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn

        done, total = state.progress()
        if self.progress_bar is None:
            self.progress_bar = Progress(
                TextColumn("[bold]{task.fields[run]}"), BarColumn(),
                TextColumn("{task.description}"), console=Console(file=self.out),
                transient=False)
            self.progress_bar.start()
            self.task = self.progress_bar.add_task("", total=total or None, run=state.run)
        self.progress_bar.update(
            self.task, completed=done, total=total or None,
            description=f"{progress_text(state, now, short=True)}; "
                        f"{seconds(state.elapsed(now))}")

    # -- the end ---------------------------------------------------------------------
    def finish(self, state: RunState, now: float) -> int:
        """Print what is left and the summary; write the summary files; the exit code."""
        self.tick(state, now)
        if self.progress_bar is not None:
            self.progress_bar.stop()
            self.progress_bar = None
        final = final_summary(state, now)
        record = summary_record(final)
        if self.format == "jsonl":
            self._json(record)
        else:
            for line in summary_text(final, now):
                self._emit(line)
        if self.summary_json is not None:
            _write(self.summary_json, "w", json.dumps(record, indent=2, default=str) + "\n")
        markdown_path = os.environ.get(SUMMARY_ENV)
        if markdown_path:
            _write(Path(markdown_path), "a", summary_markdown(final))
        return final.exit_code


def _write(path: Path, mode: str, text: str) -> None:
    """A summary file at the end of a run: a failure to write it (checked before the
    run, gone or full since) is one line, and the run's exit code stays its outcome."""
    try:
        with path.open(mode) as f:
            f.write(text)
    except OSError as e:
        print(f"warning: the summary was not written to {path} ({e.strerror or e})",
              file=sys.stderr, flush=True)


def new_events(state: RunState, seen: int) -> tuple[list[RunEvent], int]:
    """Events recorded after the first `seen` (as many as are still kept), and the new count."""
    fresh = state.event_count - seen
    if fresh <= 0:
        return [], state.event_count
    return state.events[-min(fresh, len(state.events)):], state.event_count


# -- while the run goes on -----------------------------------------------------------
def event_record(event: RunEvent) -> dict[str, Any]:
    return {"kind": "event", "schema": JSONL_SCHEMA, **msgspec.to_builtins(event)}


def progress_text(state: RunState, now: float, short: bool = False,
                  ranks: bool = True) -> str:
    """The run in one line; without `ranks`, no counts by state nor stragglers
    (many ranks: their digest says them, core/manyranks.py)."""
    done, total = state.progress()
    pct = f" ({100 * done / total:.1f}%)" if total and not short else ""
    states = state.rank_states(now)
    counts: dict[str, int] = {}
    for s in states.values():
        counts[s] = counts.get(s, 0) + 1
    agg = state.aggregate
    parts = [f"step {done}/{total or '?'}{pct}", rate_words(state.throughput(now), state.status)]
    if agg is not None:
        parts.append(f"loss {agg.train_loss:.4f} acc {100 * agg.train_accuracy:.1f}%")
    if not short and ranks:
        parts.append(", ".join(f"{n} {s}" for s, n in counts.items()) or "no ranks yet")
    if not short:
        eta = state.eta(now)
        if eta is not None:
            parts.append(f"ETA {seconds(eta)}")
        _, skew, slow = state.stragglers()
        if slow and ranks:
            why = "".join(f"; rank {r} {c[1]}" for r, c in state.straggler_causes(slow).items())
            parts.append(f"stragglers: {', '.join(map(str, slow))} "
                         f"(+{1000 * skew:.1f} ms/step{why})")
        hang = state.hang(now)
        if hang:
            parts.append(f"hang: {hang}")
        parts += [f"rank {r} {words}" for r, words in sorted(state.creeping().items())]
        if state.scalars:
            parts.append(f"scalars: {scalars_line(state.scalars)}")
    return f"{state.status}: " + "; ".join(parts)


def progress_record(state: RunState, now: float) -> dict[str, Any]:
    done, total = state.progress()
    _, skew, slow = state.stragglers()
    summary = state.summary(now)
    ranks, digest = summary.ranks, None
    if manyranks.many(ranks):  # many ranks: the outliers only, every rank in the summary
        found = manyranks.digest(ranks, slow)
        ranks, digest = manyranks.outlier_ranks(found), manyranks.record(found)
    record: dict[str, Any] = {
        "kind": "progress", "schema": JSONL_SCHEMA, "t": now, "run_id": state.run,
        "status": state.status,
        "global_step": done, "total_steps": total, "samples_per_s": state.throughput(now),
        "eta_s": state.eta(now), "stragglers": slow, "skew_s": skew,
        "straggler_causes": {str(r): {"cause": c[0], "words": c[1]}
                             for r, c in state.straggler_causes(slow).items()},
        "memory_creeping": {str(r): words for r, words in state.creeping().items()},
        "hang": state.hang(now), "telemetry_loss": state.telemetry_loss(),  # messages lost
        "ranks": [{"rank": r.rank, "state": r.state, "epoch": r.epoch, "step": r.step,
                   "global_step": r.global_step, "loss": r.loss,
                   "samples_per_s": r.samples_per_s, "comm_share": r.comm_share}
                  for r in ranks],
        "scalars": msgspec.to_builtins(summary.scalars),  # as in the summary
    }
    if digest is not None:
        record.update({"ranks_complete": False, "rank_digest": digest})
    return record


# -- the end -------------------------------------------------------------------------
class FinalSummary(msgspec.Struct, frozen=True, kw_only=True):
    """The headless summary: the run's RunSummary at its end, and the outcome
    ddtop reports for it."""

    run: RunSummary
    # A run whose daemon was killed is `lost`, as `ddtrain status` and the dashboard
    # say (its ranks too); a feed that ended before the run did otherwise, failed.
    outcome: Outcome
    exit_code: int  # ddtop's own, the outcome's, as documented for --headless
    elapsed_s: float
    lost: str | None = None  # a lost run that names no failure: why it was lost

    def failure_line(self) -> str | None:
        """The failure in the words `ddtrain status` uses (Failure.line), or why a
        lost run was lost; None when there is neither."""
        return self.run.failure.line() if self.run.failure is not None else self.lost


def final_summary(state: RunState, now: float) -> FinalSummary:
    """How the run ended, per rank, and why when it failed."""
    summary = state.summary(now)
    outcome: Outcome = ("failed" if summary.status not in ("succeeded", "stopped", LOST)
                        else summary.status)
    lost = (state.status_message or "the daemon was killed"
            if summary.failure is None and summary.status == LOST else None)
    return FinalSummary(run=summary, outcome=outcome, exit_code=exit_for_status(outcome),
                        elapsed_s=state.elapsed(now), lost=lost)


def summary_record(final: FinalSummary) -> dict[str, Any]:
    """The last JSON line (and --summary-json): the RunSummary's fields, with the
    outcome as `status` (the run's own as `run_status`), the failure with the tail
    of its traceback, the time taken and ddtop's exit code."""
    failure: dict[str, Any] | None = None
    if final.run.failure is not None:
        failure = msgspec.to_builtins(final.run.failure)
        failure["traceback_tail"] = traceback_tail(failure.pop("traceback"),
                                                   TRACEBACK_TAIL_LINES)
    elif final.lost is not None:
        failure = {"message": final.lost}
    return {"kind": "summary", "schema": JSONL_SCHEMA, **msgspec.to_builtins(final.run),
            "status": final.outcome,
            "run_status": final.run.status, "failure": failure, "elapsed_s": final.elapsed_s,
            "exit_code": final.exit_code}


def summary_text(final: FinalSummary, now: float) -> list[str]:
    s = final.run
    lines = [f"{stamp(now)} run {s.run_id} {s.status} after {seconds(final.elapsed_s)}: "
             f"step {s.global_step}/{s.total_steps or '?'}, {s.restarts} restarts, "
             f"{lost_words(s.telemetry_loss)}"]
    if s.program:
        lines.append(f"  program: {s.program}")
    lines += [f"  scalar {c.line()}" for c in s.scalars]
    if s.metrics is not None:
        lines.append(f"  global metrics {metrics_words(s.metrics)}")
    if manyranks.many(s.ranks):  # the digest; every rank: the JSON summary, ddtrain status
        lines += manyranks.lines(manyranks.digest(s.ranks, s.stragglers))
    else:
        lines += [_rank_line(r) for r in s.ranks]
    if s.rejected:
        lines.append("  rejected by the daemon: " + ", ".join(
            f"{n} {reason}" for reason, n in sorted(s.rejected.items())))
    if s.alone:
        lines.append(f"  warning: {s.alone}")
    lines += [f"  evidence: {folder}" for folder in s.evidence]
    failure = final.failure_line()
    if failure is not None:
        lines.append(f"  failure: {failure}")
        traceback = s.failure.traceback if s.failure is not None else None
        lines += [f"    | {line}" for line in traceback_tail(traceback, TRACEBACK_TAIL_LINES)]
    return lines


def _rank_line(r: RankSummary) -> str:
    how = r.signal or (f"exit {r.exit_code}" if r.exit_code is not None else "")
    if how and r.stopped_by_daemon and r.exit_code != 0:
        how += " (stopped)"  # by the daemon, or by whoever runs the job (scancel)
    where = f" node {r.node} {r.host or '?'}" if r.node is not None else ""
    return (f"  rank {r.rank:>3}{where} {r.state:<9} step {num(r.global_step, 'd')}"
            f" loss {num(r.loss, '.4f')} {how}".rstrip())


def summary_markdown(final: FinalSummary) -> str:
    s = final.run
    icons = {"succeeded": "✅", "failed": "❌", "stopped": "⏹", LOST: "❌"}
    m = s.metrics
    rows = [
        f"### {icons[final.outcome]} ddtop: run `{s.run_id}` {s.status}", "",
        "| | |", "|---|---|",
        f"| model / dataset | {s.model} / {s.dataset} |",
        f"| ranks | {s.world_size} ({s.backend}) |",
        f"| steps | {s.global_step}/{s.total_steps or '?'} |",
        f"| time | {seconds(final.elapsed_s)} |",
        f"| restarts | {s.restarts} |",
    ]
    if m is not None:
        rows.append(f"| train loss / accuracy | {m.train_loss:.4f} / "
                    f"{100 * m.train_accuracy:.2f}% |")
    if s.program:
        program = s.program.replace("|", "\\|")  # GitHub's tables split on it
        rows.append(f"| program | `{program}` |")
    rows += [f"| scalar | {c.line()} |" for c in s.scalars]
    failure = final.failure_line()
    if failure is not None:
        cell = failure.replace("|", "\\|")  # GitHub's tables split on it
        rows.append(f"| failure | {cell} |")
    if s.rejected:
        rows.append("| rejected by the daemon | " + ", ".join(
            f"{n} {reason}" for reason, n in sorted(s.rejected.items())) + " |")
    shown = s.ranks
    if manyranks.many(s.ranks):  # many ranks: counts, and the outliers' rows only
        digest = manyranks.digest(s.ranks, s.stragglers)
        rows.append("| ranks by state | " + ", ".join(
            f"{n} {state}" for state, n in digest.counts.items()) + " |")
        shown = manyranks.outlier_ranks(digest)
    rows += ["", "| rank | state | step | loss | samples/s | exit |",
             "|---:|---|---:|---:|---:|---|"]
    for r in shown:
        rows.append(f"| {r.rank} | {r.state} | {r.global_step} | {num(r.loss, '.4f')} | "
                    f"{num(r.samples_per_s, ',.0f')} | {r.signal or num(r.exit_code, 'd')} |")
    return "\n".join(rows) + "\n\n"
