"""`ddtrain watch`: watch ranks that ddtrain does not start.

    ddtrain watch -- torchrun --standalone --nproc-per-node 8 train.py --lr 3e-4
    ddtrain watch -- srun python train.py
    ddtrain watch --bind 0.0.0.0 --run-id job7      (ranks started elsewhere)

With a command, the daemon runs it with the watch environment and supervises
it in this terminal: its output is echoed (and kept in logs/command.log), every
process below it that initialises a process group reports as a rank (the
package's start-up hook), and `ddtrain watch` exits with the command's exit
code. Without one, it prints what to export where the ranks start, and waits
for them (daemon/watching.py).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
from pathlib import Path
from typing import Any

from ddtop.core.bounds import MAX_JOB_RANKS, METRICS_LINGER_S
from ddtop.core.config import TrainConfig
from ddtop.core.contract import (
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    owner_only_umask,
)
from ddtop.core.flagspec import default_runs_dir
from ddtop.core.rundir import new_run

WATCH_USAGE = "ddtrain watch [options] -- COMMAND [ARGS ...]\n       ddtrain watch [options]"
WATCH_DESCRIPTION = """\
Watch ranks that ddtrain does not start: those of any launcher (torchrun, srun,
accelerate launch, a script that spawns its own ranks, a company's wrapper).

With a COMMAND (after --), run it with the watch environment: every process it
starts that initialises a torch.distributed process group reports as a rank, with
no line of the script changed (zero-code, as under ddtrain start). The command's
output is echoed here and kept in the run's logs/command.log; ddtop, ddtrain
status/logs/stacks/stop work on the run as on any other. Exits with the command's
exit code.

Without a COMMAND, start nothing: print the variables to export where the ranks
are started (a pod spec, an sbatch file), then wait for them; end when every rank
has said goodbye, or after --idle seconds without a message.

examples:
  ddtrain watch -- torchrun --standalone --nproc-per-node 8 train.py --lr 3e-4
  ddtrain watch --headless -- accelerate launch train.py
  ddtrain watch -- python lightning_train.py
  ddtrain watch --bind 0.0.0.0 --run-id job7 --idle 600
"""


def add_watch_command(commands: Any, exit_codes: str) -> argparse.ArgumentParser:
    from ddtop.core.printer import add_output_arguments

    watch: argparse.ArgumentParser = commands.add_parser(
        "watch", help="watch ranks started by any launcher: ddtrain watch -- COMMAND",
        usage=WATCH_USAGE, description=WATCH_DESCRIPTION, epilog=exit_codes,
        allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    watch.add_argument("stray", nargs="*", help=argparse.SUPPRESS)
    watch.add_argument("--run-id", metavar="ID", default=None,
                       help="the run's id (default: new, timestamped)")
    watch.add_argument("--runs-dir", metavar="DIR", default=None,
                       help="folder of run directories (default $DDTOP_RUNS_DIR or ./runs)")
    watch.add_argument("--bind", metavar="ADDR", default="",
                       help="receive the ranks' telemetry on TCP at ADDR (free ports), with "
                       "the run's CURVE keys: for ranks on other machines; default: unix "
                       "sockets only this user can reach")
    watch.add_argument("--metrics", metavar="[HOST:]PORT", default="",
                       help="serve every rank's metrics to Prometheus at "
                       "http://HOST:PORT/metrics (HOST 127.0.0.1 unless given; PORT 0: a "
                       "free one, in run.json; docs/monitoring.md)")
    watch.add_argument("--metrics-linger", type=float, default=METRICS_LINGER_S, metavar="S",
                       help="with --metrics: after the run ends, keep serving its final state "
                       "for S seconds, for the next scrapes (ddtrain stop or Ctrl-C ends it "
                       f"sooner); 0: exit at once (default {METRICS_LINGER_S:g})")
    watch.add_argument("--metrics-auth", default="", metavar="FILE",
                       help="with --metrics: every scrape must send the credential in FILE "
                       "(a bearer token, or USER:PASSWORD; chmod 600); else 401")
    watch.add_argument("--metrics-cert", default="", metavar="FILE",
                       help="with --metrics and --metrics-key: serve https:// with this "
                       "certificate (PEM)")
    watch.add_argument("--metrics-key", default="", metavar="FILE",
                       help="with --metrics-cert: its private key (PEM, unencrypted, chmod 600)")
    watch.add_argument("--idle", type=float, default=0.0, metavar="S",
                       help="without a command: end after S seconds without any rank's "
                       "message (default: wait until every rank has said goodbye)")
    watch.add_argument("--allow-no-ranks", action="store_true",
                       help="with a command: succeed when it exits 0 though no process of "
                       "it reported as a rank (default: such a watch fails, \"no rank seen\")")
    watch.add_argument("--hang-timeout", type=float, default=None, metavar="S",
                       help="fail the run (SIGTERM to its ranks) when it has hung for S "
                       "seconds, naming the rank the others wait for (default: off)")
    watch.add_argument("--tensorboard", default="", metavar="DIR",
                       help="also write the ranks' telemetry, live, as TensorBoard event "
                       "files in DIR/<run id>/ (needs the tensorboard extra)")
    watch.add_argument("--headless", action="store_true",
                       help="print progress lines from the ranks' telemetry (or --format "
                       "jsonl) instead of the command's output; for CI")
    nodes = watch.add_argument_group(
        "multi-node", "one ddtrain watch per node, each running that node's part of the job; "
        "node 0's is the job's hub (docs/multi-node.md)")
    nodes.add_argument("--nnodes", type=int, default=1, metavar="N",
                       help="machines (nodes) of the job, one ddtrain watch on each")
    nodes.add_argument("--node-rank", type=int, default=0, metavar="K",
                       help="this node's number, 0 to N-1; node 0's watch is the hub")
    nodes.add_argument("--hub", default="", metavar="tcp://HOST:PORT",
                       help="node 1 and up, without a shared runs directory: the hub's "
                       "control endpoint (its hub.json)")
    nodes.add_argument("--hub-keys", default="", metavar="DIR",
                       help="with --hub: a copy of the job's keys folder")
    add_output_arguments(watch)
    return watch


def watch_config(args: argparse.Namespace) -> TrainConfig:
    """The run's settings from the command line; UsageError naming the flag."""
    if args.stray:
        raise UsageError(f"put the command after --: ddtrain watch -- {shlex.join(args.stray)}")
    command: list[str] = list(args.program_args)
    if command:
        _check_command(command[0])
        if args.idle:
            raise UsageError("--idle is for a watch without a command (this one ends with "
                             "its command): leave it out")
    elif args.allow_no_ranks:
        raise UsageError("--allow-no-ranks is for a watch with a command (this one waits "
                         "for its ranks): leave it out")
    elif not (args.idle >= 0 and args.idle < float("inf")):
        raise UsageError(f"--idle must be a number of seconds >= 0 (got {args.idle:g})")
    nodes: dict[str, Any] = {}
    if args.nnodes != 1 or args.node_rank or args.hub or args.hub_keys:
        # A job's hub bounds the ranks it takes by the world size: here only the ranks
        # know it. Node 0 serves the other nodes: on every interface unless --bind.
        nodes = {"nnodes": args.nnodes, "node_rank": args.node_rank, "hub": args.hub,
                 "hub_keys": args.hub_keys, "world_size": MAX_JOB_RANKS}
        if args.node_rank == 0 and not args.bind:
            args.bind = "0.0.0.0"
    return TrainConfig(run_id=args.run_id, runs_dir=args.runs_dir or default_runs_dir(),
                       bind=args.bind, hang_timeout=args.hang_timeout, watch=command,
                       tensorboard=args.tensorboard,
                       metrics=args.metrics, metrics_linger=args.metrics_linger,
                       metrics_auth=args.metrics_auth,
                       metrics_cert=args.metrics_cert, metrics_key=args.metrics_key,
                       idle=args.idle, allow_no_ranks=args.allow_no_ranks,
                       workdir=str(Path.cwd()), **nodes).validate()


def _check_command(name: str) -> None:
    if "/" in name:
        path = Path(name)
        if not path.is_file() or not os.access(path, os.X_OK):
            why = "not executable" if path.is_file() else "no such file"
            raise UsageError(f"cannot run {name!r}: {why}; check the command after --")
    elif shutil.which(name) is None:
        raise UsageError(f"cannot run {name!r}: not found on PATH; check the command after --")


def cmd_watch(args: argparse.Namespace) -> int:
    from ddtop.daemon.foreground import supervise

    owner_only_umask()
    config = watch_config(args)
    paths = new_run(config.runs_dir, config.run_id, config.node_rank)
    config = TrainConfig(**{**config.to_dict(), "run_id": paths.run_id})
    where = f"{paths.root} (Ctrl-C stops the ranks)"
    banner = (f"ddtrain: watching run {paths.run_id}: {config.program_label} in {where}"
              if config.watch else f"ddtrain: run {paths.run_id} waits for its ranks in {where}")
    code, supervisor = supervise(args, config, paths, banner)
    from ddtop.daemon.watching import WatchedCommand

    starter = supervisor.starter
    starter_code = starter.exit_code if isinstance(starter, WatchedCommand) else None
    if code == EXIT_USAGE or starter_code is None or not config.watch:
        return code
    if starter_code == 0 and code != EXIT_OK:  # the command succeeded; the watch did not
        return code
    return starter_code if starter_code >= 0 else 128 - starter_code

