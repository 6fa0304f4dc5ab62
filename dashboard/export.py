"""`ddtop export RUN --tensorboard DIR`: a run's journal as TensorBoard event files.

    ddtop export RUN --tensorboard DIR   RUN as ddtop takes it (an id, a unique
                                         prefix, a run directory; default the newest)

A finished run, or a live one as far as it is journaled. The journal is read as a
replay reads it (core/journal.py), folded into a RunState, and written as
`ddtrain start --tensorboard` writes it live (core/tbpoints.py, tbwriter.py)
into DIR/<run id>/. What could not be read (records not decoded, a damaged tail,
records the daemon could not write) is skipped and said in one line.

The files are written in a folder of the export's own beside it
(DIR/.<run id>.export-<pid>-<n>), renamed to DIR/<run id> once all are written: an
export that fails removes what it wrote there and leaves DIR/<run id> as it was, so
the same export can simply be run again.

Exit codes: 0 written, 2 bad input (no such run, DIR not writable, tensorboard
not installed, DIR/<run id> already holding TensorBoard files, or other things).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ddtop.core import journal, outlets, wire
from ddtop.core.contract import EXIT_OK, EXIT_USAGE, UsageError
from ddtop.core.flags import OneLineParser
from ddtop.core.flagspec import (
    add_runs_dir_argument,
    default_runs_dir,
)
from ddtop.core.rundir import RunPaths, locate_run
from ddtop.core.state import RunState
from ddtop.core.text import count_of

if TYPE_CHECKING:
    from ddtop.core.tbwriter import EventFiles


class Exported:
    """What an export wrote and skipped."""

    def __init__(self) -> None:
        self.records = 0  # folded
        self.steps = 0  # Step messages written as points
        self.ranks = 0
        self.undecoded = 0  # records whose message could not be decoded
        self.missing = 0  # gaps in the relay sequence: records the daemon could not write
        self.damaged_bytes = 0  # a torn or damaged tail, unread

    def skipped(self) -> str:
        """What was skipped, in words ("" when nothing was)."""
        parts = []
        if self.undecoded:
            parts.append(f"{count_of(self.undecoded, 'record')} not readable")
        if self.missing:
            parts.append(f"{count_of(self.missing, 'record')} the daemon could not write "
                         "(missing from the journal)")
        if self.damaged_bytes:
            parts.append(f"the last {self.damaged_bytes:,} bytes (a damaged or torn record)")
        return "; ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="ddtop export",
        description="Write a run's telemetry journal (a finished run, or a live one as far "
        "as it is journaled) as TensorBoard event files: a folder per rank (step, compute "
        "and comm time, comm share, loss) and one for the run (global metrics, events as "
        "text), under DIR/<run id>/. View them with: tensorboard --logdir DIR",
        epilog="Exit codes: 0 written, 2 bad input.")
    parser.add_argument("run", nargs="?", metavar="RUN",
                        help="run id, unique prefix, or run directory (default: the newest run)")
    add_runs_dir_argument(parser)
    parser.add_argument("--tensorboard", required=True, metavar="DIR",
                        help="folder of TensorBoard logs: the run is written to DIR/<run id>/")
    return parser


def export(paths: RunPaths, into: Path) -> Exported:
    """The run's journal into `into` (DIR/<run id>: absent, or an empty folder),
    written in a new folder beside it and renamed to `into` at the end; OSError when
    a write fails, after removing what it wrote (the folder `into` untouched)."""
    from ddtop.core.tbwriter import EventFiles

    partial = _own_folder(into)
    try:
        files = EventFiles(partial)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.rmdir()
        raise
    try:
        done = _write(paths, files)
        partial.rename(into)  # where `into` is an empty folder, it is replaced
    except BaseException:
        files.remove()
        raise
    return done


def _own_folder(into: Path) -> Path:
    """A new folder beside `into`, made here (so what is in it is the export's)."""
    for n in itertools.count():
        partial = into.with_name(f".{into.name}.export-{os.getpid()}-{n}")
        try:
            partial.mkdir(parents=True)
        except FileExistsError:
            continue  # a leftover whose removal failed: never reused
        return partial
    raise AssertionError("unreachable")


def _write(paths: RunPaths, files: EventFiles) -> Exported:
    from ddtop.core.tbpoints import Translator

    done = Exported()
    state, translator = RunState(run=paths.run_id), Translator()
    reading = journal.Reading(paths.journal)
    previous = 0
    for record in reading:
        # As journal.replay counts them: a gap in the relay sequence is records not
        # written; a sequence starting over, a later daemon of the run (a resume).
        done.missing += record.seq - (previous + 1 if record.seq > previous else 1)
        previous = record.seq
        try:
            message = wire.decode([record.frame])
        except wire.WireError:
            done.undecoded += 1
            continue
        if state.apply(message, record.received):  # as the daemon takes it: or not at all
            files.write(translator.items(message, state, record.received))
        done.records += 1
    files.write(translator.pending())  # the last step's lines
    files.close()  # on an error, what is held is dropped with the rest (export)
    done.steps, done.damaged_bytes = translator.steps_written, reading.unread
    done.ranks = len(state.ranks)
    return done


def already_written(into: Path) -> bool:
    return into.is_dir() and any(into.glob("*/events.out.tfevents.*"))


def in_the_way(into: Path) -> bool:
    """Something at `into` the export's folder cannot replace: a file, or a folder
    with something in it (an empty folder is replaced)."""
    try:
        return into.exists() and (not into.is_dir() or any(into.iterdir()))
    except OSError:
        return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        try:
            outlets.require_tensorboard("ddtop export --tensorboard")
        except ValueError as e:
            raise UsageError(str(e)) from None
        try:
            paths = locate_run(args.runs_dir or default_runs_dir(), args.run)
        except OSError as e:
            raise UsageError(f"cannot look for runs there: {e.strerror or e}") from None
        if not paths.journal.is_file():
            raise UsageError(f"run {paths.run_id} has no telemetry journal "
                             f"({paths.journal}): nothing to export")
        into = Path(args.tensorboard) / paths.run_id
        if already_written(into):
            raise UsageError(f"{into} already holds TensorBoard files of run {paths.run_id} "
                             "(written live, or exported before): remove it, or give "
                             "another --tensorboard DIR")
        if in_the_way(into):
            raise UsageError(f"{into} is there already, not an empty folder (the export "
                             f"writes the folder of run {paths.run_id} whole): remove it, "
                             "or give another --tensorboard DIR")
        try:
            done = export(paths, into)
        except OSError as e:
            what = (f"read {paths.journal}" if e.filename == str(paths.journal)
                    else f"write TensorBoard files in {into}")
            raise UsageError(f"cannot {what}: {e.strerror or e}") from None
    except UsageError as e:
        print(f"ddtop: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_USAGE
    skipped = done.skipped()
    print(f"ddtop: exported run {paths.run_id} to {into}: "
          f"{count_of(done.steps, 'step message')} of {count_of(done.ranks, 'rank')}"
          f"{f'; skipped {skipped}' if skipped else ''} (tensorboard --logdir "
          f"{args.tensorboard})")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
