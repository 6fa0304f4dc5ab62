"""Every collective of torch.distributed a rank enters, seen (zero-code mode).

Frameworks run collectives of their own besides DDP's gradient all-reduce:
Lightning broadcasts its SIGTERM flag before every batch, Hugging Face's
Trainer all-gathers the number of items in each batch (through Accelerate),
and `all_gather_object`, barriers and the like come before and after. A rank
waiting in one of them waits for the others: without seeing it, a hang after
an optimizer step has nobody "in a collective" (the lowest stalled rank was
blamed), and a rank slowed between its optimizer step and the next such
collective makes the others' wait look like their own work.

`wrap()` replaces the public collective functions (OPS) where programs reach
them, `torch.distributed` and `torch.distributed.distributed_c10d` (the way
starthook.py wraps init_process_group); they call through at once unless
`watch(rank)` has named a rank (autowatch.install). For the rank, each call:

- takes the next collective number and is named as the collective the rank
  is in (`LiveTelemetry.collective_started`: what heartbeats say, and what the
  daemon's hang rule reads), with its payload in bytes where the tensors tell
  it at no cost (0 for barriers and the object collectives);
- when it returns (a blocking call) it is over, and its time is communication
  of the step in progress (`comm_done`: comm_s, bytes, ops of the Step, as a
  DDP all-reduce's), so the time a rank waits in it is never its compute;
- with `async_op=True` it is over when its work's future completes (seen
  from the backend's thread), and its time runs from the call to then; where
  a backend gives no future, it is over as the call returns.

A collective called from inside another (an object collective's own
`all_gather` and `broadcast`) is part of it, not another, on the same thread.
DDP's gradient all-reduce is not one of them: its reducer calls the process
group from C++, and a comm hook in Python (torch's `allreduce_hook`, PowerSGD,
a user's own, ddtop's timer on a GPU) that calls `dist.all_reduce` runs as
`ddp_hook` makes it, so what it calls is DDP's all-reduce, timed as such
(DDPStats, CommTimer), not seen again here.

Point-to-point calls are seen with their peer, never as their group's
collective: `send` and `recv`, and `isend` and `irecv`, also as the ops of a
`batch_isend_irecv` (each as the batch issues it; torch's P2POp and the batch
know the two by identity, which training/p2pops.py keeps). An isend or irecv is
over when its work is completed: gloo's give no future, so the sender thread
asks (training/pendingworks.py), and their time is not counted as
communication.

Not seen: the ProcessGroup's methods called directly (`pg.allreduce(...)`),
torch's functional collectives (`torch.distributed._functional_collectives`,
DTensor) and `all_gather_single` / `reduce_scatter_single` (FSDP2's own). Code that
holds a collective function it took before `wrap()` (`from torch.distributed
import all_reduce` before the rank was instrumented) calls the original: under
`ddtrain start` wrap() runs before the script, and the start-up hook runs it
as soon as torch is imported.

Nothing here raises into the program: a failure of its own is one warning
event, and the collective runs as it would have. This module imports only
torch, the standard library and its two helpers: the start-up hook loads it as torch is
imported, in processes that may never become ranks.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ddtop.training import p2pops, pendingworks

if TYPE_CHECKING:
    from ddtop.training.telemetry import LiveTelemetry

# Where programs reach the collective functions: each that holds torch's is wrapped.
HOLDERS = ("torch.distributed", "torch.distributed.distributed_c10d")

Args = tuple[Any, ...]
Kwargs = dict[str, Any]
Size = Callable[[Args, Kwargs], int]


def _arg(args: Args, kwargs: Kwargs, at: int, name: str) -> Any:
    return args[at] if len(args) > at else kwargs.get(name)


def _bytes(t: Any) -> int:
    return t.nbytes if isinstance(t, torch.Tensor) else 0


def _count(items: Any) -> int:
    return len(items) if isinstance(items, list | tuple) else 0


def _tensor(at: int, name: str) -> Size:
    """The bytes of one tensor argument."""
    def size(args: Args, kwargs: Kwargs) -> int:  # (every call: _arg and _bytes inline)
        t = args[at] if len(args) > at else kwargs.get(name)
        return t.nbytes if isinstance(t, torch.Tensor) else 0
    return size


def _times_list(at: int, name: str, list_at: int, list_name: str) -> Size:
    """One tensor's bytes, as many times as a list argument has tensors."""
    return lambda args, kwargs: (_bytes(_arg(args, kwargs, at, name))
                                 * _count(_arg(args, kwargs, list_at, list_name)))


