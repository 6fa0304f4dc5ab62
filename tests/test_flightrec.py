"""The Flight Recorder's dumps read back and said in words (daemon/flightrec.py), on
dumps in torch's JSON format as a gloo rank writes them (training/flightrec.py);
the real dumps of real runs are in tests/test_drills.py and tests/test_desync.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ddtop.daemon import flightrec


def entry(seq: int, op: str, group: tuple[str, str] = ("0", "default_pg"), size: int = 4,
          dtype: str = "Float", retired: bool = True, p2p: bool = False) -> dict[str, Any]:
    """One entry as torch 2.14 writes it for gloo (its fields, a few not read)."""
    return {"collective_seq_id": seq, "input_dtypes": [dtype], "input_sizes": [[size]],
            "is_p2p": p2p, "op_id": seq, "output_dtypes": [dtype], "output_sizes": [[size]],
            "p2p_seq_id": 0, "pg_id": int(group[0]), "process_group": list(group),
            "profiling_name": f"gloo:{op}", "record_id": seq, "retired": retired,
            "state": "scheduled", "thread_id": "1", "thread_name": "python",
            "time_created_ns": 1, "time_discovered_completed_ns": 0,
            "time_discovered_started_ns": 0, "timeout_ms": 1800000}


def dump(entries: list[dict[str, Any]], groups: dict[str, str] | None = None) -> bytes:
    config = {name: {"desc": "", "name": name, "ranks": ranks}
              for name, ranks in (groups or {"": "[0, 1]"}).items()}
    return json.dumps({"version": "2.10", "comm_lib_version": "", "nccl_comm_state": {},
                       "pg_config": config, "pg_status": {}, "entries": entries}).encode()


def read(tmp_path: Path, data: bytes, name: str = "rank-0.fr.json") -> flightrec.Dump | str:
    path = tmp_path / name
    path.write_bytes(data)
    return flightrec.read(path)


def dumps(tmp_path: Path, by_rank: dict[int, list[dict[str, Any]]],
          groups: dict[str, str] | None = None) -> dict[int, flightrec.Dump]:
    read_back = {k: read(tmp_path, dump(entries, groups), f"rank-{k}.fr.json")
                 for k, entries in by_rank.items()}
    assert all(isinstance(d, flightrec.Dump) for d in read_back.values()), read_back
    return read_back  # type: ignore[return-value]


def test_a_desync_names_each_sides_last_collective(tmp_path: Path) -> None:
    done = [entry(n, "all_reduce") for n in range(1, 7)]
    found = dumps(tmp_path, {
        0: [*done, entry(7, "all_reduce", retired=False)],
        1: [*done, entry(7, "all_reduce", retired=False)],
        2: [*done, entry(7, "all_reduce", retired=False)],
        3: [*done, entry(7, "all_gather", size=1, retired=False)]})
    assert flightrec.verdict(found) == (
        "Flight Recorder: group world: ranks 0-2' last is all_reduce #7 (float32 x 4, not "
        "completed); rank 3's is all_gather #7 (float32 x 1, not completed)")


def test_a_hang_in_a_sub_group_names_each_group(tmp_path: Path) -> None:
    pair = ("1", "undefined")
    world = [entry(n, "all_reduce") for n in range(1, 4)]
    found = dumps(tmp_path, {
        # Ranks 0-1 wait in the world's #4 for ranks 2-3; rank 3 waits in its pair's #2
        # for rank 2, which is outside any collective (its pair's #1 is over).
        0: [*world, entry(4, "all_reduce", retired=False)],
        1: [*world, entry(4, "all_reduce", retired=False)],
        2: [*world, entry(1, "all_reduce", pair)],
        3: [*world, entry(1, "all_reduce", pair), entry(2, "all_reduce", pair, retired=False)],
    })  # (torch 2.14's gloo dumps: pg_config names no group, {"": ...})
    # Named as the ranks' signatures named it, or else by torch's name.
    assert "; group pg 1 (undefined): rank 2's last" in flightrec.verdict(found)
    assert flightrec.verdict(found, {"1": "[2,3]", "0": "world"}) == (
        "Flight Recorder: group world: ranks 0-1' last is all_reduce #4 (float32 x 4, not "
        "completed); ranks 2-3' is all_reduce #3 (float32 x 4, over); group [2,3]: rank 2's "
        "last is all_reduce #1 (float32 x 4, over); rank 3's is all_reduce #2 (float32 x 4, "
        "not completed)")


def test_ranks_whose_last_collectives_are_all_over_and_alike_say_so(tmp_path: Path) -> None:
    same = [entry(1, "broadcast", dtype="Long"), entry(2, "all_reduce", dtype="BFloat16"),
            entry(3, "send", p2p=True, retired=False)]  # point-to-point: not a group's
    assert flightrec.verdict(dumps(tmp_path, {0: same, 1: same})) == (
        "Flight Recorder: every rank's last collective is over, the same in each group")
    assert flightrec.verdict({}) == ""


def test_what_a_rank_wrote_is_not_trusted(tmp_path: Path) -> None:
    assert read(tmp_path, b"\x00garbage").startswith("not a Flight Recorder dump (")
    assert read(tmp_path, b'{"entries": 3}').startswith("not a Flight Recorder dump (")
    assert read(tmp_path, json.dumps({"error": "RuntimeError: no\x1b[2J"}).encode()) == \
        "torch could not dump it: RuntimeError: no?[2J"
    assert flightrec.read(tmp_path / "none.json").startswith("unreadable (")
    # Names cut to printable characters; sizes and dtypes of any shape said, not raised on.
    odd = entry(1, "all_reduce\x1b[31m", ("\n0", "default_pg"), retired=False)
    odd["input_sizes"], odd["input_dtypes"] = [[2, "x"], 7], [None, "Weird\t"]
    found = dumps(tmp_path, {0: [odd]})
    assert flightrec.verdict(found) == (
        "Flight Recorder: group world: rank 0's last is all_reduce?[31m #1 (not completed)")


def test_a_dump_beyond_its_bound_is_not_read(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flightrec, "MAX_DUMP_BYTES", 1 << 20)
    data = dump([entry(n, "all_reduce") for n in range(1, 4000)])
    assert len(data) > 1 << 20
    assert read(tmp_path, data) == "over 1 MiB: not read"


def test_a_dump_that_names_a_groups_ranks_is_named_by_them(tmp_path: Path) -> None:
    waiting = [entry(1, "all_reduce", ("5", "undefined"), retired=False)]
    found = dumps(tmp_path, {0: waiting, 1: waiting}, groups={"5": "[0, 1]"})
    assert flightrec.verdict(found) == ("Flight Recorder: group [0,1]: ranks 0-1' last is "
                                        "all_reduce #1 (float32 x 4, not completed)")
