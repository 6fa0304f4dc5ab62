"""`ddtrain start`'s training flags are built from TrainConfig's fields: a new
option is written once, as a documented field, and its flag follows."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import typing
from dataclasses import dataclass
from typing import Any, Literal

import pytest

from ddtop.core.bounds import Range, check_ranges, non_empty
from ddtop.core.config import TrainConfig
from ddtop.core.flags import (
    add_config_arguments,
    add_train_arguments,
    explicit_overrides,
    field_docs,
)
from ddtop.core.flagspec import Flag, flag

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
HINTS = typing.get_type_hints(TrainConfig)

# Every flag as it was written by hand before: spelling, type or choices, default.
BEFORE: dict[str, tuple[Any, Any]] = {
    "--world-size": (int, 1), "--backend": (("auto", "nccl", "gloo"), "auto"),
    "--device": (("auto", "cuda", "cpu"), "auto"), "--model": (("mlp", "cnn", "resnet18"), "mlp"),
    "--dataset": (("synthetic", "mnist", "fashion-mnist", "cifar10"), "synthetic"),
    "--data-dir": (str, "data"), "--download": (bool, False), "--epochs": (int, 3),
    "--batch-size": (int, 64), "--lr": (float, 0.003), "--seed": (int, 0),
    "--sync-every": (int, 0), "--checkpoint-every": (int, 0), "--keep-checkpoints": (int, 3),
    "--resume": (bool, False), "--workers": (int, 0), "--threads-per-rank": (int, 1),
    "--synthetic-train-samples": (int, 32768), "--synthetic-val-samples": (int, 2048),
    "--progress-every": (float, 2.0), "--runs-dir": (str, "runs"),
    "--launcher": (("local", "torchrun"), "local"), "--max-restarts": (int, 0),
    "--run-id": (str, None), "--master-addr": (str, "127.0.0.1"), "--master-port": (int, 0),
    "--bind": (str, ""),
    "--start-method": (("forkserver", "spawn", "fork"), "forkserver"),
    "--module": (str, None),  # added with the user's own scripts
    "--fail-on-nan": (bool, False),  # added with non-finite loss events
    # added with gradient synchronisation strategies (docs/strategies.md)
    "--strategy": (("ddp", "allreduce", "hooks", "hooks-async", "ring", "fsdp"), "ddp"),
    "--hang-timeout": (float, None),  # added with fault drills (docs/daemon.md)
    "--flight-recorder": (int, None),  # added with the evidence (docs/daemon.md)
    "--profile-stragglers": (bool, False),  # added with ddtrain profile (docs/cli.md)
    # added with multi-node jobs (docs/multi-node.md)
    "--nnodes": (int, 1), "--node-rank": (int, 0), "--nproc-per-node": (int, 1),
    "--rdzv-endpoint": (str, ""), "--hub": (str, ""), "--hub-keys": (str, ""),
    "--local-addr": (str, ""),
    "--tensorboard": (str, ""),  # added with TensorBoard files (docs/monitoring.md)
    "--metrics": (str, ""),  # added with Prometheus metrics (docs/monitoring.md)
    "--metrics-linger": (float, 30.0),  # added with the end kept for scrapes (monitoring.md)
    # added with the doors of --metrics: a credential, TLS (docs/monitoring.md)
    "--metrics-auth": (str, ""), "--metrics-cert": (str, ""), "--metrics-key": (str, ""),
    "--step-delay": (float, 0.0),  # added for runs watched at leisure (docs/cli.md)
}
# Fields with no flag of their own: PROGRAM and what follows `--` are positional.
# watch, idle, allow_no_ranks: ddtrain watch's own flags
NO_FLAG = {"extra", "program", "program_args", "workdir", "watch", "idle", "allow_no_ranks"}


def train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test")
    add_train_arguments(parser)
    return parser


def flags_by_field(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    found: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        if action.dest != "help":
            found.setdefault(action.dest, []).append(action)
    return found


def test_every_field_but_extra_has_exactly_one_flag() -> None:
    found = flags_by_field(train_parser())
    assert set(found) == set(FIELDS) - NO_FLAG
    assert all(len(actions) == 1 for actions in found.values())
    for name, (action,) in found.items():
        assert action.option_strings[0] == "--" + name.replace("_", "-")
        assert action.default is argparse.SUPPRESS


def test_every_flag_of_before_is_kept_with_its_type_choices_and_default() -> None:
    by_option = {action.option_strings[0]: action for action in train_parser()._actions}
    for option, (kind, default) in BEFORE.items():
        action = by_option[option]
        assert getattr(TrainConfig(), action.dest) == default, option
        if kind is bool:
            assert action.nargs == 0 and action.const is True, option
        elif isinstance(kind, tuple):
            assert tuple(action.choices or ()) == kind, option
        elif kind is str:
            assert action.type is non_empty, option  # a str that refuses ''
        else:
            assert action.type is kind, option
    assert by_option["--world-size"].option_strings == ["--world-size", "-n"]
    assert set(by_option) - {"-h"} == set(BEFORE)


def test_every_field_is_documented_and_its_help_has_the_doc_and_the_default() -> None:
    docs = field_docs(TrainConfig)
    assert set(docs) == set(FIELDS)  # a field without a docstring fails here
    for name, (action,) in flags_by_field(train_parser()).items():
        field, how = FIELDS[name], FIELDS[name].metadata.get("flag", Flag())
        assert action.help is not None and action.help.startswith(docs[name]), name
        if how.default_text is not None:
            assert action.help.endswith(f"(default: {how.default_text})"), name
        elif HINTS[name] is bool:
            assert action.help == docs[name], name  # a switch is off unless given
        else:
            assert action.help.endswith(f"(default {field.default})"), name
    text = " ".join(train_parser().format_help().split())
    assert "--runs-dir DIR folder of run directories (default: $DDTOP_RUNS_DIR or ./runs)" in text


def test_choices_are_the_literal_arguments_and_bools_are_switches() -> None:
    found = flags_by_field(train_parser())
    literals = [n for n, hint in HINTS.items() if typing.get_origin(hint) is Literal]
    assert {"backend", "device", "model", "dataset", "start_method", "launcher"} <= set(literals)
    for name in literals:
        assert tuple(found[name][0].choices or ()) == typing.get_args(HINTS[name]), name
    switches = [n for n, hint in HINTS.items() if hint is bool and n not in NO_FLAG]
    assert switches == ["download", "fail_on_nan", "resume", "profile_stragglers"]
    for name in switches:
        assert isinstance(found[name][0], argparse._StoreTrueAction), name


def test_only_typed_flags_become_overrides() -> None:
    parser = train_parser()
    assert explicit_overrides(parser.parse_args([])) == {}
    overrides = explicit_overrides(parser.parse_args(["--batch-size", "32", "--resume"]))
    assert overrides == {"batch_size": 32, "resume": True}
    overrides = explicit_overrides(parser.parse_args(["-n", "2", "--run-id", "r1", "--lr", "0.1"]))
    assert overrides == {"world_size": 2, "run_id": "r1", "lr": 0.1}


def test_every_integer_field_has_its_range_and_every_string_flag_refuses_empty() -> None:
    parser = train_parser()
    for name, (action,) in flags_by_field(parser).items():
        bounds = FIELDS[name].metadata.get("range")
        if action.type is int:
            default = getattr(TrainConfig(), name)  # (None: an optional one, not given)
            assert isinstance(bounds, Range) and (default is None or bounds.low <= default
                                                  <= bounds.high), name
            assert action.help is not None and f"; at most {bounds.high}" in action.help, name
            over = dataclasses.replace(TrainConfig(), **{name: bounds.high + 1})
            problem = check_ranges(over)
            flag_name = action.option_strings[0]
            assert problem is not None and problem.startswith(
                f"{flag_name} must be at most {bounds.high} (got {bounds.high + 1}): give "
                f"{bounds.low} to {bounds.high}"), problem
        elif action.type is non_empty:
            with pytest.raises(SystemExit):
                parser.parse_args([action.option_strings[0], ""])
    assert check_ranges(TrainConfig()) is None


def test_an_absurd_number_is_named_by_its_head_and_length() -> None:
    problem = Range(0, 10, "why").problem("--k", 10**40)
    assert problem == "--k must be at most 10 (got 10000000..., 41 digits): give 0 to 10 (why)"
    assert Range(0, 10).problem("--k", -12345) == (
        "--k must be at least 0 (got -12345): give 0 to 10")


def test_an_integer_field_without_a_range_must_say_so() -> None:
    @dataclass
    class Unbounded:
        steps: int = 5
        """steps"""

    with pytest.raises(TypeError, match="steps: an integer flag needs its range"):
        add_config_arguments(argparse.ArgumentParser(), Unbounded)
    with pytest.raises(TypeError, match="both low= and high="):
        flag(5, low=0)


@dataclass(frozen=True)
class Small:
    warmup_steps: int = flag(5, metavar="K", group="schedule", low=0, high=1000)
    """steps of linear learning-rate warm-up, 10% of them at full rate"""
    schedule: Literal["cosine", "step"] = "cosine"
    """learning-rate schedule"""
    note: str | None = None
    """free text"""
    fast: bool = False
    """skip validation"""
    extra: dict[str, Any] = dataclasses.field(
        default_factory=dict, metadata={"flag": Flag(enabled=False)})


def test_the_generator_works_for_any_documented_dataclass() -> None:
    parser = argparse.ArgumentParser(prog="small")
    add_config_arguments(parser, Small)
    text = " ".join(parser.format_help().split())
    assert "schedule: --warmup-steps K steps of linear learning-rate warm-up, 10% of them at " \
        "full rate; at most 1000 (default 5)" in text
    assert "--schedule {cosine,step} learning-rate schedule (default cosine)" in text
    assert "--note NOTE free text" in text and "--fast skip validation" in text
    assert "--extra" not in text
    args = vars(parser.parse_args(["--warmup-steps", "7", "--schedule", "step", "--fast"]))
    assert args == {"warmup_steps": 7, "schedule": "step", "fast": True}
    with pytest.raises(SystemExit):
        parser.parse_args(["--schedule", "linear"])


def test_a_field_of_a_type_with_no_flag_must_say_so() -> None:
    @dataclass
    class Bad:
        tags: list[str] = dataclasses.field(default_factory=list)
        """tags"""

    with pytest.raises(TypeError, match="tags"):
        add_config_arguments(argparse.ArgumentParser(), Bad)


def test_without_source_the_flags_work_with_shorter_help(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_source(obj: object) -> str:
        raise OSError("could not get source code")

    monkeypatch.setattr(inspect, "getsource", no_source)
    assert field_docs(TrainConfig) == {}
    parser = train_parser()
    (batch,) = flags_by_field(parser)["batch_size"]
    assert batch.help == "at most 1000000 (default 64)"
    assert explicit_overrides(parser.parse_args(["--batch-size", "32"])) == {"batch_size": 32}
