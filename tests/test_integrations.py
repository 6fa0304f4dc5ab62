"""ddtop's framework integrations with the real frameworks: the Lightning
callback (ddtop.lightning), the Hugging Face Trainer callback
(ddtop.transformers) and Accelerate's three lines, each as 2 gloo ranks on CPU.

Each runs with zero-code on (`ddtrain start -n 2 SCRIPT`: the optimizer hook
counts the steps, the callback adds to them) and off (`ddtrain watch --
torchrun ...` with DDTOP_ZERO_CODE=off: the callback counts them), and is
judged from `ddtrain status --json` and the run's journal: exact optimizer
steps per rank (gradient accumulation is not more steps), the loss, the
learning rate and the logged scalars, evaluation seen as evaluation (the
scripts wait outside any forward there, where only the callback can say it),
comm time, no warning. The frameworks are in the `test` extra; a missing one
skips its tests, saying which.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import DDTRAIN, TORCHRUN, Together, tagged_env, together

from ddtop.core import journal, wire

SCRIPTS = Path(__file__).parent / "scripts"
RUN_TIMEOUT_S = 240
ZERO_CODE_OFF = {"DDTOP_ZERO_CODE": "off"}
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def needs(module: str) -> None:
    pytest.importorskip(module, reason=f"{module} is not installed: pip install -e '.[test]' "
                                       "(the test extra has the frameworks)")


class Watched:
    """A finished run: its status (`ddtrain status --json`) and what its ranks sent
    (the telemetry journal)."""

    def __init__(self, cwd: Path, run: str) -> None:
        done = subprocess.run([DDTRAIN, "status", run, "--json"], cwd=cwd, capture_output=True,
                              text=True, timeout=30, env=tagged_env("status"))
        assert done.returncode == 0, done.stderr
        self.status: dict[str, Any] = json.loads(done.stdout)
        self.sent = [wire.decode([r.frame])
                     for r in journal.read(cwd / "runs" / run / "telemetry.journal")]

    def of(self, kind: type, rank: int | None = None) -> list[Any]:
        return [m for m in self.sent if isinstance(m, kind) and (rank is None or m.rank == rank)]

    def ranks(self) -> list[tuple[int, str, int]]:
        return [(r["rank"], r["state"], r["global_step"]) for r in self.status["ranks"]]

    def scalar(self, name: str) -> dict[str, Any]:
        found = [s for s in self.status["scalars"] if s["name"] == name]
        assert found, f"no scalar {name}: {[s['name'] for s in self.status['scalars']]}"
        return found[0]

    def evaluating_at(self, rank: int) -> set[int]:
        """The global steps at which this rank's heartbeats said `evaluation`."""
        return {h.global_step for h in self.of(wire.Heartbeat, rank) if h.phase == "evaluation"}

    def lrs(self, rank: int) -> set[float]:
        return {s.lr for s in self.of(wire.Step, rank)}

    def warnings(self) -> list[str]:
        return [e.message for e in self.of(wire.Event) if e.type in ("warning", "error")]


