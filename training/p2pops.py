"""torch's `P2POp` and `batch_isend_irecv` kept working once `isend` and `irecv`
are wrapped (training/collectives.py).

torch knows the two by identity: `P2POp(op, ...)` refuses an op that is not
torch.distributed's `isend` or `irecv` as the module holds them at that moment
(`_check_op`), and `batch_isend_irecv` gives each op the peer's keyword by
`op.op is isend`. Wrapped, the module holds ddtop's wrappers, which both then
see, so `P2POp(dist.isend, ...)` works as it did. A program that took torch's
own function before they were wrapped (`from torch.distributed import isend`
before the rank was instrumented) would have its P2POp refused, and its batch
given the wrong keyword. So, while they are wrapped:

- `_check_op` also accepts torch's own two;
- `batch_isend_irecv` hands each of its P2POps holding torch's own the wrapper
  instead, then is torch's own (each op is then seen as a wrapped isend or irecv
  is: in the order the batch issues them).

Where torch has neither (another torch), `install` says so and isend and irecv
are left torch's own. This module imports only the standard library.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

_saved: dict[str, Callable[..., Any]] = {}  # "_check_op", "batch_isend_irecv" -> torch's
HOLDERS = ("torch.distributed", "torch.distributed.distributed_c10d")


def can_install(c10d: Any) -> bool:
    """Whether torch has the two this module replaces, as expected."""
    return callable(getattr(c10d, "_check_op", None)) and callable(
        getattr(c10d, "batch_isend_irecv", None))


def install(c10d: Any, modules: list[Any], ours: dict[Callable[..., Any], Callable[..., Any]]
            ) -> None:
    """`ours`: torch's isend and irecv -> their wrappers (already where programs reach
    them); `modules`: where programs reach batch_isend_irecv."""
    if _saved or not can_install(c10d):
        return
    check, batch = c10d._check_op, c10d.batch_isend_irecv
    _saved["_check_op"], _saved["batch_isend_irecv"] = check, batch

    def _check_op(op: Any) -> None:
        check(ours.get(op, op) if _hashable(op) else op)

    @functools.wraps(batch)
    def batch_isend_irecv(p2p_op_list: Any) -> Any:
        with contextlib.suppress(Exception):  # (torch's own check says what is wrong)
            for p2p_op in p2p_op_list:
                theirs = getattr(p2p_op, "op", None)
                if _hashable(theirs) and theirs in ours:
                    p2p_op.op = ours[theirs]
        return batch(p2p_op_list)

    c10d._check_op = _check_op
    for module in modules:
        if getattr(module, "batch_isend_irecv", None) is batch:
            module.batch_isend_irecv = batch_isend_irecv


def uninstall(c10d: Any, modules: list[Any]) -> None:
    """torch's own two back."""
    if not _saved:
        return
    c10d._check_op = _saved["_check_op"]
    batch = _saved["batch_isend_irecv"]
    for module in modules:
        current = getattr(module, "batch_isend_irecv", None)
        if getattr(current, "__wrapped__", None) is batch:
            module.batch_isend_irecv = batch
    _saved.clear()


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
