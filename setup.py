"""The one build step pyproject.toml cannot say: the start-up hook's .pth file
(training/ddtop-starthook.pth; training/starthook.py says what its line does)
goes to the top of site-packages, beside the `ddtop` package, where `site`
runs it at every interpreter start. For a wheel (`pip install .`) it is copied
beside the packages; an editable install (`pip install -e .`) maps the packages
to this tree with a finder of setuptools', and its wheel gets the file
written in beside that finder's own .pth (setuptools' editable_wheel picks the
strategy that fills the wheel: ours is that strategy plus the file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = Path("training", "ddtop-starthook.pth")


class BuildPyWithPth(build_py):
    """The packages, and the .pth at the top of what the wheel installs."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(PTH), str(Path(self.build_lib, PTH.name)), preserve_mode=False)


class EditableWheelWithPth(editable_wheel):
    """An editable wheel that carries the .pth too (listed in its RECORD, so that
    uninstalling removes it)."""

    def _select_strategy(self, *args: Any, **kwargs: Any) -> Any:
        return _WithPth(super()._select_strategy(*args, **kwargs))


class _WithPth:
    """setuptools' editable strategy, then the .pth written into the same wheel."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def __call__(self, wheel: Any, files: Any, mapping: Any) -> None:
        self.strategy(wheel, files, mapping)
        wheel.writestr(PTH.name, PTH.read_bytes())

    def __enter__(self) -> _WithPth:
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc: object) -> Any:
        return self.strategy.__exit__(*exc)


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
