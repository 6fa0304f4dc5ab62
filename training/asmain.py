"""A program run as `python` runs it: a script as a fresh `__main__` module, a
module through runpy. Shared by the ranks ddtrain starts (training/script.py)
and by `python -m ddtop.run` (api/run.py), so it imports nothing heavy.
"""

from __future__ import annotations

import builtins
import runpy
import sys
import types
from pathlib import Path


def run_as_main(path: Path) -> None:
    """Run a script as `python script.py` does: a fresh `__main__` module whose
    `__file__` is the absolute path (sys.argv[0] stays as typed)."""
    main = types.ModuleType("__main__")
    main.__dict__.update({"__file__": str(path), "__builtins__": builtins, "__spec__": None,
                          "__loader__": None, "__package__": None, "__cached__": None})
    sys.modules["__main__"] = main  # pickling what the script defines finds it here
    # The user's own script, run as python itself would run it.
    exec(compile(path.read_bytes(), str(path), "exec"), main.__dict__)


def run_module(module: str) -> None:
    """Run a module as `python -m module` does (runpy puts its file in sys.argv[0])."""
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def ours(filename: str) -> bool:
    """Frames of this module and runpy, in front of the program's own in a traceback."""
    return filename in (__file__, runpy.__file__, "<frozen runpy>")