# The six framework runs, started together (a module fixture) so that their
# start-ups overlap: name -> (script, zero-code on, its arguments, environment, the
# modules it needs). Each test waits for its own and checks that nothing is left.
RUNS: dict[str, tuple[str, bool, tuple[str, ...], dict[str, str], tuple[str, ...]]] = {
    # 40 batches a rank, 2 a step: 20 optimizer steps, not 40.
    **{f"lightning-{on}": ("cb_lightning.py", on == "zero-code",
                           ("--batches", "40", "--accumulate", "2"), {}, ("lightning",))
       for on in ("zero-code", "zero-code-off")},
    # 20 micro-batches a rank, 2 a step: 10 optimizer steps.
    **{f"hf-{on}": ("cb_hf.py", on == "zero-code", ("--steps", "10", "--accumulate", "2"),
                    OFFLINE, ("transformers", "accelerate"))
       for on in ("zero-code", "zero-code-off")},
    # 32 batches a rank, accelerator.accumulate over 2: 16 optimizer steps.
    "accelerate-three-lines": ("cb_accelerate.py", True, ("--batches", "32", "--accumulate", "2"),
                               {}, ("accelerate",)),
    "accelerate-no-line": ("cb_accelerate.py", True,
                           ("--batches", "32", "--accumulate", "2", "--plain"), {},
                           ("accelerate",)),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Together]:
    """Each SCRIPT as 2 ranks: under `ddtrain start` (zero-code on), or under
    torchrun in `ddtrain watch` with DDTOP_ZERO_CODE=off (the callback alone); a
    run whose framework is missing is not started (its test skips, saying so)."""
    with together(tmp_path_factory.mktemp("integrations")) as started:
        for name, (script, zero_code, args, env, modules) in RUNS.items():
            if not all(importlib.util.find_spec(m) for m in modules):
                continue
            path = str(SCRIPTS / script)
            if zero_code:
                started.start(name, [DDTRAIN, "start", "--foreground", "-n", "2", "--run-id",
                                     "cb", path, "--", *args], env, RUN_TIMEOUT_S)
            else:
                started.start(name, [DDTRAIN, "watch", "--run-id", "cb", "--", TORCHRUN,
                                     "--standalone", "--nproc-per-node", "2", path, *args],
                              {**env, **ZERO_CODE_OFF}, RUN_TIMEOUT_S)
        yield started


def run(runs: Together, name: str) -> Watched:
    """Run `name`'s result: succeeded, nothing left, no rank but its own."""
    zero_code = RUNS[name][1]
    done = runs.result(name)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.leftovers == []
    watched = Watched(runs.cwd(name), "cb")
    assert watched.status["status"] == "succeeded"
    assert watched.status["rejected"] == {}  # no rank but the ones started for the run
    if zero_code:  # the framework spawned no rank of its own: each is the process ddtrain started
        assert sorted(r["pid"] for r in watched.status["ranks"]) == sorted(
            p["pid"] for p in watched.status["processes"])
    return watched


# -- importing them ------------------------------------------------------------------
@pytest.mark.parametrize(("module", "framework", "said"), [
    ("ddtop.lightning", "lightning", "ddtop.lightning needs Lightning 2: pip install lightning"),
    ("ddtop.transformers", "transformers",
     "ddtop.transformers needs Hugging Face Transformers: pip install transformers"),
], ids=["lightning", "transformers"])
def test_without_the_framework_the_import_says_what_to_install(
        module: str, framework: str, said: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == framework or m.startswith(framework + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, framework, None)  # not installed, as far as import goes
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError) as raised:
        importlib.import_module(module)
    assert str(raised.value) == said
    assert raised.value.__suppress_context__  # one line, not the chain under it
    monkeypatch.delitem(sys.modules, module, raising=False)


def test_ddtop_transformers_is_the_real_transformers_callback() -> None:
    needs("transformers")
    import transformers

    from ddtop.transformers import DdtopCallback

    assert issubclass(DdtopCallback, transformers.TrainerCallback)
    assert sys.modules["transformers"] is transformers
    assert transformers.__file__ is not None and "ddtop" not in Path(transformers.__file__).parts


