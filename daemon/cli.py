"""`ddtrain`: start, watch and stop distributed training runs.

    ddtrain start --world-size 8          a detached daemon runs the job; returns at once
    ddtrain start --foreground -n 2       the same daemon, in this terminal
    ddtrain watch -- torchrun ...         watch ranks any launcher starts
    ddtrain status [RUN] [--json]         ranks, progress, exit codes
    ddtrain list                          every run under ./runs
    ddtrain logs [RUN] [--rank K] [-f]    the ranks' output
    ddtrain stop [RUN] [--timeout S]      finish the step, checkpoint, exit

RUN is a run id (a unique prefix is enough) or a run directory; without it,
the newest run under --runs-dir ($DDTOP_RUNS_DIR, else ./runs).

Exit codes: 0 the run succeeded, 1 a rank failed (named in the last lines),
2 bad input, 130 stopped (Ctrl-C or `ddtrain stop`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ddtop.core import control, inject, protocol
from ddtop.core.config import (
    TrainConfig,
    resume_mismatch,
)
from ddtop.core.contract import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    FAULT_ENV,
    FR_ENTRIES,
    FR_ENV,
    MAX_FR_ENTRIES,
    UsageError,
    owner_only_umask,
)
from ddtop.core.flags import OneLineParser
from ddtop.core.flagspec import add_runs_dir_argument
from ddtop.core.manyranks import MANY_RANKS
from ddtop.core.rundir import (
    RunPaths,
    find_run,
    new_run,
    read_json,
    remove_unstarted,
    write_json_atomic,
)
from ddtop.core.runinfo import RunInfo
from ddtop.core.text import count_of
from ddtop.daemon import profilecmd
from ddtop.daemon.stacks import cmd_evidence, cmd_stacks
from ddtop.daemon.startline import (
    add_start_command,
    parse_command_line,
    said_from_environment,
    start_overrides,
)
from ddtop.daemon.statuscmds import cmd_list, cmd_logs, cmd_status, cmd_stop
from ddtop.daemon.watchcmd import add_watch_command, cmd_watch

EXIT_CODES = ("Exit codes: 0 succeeded, 1 a rank failed, 2 bad input, "
              "130 stopped (Ctrl-C or ddtrain stop).")
WATCH_EXIT_CODES = ("Exit codes: the command's (128+N when a signal N ended it); without a "
                    "command 0 when every rank ended well, 1 otherwise; 2 bad input.")
# A detached start waits this long for every rank to say hello (or the run to fail).
START_WATCH_S = 20.0
DAEMON_READY_S = 30.0


def _version() -> str:
    try:
        return version("ddtop")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="ddtrain",
        description="Start, watch and stop distributed PyTorch training runs.",
        epilog=EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"ddtrain {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_start_command(commands, EXIT_CODES)
    add_watch_command(commands, WATCH_EXIT_CODES)

    def with_run(p: argparse.ArgumentParser) -> None:
        p.add_argument("run", nargs="?", metavar="RUN",
                       help="run id, unique prefix, or run directory (default: the newest run)")
        add_runs_dir_argument(p)

    status = commands.add_parser("status", help="a run's state, rank by rank",
                                 description="Show a run's status, progress and every rank's "
                                 "pid, state and exit code or signal.")
    with_run(status)
    status.add_argument("--json", action="store_true", help="one JSON object, for scripts "
                        "(every rank, at any size)")
    status.add_argument("--ranks", action="store_true",
                        help=f"a line per rank at any size (above {MANY_RANKS} ranks the text "
                        "says counts by state and names the outliers only)")
    listing = commands.add_parser("list", help="every run under the runs directory",
                                  description="List the runs under the runs directory, live "
                                  "or not, oldest first.")
    add_runs_dir_argument(listing)
    listing.add_argument("--json", action="store_true", help="one JSON array, for scripts")
    stop = commands.add_parser(
        "stop", help="stop a run gracefully",
        description="Stop a run: every rank finishes its current step, rank 0 writes a "
        "checkpoint, the ranks exit (resume later with ddtrain start --resume). Ranks still "
        "running after --timeout seconds are terminated.")
    with_run(stop)
    stop.add_argument("--timeout", type=float, default=30.0, metavar="S",
                      help="seconds to wait for a graceful stop before terminating (default 30)")
    logs = commands.add_parser("logs", help="the ranks' output",
                               description="Print the ranks' stdout and stderr, each line "
                               "prefixed with its rank and host.")
    with_run(logs)
    logs.add_argument("--rank", type=int, default=None, metavar="K", help="only rank K")
    logs.add_argument("-f", "--follow", action="store_true",
                      help="keep printing new lines until the run ends")
    stacks = commands.add_parser(
        "stacks", help="every rank's Python stacks, now",
        description="Print every thread's Python stack of each rank (or of rank K), also of "
        "a rank blocked inside a collective; each dump is kept in the run directory as "
        "logs/rank-K.stacks.")
    with_run(stacks)
    stacks.add_argument("--rank", type=int, default=None, metavar="K", help="only rank K")
    evidence = commands.add_parser(
        "evidence", help="gather the evidence of a run now: every rank's stacks and state",
        description="Ask the run's daemon to gather the evidence now, as it does when a "
        "desync is named or --hang-timeout fails a hang: every rank's Python and native "
        "stacks and its state (collectives with their signatures, memory), in "
        "runs/<id>/evidence/<time>/; print what it wrote.")
    with_run(evidence)
    profile = commands.add_parser(
        "profile", help="torch.profiler on chosen ranks, the same steps: top operators side "
        "by side",
        description="Profile ranks of a live run with torch.profiler for the same N "
        "optimizer steps, a few steps from now: one trace per rank (Chrome / Perfetto JSON, "
        "gzipped) in runs/<id>/profiles/<time>/, then each rank's top operators by self "
        "time per step side by side, and the straggler against the median of the others. "
        "Zero-code: no line of the script changes.")
    with_run(profile)
    profilecmd.add_arguments(profile)
    serve = commands.add_parser("serve")  # the detached daemon; not for people
    serve.add_argument("run_dir")
    return parser


# -- start --------------------------------------------------------------------------
def resolve_start(args: argparse.Namespace) -> tuple[TrainConfig, RunPaths]:
    """The run's config and directory: a new run, or the run being resumed."""
    overrides = start_overrides(args)
    runs_dir = overrides["runs_dir"]
    if not overrides.get("resume"):
        config = TrainConfig(**overrides).validate()
        paths = new_run(runs_dir, config.run_id, config.node_rank)
        return TrainConfig(**{**config.to_dict(), "run_id": paths.run_id}), paths
    paths = find_run(runs_dir, overrides.get("run_id"))
    info = RunInfo.load(paths)
    if info.live:
        raise UsageError(f"run {paths.run_id} is still running (daemon pid {info.daemon_pid}): "
                         f"stop it first with: ddtrain stop {paths.run_id}")
    try:
        saved = read_json(paths.config)
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
        merged = {**saved, **overrides, "runs_dir": runs_dir, "run_id": paths.run_id,
                  "resume": True}
        config = TrainConfig.from_dict(merged)
    except (OSError, ValueError, UsageError) as e:
        raise UsageError(f"cannot read {paths.config} ({e}): the run cannot be resumed; "
                         "start a new run") from None
    config = config.validate()
    diffs = resume_mismatch(saved, config)
    if diffs:
        raise UsageError(f"run {paths.run_id} cannot be resumed with different settings "
                         f"({'; '.join(diffs)}): drop those flags, or start a new run")
    if not config.runs_user_code and not paths.checkpoint_files():
        raise UsageError(f"run {paths.run_id} has no checkpoint to resume from: "
                         "start a new run without --resume")
    return config, paths


