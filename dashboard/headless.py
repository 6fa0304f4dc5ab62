"""`ddtop --headless` and `ddtrain start --foreground --headless`: a run's progress
as log lines (CI), JSON lines (scripts) or a progress bar (a terminal), from the
same RunState the dashboard shows, ending with a summary and the run's exit code.

    --format text    a timestamped line per event and per --interval; on a
                     terminal, a progress bar with the events printed above it
    --format jsonl   {"kind": "event", ...} per event, {"kind": "progress", ...}
                     per interval, and last {"kind": "summary", "status": ...}

Exit codes: 0 the run succeeded, 1 it failed (or was lost: its daemon was killed),
130 it was stopped, 2 bad input or no run reachable within --wait.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import msgspec

from ddtop.daemon.contract import EXIT_INTERRUPTED, EXIT_USAGE, exit_for_status
from ddtop.daemon.state import RunState
from ddtop.daemon.summary import LOST, TRACEBACK_TAIL_LINES, Failure, ScalarSummary
from ddtop.dashboard import format as fmt
from ddtop.dashboard.feed import CONNECTING, Feed, Pacer

DEFAULT_INTERVAL_S = 10.0
PUMP_S = 0.1
SUMMARY_ENV = "GITHUB_STEP_SUMMARY"


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
    """Turns a feed's RunState into output; `tick()` often, `finish()` once."""

    def __init__(self, feed: Feed, format: str = "text", interval: float = DEFAULT_INTERVAL_S,
                 out: TextIO | None = None, summary_json: Path | None = None,
                 tty: bool | None = None) -> None:
        out = out or sys.stdout  # the one of the time of the call, not of the import
        self.feed, self.format, self.interval, self.out = feed, format, interval, out
        self.summary_json = summary_json
        self.tty = out.isatty() if tty is None else tty
        self.events_seen = 0
        self.next_progress: float | None = None
        self.progress_bar: Any = None  # rich Progress, on a terminal in text format
        self.task: Any = None

    # -- while the run goes on ------------------------------------------------------
    def tick(self) -> None:
        with self.feed.lock:
            state, now = self.feed.state, self.feed.now()
            events, self.events_seen = fmt.new_events(state, self.events_seen)
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

    def _event(self, event: dict[str, Any]) -> None:
        if self.format == "jsonl":
            self._json({"kind": "event", **event})
            return
        text = (f"{fmt.stamp(event['t'])} [{fmt.event_source(event)}] {event['type']}: "
                f"{event['message']}")
        tail = fmt.traceback_tail(event.get("traceback"), TRACEBACK_TAIL_LINES)
        self._emit("\n".join([text, *(f"    | {line}" for line in tail)]))

    def _progress(self, state: RunState, now: float) -> None:
        if self.format == "jsonl":
            self._json(progress_record(state, now))
            return
        self._emit(f"{fmt.stamp(now)} {progress_text(state, now)}")

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
                        f"{fmt.seconds(fmt.elapsed(state, now))}")

    # -- the end ---------------------------------------------------------------------
    def finish(self) -> int:
        """Print what is left and the summary; write the summary files; the exit code."""
        self.tick()
        if self.progress_bar is not None:
            self.progress_bar.stop()
            self.progress_bar = None
        with self.feed.lock:
            now = self.feed.now()
            summary = final_summary(self.feed.state, now)
        if self.format == "jsonl":
            self._json(summary)
        else:
            for line in summary_text(summary, now):
                self._emit(line)
        if self.summary_json is not None:
            _write(self.summary_json, "w", json.dumps(summary, indent=2, default=str) + "\n")
        markdown_path = os.environ.get(SUMMARY_ENV)
        if markdown_path:
            _write(Path(markdown_path), "a", summary_markdown(summary))
        return int(summary["exit_code"])


def _write(path: Path, mode: str, text: str) -> None:
    """A summary file at the end of a run: a failure to write it (checked before the
    run, gone or full since) is one line, and the run's exit code stays its outcome."""
    try:
        with path.open(mode) as f:
            f.write(text)
    except OSError as e:
        print(f"warning: the summary was not written to {path} ({e.strerror or e})",
              file=sys.stderr, flush=True)


