"""A job of 16,384 ranks (2,048 nodes x 8) is configured, and what goes past the
limits is one line naming the limit: one machine starts at most 1,024 ranks, a
multi-node job has at most 65,536 ranks on at most 8,192 nodes (core/bounds.py,
docs/cli.md#limits). In process: the real parser and validation, nothing started."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from ddtop.core import protocol
from ddtop.core.bounds import MAX_JOB_RANKS, MAX_MACHINE_RANKS, MAX_NNODES
from ddtop.core.config import TrainConfig
from ddtop.core.state import MAX_RANKS
from ddtop.core.summary import RunRecord, decode_record, encode_record
from ddtop.daemon import cli
from ddtop.daemon.startline import parse_command_line, start_overrides

BIG = ("--nnodes", "2048", "--nproc-per-node", "8", "--node-rank", "5",
       "--rdzv-endpoint", "node0:29400", "--run-id", "big")


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DDTOP_RUNS_DIR", raising=False)
    return tmp_path


def config_of(*argv: str) -> TrainConfig:
    """The validated settings `ddtrain start ARGV` runs with."""
    args = parse_command_line(cli.build_parser(), ["start", *argv], {})
    return TrainConfig(**start_overrides(args)).validate()


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """`ddtrain start ARGV` in this process: exit 2, one line, nothing started."""
    try:
        code = cli.main(["start", "--foreground", *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    assert code == 2, (argv, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in out + err, err
    assert not Path("runs").exists() or not any(Path("runs").iterdir())
    return err.strip()


def test_the_bounds_agree_with_the_fold() -> None:
    assert MAX_RANKS == MAX_JOB_RANKS == 65536 and MAX_MACHINE_RANKS == 1024
    assert MAX_NNODES * 8 == MAX_JOB_RANKS


@pytest.mark.usefixtures("project")
def test_2048_nodes_of_8_ranks_are_a_job() -> None:
    config = config_of(*BIG, "train.py")
    assert (config.world_size, config.nnodes, config.nproc_per_node, config.node_rank) == (
        16384, 2048, 8, 5)
    top = config_of("--nnodes", "8192", "--nproc-per-node", "8", "--node-rank", "8191",
                    "--rdzv-endpoint", "node0:29400", "--run-id", "top", "train.py")
    assert top.world_size == MAX_JOB_RANKS
    # config.json of such a job is read back and checked alike
    assert TrainConfig.from_dict(config.to_dict()).validate() == config


@pytest.mark.parametrize(("argv", "says"), [
    (("--nproc-per-node", "2000"),
     "--nproc-per-node must be at most 1024 (got 2000): give 1 to 1024 (every one runs on "
     "this machine)"),
    (("--nnodes", "10000"), "--nnodes must be at most 8192 (got 10000): give 1 to 8192"),
    (("--nnodes", "8192", "--nproc-per-node", "16"),
     "--nnodes x --nproc-per-node must be at most 65536 ranks (got 8192 x 16 = 131072)"),
    (("--node-rank", "2048"), "--node-rank 2048 must be below --nnodes 2048"),
    (("--node-rank", "9000"), "--node-rank must be at most 8191 (got 9000)"),
    (("--node-rank", "-1"), "--node-rank must be at least 0 (got -1)"),
    (("--world-size", "4096"),
     "--world-size 4096 must be --nnodes x --nproc-per-node = 16384"),
    (("--world-size", "100000"), "--world-size must be at most 65536 (got 100000)"),
])
@pytest.mark.usefixtures("project")
def test_a_big_job_past_a_limit_is_one_line_naming_it(
        capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], says: str) -> None:
    # the later value of a flag given twice is argparse's: BIG's is overridden
    line = refused(capsys, *BIG, *argv, "train.py")
    assert says in line, line


@pytest.mark.usefixtures("project")
def test_one_machine_still_starts_at_most_1024_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (("-n", "2048"), ("--nproc-per-node", "2048"), ("--nnodes", "1", "-n", "2048")):
        line = refused(capsys, *argv, "train.py")
        assert "must be at most 1024 (got 2048)" in line and "this machine" in line, line
    assert config_of("-n", "1024", "train.py").world_size == 1024


def test_the_protocol_takes_the_jobs_ranks_and_nodes() -> None:
    beat = protocol.NodeHeartbeat(node=2047, status="running",
                                  ranks=list(range(16376, 16384)))
    assert protocol.HUB_REQUESTS.decode(protocol.encode(beat)) == beat
    assert protocol.HUB_REQUESTS.decode(protocol.encode(protocol.Stacks(rank=16383))) == (
        protocol.Stacks(rank=16383))
    for past in (protocol.NodeHeartbeat(node=MAX_NNODES, status="running"),
                 protocol.NodeHeartbeat(node=1, status="running", ranks=[MAX_JOB_RANKS]),
                 protocol.NodeHeartbeat(node=1, status="running",
                                        ranks=list(range(MAX_MACHINE_RANKS + 1))),
                 protocol.Stacks(rank=MAX_JOB_RANKS)):
        with pytest.raises(protocol.BadRequest):
            protocol.HUB_REQUESTS.decode(protocol.encode(past))


def test_run_json_holds_a_jobs_world_size() -> None:
    record = RunRecord(run_id="big", world_size=16384)
    assert decode_record(encode_record(record)).world_size == 16384
    past = msgspec.structs.replace(record, world_size=MAX_JOB_RANKS + 1)
    with pytest.raises(ValueError, match="world_size"):
        decode_record(encode_record(past))