def of(config: TrainConfig) -> str:
    """' of train.py --lr 3e-4' for a user's program, '' for the built-in trainer."""
    return f" of {config.program_label}" if config.runs_user_code else ""


def cmd_start(args: argparse.Namespace) -> int:
    check_torch()
    owner_only_umask()  # the run directory and all in it: the owner's alone
    try:
        config, paths = resolve_start(args)
    except UsageError as e:  # a value from torchrun's environment is said to be one
        raise said_from_environment(e, args) from None
    try:
        return _start(args, config, paths)
    except UsageError:
        if not config.resume:  # a new run's folder claimed for nothing: given back
            with contextlib.suppress(OSError):
                paths.root.rmdir()  # only if still empty
        raise


def check_torch() -> None:
    """Ranks import torch; ddtrain itself never does. Where it is not installed
    (ddtop installed without its `train` extra, to watch), say so before anything
    starts, not as every rank's traceback."""
    if importlib.util.find_spec("torch") is None:
        raise UsageError("ddtrain start runs ranks, which need torch, not installed here: "
                         "pip install 'ddtop[train]' (ddtop alone only watches)")


def arm_drills(specs: list[str], world_size: int, epochs: int | None = None,
               launcher: str = "local", strategy: str | None = None) -> None:
    """--inject: the specs checked (bad input raises UsageError), and handed to the
    daemon and every rank in DDTOP_FAULT, its transport and nothing else: this
    process's environment is what the daemon (this process, or the detached one)
    and every rank it starts inherit, with any launcher, so a DDTOP_FAULT the user
    had set is replaced, or removed without --inject (and said to be ignored).
    `epochs`: the built-in trainer's (a user's script's epochs are its own business).
    `launcher`: take-port drills the port the daemon picks, which torchrun picks itself.
    `strategy`: the built-in trainer's (None: a user's script), for skip."""
    inherited = os.environ.pop(FAULT_ENV, None)
    if not specs:
        if inherited:
            print(f"ddtrain: note: {FAULT_ENV} in the environment is ignored: drills are "
                  f"given with {inject.FLAG} SPEC (docs/cli.md#failure-drills)",
                  file=sys.stderr, flush=True)
        return
    drills = inject.parse_all(specs)
    inject.check_ranks(drills, world_size)
    if epochs is not None:
        inject.check_epochs(drills, epochs)
    inject.check_ddp(drills, strategy)
    if launcher == "torchrun" and any(d.action in inject.AT_START for d in drills):
        raise UsageError(f"{inject.FLAG} 0:take-port drills the rendezvous port the daemon "
                         "picks; under --launcher torchrun, torchrun picks it: leave it out")
    os.environ[FAULT_ENV] = inject.encode(drills)


