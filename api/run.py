"""`python -m ddtop.run SCRIPT [ARGS...]` or `python -m ddtop.run -m MODULE [ARGS...]`:
run a training program as `python SCRIPT ARGS` (or `python -m MODULE ARGS`)
would, watched with no line changed when DDTOP_TELEMETRY is set:

    torchrun --nproc-per-node 8 -m ddtop.run train.py --lr 3e-4
    srun python -m ddtop.run -m mypkg.train --config c.yaml

It arms the start-up hook that the package's .pth file arms at every
interpreter start (ddtop.training.starthook): the spelling for those who
prefer to see it on the command line, or whose interpreter skips .pth files
(`python -S`, an install without the file). The program runs as Python runs
it: `__name__ == "__main__"`, sys.argv as [SCRIPT, ARGS...], the script's
folder first on sys.path (for -m: the working directory), its exit code the
command's. Without DDTOP_TELEMETRY it runs unwatched, saying nothing. A
program that cannot run (none given, a missing file, a syntax error, a module
not on the path) is one line and exit 2.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from types import TracebackType

from ddtop.core.contract import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError, telemetry_endpoint
from ddtop.core.program import check_program
from ddtop.training import asmain, starthook

USAGE = "usage: python -m ddtop.run SCRIPT [ARGS...]  |  python -m ddtop.run -m MODULE [ARGS...]"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return EXIT_OK
    try:
        program, module, rest = read_command(args)
        check_program(program, module, str(Path.cwd()))
    except UsageError as e:
        print(f"ddtop.run: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if telemetry_endpoint() is not None:
        starthook.arm()
    return run(program, module, rest)


def read_command(args: list[str]) -> tuple[str | None, str | None, list[str]]:
    """(script, module, the program's own arguments) from the command line."""
    if not args:
        raise UsageError(f"give the script to run ({USAGE})")
    if args[0] == "-m":
        if len(args) < 2 or not args[1]:
            raise UsageError(f"-m needs a module name ({USAGE})")
        return None, args[1], args[2:]
    if args[0].startswith("-"):
        raise UsageError(f"{args[0]}: python -m ddtop.run takes no options before the "
                         f"program; they go to python, or after the script to it ({USAGE})")
    return args[0], None, args[1:]


def run(program: str | None, module: str | None, args: list[str]) -> int:
    """Run the program in this process as Python would; its exit code."""
    if module is not None:
        sys.argv = [module, *args]  # runpy puts the module's file in argv[0]
        runner = functools.partial(asmain.run_module, module)
    else:
        assert program is not None, "a script or a module"
        sys.argv = [program, *args]
        if not sys.flags.safe_path:  # where `python -m` put the working directory
            sys.path[0] = str(Path(program).resolve().parent)
        runner = functools.partial(asmain.run_as_main, Path(program).absolute())
    try:
        runner()
    except SystemExit as e:  # its code is the command's (a text: printed by Python, 1)
        starthook.exiting(e.code)
        raise
    except KeyboardInterrupt:
        raise  # Python's own ending for it, and its exit status
    except BaseException as e:  # noqa: BLE001 - shown as Python shows it, then exit code 1
        # (Python prints the exception's own traceback, whatever the third argument.)
        e.__traceback__ = _programs_own(e.__traceback__)
        sys.excepthook(type(e), e, e.__traceback__)
        return EXIT_FAILED
    return EXIT_OK


def _programs_own(frames: TracebackType | None) -> TracebackType | None:
    """The traceback from the program's first frame on (ours and runpy's left out)."""
    while frames is not None and (frames.tb_frame.f_code.co_filename == __file__
                                  or asmain.ours(frames.tb_frame.f_code.co_filename)):
        frames = frames.tb_next
    return frames


if __name__ == "__main__":
    sys.exit(main())