def _list(at: int, name: str) -> Size:
    def size(args: Args, kwargs: Kwargs) -> int:
        items = _arg(args, kwargs, at, name)
        return sum(map(_bytes, items)) if isinstance(items, list | tuple) else 0
    return size


def _nothing(args: Args, kwargs: Kwargs) -> int:
    return 0


# The input a collective's signature describes (its dtype and elements): a tensor
# argument, or a list's first tensor; None for a barrier or an object collective.
Input = Callable[[Args, Kwargs], Any]


def _input(at: int, name: str) -> Input:
    return lambda args, kwargs: args[at] if len(args) > at else kwargs.get(name)


def _first(at: int, name: str) -> Input:
    def first(args: Args, kwargs: Kwargs) -> Any:
        items = _arg(args, kwargs, at, name)
        return items[0] if isinstance(items, list | tuple) and items else None
    return first


def _none(args: Args, kwargs: Kwargs) -> Any:
    return None


# Bus-bandwidth families (nccl-tests' busbw / algbw): set for the world size in watch().
ALL_REDUCE, GATHER, ONE = "all_reduce", "gather", "one"
# name -> (its payload in bytes, as nccl-tests sizes the op; its bus family; the
# input its signature describes: for the gathers and scatters, one rank's part).
OPS: dict[str, tuple[Size, str, Input]] = {
    "all_reduce": (_tensor(0, "tensor"), ALL_REDUCE, _input(0, "tensor")),
    "broadcast": (_tensor(0, "tensor"), ONE, _input(0, "tensor")),
    "reduce": (_tensor(0, "tensor"), ONE, _input(0, "tensor")),
    "all_gather": (_times_list(1, "tensor", 0, "tensor_list"), GATHER, _input(1, "tensor")),
    "all_gather_into_tensor": (_tensor(0, "output_tensor"), GATHER,
                               _input(1, "input_tensor")),
    "reduce_scatter": (_times_list(0, "output", 1, "input_list"), GATHER, _input(0, "output")),
    "reduce_scatter_tensor": (_tensor(1, "input"), GATHER, _input(0, "output")),
    "gather": (_tensor(0, "tensor"), ONE, _input(0, "tensor")),
    "scatter": (_tensor(0, "tensor"), ONE, _input(0, "tensor")),
    "all_to_all": (_list(1, "input_tensor_list"), GATHER, _first(1, "input_tensor_list")),
    "all_to_all_single": (_tensor(1, "input"), GATHER, _input(1, "input")),
    "barrier": (_nothing, ONE, _none),
    "monitored_barrier": (_nothing, ONE, _none),
    "all_gather_object": (_nothing, ONE, _none),
    "broadcast_object_list": (_nothing, ONE, _none),
    "gather_object": (_nothing, ONE, _none),
    "scatter_object_list": (_nothing, ONE, _none),
    "send": (_tensor(0, "tensor"), ONE, _input(0, "tensor")),
    "recv": (_tensor(0, "tensor"), ONE, _input(0, "tensor")),
    "isend": (_tensor(0, "tensor"), ONE, _input(0, "tensor")),
    "irecv": (_tensor(0, "tensor"), ONE, _input(0, "tensor")),
}
# Point-to-point: the peer's argument (a global rank). Not its group's collective:
# never counted in the group's number (only two of its ranks take part).
P2P = {"send": (1, "dst"), "recv": (1, "src"), "isend": (1, "dst"), "irecv": (1, "src")}
# Always asynchronous (no async_op: they return their work). torch's P2POp and
# batch_isend_irecv know them by identity: wrapped only where training/p2pops.py
# keeps those working.
ASYNC = frozenset({"isend", "irecv"})


class Rank(Protocol):
    """What a wrapped collective asks of the rank it reports to (api.py's LiveRank)."""

    active: bool  # False in a forked child: nothing is marked
    telemetry: LiveTelemetry

    def warn_once(self, key: str, message: str) -> None: ...