def arm_flight_recorder(entries: int | None) -> None:
    """--flight-recorder: the entries of torch's Flight Recorder every rank keeps,
    handed to the daemon and the ranks in the environment torch reads them from
    (FR_ENV); without it, one inherited stays (checked: bad input raises
    UsageError), else FR_ENTRIES."""
    if entries is None:
        inherited = os.environ.get(FR_ENV)
        if inherited is None:
            entries = FR_ENTRIES
        elif not (inherited.strip().isascii() and inherited.strip().isdigit()
                  and int(inherited) <= MAX_FR_ENTRIES):
            raise UsageError(f"{FR_ENV}={inherited!r} in the environment is not 0 to "
                             f"{MAX_FR_ENTRIES:,} entries: unset it, or give "
                             "--flight-recorder N (0: off)")
        else:
            return
    os.environ[FR_ENV] = str(entries)


def _start(args: argparse.Namespace, config: TrainConfig, paths: RunPaths) -> int:
    verb = "resuming" if config.resume else "starting"
    builtin = not config.runs_user_code
    arm_drills(args.inject, config.world_size, config.epochs if builtin else None,
               config.launcher, config.strategy if builtin else None)
    arm_flight_recorder(config.flight_recorder)
    if args.headless and not args.foreground:
        raise UsageError("--headless prints a run in this terminal: add --foreground (a "
                         "detached run is watched with: ddtop --headless)")
    if args.foreground:
        from ddtop.daemon.foreground import supervise

        what = f"{verb} run {paths.run_id} with {count_of(config.world_size, 'rank')}{of(config)}"
        banner = (f"ddtrain: {what} in {paths.root} (Ctrl-C stops it; rank output in "
                  f"{paths.logs})" if args.headless
                  else f"ddtrain: {what} in {paths.root} (Ctrl-C stops it)")
        return supervise(args, config, paths, banner)[0]
    return start_detached(config, paths)


