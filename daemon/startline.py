"""`ddtrain start`'s command line read as torchrun's is:

    ddtrain start [options] train.py ARGS...       ARGS are the script's, untouched
    ddtrain start [options] -m pkg.train ARGS...   as python -m (and torchrun -m)
    ddtrain start [options] train.py -- ARGS...    the same: a `--` right after it is dropped
    ddtrain start [options]                        the built-in trainer, with its flags

Everything after the script (or `-m MODULE`) belongs to it, so ddtrain's own options
go before it; no option is abbreviated (torchrun's own options are also taken in
their other spelling, --nproc_per_node). `--nproc-per-node P` is the ranks on this
machine (on one machine the world size, as `-n`); `--standalone` and `--nnodes 1`
are accepted; an option torchrun also has takes its default from torchrun's
environment variable, `PET_<OPTION>` (as torch/distributed/argparse_util.py's `env`
and `check_env` read them: Kubeflow's PyTorchJob sets them). A flag of the built-in
trainer given with a script is bad input: one line, exit 2, naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddtop.core.config import TrainConfig
from ddtop.core.contract import UsageError
from ddtop.core.flags import add_train_arguments, explicit_overrides
from ddtop.core.flagspec import BUILT_IN, Flag, default_runs_dir
from ddtop.core.program import check_program

# torchrun's options that ddtrain start has, beside those of TrainConfig's fields.
TORCHRUN_SWITCHES = ("standalone",)
START_USAGE = """ddtrain start [options] SCRIPT [SCRIPT ARGS...]
       ddtrain start [options] -m MODULE [MODULE ARGS...]
       ddtrain start [options] [built-in trainer flags]"""
START_DESCRIPTION = """\
Run your training script as every rank, as torchrun runs it: torchrun's
environment, and everything after the script is its own arguments. Without a
script, the built-in trainer runs (its flags are grouped below). A daemon
supervises the ranks and relays their telemetry; it writes runs/<run-id>/
(config, run.json, per-rank logs, telemetry journal, metrics, checkpoints).
Without --foreground it detaches and this command returns once the ranks are up.

