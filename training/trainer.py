"""The training loop of one rank: DDP, metric syncs, checkpoints, resume.

Every collective here (metric syncs, checkpoints, evaluation) happens at the
same step on every rank, decided only by step counts that all ranks share, so
no rank can wait in a collective that another rank skipped.

The loop reports through `import ddtop`, the same calls a user's script makes
(`ddtop.watch`, `ddtop.init`, `ddtop.phase`, `ddtop.step`: training/api.py
counts and times both alike), and tells its `Reporter` (reporting.py) each
fact once (a step, a sync, a checkpoint, an epoch's end); the reporter prints
and records it and sends it as telemetry. What the API does not carry (the
collectives a rank waits in) goes to `Telemetry` directly.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ddtop
from ddtop.core.config import TrainConfig
from ddtop.core.contract import EXIT_FAILED, EXIT_USAGE, UsageError
from ddtop.core.rundir import RunPaths, find_run, new_run_id, write_json_atomic
from ddtop.training import api, checkpoint, data, starthook, strategies
from ddtop.training.checkpoint import Position
from ddtop.training.collectives import entered
from ddtop.training.distributed import RankEnv, process_group, resolve_backend, resolve_device
from ddtop.training.drills import Drills
from ddtop.training.metrics import GlobalMetrics, Totals, gather_counters
from ddtop.training.models import build_model
from ddtop.training.reporting import Reporter
from ddtop.training.stopping import StopAgreement
from ddtop.training.telemetry import Telemetry


def agree_on_run(config: TrainConfig, env: RankEnv) -> TrainConfig:
    """Every rank uses the run id rank 0 chose (under torchrun nobody chose yet)."""
    if config.run_id is None:
        choice: list[str | None] = [None]
        if env.is_main:
            choice[0] = (find_run(config.runs_dir, None).run_id if config.resume
                         else new_run_id())
        dist.broadcast_object_list(choice, src=0)
        config = replace(config, run_id=choice[0])
    if env.is_main:
        paths = run_paths(config).create()
        if not paths.config.exists() or not config.resume:
            write_json_atomic(paths.config, config.to_dict())
    return config


def plus(a: Counter[str], b: Counter[str]) -> Counter[str]:
    """a + b key by key, keeping every value: Counter's `+` drops results that are
    not positive, NaN among them (a diverged loss would be summed as 0)."""
    total = Counter(a)
    total.update(b)
    return total


def run_paths(config: TrainConfig) -> RunPaths:
    assert config.run_id is not None
    return RunPaths(Path(config.runs_dir) / config.run_id)


def train(config: TrainConfig, env: RankEnv, launch_time: float | None = None) -> None:
    starthook.stand_aside()  # this rank reports with what it knows (start_reporting)
    device = resolve_device(config, env)
    backend = resolve_backend(config, device)
    torch.set_num_threads(config.threads_per_rank)
    with process_group(env, backend, device):
        config = agree_on_run(config, env)
        try:
            Trainer(config, env, device, backend, launch_time).fit()
        except BaseException as e:
            live = api.running()
            if live is not None:
                live.telemetry.error(e)
                live.close(EXIT_USAGE if isinstance(e, UsageError) else EXIT_FAILED)
            raise
        live = api.running()
        if live is not None:
            live.close(0)


def start_reporting(config: TrainConfig, device: torch.device, backend: str,
                    total_steps: int) -> api.LiveRank | None:
    """This rank's `ddtop` reporter (None without DDTOP_TELEMETRY), saying hello
    with what the built-in trainer knows of itself."""
    assert config.run_id is not None
    return api.start(run=config.run_id, device=str(device), backend=backend,
                     config_digest=config.digest(), model=config.model,
                     dataset=config.dataset, epochs=config.epochs,
                     global_batch=config.batch_size, program="", total_steps=total_steps,
                     strategy=config.strategy)


class Trainer:
    def __init__(self, config: TrainConfig, env: RankEnv, device: torch.device, backend: str,
                 launch_time: float | None) -> None:
        self.config, self.env, self.device = config, env, device
        self.paths = run_paths(config)
        self.train_set, self.val_set, spec = data.build_datasets(config, env)
        self.sampler = data.train_sampler(self.train_set, config, env)
        self.steps_per_epoch = data.steps_per_epoch(self.sampler, config.batch_per_rank)
        # Reporting starts once the totals are known, so the rank says hello once.
        live = start_reporting(config, device, backend, self.steps_per_epoch * config.epochs)
        # Directly only for events, aggregates and collectives; steps and phases go to ddtop.
        self.telemetry = live.telemetry if live is not None else Telemetry()
        self.report = Reporter.for_rank(config, env, self.paths, launch_time, self.telemetry)
        torch.manual_seed(config.seed)  # the same initial weights on every rank
        self.model = build_model(config.model, spec).to(device)
        self.position = Position(0, 0)
        self.global_step = 0
        self.carried: Counter[str] = Counter()  # epoch totals from before a resume
        state = self._load_checkpoint() if config.resume else None
        if state is None:
            # Different randomness per rank (dropout), reproducible per seed.
            torch.manual_seed(config.seed + env.rank)
            random.seed(config.seed + env.rank)
        # How gradients are averaged (--strategy: DDP by default); every rank starts
        # from rank 0's weights, and the communication is timed into the telemetry.
        self.strategy = strategies.build(config.strategy, self.model, device, self.telemetry)
        self.optimizer = torch.optim.SGD(self.strategy.model.parameters(), lr=config.lr,
                                         momentum=0.9)
        if state is not None:
            self.strategy.load_optimizer_state(self.optimizer, state["optimizer"])
            checkpoint.set_rng_state(state["rng"][env.rank], device)
        ddtop.watch(self.optimizer)  # its learning rate
        ddtop.init(start_step=self.global_step)  # steps done before a resume
        self.loss_fn = nn.CrossEntropyLoss()
        self.pin = device.type == "cuda"
        self.drills = Drills.from_environ(env.rank, phase=ddtop.phase,  # --inject
                                          collective=self.telemetry.collective)
        self.stop = StopAgreement(env.is_main, self.global_step)
        self.report.started(backend, device, self.model, self.train_set, self.val_set,
                            self.steps_per_epoch)

    def _load_checkpoint(self) -> dict[str, Any]:
        found = checkpoint.load_newest_valid(self.paths.checkpoints)
        if found is None:
            raise UsageError(f"--resume: no valid checkpoint in {self.paths.checkpoints}: "
                             "start a new run without --resume")
        path, state = found
        checkpoint.check_compatible(path, state, self.config)
        self.model.load_state_dict(state["model"])
        self.position = Position(state["epoch"], state["step"])
        self.global_step = state["global_step"]
        if self.env.is_main:  # rank 0 carries the epoch's global totals so far
            self.carried = Counter(state["train_totals"])
        self.report.resumed(path, self.position, self.global_step)
        return state

    # -- the loop --------------------------------------------------------------
    def fit(self) -> None:
        for epoch in range(self.position.epoch, self.config.epochs):
            resumed = epoch == self.position.epoch
            if not self.train_epoch(epoch, self.position.step if resumed else 0,
                                    self.carried if resumed else Counter()):
                return
        self.report.finished(self.global_step)

    def train_epoch(self, epoch: int, skip: int, carried: Counter[str]) -> bool:
        """One epoch from step `skip`; False when a graceful stop ended it early."""
        cfg = self.config
        self.sampler.set_epoch(epoch)
        loader = data.train_loader(self.train_set, self.sampler, cfg, self.env, epoch, skip,
                                   self.pin)
        totals = Totals(self.device)
        self.model.train()
        self.report.epoch_started(epoch)
        batches = iter(loader)
        for step in range(skip + 1, self.steps_per_epoch + 1):
            if self.stop.due(self.global_step):  # every rank stops after the same step
                at = Position(epoch, step - 1)
                self.save(at, plus(totals.counter(), carried))
                self.report.stopped(at, self.global_step)
                return False
            with ddtop.phase("data"):
                if cfg.step_delay:
                    time.sleep(cfg.step_delay)  # --step-delay: a throttled run
                x, y = next(batches)
                x = x.to(self.device, non_blocking=True)
                y = y.to(self.device, non_blocking=True)
            if self.drills is not None and self.drills.take_skip():
                self.strategy.skip_sync()  # --inject R:skip: this step's all-reduce
            with ddtop.phase("forward"):
                self.optimizer.zero_grad(set_to_none=True)
                logits = self.strategy.model(x)
                loss = self.loss_fn(logits, y)
            with ddtop.phase("backward"):
                self.strategy.backward(loss)  # and the gradients averaged over the ranks
            with ddtop.phase("optimizer"):
                self.optimizer.step()
            totals.add(loss, logits, y)
            self.global_step += 1
            self.report.step(epoch, step, self.steps_per_epoch, self.global_step, loss,
                             y.shape[0])
            if cfg.sync_every and self.global_step % cfg.sync_every == 0:
                self.report.synced(epoch, step, self.global_step,
                                   self.gather_metrics(plus(totals.counter(), carried)))
            if cfg.checkpoint_every and self.global_step % cfg.checkpoint_every == 0:
                self.save(Position(epoch, step), plus(totals.counter(), carried))
            if self.drills is not None:
                self.drills.after_step(self.global_step, self.steps_per_epoch)
        train_metrics = self.gather_metrics(plus(totals.counter(), carried))
        val_metrics = self.evaluate()
        self.save(Position(epoch + 1, 0), Counter())
        self.report.epoch_done(epoch, self.global_step, train_metrics, val_metrics)
        return True

    def gather_metrics(self, local: Counter[str]) -> GlobalMetrics:
        # `local` was just read from the device (Totals.counter): a sync point, where
        # a GPU loss gone NaN is told at no extra cost.
        self.report.check_loss()
        with ddtop.phase("sync"), self.telemetry.collective("all_gather_object",
                                                            sig=entered(None)):
            return GlobalMetrics.from_counter(gather_counters(local))

    def evaluate(self) -> GlobalMetrics:
        """Every validation sample exactly once across ranks (see ShardSampler)."""
        loader = data.val_loader(self.val_set, self.config, self.env, self.pin)
        totals = Totals(self.device)
        self.model.eval()
        with ddtop.phase("eval"), torch.no_grad(), self.strategy.evaluating() as model:
            for x, y in loader:
                # No collective per batch (the bare module), so uneven shards cannot hang.
                logits = model(x.to(self.device, non_blocking=True))
                y = y.to(self.device, non_blocking=True)
                totals.add(self.loss_fn(logits, y), logits, y)
        self.model.train()
        return self.gather_metrics(totals.counter())

    def save(self, position: Position, epoch_totals: Counter[str]) -> None:
        """Collective: every rank contributes its RNG state; rank 0 writes."""
        self.report.check_loss()  # `epoch_totals` was just read from the device
        with ddtop.phase("checkpoint"):
            self._save(position, epoch_totals)

    def _save(self, position: Position, epoch_totals: Counter[str]) -> None:
        rngs: list[dict[str, Any] | None] = [None] * self.env.world_size
        with self.telemetry.collective("all_gather_object", sig=entered(None)):
            dist.all_gather_object(rngs, checkpoint.rng_state(self.device))
            totals = gather_counters(epoch_totals)
        # Plain state dicts whatever the strategy (fsdp gathers them: every rank takes part).
        model_state = self.strategy.model_state()
        optimizer_state = self.strategy.optimizer_state(self.optimizer)
        if not self.env.is_main:
            return
        path = checkpoint.save(self.paths.checkpoints, {
            "model": model_state,
            "optimizer": optimizer_state,
            "epoch": position.epoch,
            "step": position.step,
            "sampler_epoch": position.epoch,
            "global_step": self.global_step,
            "rng": rngs,
            "train_totals": dict(totals),
            "config": self.config.to_dict(),
            "world_size": self.env.world_size,
            "time": time.time(),
        }, keep=self.config.keep_checkpoints)
        self.report.checkpointed(path, position, self.global_step)