def start_detached(config: TrainConfig, paths: RunPaths) -> int:
    try:
        paths.create()
        write_json_atomic(paths.config, config.to_dict())
        log = paths.daemon_log.open("ab")
    except OSError as e:
        raise UsageError(f"cannot write the run directory {paths.root}: {e.strerror}; "
                         "pick another --runs-dir") from None
    with log:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "ddtop.daemon", "serve", str(paths.root)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True,  # its own session and process group: no terminal signals
        )
    deadline = time.monotonic() + DAEMON_READY_S
    while RunInfo.load(paths).record.daemon_pid != daemon.pid:
        if daemon.poll() is not None or time.monotonic() > deadline:
            return _start_failed(daemon, paths)
        time.sleep(0.05)
    # Node K > 0 of a multi-node job waits for its own ranks; the hub for every node's.
    expected = config.world_size if config.is_hub else config.nproc_per_node
    info = RunInfo.load(paths)
    up = _wait_for_ranks(daemon, info, expected)
    if daemon.poll() is not None and daemon.returncode != 0:
        return _start_failed(daemon, paths)
    rid = paths.run_id
    state = ("all ranks up" if up else
             "ranks still starting" if daemon.poll() is None else "already finished")
    node = (f"node {config.node_rank} of {config.nnodes}, " if config.multi_node else "")
    print(f"ddtrain: started run {rid}: {node}{count_of(expected, 'rank')} ({state}), "
          f"daemon pid {daemon.pid}\n"
          f"  directory  {paths.root}\n"
          f"  watch      ddtop {rid}\n"
          f"  status     ddtrain status {rid}   |   ddtrain logs -f {rid}\n"
          f"  stop       ddtrain stop {rid}", flush=True)
    if info.metrics:
        print(f"  metrics    {info.metrics}", flush=True)
    return EXIT_OK


def _wait_for_ranks(daemon: subprocess.Popen[bytes], info: RunInfo, expected: int) -> bool:
    """Until `expected` ranks have said hello (True), the daemon exits, or START_WATCH_S."""
    deadline = time.monotonic() + START_WATCH_S
    while time.monotonic() < deadline and daemon.poll() is None and info.control:
        try:
            summary = control.request(info.control, protocol.Status(), 1.0,
                                      keys=info.keys).summary
        except control.Unreachable:
            summary = None
        if summary is None:
            time.sleep(0.1)
            continue
        if sum(r.state != "starting" for r in summary.ranks) >= expected:
            return True
        time.sleep(0.1)
    return False


def _start_failed(daemon: subprocess.Popen[bytes], paths: RunPaths) -> int:
    if daemon.poll() is None:
        daemon.kill()
        daemon.wait()
        print(f"ddtrain: error: the daemon did not come up within {DAEMON_READY_S:g} s; "
              f"see {paths.daemon_log}", file=sys.stderr)
        return EXIT_FAILED
    lines = paths.daemon_log.read_text(errors="replace").strip().splitlines()
    errors = [line for line in lines if line.startswith("ddtrain: error:")]
    if errors:
        print(errors[-1], file=sys.stderr)
        if daemon.returncode == EXIT_USAGE:
            remove_unstarted(paths)  # refused before it began: no run to keep
    else:
        print("\n".join(lines[-12:]), file=sys.stderr)
        print(f"ddtrain: run {paths.run_id} failed while starting; its daemon's output is in "
              f"{paths.daemon_log}", file=sys.stderr)
    return daemon.returncode if daemon.returncode in (EXIT_USAGE, EXIT_FAILED) else EXIT_FAILED


def cmd_serve(args: argparse.Namespace) -> int:
    """The detached daemon: the same Supervisor as --foreground, output to daemon.log."""
    from ddtop.core.rundir import log_stream
    from ddtop.daemon.supervisor import Supervisor

    owner_only_umask()  # inherited from ddtrain start; said again for a daemon started by hand
    # Its output is daemon.log: on a disk that fills up, lines are lost, not the daemon.
    sys.stdout, sys.stderr = log_stream(1), log_stream(2)
    paths = RunPaths(Path(args.run_dir))
    config = TrainConfig.from_dict(read_json(paths.config)).validate()
    print(f"ddtrain: daemon pid {os.getpid()} for run {paths.run_id} "
          f"({count_of(config.world_size, 'rank')})", flush=True)
    supervisor = Supervisor(config, paths, out=sys.stdout, err=sys.stderr, echo=False)
    code = supervisor.run()
    supervisor.linger()  # --metrics: the final state, for the last scrapes
    return code


# -- main -------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    commands = {"start": cmd_start, "serve": cmd_serve, "status": cmd_status,
                "list": cmd_list, "stop": cmd_stop, "logs": cmd_logs,
                "stacks": cmd_stacks, "evidence": cmd_evidence, "watch": cmd_watch,
                "profile": profilecmd.cmd_profile}
    try:
        args = parse_command_line(parser, sys.argv[1:] if argv is None else argv, os.environ)
        return commands[args.command](args)
    except UsageError as e:
        print(f"ddtrain: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # outside the Supervisor, which handles Ctrl-C itself
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `ddtrain status | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