class _Thread(threading.local):
    """What this thread is in: a wrapped collective (one called from it is part of
    it), or a DDP comm hook (what it calls is DDP's all-reduce)."""

    inside = False


_rank: Rank | None = None  # the rank the collectives are marked for
_thread = _Thread()
_factors = {ALL_REDUCE: 1.0, GATHER: 1.0, ONE: 1.0}
_wrapped: dict[str, Callable[..., Any]] = {}  # name -> torch's own function
_compiling = torch.compiler.is_compiling
# A process group -> [its name, size and ranks, the number of its collectives this
# rank has entered, 1] (_group). Keyed by the group object: a group made again
# (torch's process group destroyed and created anew) counts anew. Weakly: a group the
# script destroyed is released as torch expects (held here, it lived on to the
# interpreter's exit, where tearing down its gloo threads could abort the process).
_groups: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
_dtypes: dict[Any, str] = {}  # torch.float32 -> "float32"
_members: Any = None  # torch's GroupMember (its WORLD: the default group), set by wrap()
MAX_RANKS_TEXT = 128  # wire.RanksText's bound


def wrap() -> None:
    """Replace the collective functions where programs reach them (idempotent;
    those torch does not have are left out)."""
    if _wrapped:
        return
    global _members
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:  # torch.distributed not available in this build
        return
    _members = c10d.GroupMember
    p2p_ops = p2pops.can_install(c10d)
    ours: dict[Callable[..., Any], Callable[..., Any]] = {}  # torch's isend, irecv -> ours
    for name, (size, family, described) in OPS.items():
        original = getattr(c10d, name, None)
        if not callable(original) or (name in ASYNC and not p2p_ops):
            continue
        _wrapped[name] = original
        wrapper = _wrap(name, original, size, family, described)
        if name in ASYNC:
            ours[original] = wrapper
        for holder in HOLDERS:
            module = sys.modules.get(holder)
            if module is not None and getattr(module, name, None) is original:
                setattr(module, name, wrapper)
    if ours:
        p2pops.install(c10d, _holders(), ours)


def _holders() -> list[Any]:
    return [m for m in (sys.modules.get(h) for h in HOLDERS) if m is not None]


def unwrap() -> None:
    """torch's own functions back where they were (for tests and benchmarks)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is not None:
        p2pops.uninstall(c10d, _holders())
    for name, original in _wrapped.items():
        for holder in HOLDERS:
            module = sys.modules.get(holder)
            current = getattr(module, name, None) if module is not None else None
            if getattr(current, "__wrapped__", None) is original:
                setattr(module, name, original)
    _wrapped.clear()


def watch(rank: Rank | None) -> None:
    """Mark the collectives of `rank` from now on (None: nobody's)."""
    global _rank
    if rank is not None:
        n = max(1, rank.telemetry.world_size)
        _factors[ALL_REDUCE], _factors[GATHER] = 2 * (n - 1) / n, (n - 1) / n
    _rank = rank


def ddp_hook(hook: Any) -> Any:
    """`hook`, a DDP comm hook, as DDP is given it: the collectives it calls are
    DDP's gradient all-reduce (timed by DDPStats or the CommTimer), not seen here.
    It runs as it would (its signature, name and result are its own); what is not
    callable is left as it is, for DDP to refuse as it would."""
    if not callable(hook):
        return hook

    @functools.wraps(hook)
    def comm_hook(*args: Any) -> Any:
        thread = _thread
        if _compiling() or thread.inside:  # (compiled autograd traces it: as it is)
            return hook(*args)
        thread.inside = True
        try:
            return hook(*args)
        finally:
            thread.inside = False

    return comm_hook


def _param_at(original: Callable[..., Any], param: str) -> int:
    """The position of `param` (`async_op`, `group`) among the positional
    parameters of torch's function (under its decorators), or -1 without one."""
    inner = original
    while hasattr(inner, "__wrapped__"):  # (inspect.unwrap, without importing inspect)
        inner = inner.__wrapped__
    code = getattr(inner, "__code__", None)
    if code is None:
        return -1
    params = code.co_varnames[: code.co_argcount]
    return params.index(param) if param in params else -1


def ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 3] -> "0-3"; [2, 3] -> "2,3"; [0, 2, 4, 5, 6] -> "0,2,4-6" (runs of
    three or more as a range), cut at MAX_RANKS_TEXT characters ("...")."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ranks[i]}-{ranks[j]}")
        else:
            parts.extend(str(r) for r in ranks[i:j + 1])
        i = j + 1
    text = ",".join(parts)
    return text if len(text) <= MAX_RANKS_TEXT else text[:MAX_RANKS_TEXT - 3] + "..."


