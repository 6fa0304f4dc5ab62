"""Pure pieces: config validation, run directories, checkpoint files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ddtop.core.config import TrainConfig, resume_mismatch
from ddtop.core.contract import TELEMETRY_ENV, UsageError, telemetry_endpoint
from ddtop.core.rundir import RunPaths, find_run, write_json_atomic
from ddtop.core.text import count_of
from ddtop.training import checkpoint


def test_defaults_are_valid_and_split_across_ranks() -> None:
    config = TrainConfig(world_size=8, workers=8).validate()
    assert (config.batch_per_rank, config.workers_per_rank) == (8, 1)


@pytest.mark.parametrize(("fields", "message"), [
    ({"world_size": 4, "batch_size": 10}, "--batch-size 10 is the global batch"),
    ({"world_size": 4, "batch_size": 3}, "use 4"),
    ({"epochs": 0}, "--epochs must be at least 1"),
    ({"master_port": 70000}, "--master-port must be at most 65535 .got 70000.: give 0 to 65535"),
    ({"sync_every": -1}, "--sync-every"),
    ({"run_id": "a/b"}, "--run-id"),
])
def test_validation_names_the_flag(fields: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        TrainConfig(**fields).validate()  # type: ignore[arg-type]


def test_a_count_of_ranks_reads_as_a_sentence() -> None:
    assert [count_of(n, "rank") for n in (1, 2, 8)] == ["1 rank", "2 ranks", "8 ranks"]
    assert count_of(1, "epoch") == "1 epoch"


@pytest.mark.parametrize(("value", "endpoint"), [
    (None, None), ("", None), ("off", None),
    ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555"), ("ipc:///tmp/t.ipc", "ipc:///tmp/t.ipc")])
def test_telemetry_is_off_when_its_variable_is_unset_empty_or_off(
        monkeypatch: pytest.MonkeyPatch, value: str | None, endpoint: str | None) -> None:
    if value is None:
        monkeypatch.delenv(TELEMETRY_ENV, raising=False)
    else:
        monkeypatch.setenv(TELEMETRY_ENV, value)
    assert telemetry_endpoint() == endpoint


def test_config_round_trips_and_digest_tracks_results() -> None:
    config = TrainConfig(world_size=2, model="cnn")
    assert TrainConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert config.digest() == TrainConfig(world_size=2, model="cnn", epochs=9).digest()
    assert config.digest() != TrainConfig(world_size=2, model="mlp").digest()


def test_resume_mismatch_lists_changed_flags() -> None:
    saved = TrainConfig(world_size=2).to_dict()
    assert resume_mismatch(saved, TrainConfig(world_size=2, epochs=10)) == []
    assert resume_mismatch(saved, TrainConfig(world_size=4, model="cnn")) == [
        "--model mlp -> cnn", "--world-size 2 -> 4"]


def make_run(base: Path, name: str, written: int) -> None:
    config = RunPaths(base / name).create().config
    config.write_text("{}")
    os.utime(config, (written, written))


def test_find_run_newest_prefix_and_ambiguity(tmp_path: Path) -> None:
    for i, name in enumerate(("20260101-000000-aaaa", "20260102-000000-bbbb",
                              "20260102-000000-bbcc")):
        make_run(tmp_path, name, written=1_000_000 + i)
    assert find_run(tmp_path, None).run_id == "20260102-000000-bbcc"
    make_run(tmp_path, "my-run", written=2_000_000)  # newest, though it sorts first by name
    assert find_run(tmp_path, None).run_id == "my-run"
    assert find_run(tmp_path, "20260101").run_id == "20260101-000000-aaaa"
    with pytest.raises(UsageError, match="ambiguous"):
        find_run(tmp_path, "20260102-000000-bb")
    with pytest.raises(UsageError, match="no run 'zzz'"):
        find_run(tmp_path, "zzz")


def test_atomic_json_leaves_no_temporary_file(tmp_path: Path) -> None:
    write_json_atomic(tmp_path / "x.json", {"a": 1})
    write_json_atomic(tmp_path / "x.json", {"a": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": 2}


def state(step: int) -> dict[str, object]:
    return {"global_step": step, "model": {"w": torch.full((2,), float(step))},
            "config": TrainConfig().to_dict()}


def test_checkpoints_keep_newest_and_skip_damaged(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, state(step), keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000002.pt", "step-00000003.pt", "step-00000004.pt"]
    (tmp_path / "step-00000004.pt").write_bytes(b"truncated")
    found = checkpoint.load_newest_valid(tmp_path)
    assert found is not None and found[1]["global_step"] == 3
    assert "skipping unreadable checkpoint step-00000004.pt" in capsys.readouterr().err


def test_checkpoint_from_another_model_is_refused(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path, state(1), keep=0)
    loaded = checkpoint.load_newest_valid(tmp_path)
    assert loaded is not None
    with pytest.raises(UsageError, match="--model mlp -> resnet18"):
        checkpoint.check_compatible(path, loaded[1], TrainConfig(model="resnet18"))
