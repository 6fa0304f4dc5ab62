"""torch's Flight Recorder, dumped beside a rank's stacks when the daemon asks for them.

The Flight Recorder keeps the last TORCH_FR_BUFFER_SIZE collectives a rank
entered on every process group (the op, its inputs' sizes and dtypes, the
group, the group's own #N, and whether it is over), for gloo as for NCCL.
`ddtrain start` turns it on for the ranks it starts (--flight-recorder,
core/contract.py FR_ENTRIES by default).

The daemon asks for a rank's stacks with a signal: faulthandler's C handler
appends them to logs/rank-K.stacks whatever the main thread is doing, stuck
in a collective included. The sender thread sees that file grow (`poll`: one
stat a pass, every 0.1 s) and writes the Flight Recorder's entries beside it,
whole (a temporary file renamed): rank-K.fr.json, torch's JSON dump
(`_dump_fr_trace_json`, 0.3 ms for 2,000 entries), or {"error": why there is
none}; the daemon reads it (daemon/flightrec.py).

(torch's pickle dump, the one torchfrtrace reads, is not written: torch 2.14's
gloo dumps name no group in their pg_config, and torchfrtrace stops on them
with KeyError: ('0', 0). NCCL's own recorder, `_dump_nccl_trace`, is not read.)

Nothing listens for it: the signal and the run folder are channels the run
already has. A rank whose threads cannot run (stopped, or a thread holding the
GIL) writes nothing, and the daemon says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ddtop.core.contract import FR_ENV, FR_JSON_SUFFIX

_stacks: Path | None = None  # the rank's stacks file, once watched
_size = 0  # its size as last seen


def entries() -> int:
    """The entries the Flight Recorder keeps in this process (0: off)."""
    value = os.environ.get(FR_ENV, "0").strip()
    return int(value) if value.isascii() and value.isdigit() else 0


def watch(stacks: Path) -> None:
    """Dump the Flight Recorder whenever `stacks` grows (where it is on)."""
    global _stacks, _size
    if entries() > 0:
        _stacks, _size = stacks, _file_size(stacks)


def poll() -> None:
    """On the sender thread, each pass: dump if the stacks file grew."""
    global _size
    stacks = _stacks
    if stacks is None:
        return
    size = _file_size(stacks)
    grew, _size = size > _size, size
    if grew:
        dump(stacks)


def dump(stacks: Path) -> None:
    """Write the Flight Recorder's dumps beside `stacks` (never raises)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    try:
        from torch._C import _distributed_c10d as c10d

        as_json = c10d._dump_fr_trace_json()  # type: ignore[attr-defined]
    except Exception as e:  # noqa: BLE001 - said in the evidence, never raised
        as_json = json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
    _write(stacks.with_suffix(FR_JSON_SUFFIX), as_json)


def _write(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_bytes(data)
        partial.replace(path)
    except OSError:
        pass  # (a full disk: the evidence says the dump is missing)


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