examples:
  ddtrain start -n 8 train.py --lr 3e-4 --epochs 5   8 ranks; train.py gets --lr 3e-4 ...
  ddtrain start --nproc-per-node 8 train.py          the same in torchrun's words
  ddtrain start --foreground -n 2 -m mypkg.train     a module, in this terminal
  ddtrain start -n 2 --model cnn --epochs 1          the built-in trainer"""


def add_start_command(commands: Any, exit_codes: str) -> argparse.ArgumentParser:
    """`ddtrain start` under `commands` (the subparsers of ddtrain's parser)."""
    start: argparse.ArgumentParser = commands.add_parser(
        "start",
        help="launch a run: your script (as torchrun would) or the built-in trainer",
        usage=START_USAGE,
        description=START_DESCRIPTION,
        epilog=exit_codes,
        allow_abbrev=False,  # --batch is a script's, never ddtrain's --batch-size
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    start.add_argument("program", nargs="?", default=argparse.SUPPRESS, metavar="SCRIPT",
                       help="your training script, run as every rank with torchrun's "
                       "environment instead of the built-in trainer; everything after it is "
                       "its own arguments (ddtrain start -n 8 train.py --lr 3e-4)")
    start.add_argument("--foreground", action="store_true",
                       help="run the daemon in this terminal, printing the ranks' output; "
                       "exit with the run's outcome")
    start.add_argument("--headless", action="store_true",
                       help="with --foreground: print progress lines from the run's telemetry "
                       "(or --format jsonl) instead of the ranks' output; for CI")
    start.add_argument("--standalone", action="store_true", default=argparse.SUPPRESS,
                       help="torchrun's: one machine with a local rendezvous (what ddtrain "
                       "does without --nnodes)")
    from ddtop.core.printer import add_output_arguments

    add_output_arguments(start)
    add_train_arguments(start)
    drills = start.add_argument_group("fault drills")
    drills.add_argument(
        "--inject", action="append", default=[], metavar="SPEC",
        help="make a rank fail on purpose, to see how the failure is named (repeatable): "
        "RANK:ACTION[@step=N|@epoch=E] with ACTION kill, stop, hang, raise, segfault, "
        "exit=CODE, slow=FACTORx or stall-data=SECONDSs; e.g. 1:kill@step=50, "
        "2:hang@step=80, 1:slow=1.5x, 0:stall-data=2s@step=30 (first attempt only; "
        "docs/cli.md#failure-drills)")
    return start


def said_from_environment(error: UsageError, args: argparse.Namespace) -> UsageError:
    """`error`, saying which values came from torchrun's environment (if any did)."""
    taken = getattr(args, "torchrun_env", [])
    return UsageError(f"{error} (from torchrun's environment: {', '.join(taken)})"
                      if taken else str(error))


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of the command `name` (e.g. start) under `parser`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise KeyError(name)


def split_command_line(argv: list[str],
                       start: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """(ddtrain's own arguments, the program's). For `start`, the program's begin
    after the script or `-m MODULE` (a `--` right after it dropped); a `--` before
    any program gives what follows it as the program's (refused later: no script).
    Other commands take no program: split at the first `--`, as always."""
    if argv[:1] != ["start"]:
        if "--" not in argv:
            return argv, []
        at = argv.index("--")
        return argv[:at], argv[at + 1:]
    rest = list(argv[1:])
    options = start._option_string_actions
    i = 0
    while i < len(rest):
        token = rest[i]
        if token == "--":
            return ["start", *rest[:i]], rest[i + 1:]
        if not token.startswith("-") or token == "-":  # the script
            return ["start", *rest[:i + 1]], _program_args(rest[i + 1:], token, options)
        name, equals, value = token.partition("=")
        if name.startswith("--") and name not in options and _is_torchrun(
                options.get(name.replace("_", "-"))):  # torchrun's --nproc_per_node
            name = name.replace("_", "-")
            rest[i] = name + equals + value
        action, attached = options.get(name), bool(equals)
        if action is None and not token.startswith("--") and len(token) > 2:
            action, attached = options.get(token[:2]), True  # -n2, -mpkg.train
        if action is not None and action.dest == "module":
            end = i + 1 if attached else i + 2
            return ["start", *rest[:end]], _program_args(rest[end:], None, options)
        i += 2 if action is not None and action.nargs != 0 and not attached else 1
    return ["start", *rest], []


def _program_args(after: list[str], script: str | None,
                  options: Mapping[str, argparse.Action]) -> list[str]:
    """What follows the program, for the program (a `-m` too, as torchrun passes
    it): a `--` right after it is dropped (ddtrain's earlier spelling, `train.py --
    ARGS`). The one spelling that would now silently mean something else is
    refused: ddtrain's own options between the script and a `--` (`train.py
    --inject 1:kill -- --lr 3e-4`, as ddtrain once read it)."""
    if after[:1] == ["--"]:
        return after[1:]
    if script is not None and "--" in after:
        for token in after[:after.index("--")]:
            action = options.get(token.partition("=")[0])
            if action is not None and _group(action.dest) not in (BUILT_IN, "program"):
                raise UsageError(f"{token} follows {script}: what follows a script is its "
                                 f"own arguments; put ddtrain's options before the script "
                                 f"(or give {script} -- ARGS to pass them all to it)")
    return after


def _is_torchrun(action: argparse.Action | None) -> bool:
    return action is not None and action.dest in torchrun_dests()


def _group(dest: str) -> str | None:
    """The --help group of TrainConfig's field `dest` (None: not a field's flag)."""
    field = TrainConfig.__dataclass_fields__.get(dest)
    if field is None:
        return None
    how: Flag = field.metadata.get("flag", Flag())
    return how.group if how.enabled else None


def torchrun_dests() -> tuple[str, ...]:
    """The options of ddtrain start that torchrun has too (PET_<DEST> defaults)."""
    fields = [f.name for f in dataclasses.fields(TrainConfig)
              if f.metadata.get("flag", Flag()).torchrun]
    return (*fields, *TORCHRUN_SWITCHES)


def apply_torchrun_environment(start: argparse.ArgumentParser, args: argparse.Namespace,
                               environ: Mapping[str, str]) -> list[str]:
    """Each torchrun option not given on the command line takes PET_<DEST> from
    `environ`, as torchrun reads it (a switch: a whole number, non-zero on); set on
    `args`. Returns what was taken, as `PET_X=value`; bad values are UsageError."""
    taken = []
    by_dest = {a.dest: a for a in start._actions}
    for dest in torchrun_dests():
        name = f"PET_{dest.upper()}"
        if name not in environ or hasattr(args, dest):
            continue
        value, action = environ[name], by_dest[dest]
        option = action.option_strings[0]
        if action.nargs == 0:
            try:
                on = int(value) != 0
            except ValueError:
                raise UsageError(f"{name}={value!r} in the environment (torchrun's {option}): "
                                 "give 1 or 0") from None
            if on:
                setattr(args, dest, True)
        else:
            setattr(args, dest, _converted(action, value, f"{name}={value!r} in the "
                                           f"environment (torchrun's {option})"))
        taken.append(f"{name}={value}")
    return taken


def _converted(action: argparse.Action, value: str, where: str) -> Any:
    try:
        converted = action.type(value) if callable(action.type) else value
    except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
        kind = getattr(action.type, "__name__", "value")
        reason = str(e) if isinstance(e, argparse.ArgumentTypeError) else f"not a valid {kind}"
        raise UsageError(f"{where}: {reason}") from None
    if action.choices is not None and converted not in action.choices:
        raise UsageError(f"{where}: choose from {', '.join(map(str, action.choices))}")
    return converted


def resolve_ranks(overrides: dict[str, Any], standalone: bool) -> None:
    """--nproc-per-node, -n, --nnodes and --standalone into the world size, as
    torchrun means them (UsageError when they disagree); `overrides` updated."""
    nnodes = overrides.get("nnodes", 1)
    if standalone and nnodes > 1:
        raise UsageError(f"--standalone is one machine but --nnodes is {nnodes}: leave out "
                         "one of them")
    if nnodes == 1 and "nnodes" in overrides and overrides.pop("rdzv_endpoint", None):
        # torchrun's single-node c10d habit: one machine needs no endpoint, as --standalone.
        print("ddtrain: note: --rdzv-endpoint is not needed on one machine (--nnodes 1): "
              "the ranks rendezvous here, as with --standalone", file=sys.stderr, flush=True)
    if nnodes == 1 and "nproc_per_node" in overrides:
        nproc = overrides["nproc_per_node"]
        if overrides.setdefault("world_size", nproc) != nproc:
            raise UsageError(f"-n {overrides['world_size']} and --nproc-per-node {nproc} "
                             "disagree: on one machine both are its ranks; give one of them")


def check_script_flags(overrides: Mapping[str, Any], label: str) -> None:
    """A flag of the built-in trainer given with a script (`label`): UsageError."""
    built_in = [name for name in overrides if _group(name) == BUILT_IN]
    if built_in:
        flag = "--" + built_in[0].replace("_", "-")
        raise UsageError(f"{flag} is a flag of the built-in trainer, not of {label}: a "
                         f"script's own flags follow its name (ddtrain start [options] "
                         f"{label} {flag} ...)")


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str],
                       environ: Mapping[str, str]) -> argparse.Namespace:
    """ddtrain's arguments: the parsed namespace, with `program_args` (the program's
    own) and, for start, `torchrun_env` (the PET_* values it took from `environ`)."""
    start = subparser(parser, "start")
    own, program_args = split_command_line(argv, start)
    args = parser.parse_args(own)
    args.program_args = program_args
    if args.command == "start":
        args.torchrun_env = apply_torchrun_environment(start, args, environ)
    return args


def start_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig fields `ddtrain start` was given (its runs_dir always): the
    program checked, the ranks resolved as torchrun means them; UsageError if not."""
    overrides = explicit_overrides(args)
    overrides["runs_dir"] = overrides.get("runs_dir") or default_runs_dir()
    if args.program_args:
        if "program" not in overrides and "module" not in overrides:
            raise UsageError(f"arguments after -- ({' '.join(args.program_args)}) are for a "
                             "script: give the script first, e.g. ddtrain start train.py ARGS")
        overrides["program_args"] = args.program_args
    resolve_ranks(overrides, getattr(args, "standalone", False))
    if "program" in overrides or "module" in overrides:
        overrides["workdir"] = str(Path.cwd())
        check_program(overrides.get("program"), overrides.get("module"), overrides["workdir"])
        check_script_flags(overrides, overrides.get("program") or f"-m {overrides['module']}")
    if overrides.get("nnodes", 1) > 1:
        if overrides.get("resume"):
            raise UsageError("--resume is not supported for a multi-node job yet: start a "
                             "new one with another --run-id")
        overrides.setdefault("world_size", overrides["nnodes"] * overrides.get("nproc_per_node", 1))
        overrides["launcher"] = "torchrun"  # torchrun's agent does the c10d rendezvous
    return overrides
