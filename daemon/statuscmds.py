"""`ddtrain status`, `list`, `stop` and `logs`: the commands that look at, or act
on, a run that already exists. Each reads the run's RunSummary (core/summary.py)
through RunInfo, never run.json's fields by hand."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from ddtop.core import control, manyranks, protocol
from ddtop.core.contract import EXIT_FAILED, EXIT_OK, UsageError
from ddtop.core.flagspec import default_runs_dir
from ddtop.core.processes import LogTail, ProcessId, same_process, send_signal
from ddtop.core.rundir import RunPaths, locate_run, run_held
from ddtop.core.runinfo import RunInfo, list_runs
from ddtop.core.summary import (
    LOST,
    TRACEBACK_TAIL_LINES,
    RunRecord,
    metrics_words,
    rate_words,
)
from ddtop.core.text import count_of, size
from ddtop.daemon.leftovers import end
from ddtop.daemon.watchguard import describe, started_by

FOLLOW_POLL_S = 0.2
# `ddtrain stop` waits this long past --timeout before it kills the daemon itself
# (the daemon escalates by itself after the timeout; this is only a backstop).
STOP_BACKSTOP_S = 15.0
# The longest `ddtrain stop --timeout`: a day.
MAX_STOP_TIMEOUT_S = 86_400.0


def run_of(args: argparse.Namespace) -> RunPaths:
    try:
        return locate_run(args.runs_dir or default_runs_dir(), args.run)
    except OSError as e:  # a RUN or --runs-dir the file system refuses (too long, ...)
        raise UsageError(f"cannot look for runs there: {e.strerror or e}; "
                         "give a run id or a run directory") from None


def _fmt(value: Any, spec: str = "", none: str = "-") -> str:
    return none if value is None else format(value, spec)


# -- status -------------------------------------------------------------------------
def cmd_status(args: argparse.Namespace) -> int:
    info = RunInfo.load(run_of(args))
    if info.problem:
        print(f"ddtrain: warning: {info.problem}; showing what the journal says", file=sys.stderr)
    summary = info.summary()
    if info.answered is False:
        written = info.record_written
        age = f", written {time.time() - written:.0f} s ago" if written is not None else ""
        print(f"ddtrain: warning: the daemon (pid {info.daemon_pid}) does not answer "
              f"({info.no_answer}); what follows is its last record ({info.paths.status}"
              f"{age}), not the run as it stands", file=sys.stderr)
    if args.json:
        doc = msgspec.to_builtins(summary)
        doc.update({"status": info.status, "dir": str(info.paths.root),
                    "daemon_alive": info.live, "daemon_answered": info.answered,
                    "record_written": info.record_written})
        print(msgspec.json.format(msgspec.json.encode(doc), indent=2).decode())
        return EXIT_OK
    for line in status_lines(info, summary, every_rank=args.ranks):
        print(line)
    return EXIT_OK


def status_lines(info: RunInfo, s: RunRecord, every_rank: bool = False) -> list[str]:
    """The run in lines: a line per rank, or above manyranks.MANY_RANKS ranks (but
    with `every_rank`) their digest: counts by state, steps, the outliers named."""
    digest = (manyranks.digest(s.ranks, s.stragglers)
              if manyranks.many(s.ranks) and not every_rank else None)
    daemon = (f"daemon pid {info.daemon_pid}, not answering" if info.answered is False
              else f"daemon pid {info.daemon_pid}" if info.live
              else f"daemon gone; pid {info.daemon_pid} is another process now"
              if info.status == LOST and info.pid_reused
              else "daemon gone" if info.status == LOST else "finished")
    lines = [f"run {info.paths.run_id}: {info.status} ({daemon}; "
             f"{count_of(s.world_size or len(s.ranks), 'rank')}; {s.restarts} restarts)"]
    if s.model or s.program:
        pct = f" ({100 * s.global_step / s.total_steps:.1f}%)" if s.total_steps else ""
        what = s.program or f"{s.model} on {s.dataset}"
        lines.append(f"  {what}, {s.backend}; step {s.global_step}/"
                     f"{s.total_steps or '?'}{pct}; {rate_words(s.samples_per_s, info.status)}")
    if info.live and info.metrics:
        lines.append(f"  metrics {info.metrics}")
    lines += [f"  scalar {c.line()}" for c in s.scalars]
    if s.metrics is not None:
        lines.append(f"  global {metrics_words(s.metrics)}")
    if s.hang:
        lines.append(f"  hang: {s.hang}")
    if s.alone:
        lines.append(f"  warning: {s.alone}")
    if s.rejected:
        lines.append("  rejected by the daemon: " + ", ".join(
            f"{n} {reason}" for reason, n in sorted(s.rejected.items())))
    if s.journal_dropped:
        lines.append(f"  journal: {count_of(s.journal_dropped, 'record')} not written (the disk "
                     "refused them); a replay misses them")
    if s.stragglers and digest is None:
        lines.append(f"  stragglers: {', '.join(map(str, s.stragglers))} "
                     f"(skew {1000 * s.skew_s:.1f} ms per step)")
    for rank, cause in sorted(s.straggler_causes.items()):  # (shown, never trusted)
        lines.append(f"  rank {rank} straggles: {cause}")
    for rank, creep in sorted(s.memory_creeping.items()):
        lines.append(f"  rank {rank} {creep}")
    if digest is not None:
        lines += manyranks.lines(digest)
        lines.append(f"  (every rank: ddtrain status {info.paths.run_id} --ranks)")
    else:
        lines += _rank_table(s)
    f = s.failure
    if f is not None and info.status in ("failed", LOST):
        lines.append(f"failure: {f.line()}")
        lines += [f"  | {line}" for line in (f.traceback or "").rstrip().splitlines()
                  [-TRACEBACK_TAIL_LINES:]]
    for e in s.timeline:
        lines.append(f"restart {e.restart}: rank {e.rank} {e.reason} at step {e.global_step}; "
                     f"from {e.checkpoint or 'the start'}")
    return lines


def _rank_table(s: RunRecord) -> list[str]:
    """A line per rank, under a header."""
    lines: list[str] = []
    nodes = any(r.node is not None for r in s.ranks)  # a multi-node job: NODE and HOST
    where = f"{'NODE':>4}  {'HOST':<16}  " if nodes else ""
    w = 11 if nodes else 9  # a node's ranks may be "unreachable"
    lines.append(f"{'RANK':>4}  {where}{'PID':>7}  {'STATE':<{w}} {'EPOCH':>5}  {'STEP':>7}  "
                 f"{'LOSS':>8}  {'SAMPLES/S':>9}  {'MEMORY (PEAK)':>17}  EXIT")
    for r in s.ranks:
        memory = "-" if r.memory is None else size(r.memory) + (
            f" ({size(r.memory_peak)})" if r.memory_peak is not None else "")
        exit_ = r.signal or _fmt(r.exit_code)
        if r.stopped_by_daemon and exit_ not in ("-", "0"):
            exit_ += " (stopped)"
        where = f"{_fmt(r.node):>4}  {r.host[:16]:<16}  " if nodes else ""
        lines.append(f"{r.rank:>4}  {where}{_fmt(r.pid):>7}  {r.state:<{w}} {_fmt(r.epoch):>5}  "
                     f"{r.global_step:>7}  {_fmt(r.loss, '.4f'):>8}  "
                     f"{_fmt(r.samples_per_s, ',.0f'):>9}  {memory:>17}  {exit_}")
    return lines


# -- list ---------------------------------------------------------------------------
def cmd_list(args: argparse.Namespace) -> int:
    runs_dir = Path(args.runs_dir or default_runs_dir())
    rows: list[dict[str, Any]] = []
    try:
        if not runs_dir.is_dir():  # as `ddtrain status` says it: no run to list
            raise UsageError(f"no runs under {runs_dir}/: " + (
                "it is not a folder; pass the folder of run directories as --runs-dir"
                if runs_dir.exists() else "start one first, or pass --runs-dir"))
        runs = list_runs(runs_dir)
    except OSError as e:  # a --runs-dir the file system refuses (too long, ...)
        raise UsageError(f"cannot list {runs_dir}/: {e.strerror or e}; "
                         "pass another --runs-dir") from None
    for info in runs:
        started, ended = info.record.started, info.record.ended
        end = ended or (time.time() if info.live else None)
        config = info.config
        rows.append({
            "run_id": info.paths.run_id, "status": info.status, "world_size": info.world_size,
            "model": config.model if config else None,
            "dataset": config.dataset if config else None, "started": started,
            "seconds": None if not started or not end else end - started,
            "restarts": info.record.restarts, "daemon_pid": info.daemon_pid,
            "dir": str(info.paths.root),
        })
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(rows), indent=2).decode())
        return EXIT_OK
    if not rows:
        print(f"no runs under {runs_dir}/ (start one with: ddtrain start)")
        return EXIT_OK
    print(f"{'RUN':<26} {'STATUS':<10} {'RANKS':>5}  {'MODEL':<8} {'DATASET':<13} "
          f"{'STARTED':<19} {'TIME':>8}")
    for r in rows:
        when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["started"]))
                if r["started"] else "-")
        seconds = f"{r['seconds']:.0f} s" if r["seconds"] is not None else "-"
        print(f"{r['run_id']:<26} {r['status']:<10} {_fmt(r['world_size'] or None):>5}  "
              f"{_fmt(r['model']):<8} {_fmt(r['dataset']):<13} {when:<19} {seconds:>8}")
    return EXIT_OK


# -- stop ---------------------------------------------------------------------------
def cmd_stop(args: argparse.Namespace) -> int:
    if not 0 <= args.timeout <= MAX_STOP_TIMEOUT_S:  # NaN too: it would never escalate
        raise UsageError(f"--timeout must be a number of seconds from 0 to "
                         f"{MAX_STOP_TIMEOUT_S:g} (got {args.timeout:g})")
    info = RunInfo.load(run_of(args))
    rid, pid, daemon = info.paths.run_id, info.daemon_pid, info.daemon
    if info.problem:
        print(f"ddtrain: warning: {info.problem}; its daemon, if any, cannot be found from it",
              file=sys.stderr)
    unverifiable = info.unverifiable
    if not info.live:
        # Nothing is signalled: a pid that names another process now is left alone.
        reused = (f"; pid {pid} is another process now, left alone" if info.status == LOST
                  and info.pid_reused and not unverifiable else "")
        said = f"; {unverifiable}" if info.status == LOST and unverifiable else ""
        print(f"ddtrain: run {rid} is not running ({info.status}{reused}){said}", flush=True)
        if info.status == LOST and daemon is not None and daemon.start is not None:
            _end_what_it_started(rid, daemon, args.timeout)
        elif (daemon is not None and info.daemon_here and not unverifiable
              and not run_held(info.paths)):
            # Ended, its daemon still serving the final state for scrapes: ended now.
            send_signal(daemon, signal.SIGTERM)
            print(f"ddtrain: run {rid}: its daemon (pid {pid}), which kept serving its "
                  "final metrics (--metrics-linger), is ended", flush=True)
        return EXIT_OK
    assert pid is not None
    try:
        if info.control is None:
            raise control.Unreachable("no control endpoint in run.json")
        reply = control.request(info.control, protocol.Stop(timeout=args.timeout),
                                control.STOP_REQUEST_TIMEOUT_S, keys=info.keys)
        if not reply.ok:
            raise control.Unreachable(reply.error)
        what = ("its ranks get SIGTERM" if info.config and info.config.runs_user_code
                else "ranks finish their step and rank 0 checkpoints")
        print(f"ddtrain: stopping run {rid}: {what} (up to {args.timeout:g} s)...", flush=True)
    except control.Unreachable as e:
        if unverifiable:  # a daemon's command line, but which process is it?
            print(f"ddtrain: run {rid}: the daemon (pid {pid}) does not answer ({e}); "
                  f"{unverifiable} (stop it yourself if it is the run's daemon)", flush=True)
            return EXIT_FAILED
        print(f"ddtrain: the daemon (pid {pid}) does not answer ({e}); terminating it, "
              "which stops its ranks at once", flush=True)
        # Only the daemon itself: send_signal checks that the pid still names it.
        send_signal(daemon, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout + STOP_BACKSTOP_S
    # Until the run has ended and its daemon let go of it (a resume may start then):
    # the daemon may serve the final metrics a while longer (--metrics-linger).
    while same_process(daemon) and (RunInfo.load(info.paths).live or run_held(info.paths)):
        if time.monotonic() > deadline:
            print(f"ddtrain: the daemon (pid {pid}) is still there; killing it", flush=True)
            send_signal(daemon, signal.SIGKILL)
            break
        time.sleep(0.1)
    final = RunInfo.load(info.paths)
    hint = (f"; resume with: ddtrain start --resume --run-id {rid}"
            if info.paths.checkpoint_files() and final.status != "succeeded" else "")
    print(f"ddtrain: run {rid} {final.status}{hint}")
    return EXIT_OK


def _end_what_it_started(rid: str, daemon: ProcessId, timeout: float) -> None:
    """A lost run's processes (a watched command and its ranks, whose guard did
    not end them: killed with it), found by the environment the daemon gave them
    (daemon/watchguard.py), never by a recorded pid alone: SIGTERM, then SIGKILL
    after `timeout`."""
    found = started_by(daemon.pid, rid, daemon)
    if not found:
        return
    print(f"ddtrain: its daemon (pid {daemon.pid}) is gone, but what it started is not: "
          f"stopping {describe(found)} (up to {timeout:g} s)...", flush=True)
    ended, killed = end(lambda: started_by(daemon.pid, rid, daemon), timeout)
    hard = f", {len(killed)} with SIGKILL" if killed else ""
    noun = "process" if len(ended) == 1 else "processes"
    print(f"ddtrain: run {rid}: ended {len(ended)} {noun}{hard}", flush=True)


# -- logs ---------------------------------------------------------------------------
def cmd_logs(args: argparse.Namespace) -> int:
    paths = run_of(args)
    info = RunInfo.load(paths)
    if paths.logs.exists() and not paths.logs.is_dir():
        raise UsageError(f"{paths.logs} is not a folder: a run's logs/ holds its rank "
                         "logs (move what is there aside)")
    world = info.world_size or len(list(paths.logs.glob("rank-*.log")))
    host = f" {info.record.host}" if info.record.host else ""  # unknown: run.json unreadable
    command = paths.logs / "command.log"  # `ddtrain watch`: the ranks' output is the command's
    if command.exists():
        if args.rank is not None:
            raise UsageError(f"run {paths.run_id} was watched: its ranks' output is its "
                             f"command's, in one log: ddtrain logs {paths.run_id} (no --rank)")
        tails = {f"command{host}": LogTail(command)}
    else:
        if args.rank is not None and not 0 <= args.rank < world:
            raise UsageError(f"--rank {args.rank} is not a rank of run {paths.run_id} "
                             f"(ranks 0..{world - 1})")
        ranks = [args.rank] if args.rank is not None else list(range(world))
        tails = {f"rank {k}{host}": LogTail(paths.rank_log(k)) for k in ranks}

    def pump(final: bool) -> None:
        for name, tail in tails.items():
            try:
                for line in tail.lines(final):
                    sys.stdout.write(f"[{name}] {line}\n")
            except OSError as e:  # a log that is a folder, or unreadable
                raise UsageError(f"cannot read {tail.path}: {e.strerror or e}") from None
        sys.stdout.flush()

    try:
        if not args.follow:
            pump(final=True)
            return EXIT_OK
        while True:
            alive = RunInfo.load(paths).live
            pump(final=not alive)
            if not alive:
                return EXIT_OK
            time.sleep(FOLLOW_POLL_S)
    finally:
        sys.stdout.flush()