def _group(pg: Any) -> list[Any]:
    """The entry of process group `pg` (the default one: "world"), made at its first
    collective: [name, size, ranks, its collectives so far, 1, its description] (for
    a group this rank is not in, or before any process group: ["", 0, "", 0, 0, ""],
    never counted)."""
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    try:
        ranks = sorted(c10d.get_process_group_ranks(pg))
        world = pg is c10d.GroupMember.WORLD
        name = "world" if world else str(c10d._get_process_group_name(pg))
        entry = [name[:64], len(ranks), ranks_text(ranks), 0, 1, "" if world else _desc(pg)]
    except Exception:  # noqa: BLE001 - not a group of this rank's: never compared
        entry = ["", 0, "", 0, 0, ""]
    _groups[pg] = entry
    return entry


def group_entered(pg: Any, dtype: str, count: int) -> tuple[str, int, str, int, str, int, int, str]:
    """The signature of a collective on group `pg` that ddtop issues or sees itself
    rather than through a wrapped function (DDP's gradient all-reduce of a step:
    training/commtimer.py), counted in the group's own sequence as the wrapped ones
    are: `dtype` and `count`, the elements it reduces."""
    entry = _groups.get(pg) or _group(pg)
    entry[3] += entry[4]
    return entry[0], entry[1], entry[2], entry[3], dtype, count, -1, entry[5]


def _desc(pg: Any) -> str:
    """A group's description where one was given (`new_group(group_desc=)`, or a
    DeviceMesh's for its dimension: "mesh_tp"), else ""; printable, as wire.GroupName."""
    desc = str(getattr(pg, "group_desc", "") or "")
    if desc in ("undefined", "default_pg"):
        return ""
    return "".join(ch if ch.isprintable() else "?" for ch in desc[:64])


def p2p_entered(pg: Any, dtype: str, count: int, peer: int
                ) -> tuple[str, int, str, int, str, int, int, str]:
    """The signature of a send or recv ddtop issues itself (a p2p-hang drill) on
    group `pg` (None: the default one), with its `peer`: not counted in the
    group's sequence, as a wrapped one's is not."""
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    pg = c10d.GroupMember.WORLD if pg is None else pg
    entry = _groups.get(pg) or _group(pg)
    return entry[0], entry[1], entry[2], 0, dtype, count, peer, entry[5]


def counts() -> list[tuple[str, int]]:
    """The collectives entered so far on each group of this rank that has had one
    (wire.GroupCounts), at most wire.MAX_COUNTED_GROUPS of them."""
    try:
        found = [(e[0], e[3]) for e in list(_groups.values()) if e[4] and e[3]]
    except RuntimeError:  # (a group made on another thread meanwhile: none this time)
        return []
    return found[:64]


def entered(pg: Any, dtype: str = "", count: int = -1
            ) -> tuple[str, int, str, int, str, int, int, str]:
    """group_entered for a collective the built-in trainer issues itself (its
    metrics' and checkpoints' all_gather_object, a desync drill's all_gather):
    `pg` None is the default group; an object collective has no dtype and -1
    elements, as a wrapped one's signature says."""
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    return group_entered(c10d.GroupMember.WORLD if pg is None else pg, dtype, count)


def _dtype(t: Any) -> str:
    name = _dtypes.get(t.dtype)
    if name is None:
        name = _dtypes[t.dtype] = str(t.dtype).removeprefix("torch.")
    return name


