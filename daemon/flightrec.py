"""The Flight Recorder's dumps of a run's ranks (training/flightrec.py writes them
beside each rank's stacks), read back for the evidence, and their verdict in words:

    Flight Recorder: group world: ranks 0-2's last is all_reduce #7 (float32 x 4, not
    completed); rank 3's is all_gather #7 (float32 x 4, not completed)

Groups are named as ddtop's
signatures name them ("world", or their ranks), else by torch's name. For each
process group where a rank's last collective is not over, or where the
ranks' last ones differ, each rank's last entry (the group's own #N, as torch
counts it: every collective of the group, DDP's buckets and the object
collectives' inner calls included), ranks with the same one together.

The dumps are the ranks' files, so nothing in them is trusted: each is read
within MAX_DUMP_BYTES, decoded against the few fields the verdict reads (a file
that does not decode is named as unreadable), and every string it gives is cut
to a few printable characters before it is shown.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec

from ddtop.core.text import rank_list

MAX_DUMP_BYTES = 64 << 20  # a dump of 1,000,000 entries is about 600 MB: refused beyond
MAX_GROUPS_SAID = 4  # groups in the verdict; "and N more" beyond
_UNSAFE = re.compile(r"[^A-Za-z0-9_:.\-\[\], ]")
# torch's dtype names (c10's ScalarType) as ddtop says them elsewhere.
DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
          "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
          "Bool": "bool"}


class Entry(msgspec.Struct):
    """One collective of a rank's Flight Recorder (the fields read; the rest ignored)."""

    collective_seq_id: int = 0
    is_p2p: bool = False
    profiling_name: str = ""
    process_group: list[Any] = []  # [its name, its description]
    input_sizes: list[Any] = []  # a list of dimensions per input
    input_dtypes: list[Any] = []
    retired: bool = True
    state: str = ""


class GroupConfig(msgspec.Struct):
    desc: str = ""
    ranks: str = ""


class Dump(msgspec.Struct):
    entries: list[Entry] = []
    pg_config: dict[str, GroupConfig] = {}
    error: str | None = None


_decoder = msgspec.json.Decoder(Dump)


def read(path: Path) -> Dump | str:
    """Rank's dump at `path`, or why it cannot be had, in words."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_DUMP_BYTES + 1)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    if len(data) > MAX_DUMP_BYTES:
        return f"over {MAX_DUMP_BYTES >> 20} MiB: not read"
    try:
        dump = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return f"not a Flight Recorder dump ({_clean(str(e), 80)})"
    if dump.error is not None:
        return f"torch could not dump it: {_clean(dump.error, 120)}"
    return dump


Last = tuple[int, str, str, bool]  # the group's #N, op, input, over


def verdict(dumps: dict[int, Dump], known: dict[str, str] | None = None) -> str:
    """The dumps' verdict in words (module docstring); "" without a dump. `known`:
    the groups' names as ddtop says them, by torch's name of the group (what the
    ranks' signatures said: torch 2.14's gloo dumps leave a sub-group's ranks out)."""
    if not dumps:
        return ""
    lasts: dict[str, dict[int, Last]] = {}
    names: dict[str, str] = {}
    for rank, dump in sorted(dumps.items()):
        for entry in dump.entries:
            if entry.is_p2p or not entry.process_group:
                continue
            key = _clean(str(entry.process_group[0]), 32)
            if key not in names:
                names[key] = (known or {}).get(key) or _group_name(entry, dump)
            mine = lasts.setdefault(key, {})
            if rank not in mine or entry.collective_seq_id >= mine[rank][0]:
                mine[rank] = (entry.collective_seq_id, _op(entry.profiling_name),
                              _input(entry), entry.retired)
    said = []
    for key, by_rank in lasts.items():
        if all(over for *_, over in by_rank.values()) and len(set(by_rank.values())) == 1:
            continue  # every rank's last is the same, and over: nothing waits here
        said.append(f"group {names[key]}: " + _sides(by_rank))
    if not said:
        return ("Flight Recorder: every rank's last collective is over, the same in each "
                "group")
    more = len(said) - MAX_GROUPS_SAID
    return ("Flight Recorder: " + "; ".join(said[:MAX_GROUPS_SAID])
            + (f"; and {more} more group{'s' if more > 1 else ''}" if more > 0 else ""))


def _sides(by_rank: dict[int, Last]) -> str:
    sides: dict[Last, list[int]] = {}
    for rank, last in sorted(by_rank.items()):
        sides.setdefault(last, []).append(rank)
    words = []
    for n, (last, ranks) in enumerate(sorted(sides.items(), key=lambda s: -len(s[1]))):
        seq, op, shape, over = last
        whose = (f"rank {ranks[0]}'s" if len(ranks) == 1 else f"{rank_list(ranks)}'")
        what = f"{op} #{seq}" + (f" ({shape}, " if shape else " (") + (
            "over)" if over else "not completed)")
        words.append(f"{whose} {'last is' if n == 0 else 'is'} {what}")
    return "; ".join(words)


def _group_name(entry: Entry, dump: Dump) -> str:
    name = str(entry.process_group[0])
    desc = str(entry.process_group[1]) if len(entry.process_group) > 1 else ""
    if desc == "default_pg":
        return "world"
    config = dump.pg_config.get(name)
    if config is not None and config.ranks:
        return _clean(config.ranks.replace(" ", ""), 40)
    return f"pg {_clean(name, 32)}" + (f" ({_clean(desc, 32)})" if desc else "")


def _op(profiling_name: str) -> str:
    """'gloo:all_reduce' -> 'all_reduce'."""
    return _clean(profiling_name.rpartition(":")[2], 40) or "?"


def _input(entry: Entry) -> str:
    if not entry.input_sizes:
        return ""
    elements = 0
    for size in entry.input_sizes[:64]:
        if not isinstance(size, list):
            return ""
        n = 1
        for d in size[:8]:
            n *= max(0, min(d, 1 << 40)) if isinstance(d, int) else 0
        elements += n
    dtypes = {DTYPES.get(d, _clean(d, 16).lower()) if isinstance(d, str) else "?"
              for d in entry.input_dtypes[:64]}
    dtype = dtypes.pop() if len(dtypes) == 1 else "mixed"
    return f"{dtype} x {elements:,}"


def _clean(text: str, limit: int) -> str:
    return _UNSAFE.sub("?", text[:limit])
