"""`ddtrain start`'s command line read as torchrun's: everything after the script
is the script's, --nproc-per-node is the ranks on this machine, PET_* defaults,
no abbreviations, a built-in trainer's flag with a script refused. In process:
the real parser, argv in, the run's settings out (tests/test_torchrun_syntax.py
runs a few through the real command)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch.distributed import argparse_util
from torch.distributed.run import get_args_parser

from ddtop.core.config import TrainConfig
from ddtop.core.contract import UsageError
from ddtop.core.flagspec import BUILT_IN, Flag
from ddtop.daemon.cli import build_parser
from ddtop.daemon.startline import (
    parse_command_line,
    start_overrides,
    subparser,
    torchrun_dests,
)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory: a script, and a package with a module."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def settings(*argv: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The TrainConfig fields `ddtrain start ARGV` gives, as cmd_start sees them."""
    args = parse_command_line(build_parser(), ["start", *argv], env or {})
    return start_overrides(args)


def refused(*argv: str, env: dict[str, str] | None = None) -> str:
    with pytest.raises(UsageError) as raised:
        settings(*argv, env=env)
    message = str(raised.value)
    assert "\n" not in message
    return message


def parse_exit(*argv: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as raised:
        settings(*argv)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    return err


@pytest.mark.usefixtures("project")
def test_everything_after_the_script_is_the_scripts() -> None:
    got = settings("-n", "8", "train.py", "--lr", "3e-4", "--epochs", "5")
    assert (got["program"], got["program_args"], got["world_size"]) == (
        "train.py", ["--lr", "3e-4", "--epochs", "5"], 8)
    assert "lr" not in got and "epochs" not in got  # not the built-in trainer's
    # ddtrain's own names after the script are the script's too: --model, -n, --batch
    got = settings("train.py", "--model", "gpt2", "-n", "3", "--batch", "32", "x")
    assert got["program_args"] == ["--model", "gpt2", "-n", "3", "--batch", "32", "x"]
    assert "world_size" not in got and "model" not in got


@pytest.mark.usefixtures("project")
def test_a_double_dash_right_after_the_script_is_still_accepted() -> None:
    assert settings("train.py", "--", "--lr", "3e-4")["program_args"] == ["--lr", "3e-4"]
    assert settings("train.py", "--", "--", "x")["program_args"] == ["--", "x"]
    # later, it is the script's own (as torchrun passes it)
    assert settings("train.py", "--lr", "1", "--", "x")["program_args"] == [
        "--lr", "1", "--", "x"]


@pytest.mark.parametrize("head", [["-m", "mypkg.train"], ["-mmypkg.train"],
                                  ["--module", "mypkg.train"], ["--module=mypkg.train"]])
@pytest.mark.usefixtures("project")
def test_everything_after_the_module_is_the_modules(head: list[str]) -> None:
    got = settings("-n", "2", *head, "--lr", "1", "-m", "x")
    assert (got["module"], got["program_args"], got["world_size"]) == (
        "mypkg.train", ["--lr", "1", "-m", "x"], 2)


@pytest.mark.parametrize("before", [
    ["-n2"], ["-n", "2"], ["--world-size=2"], ["--run-id", "train.py"],
    ["--inject", "1:kill@step=5", "-n", "2"], ["--foreground", "--headless", "-n", "2"],
    ["--runs-dir", "train.py", "-n", "2"],
])
@pytest.mark.usefixtures("project")
def test_values_of_ddtrains_options_are_not_taken_for_the_script(before: list[str]) -> None:
    got = settings(*before, "train.py", "--x")
    assert (got["program"], got["program_args"]) == ("train.py", ["--x"])


@pytest.mark.parametrize("ranks", [
    ["--nproc-per-node", "2"], ["--nproc_per_node=2"], ["--nproc-per-node", "2", "-n", "2"],
    ["--standalone", "--nproc-per-node", "2"], ["--nnodes", "1", "--nproc-per-node", "2"],
    ["--nnodes=1", "--standalone", "-n", "2"],
])
@pytest.mark.usefixtures("project")
def test_nproc_per_node_is_the_ranks_on_this_machine(ranks: list[str]) -> None:
    got = settings(*ranks, "train.py")
    assert got["world_size"] == 2
    config = TrainConfig(**got).validate()
    assert (config.world_size, config.multi_node, config.launcher) == (2, False, "local")


@pytest.mark.usefixtures("project")
def test_torchruns_options_are_taken_in_their_other_spelling_too() -> None:
    got = settings("--nproc_per_node", "2", "--master_port=29500", "--start_method", "spawn",
                   "--max_restarts=1", "train.py", "--lr_max", "1", "--nproc_per_node", "3")
    assert (got["world_size"], got["master_port"], got["start_method"], got["max_restarts"],
            got["program_args"]) == (2, 29500, "spawn", 1,
                                     ["--lr_max", "1", "--nproc_per_node", "3"])


def test_only_torchruns_options_have_their_other_spelling(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert "unrecognized arguments: --run_id" in parse_exit("--run_id", "r", capsys=capsys)


@pytest.mark.usefixtures("project")
def test_nproc_per_node_and_n_that_disagree_are_one_line() -> None:
    message = refused("-n", "4", "--nproc-per-node", "2", "train.py")
    assert message == ("-n 4 and --nproc-per-node 2 disagree: on one machine both are its "
                       "ranks; give one of them")
    assert "built-in" not in refused("--nproc-per-node", "3", "-n", "2")  # trainer too
    assert "--standalone is one machine" in refused("--standalone", "--nnodes", "2",
                                                    "train.py")


@pytest.mark.usefixtures("project")
def test_a_multi_node_job_keeps_nnodes_times_nproc_per_node() -> None:
    got = settings("--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "3",
                   "--rdzv-endpoint", "node0:29400", "--run-id", "j", "train.py", "--lr", "1")
    assert (got["world_size"], got["launcher"], got["program_args"]) == (6, "torchrun",
                                                                        ["--lr", "1"])


@pytest.mark.parametrize("flag", [["--model", "mlp"], ["--epochs", "5"], ["--lr", "0.1"],
                                  ["--batch-size", "32"], ["--download"], ["--seed", "1"],
                                  ["--backend", "gloo"], ["--checkpoint-every", "5"]])
@pytest.mark.usefixtures("project")
def test_a_built_in_trainer_flag_with_a_script_is_refused_naming_it(flag: list[str]) -> None:
    for program in (["train.py"], ["-m", "mypkg.train"]):
        message = refused("-n", "2", *flag, *program)
        assert message.startswith(f"{flag[0]} is a flag of the built-in trainer, not of "
                                  f"{' '.join(program)}")
    assert settings("-n", "2", *flag)["world_size"] == 2  # without a script: the trainer's


@pytest.mark.usefixtures("project")
def test_the_run_flags_still_apply_to_a_script() -> None:
    got = settings("-n", "2", "--threads-per-rank", "2", "--max-restarts", "1",
                   "--start-method", "spawn", "--run-id", "r", "--hang-timeout", "9",
                   "--launcher", "torchrun", "train.py")
    assert (got["threads_per_rank"], got["max_restarts"], got["start_method"]) == (2, 1, "spawn")


def test_built_in_group_is_the_trainers_flags_only() -> None:
    group = {f.name for f in TrainConfig.__dataclass_fields__.values()
             if f.metadata.get("flag", Flag()).group == BUILT_IN
             and f.metadata.get("flag", Flag()).enabled}
    assert {"model", "dataset", "epochs", "batch_size", "lr", "seed", "backend",
            "device"} <= group
    assert not group & {"world_size", "nproc_per_node", "resume", "threads_per_rank",
                        "run_id", "runs_dir", "max_restarts", "module", "launcher"}


@pytest.mark.parametrize("typed", [["--batch", "32"], ["--nproc", "2"], ["--world", "2"],
                                   ["--fore"], ["--epoch", "1"]])
@pytest.mark.usefixtures("project")
def test_no_option_is_abbreviated(typed: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_exit(*typed, capsys=capsys)
    assert f"unrecognized arguments: {typed[0]}" in err


@pytest.mark.usefixtures("project")
def test_the_old_spellings_that_would_now_mean_something_else_are_one_line() -> None:
    assert refused("-n", "2", "train.py", "--inject", "1:kill", "--", "--lr", "3") == (
        "--inject follows train.py: what follows a script is its own arguments; put "
        "ddtrain's options before the script (or give train.py -- ARGS to pass them all "
        "to it)")
    # A -m after the script is the script's, as torchrun passes it.
    assert settings("train.py", "-m", "mypkg.train")["program_args"] == ["-m", "mypkg.train"]
    assert settings("train.py", "--", "-m", "x")["program_args"] == ["-m", "x"]
    assert "are for a script" in refused("-n", "2", "--", "--lr", "1")


# -- torchrun's environment ---------------------------------------------------------
@pytest.mark.usefixtures("project")
def test_pet_variables_are_defaults_as_torchrun_reads_them() -> None:
    assert settings("train.py", env={"PET_NPROC_PER_NODE": "2"})["world_size"] == 2
    # the command line wins over the environment
    assert settings("--nproc-per-node", "3", "train.py",
                    env={"PET_NPROC_PER_NODE": "2"})["world_size"] == 3
    got = settings("train.py", env={"PET_START_METHOD": "spawn", "PET_MASTER_PORT": "29500",
                                    "PET_MASTER_ADDR": "127.0.0.2", "PET_MAX_RESTARTS": "2"})
    assert (got["start_method"], got["master_port"], got["master_addr"],
            got["max_restarts"]) == ("spawn", 29500, "127.0.0.2", 2)
    got = settings("--run-id", "job", "train.py", env={
        "PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "4",
        "PET_RDZV_ENDPOINT": "node0:29400", "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ID": "x"})
    assert (got["nnodes"], got["node_rank"], got["world_size"], got["rdzv_endpoint"]) == (
        2, 1, 8, "node0:29400")
    # torchrun's own options that ddtrain start has not are left alone
    assert "module" not in settings("train.py", env={"PET_MODULE": "1"})


@pytest.mark.usefixtures("project")
def test_pet_standalone_is_a_switch_read_as_a_whole_number() -> None:
    env = {"PET_NNODES": "2"}
    assert "--standalone is one machine" in refused("train.py", env={**env,
                                                                    "PET_STANDALONE": "1"})
    assert settings("--run-id", "j", "--rdzv-endpoint", "h:1", "train.py",
                    env={**env, "PET_STANDALONE": "0"})["nnodes"] == 2


@pytest.mark.parametrize(("env", "fragment"), [
    ({"PET_NPROC_PER_NODE": "auto"}, "PET_NPROC_PER_NODE='auto' in the environment "
     "(torchrun's --nproc-per-node): not a valid int"),
    ({"PET_NNODES": "1:2"}, "PET_NNODES='1:2'"),
    ({"PET_START_METHOD": "thread"}, "choose from forkserver, spawn, fork"),
    ({"PET_STANDALONE": "true"}, "PET_STANDALONE='true' in the environment "
     "(torchrun's --standalone): give 1 or 0"),
    ({"PET_MASTER_ADDR": ""}, "PET_MASTER_ADDR=''"),
    ({"PET_NPROC_PER_NODE": "2000"}, "(from torchrun's environment: PET_NPROC_PER_NODE=2000)"),
])
@pytest.mark.usefixtures("project")
def test_a_bad_pet_value_is_one_line_naming_the_variable(env: dict[str, str],
                                                         fragment: str) -> None:
    with pytest.raises(UsageError) as raised:
        from ddtop.daemon.cli import cmd_start

        cmd_start(parse_command_line(build_parser(), ["start", "train.py"], env))
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


def test_the_pet_options_are_torchruns_own_and_all_that_ddtrain_start_shares() -> None:
    """Read from torchrun's parser in the installed torch: an option that reads
    PET_<DEST> there, and that ddtrain start has under the same name and meaning."""
    torchrun = {a.dest: a for a in get_args_parser()._actions
                if isinstance(a, argparse_util.env | argparse_util.check_env)}
    ours = {a.dest: a for a in subparser(build_parser(), "start")._actions}
    assert set(torchrun_dests()) <= set(torchrun)
    for dest in torchrun_dests():
        spellings = {o.replace("_", "-") for o in torchrun[dest].option_strings}
        assert spellings <= set(ours[dest].option_strings), dest  # --x_y read as --x-y
        assert (torchrun[dest].nargs == 0) == (ours[dest].nargs == 0), dest
    # every other option both have differs in meaning: torchrun's -m is a switch
    assert set(torchrun) & set(ours) - set(torchrun_dests()) == {"module"}


def test_help_leads_with_a_script_and_groups_the_built_in_trainers_flags() -> None:
    start = subparser(build_parser(), "start")
    text = start.format_help()
    assert text.startswith("usage: ddtrain start [options] SCRIPT [SCRIPT ARGS...]\n")
    assert "\nRun your training script as every rank, as torchrun runs it" in text
    built_in = text.split(f"\n{BUILT_IN}:\n", 1)[1].split("\n\n", 1)[0]
    assert "--model" in built_in and "--epochs" in built_in and "--lr" in built_in
    assert "\n  --world-size" not in built_in and "\n  --nproc-per-node" not in built_in
    assert text.index("--nproc-per-node") < text.index("--model")


@pytest.mark.usefixtures("project")
def test_one_node_with_a_rendezvous_endpoint_is_one_machine(capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    """torchrun's single-node c10d habit (`--nnodes 1 --rdzv-endpoint`, or a
    PyTorchJob's PET_NNODES=1 with PET_RDZV_ENDPOINT): accepted, with a note."""
    got = settings("--nnodes", "1", "--rdzv-endpoint", "localhost:29400",
                   "--nproc-per-node", "2", "train.py")
    assert (got["nnodes"], got["world_size"], "rdzv_endpoint" in got) == (1, 2, False)
    assert "--rdzv-endpoint is not needed on one machine" in capsys.readouterr().err
    got = settings("train.py", env={"PET_NNODES": "1", "PET_RDZV_ENDPOINT": "h:1",
                                    "PET_NPROC_PER_NODE": "3"})
    assert (got["world_size"], "rdzv_endpoint" in got) == (3, False)
    # without --nnodes 1 it is still refused: a lone endpoint is a mistake
    with pytest.raises(UsageError, match="--rdzv-endpoint is for a multi-node job"):
        TrainConfig(**settings("--rdzv-endpoint", "h:1", "train.py")).validate()