def watch(feed: Feed, printer: Printer, wait_s: float, err: TextIO | None = None) -> int:
    """Pump the feed and print until the run ends; 2 when it cannot be reached in time."""
    err = err or sys.stderr
    deadline = time.monotonic() + wait_s
    pacer = Pacer(feed, PUMP_S)
    try:
        while not feed.finished:
            pacer.pump()
            if feed.connection == CONNECTING and time.monotonic() > deadline:
                print(f"ddtop: error: run {feed.state.run} cannot be reached within "
                      f"{wait_s:g} s ({feed.detail or 'no answer'}); is its daemon running? "
                      "(ddtrain status)", file=err)
                return EXIT_USAGE
            printer.tick()
            pacer.rest()
    except KeyboardInterrupt:
        print(f"ddtop: detached; run {feed.state.run} goes on (ddtrain stop to stop it)",
              file=err)
        return EXIT_INTERRUPTED
    return printer.finish()


# -- what is printed ---------------------------------------------------------------
def progress_text(state: RunState, now: float, short: bool = False) -> str:
    done, total = state.progress()
    pct = f" ({100 * done / total:.1f}%)" if total and not short else ""
    states = state.rank_states(now)
    counts: dict[str, int] = {}
    for s in states.values():
        counts[s] = counts.get(s, 0) + 1
    agg = state.aggregate
    parts = [f"step {done}/{total or '?'}{pct}", f"{state.throughput(now):,.0f} samples/s"]
    if agg is not None:
        parts.append(f"loss {agg.train_loss:.4f} acc {100 * agg.train_accuracy:.1f}%")
    if not short:
        parts.append(", ".join(f"{n} {s}" for s, n in counts.items()) or "no ranks yet")
        eta = fmt.eta(state, now)
        if eta is not None:
            parts.append(f"ETA {fmt.seconds(eta)}")
        _, skew, slow = state.stragglers()
        if slow:
            parts.append(f"stragglers: {', '.join(map(str, slow))} "
                         f"(+{1000 * skew:.1f} ms/step)")
        hang = state.hang(now)
        if hang:
            parts.append(f"hang: {hang}")
        if state.scalars:
            parts.append(f"scalars: {fmt.scalars_line(state)}")
    return f"{state.status}: " + "; ".join(parts)


def progress_record(state: RunState, now: float) -> dict[str, Any]:
    done, total = state.progress()
    _, skew, slow = state.stragglers()
    summary = state.summary(now)
    return {
        "kind": "progress", "t": now, "run_id": state.run, "status": state.status,
        "global_step": done, "total_steps": total, "samples_per_s": state.throughput(now),
        "eta_s": fmt.eta(state, now), "stragglers": slow, "skew_s": skew,
        "hang": state.hang(now), "telemetry_loss": state.telemetry_loss(),
        "ranks": [{"rank": r.rank, "state": r.state, "epoch": r.epoch, "step": r.step,
                   "global_step": r.global_step, "loss": r.loss,
                   "samples_per_s": r.samples_per_s, "comm_share": r.comm_share}
                  for r in summary.ranks],
        "scalars": msgspec.to_builtins(summary.scalars),  # as in the summary
    }


def final_summary(state: RunState, now: float) -> dict[str, Any]:
    """The last JSON line: how the run ended, per rank, and why when it failed."""
    summary = state.summary(now)
    status = summary.status
    # A run whose daemon was killed is `lost`, as `ddtrain status` and the dashboard
    # say (its ranks too); a feed that ended before the run did otherwise, failed.
    reported = status if status in ("succeeded", "stopped", LOST) else "failed"
    failure: dict[str, Any] | None = None
    if summary.failure is not None:
        failure = msgspec.to_builtins(summary.failure)
        failure["traceback_tail"] = fmt.traceback_tail(failure.pop("traceback"),
                                                       TRACEBACK_TAIL_LINES)
    elif status == LOST:
        failure = {"message": state.status_message or "the daemon was killed"}
    # `exit_code` here is ddtop's own: the outcome's, as documented for --headless.
    return {"kind": "summary", **msgspec.to_builtins(summary), "status": reported,
            "run_status": status, "failure": failure, "elapsed_s": fmt.elapsed(state, now),
            "exit_code": exit_for_status(reported)}


