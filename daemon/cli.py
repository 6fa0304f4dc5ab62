"""`ddtrain`: start distributed training runs.

    ddtrain start --foreground --world-size 8          built-in dataset, 8 ranks
    ddtrain start --foreground -n 2 --model cnn --dataset mnist --data-dir data --download
    ddtrain start --foreground --resume                continue the newest run

Exit codes: 0 the run succeeded, 1 a rank failed (named in the last lines),
2 bad input, 130 stopped with Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ddtop.daemon.config import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    OneLineParser,
    TrainConfig,
    UsageError,
    add_train_arguments,
    explicit_overrides,
    resume_mismatch,
)
from ddtop.daemon.runs import RunPaths, find_run, new_run_id, read_json


def _version() -> str:
    try:
        return version("ddtop")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="ddtrain",
        description="Start and supervise distributed PyTorch training runs.",
        epilog="Exit codes: 0 succeeded, 1 a rank failed, 2 bad input, 130 stopped by Ctrl-C.",
    )
    parser.add_argument("--version", action="version", version=f"ddtrain {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    start = commands.add_parser(
        "start",
        help="launch a run: one process per rank, DDP over gloo or nccl",
        description="Launch one process per rank and train with DistributedDataParallel. "
        "Writes runs/<run-id>/ (config, per-rank logs, metrics, checkpoints).",
        epilog="Exit codes: 0 succeeded, 1 a rank failed, 2 bad input, 130 stopped by Ctrl-C.",
    )
    start.add_argument("--foreground", action="store_true",
                       help="run in this terminal, printing progress (currently the only mode)")
    add_train_arguments(start)
    return parser


def resolve_start(args: argparse.Namespace) -> tuple[TrainConfig, RunPaths]:
    """The run's config and directory: a new run, or the run being resumed."""
    overrides = explicit_overrides(args)
    runs_dir = overrides.get("runs_dir", TrainConfig.runs_dir)
    if not overrides.get("resume"):
        config = TrainConfig(**overrides).validate()
        run_id = config.run_id or new_run_id()
        paths = RunPaths(Path(runs_dir) / run_id)
        if paths.config.exists():
            raise UsageError(f"run {run_id} already exists in {runs_dir}/: add --resume to "
                             "continue it, or pick another --run-id")
        return TrainConfig(**{**config.to_dict(), "run_id": run_id}), paths
    paths = find_run(runs_dir, overrides.get("run_id"))
    try:
        saved = read_json(paths.config)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {paths.config} ({e}): the run cannot be resumed; "
                         "start a new run") from None
    merged = {**saved, **overrides, "runs_dir": runs_dir, "run_id": paths.run_id, "resume": True}
    config = TrainConfig.from_dict(merged).validate()
    diffs = resume_mismatch(saved, config)
    if diffs:
        raise UsageError(f"run {paths.run_id} cannot be resumed with different settings "
                         f"({'; '.join(diffs)}): drop those flags, or start a new run")
    if not any(paths.checkpoints.glob("step-*.pt")):
        raise UsageError(f"run {paths.run_id} has no checkpoint to resume from: "
                         "start a new run without --resume")
    return config, paths


def cmd_start(args: argparse.Namespace) -> int:
    config, paths = resolve_start(args)
    if not args.foreground:
        print("ddtrain: note: detached runs are not available yet; running in the "
              "foreground (Ctrl-C stops the run)", file=sys.stderr)
    from ddtop.daemon.launcher import LocalLauncher

    verb = "resuming" if config.resume else "starting"
    print(f"ddtrain: {verb} run {paths.run_id} with {config.world_size} ranks in {paths.root} "
          "(Ctrl-C stops it)", flush=True)
    return LocalLauncher(config, paths).run()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    commands = {"start": cmd_start}
    try:
        return commands[args.command](args)
    except UsageError as e:
        print(f"ddtrain: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # before any rank started; afterwards the launcher handles it
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
