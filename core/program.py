"""The user's own program on `ddtrain start`'s command line, checked before any
rank starts:

    ddtrain start [options] train.py [script args]
    ddtrain start [options] -m package.module [module args]

What follows the program belongs to it, untouched (daemon/startline.py). A program that
cannot run (a missing file, a syntax error, a module that is not there) is bad
input: one line, exit 2, nothing started. Nothing here imports the user's code
or torch.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from ddtop.core.contract import UsageError


def check_program(program: str | None, module: str | None, workdir: str) -> None:
    """Raise UsageError naming the problem and the fix, if the program cannot run."""
    if program is not None and module is not None:
        raise UsageError(f"give a script ({program}) or -m {module}, not both")
    if program is not None:
        _check_script(Path(workdir) / program, program)
    elif module is not None:
        _check_module(module, workdir)


def _check_script(path: Path, given: str) -> None:
    if path.is_dir():
        raise UsageError(f"{given} is a directory: give the path of your training script in "
                         "it (or -m MODULE for a module)")
    if not path.is_file():
        raise UsageError(f"{given}: no such file in {path.parent}: give the path of your "
                         "training script (or -m MODULE for a module)")
    try:
        source = path.read_bytes()
    except OSError as e:
        raise UsageError(f"{given}: cannot be read ({e.strerror})") from None
    try:
        compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as e:
        raise UsageError(f"{given}:{e.lineno}: {e.msg}: fix the script and start again"
                         ) from None
    except ValueError as e:  # source with NUL bytes
        raise UsageError(f"{given} is not a Python script ({e})") from None


def _check_module(module: str, workdir: str) -> None:
    """The module's top-level package must be importable from `workdir` (as with
    `python -m`, the working directory comes first on the path); submodules are
    found by the ranks, which report a missing one with its traceback."""
    top = module.split(".")[0]
    if not top.isidentifier() or not all(part.isidentifier() for part in module.split(".")):
        raise UsageError(f"-m {module}: not a module name (expected e.g. -m mypkg.train)")
    saved = list(sys.path)
    sys.path.insert(0, str(Path(workdir).resolve()))
    try:
        found = importlib.util.find_spec(top)
    finally:
        sys.path[:] = saved
    if found is None:
        raise UsageError(f"-m {module}: no module {top!r} on the path from {workdir}: run from "
                         "the folder that holds it, or install it")