def summary_text(summary: dict[str, Any], now: float) -> list[str]:
    done, total = summary["global_step"], summary["total_steps"]
    lines = [f"{fmt.stamp(now)} run {summary['run_id']} {summary['run_status']} "
             f"after {fmt.seconds(summary['elapsed_s'])}: step {done}/{total}, "
             f"{summary['restarts']} restarts, telemetry loss "
             f"{100 * summary['telemetry_loss']:.2f}%"]
    if summary.get("program"):
        lines.append(f"  program: {summary['program']}")
    lines += [f"  scalar {msgspec.convert(c, ScalarSummary).line()}"
              for c in summary.get("scalars", [])]
    m = summary.get("metrics")
    if m:
        val = (f", val loss {m['val_loss']:.4f} acc {100 * m['val_accuracy']:.2f}%"
               if m.get("val_loss") is not None else "")
        lines.append(f"  global metrics (epoch {m['epoch'] + 1}, step {m['global_step']}): "
                     f"train loss {m['train_loss']:.4f} acc {100 * m['train_accuracy']:.2f}%{val}")
    for r in summary["ranks"]:
        how = r.get("signal") or (f"exit {r['exit_code']}" if r.get("exit_code") is not None
                                  else "")
        if how and r.get("stopped_by_daemon") and r.get("exit_code") != 0:
            how += " (stopped by the daemon)"
        node = r.get("node")
        where = f" node {node} {r.get('host') or '?'}" if node is not None else ""
        lines.append(f"  rank {r['rank']:>3}{where} {r['state']:<9} step "
                     f"{fmt.num(r['global_step'], 'd')}"
                     f" loss {fmt.num(r['loss'], '.4f')} {how}".rstrip())
    rejected = summary.get("rejected") or {}
    if rejected:
        lines.append("  rejected by the daemon: " + ", ".join(
            f"{n} {reason}" for reason, n in sorted(rejected.items())))
    failure = summary.get("failure")
    if failure:
        lines.append(f"  failure: {failure_line(failure)}")
        lines += [f"    | {line}" for line in failure.get("traceback_tail", [])]
    return lines


def failure_line(failure: dict[str, Any]) -> str:
    """The summary's failure in the words `ddtrain status` uses: a rank's
    (Failure.line), or the message alone when no rank is to blame (a lost run)."""
    if failure.get("rank") is None:
        return str(failure.get("message") or "the run did not finish")
    fields = {k: v for k, v in failure.items() if k != "traceback_tail"}
    return msgspec.convert(fields, Failure).line()


def summary_markdown(summary: dict[str, Any]) -> str:
    icons = {"succeeded": "✅", "failed": "❌", "stopped": "⏹", LOST: "❌"}
    icon = icons.get(summary["status"], "")
    m = summary.get("metrics") or {}
    rows = [
        f"### {icon} ddtop: run `{summary['run_id']}` {summary['run_status']}", "",
        "| | |", "|---|---|",
        f"| model / dataset | {summary.get('model')} / {summary.get('dataset')} |",
        f"| ranks | {summary.get('world_size')} ({summary.get('backend')}) |",
        f"| steps | {summary['global_step']}/{summary['total_steps']} |",
        f"| time | {fmt.seconds(summary['elapsed_s'])} |",
        f"| restarts | {summary['restarts']} |",
    ]
    if m:
        rows.append(f"| train loss / accuracy | {m['train_loss']:.4f} / "
                    f"{100 * m['train_accuracy']:.2f}% |")
    if summary.get("program"):
        program = summary["program"].replace("|", "\\|")  # GitHub's tables split on it
        rows.append(f"| program | `{program}` |")
    rows += [f"| scalar | {msgspec.convert(c, ScalarSummary).line()} |"
             for c in summary.get("scalars", [])]
    failure = summary.get("failure")
    if failure:
        cell = failure_line(failure).replace("|", "\\|")  # GitHub's tables split on it
        rows.append(f"| failure | {cell} |")
    rejected = summary.get("rejected") or {}
    if rejected:
        rows.append("| rejected by the daemon | " + ", ".join(
            f"{n} {reason}" for reason, n in sorted(rejected.items())) + " |")
    rows += ["", "| rank | state | step | loss | samples/s | exit |",
             "|---:|---|---:|---:|---:|---|"]
    for r in summary["ranks"]:
        rows.append(f"| {r['rank']} | {r['state']} | {r['global_step']} | "
                    f"{fmt.num(r['loss'], '.4f')} | {fmt.num(r['samples_per_s'], ',.0f')} | "
                    f"{r.get('signal') or fmt.num(r.get('exit_code'), 'd')} |")
    return "\n".join(rows) + "\n\n"