def signature(name: str, args: Args, kwargs: Kwargs, group_at: int, described: Input,
              peer_at: tuple[int, str] | None = None
              ) -> tuple[str, int, str, int, str, int, int, str]:
    """The signature of a call of `name` (telemetry.Signature): its group, the
    group's count of collectives on this rank (this one included; 0 where the
    group is not this rank's, and for a point-to-point call), the dtype and
    elements of its input, and the peer of a point-to-point call (`peer_at`:
    where its argument is; -1 otherwise, or when not given)."""
    group = args[group_at] if 0 <= group_at < len(args) else kwargs.get("group")
    if group is None:  # the default group, whatever it is now (None before there is one)
        group = _members.WORLD
    entry = _groups.get(group)
    if entry is None:
        entry = _group(group)
    peer = -1
    if peer_at is None:
        entry[3] += entry[4]
        number = entry[3]
    else:
        at, arg = peer_at
        given = args[at] if len(args) > at else kwargs.get(arg)
        if given is None and isinstance(kwargs.get(f"group_{arg}"), int):
            given = _global(group, kwargs[f"group_{arg}"])  # (batch_isend_irecv's way)
        peer, number = given if isinstance(given, int) and given >= 0 else -1, 0
    t = described(args, kwargs)
    if isinstance(t, torch.Tensor):
        dtype = _dtypes.get(t.dtype) or _dtype(t)
        return entry[0], entry[1], entry[2], number, dtype, t.numel(), peer, entry[5]
    return entry[0], entry[1], entry[2], number, "", -1, peer, entry[5]


def _global(group: Any, group_rank: int) -> int:
    """The global rank of `group`'s rank `group_rank` (-1: not known)."""
    try:
        return int(sys.modules["torch.distributed.distributed_c10d"].get_global_rank(
            group, group_rank))
    except Exception:  # noqa: BLE001 - not a group of this rank's: no peer named
        return -1


def _wrap(name: str, original: Callable[..., Any], size: Size, family: str,
          described: Input | None) -> Callable[..., Any]:
    """`described` None: no signature (bench/collectives.py's "unsigned": the
    wrapper as it was before signatures, side by side)."""
    async_at = _param_at(original, "async_op")
    group_at = _param_at(original, "group")
    peer_at = P2P.get(name)
    always = name in ASYNC
    perf_counter = time.perf_counter

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        rank = _rank
        # (Under torch.compile it is traced as torch's own, which dynamo knows.)
        if rank is None or _compiling():
            return original(*args, **kwargs)
        thread = _thread
        if thread.inside or not rank.active:
            return original(*args, **kwargs)
        try:
            telemetry = rank.telemetry
            nbytes = size(args, kwargs)
            later = always or (async_at >= 0 and bool(args[async_at] if len(args) > async_at
                                                      else kwargs.get("async_op", False)))
            coll = telemetry.collective_started(name, nbytes, None if described is None else
                                                signature(name, args, kwargs, group_at,
                                                          described, peer_at))
        except Exception as e:  # noqa: BLE001 - instrumentation must never break the script
            _failed(rank, e)
            return original(*args, **kwargs)
        thread.inside = True
        start = perf_counter()
        try:
            result = original(*args, **kwargs)
        except BaseException:
            thread.inside = False
            telemetry.collective_over(coll)  # (the program's own error goes on as it was)
            raise
        thread.inside = False
        try:
            if later and result is not None:
                _when_done(result, telemetry, coll, start, nbytes, _factors[family])
            else:
                telemetry.comm_done(perf_counter() - start, nbytes, _factors[family])
                telemetry.collective_over(coll)
        except Exception as e:  # noqa: BLE001 - instrumentation must never break the script
            _failed(rank, e)
        return result

    return collective


def _when_done(work: Any, telemetry: LiveTelemetry, coll: Any, start: float, nbytes: int,
               factor: float) -> None:
    """An asynchronous collective is over when its work's future completes (a work
    without one, gloo's isend and irecv: when the sender thread sees it completed)."""
    try:
        future = work.get_future()
    except Exception:  # noqa: BLE001 - no future: training/pendingworks.py
        pendingworks.add(work, lambda: telemetry.collective_over(coll))
        return

    def done(_: Any) -> None:  # on the backend's thread
        with contextlib.suppress(Exception):  # (nothing to tell it to there)
            telemetry.comm_done(time.perf_counter() - start, nbytes, factor)
            telemetry.collective_over(coll)

    future.add_done_callback(done)


def _failed(rank: Rank, e: Exception) -> None:
    rank.warn_once("hook-collective", "ddtop's collective hook failed and was skipped: "
                   f"{type(e).__name__}: {e}")