def test_without_telemetry_the_lightning_callback_leaves_a_run_as_it_was(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain `python train.py` (no DDTOP_TELEMETRY) with the callback in: one device
    in this process, the same steps and weights as without it, and ddtop off."""
    needs("lightning")
    import lightning as L
    import torch

    import ddtop
    from ddtop.lightning import DdtopCallback

    monkeypatch.delenv("DDTOP_TELEMETRY", raising=False)

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.log("mse", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(callbacks: list[L.Callback]) -> tuple[int, list[torch.Tensor]]:
        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1,
                            accumulate_grad_batches=2, callbacks=callbacks, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        model = Tiny()
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
        return trainer.global_step, [p.detach().clone() for p in model.parameters()]

    callback = DdtopCallback()
    steps, weights = fit([callback])
    assert (steps, callback._live) == (4, False)
    plain_steps, plain_weights = fit([])
    assert steps == plain_steps and all(torch.equal(a, b)
                                        for a, b in zip(weights, plain_weights, strict=True))
    assert ddtop.init() is False


@pytest.mark.processes
def test_import_ddtop_loads_no_framework() -> None:
    code = ("import sys, ddtop; print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('lightning', 'transformers', 'accelerate')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr


# -- Lightning --------------------------------------------------------------------------
@pytest.mark.parametrize("zero_code", [True, False], ids=["zero-code", "zero-code-off"])
@pytest.mark.processes
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_lightning_callback_counts_optimizer_steps_with_loss_logs_and_eval(
        runs: Together, zero_code: bool) -> None:
    needs("lightning")
    # 40 batches a rank, 2 a step: 20 optimizer steps, not 40.
    got = run(runs, "lightning-zero-code" if zero_code else "lightning-zero-code-off")
    assert got.ranks() == [(0, "finished", 20), (1, "finished", 20)]
    assert got.status["total_steps"] == 20  # trainer.estimated_stepping_batches
    for rank in got.status["ranks"]:
        # The mean of the step's training losses (Lightning hands each on halved).
        assert rank["loss"] == pytest.approx(3.0)
        assert rank["comm_share"] is not None and rank["comm_share"] > 0
    for rank in (0, 1):
        steps = got.of(wire.Step, rank)
        assert sum(s.steps for s in steps) == 20
        assert sum(s.samples for s in steps) == 40 * 8  # every batch's samples
        assert got.lrs(rank) == {0.05}
        # The sanity check before the first step, the validation after the last.
        assert {0, 20} <= got.evaluating_at(rank), got.evaluating_at(rank)
    assert got.scalar("train_mse")["ranks"] == 2 and got.scalar("val_mse")["ranks"] == 2
    assert got.warnings() == []


# -- Hugging Face Trainer ------------------------------------------------------------------
@pytest.mark.parametrize("zero_code", [True, False], ids=["zero-code", "zero-code-off"])
@pytest.mark.processes
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_hf_trainer_callback_counts_optimizer_steps_with_loss_logs_and_eval(
        runs: Together, zero_code: bool) -> None:
    needs("transformers")
    needs("accelerate")
    # 20 micro-batches a rank, 2 a step: 10 optimizer steps.
    got = run(runs, "hf-zero-code" if zero_code else "hf-zero-code-off")
    assert got.ranks() == [(0, "finished", 10), (1, "finished", 10)]
    assert got.status["total_steps"] == 10  # state.max_steps
    logged = got.scalar("loss")
    for rank in got.status["ranks"]:
        # The loss the Trainer logs (every 2 steps), with the steps it covers.
        assert rank["loss"] is not None and math.isfinite(rank["loss"])
        assert abs(rank["loss"] - logged["mean"]) < 0.05, (rank["loss"], logged)
        if zero_code:  # DDP's comm time, timed by zero-code (the callback cannot reach DDP)
            assert rank["comm_share"] is not None and rank["comm_share"] > 0
    for rank in (0, 1):
        steps = got.of(wire.Step, rank)
        assert sum(s.steps for s in steps) == 10
        assert sum(s.samples for s in steps) == 10 * 2 * 4  # micro-batches x batch size
        assert got.lrs(rank) == {0.01}
        assert {5, 10} <= got.evaluating_at(rank), got.evaluating_at(rank)  # eval_steps=5
    for name in ("learning_rate", "grad_norm", "eval_loss", "eval_waited_s"):
        assert got.scalar(name)["ranks"] == 2
    assert got.warnings() == []


# -- Accelerate: three lines -----------------------------------------------------------------
@pytest.mark.parametrize("lines", [True, False], ids=["three-lines", "no-line"])
@pytest.mark.processes
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_accelerate_counts_optimizer_steps_not_micro_batches(runs: Together,
                                                             lines: bool) -> None:
    needs("accelerate")
    # 32 batches a rank, accelerator.accumulate over 2: 16 optimizer steps.
    got = run(runs, "accelerate-three-lines" if lines else "accelerate-no-line")
    assert got.ranks() == [(0, "finished", 16), (1, "finished", 16)]
    for rank in got.status["ranks"]:
        assert rank["comm_share"] is not None and rank["comm_share"] > 0
        assert rank["loss"] == (pytest.approx(3.0) if lines else None)
    if lines:
        assert got.status["total_steps"] == 16
        assert got.scalar("mse")["ranks"] == 2
    assert got.warnings() == []
