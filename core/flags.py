"""`ddtrain start`'s flags (and `python -m ddtop.training`'s), built from the fields
of TrainConfig alone: the name gives the flag, the annotation its type, the default
and the field's docstring its help (core/config.py declares the fields, with a
`flag(...)` for what none of those can say); and the parser whose errors are one
line naming the problem.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import textwrap
import types
import typing
from typing import Any, Literal

from ddtop.core.bounds import field_range, non_empty
from ddtop.core.config import TrainConfig
from ddtop.core.contract import EXIT_USAGE
from ddtop.core.flagspec import Flag


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per TrainConfig field (see add_config_arguments)."""
    add_config_arguments(parser, TrainConfig)


def add_config_arguments(parser: argparse.ArgumentParser, cls: type[Any]) -> None:
    """Add a flag for every field of the dataclass `cls`, built from the field alone.

    `batch_size: int = 64` with the string "global batch" under it becomes
    `--batch-size B  global batch (default 64)`: the name gives the flag, the
    annotation its type (a Literal its choices, a bool a switch), the default and
    the field's docstring its help; metadata["flag"] (a Flag) adds what none of
    those can say. Defaults are suppressed so that `explicit_overrides` sees only
    what the user typed (a resumed run keeps its saved settings unless a flag
    changes them); the dataclass holds the defaults, and --help shows them.
    """
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    flags = [(f, f.metadata.get("flag", Flag())) for f in dataclasses.fields(cls)]
    flags = [(f, how) for f, how in flags if how.enabled]
    for title in dict.fromkeys(how.group for _, how in flags):  # in order of first use
        group = parser.add_argument_group(title)
        for f, how in flags:
            if how.group == title:
                _add_flag(group, f, how, hints[f.name], docs.get(f.name, ""))


def _add_flag(group: Any, f: dataclasses.Field[Any], how: Flag, hint: Any, doc: str) -> None:
    kwargs: dict[str, Any] = {}
    if hint is bool:
        kwargs["action"] = "store_true"
    elif typing.get_origin(hint) is Literal:
        kwargs["choices"] = typing.get_args(hint)
    else:
        kwargs["type"], kwargs["metavar"] = _scalar(hint, f), how.metavar
    bounds = field_range(f)
    if bounds is not None:
        doc += f"{'; ' if doc else ''}at most {bounds.high}"
    if how.default_text is not None:
        doc += f" (default: {how.default_text})"
    elif hint is not bool and f.default not in (None, dataclasses.MISSING):
        doc += f" (default {f.default})"
    names = ["--" + f.name.replace("_", "-"), *([how.short] if how.short else [])]
    group.add_argument(*names, dest=f.name, default=argparse.SUPPRESS,
                       help=doc.strip().replace("%", "%%"), **kwargs)


def _scalar(hint: Any, f: dataclasses.Field[Any]) -> Any:
    """The argparse type of a field annotated int, float, str or `X | None`: an
    int needs its Range, a str refuses an empty value (core/bounds.py)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not types.NoneType]
        hint = args[0] if len(args) == 1 else hint
    if hint not in (int, float, str):
        raise TypeError(f"field {f.name}: no flag for type {hint!r}; give it "
                        "Flag(enabled=False)")
    if hint is int and field_range(f) is None:
        raise TypeError(f"field {f.name}: an integer flag needs its range: "
                        "flag(..., low=, high=)")
    return non_empty if hint is str else hint


def field_docs(cls: type[Any]) -> dict[str, str]:
    """The string literal under each field in the class body, on one line; {} when
    the source cannot be read (the flags then work with shorter help)."""
    docs: dict[str, str] = {}
    for klass in filter(dataclasses.is_dataclass, reversed(cls.__mro__)):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        top = tree.body[0] if tree.body else None
        body = top.body if isinstance(top, ast.ClassDef) else []
        for node, after in itertools.pairwise(body):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def explicit_overrides(namespace: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig fields the user set on the command line."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return {k: v for k, v in vars(namespace).items() if k in known}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but errors are one line naming the problem and where to look."""

    def error(self, message: str) -> Any:  # argparse declares NoReturn
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
