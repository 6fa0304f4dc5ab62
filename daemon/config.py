"""The run configuration: one typed dataclass, its validation, and its flags.

It lives in the daemon (no torch here) so that `ddtrain` can reject bad input in
milliseconds, before any rank imports torch; the ranks import it from here.
Every validation error names the flag to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ddtop.daemon.contract import EXIT_USAGE, RUNS_DIR_ENV

BACKENDS = ("auto", "nccl", "gloo")
DEVICES = ("auto", "cuda", "cpu")
MODELS = ("mlp", "cnn", "resnet18")
DATASETS = ("synthetic", "mnist", "fashion-mnist", "cifar10")
START_METHODS = ("forkserver", "spawn", "fork")
LAUNCHERS = ("local", "torchrun")


def default_runs_dir() -> str:
    """Where runs live when --runs-dir is not given: $DDTOP_RUNS_DIR, else ./runs."""
    return os.environ.get(RUNS_DIR_ENV) or "runs"


# Settings that change the numbers a run produces: a resumed run must keep them,
# or it would not continue the run it claims to continue. Epochs may grow.
RESUME_FIXED = (
    "model",
    "dataset",
    "world_size",
    "batch_size",
    "lr",
    "seed",
    "synthetic_train_samples",
    "synthetic_val_samples",
)


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2, never a traceback."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs; `ddtrain start` flags map one to one onto fields."""

    world_size: int = 1
    """Number of ranks (processes) to launch: --world-size."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend: nccl when every local rank has a GPU, gloo otherwise."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where each rank computes: cuda:<local rank> when available, else cpu."""
    model: Literal["mlp", "cnn", "resnet18"] = "mlp"
    """Model to train."""
    dataset: Literal["synthetic", "mnist", "fashion-mnist", "cifar10"] = "synthetic"
    """Dataset; `synthetic` is built in and needs no download."""
    data_dir: str = "data"
    """Folder holding (or receiving, with --download) torchvision datasets."""
    download: bool = False
    """Download the torchvision dataset into --data-dir when it is missing."""
    epochs: int = 3
    """Passes over the training set."""
    batch_size: int = 64
    """Global batch size, split evenly across ranks (must divide by --world-size)."""
    lr: float = 0.003
    """Learning rate of SGD with momentum 0.9."""
    seed: int = 0
    """Seed for data order, model initialisation and the synthetic dataset."""
    sync_every: int = 0
    """Also exchange global metrics every K steps (0: only at epoch ends)."""
    checkpoint_every: int = 0
    """Also checkpoint every K steps (0: only at epoch ends)."""
    keep_checkpoints: int = 3
    """Checkpoints kept on disk, newest first (0: keep all)."""
    resume: bool = False
    """Continue a run from its newest valid checkpoint."""
    runs_dir: str = "runs"
    """Folder holding one sub-folder per run."""
    run_id: str | None = None
    """Run id (default: a new timestamped id; with --resume, the newest run)."""
    workers: int = 0
    """Data-loader worker processes in total, split across ranks."""
    threads_per_rank: int = 1
    """Intra-op threads per rank, like torchrun's OMP_NUM_THREADS=1."""
    synthetic_train_samples: int = 32768
    """Training samples in the synthetic dataset."""
    synthetic_val_samples: int = 2048
    """Validation samples in the synthetic dataset."""
    master_addr: str = "127.0.0.1"
    """Address of rank 0's rendezvous store."""
    master_port: int = 0
    """Port of rank 0's rendezvous store (0: pick a free one)."""
    start_method: Literal["forkserver", "spawn", "fork"] = "forkserver"
    """How ranks are started: forkserver imports torch once and forks each rank."""
    progress_every: float = 2.0
    """Seconds between progress lines printed by rank 0."""
    launcher: Literal["local", "torchrun"] = "local"
    """How the daemon starts ranks: its own forkserver, or torchrun --standalone."""
    max_restarts: int = 0
    """After a rank fails, restart all ranks from the newest checkpoint, up to K times."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Reserved for settings of later versions; kept so old configs still load."""

    # -- derived -----------------------------------------------------------------
    @property
    def batch_per_rank(self) -> int:
        return self.batch_size // self.world_size

    @property
    def workers_per_rank(self) -> int:
        return self.workers // self.world_size

    # -- validation --------------------------------------------------------------
    def validate(self) -> TrainConfig:
        """Return self, or raise UsageError naming the flag to fix."""
        _at_least("--world-size", self.world_size, 1)
        _at_least("--epochs", self.epochs, 1)
        _at_least("--batch-size", self.batch_size, 1)
        _at_least("--sync-every", self.sync_every, 0)
        _at_least("--checkpoint-every", self.checkpoint_every, 0)
        _at_least("--keep-checkpoints", self.keep_checkpoints, 0)
        _at_least("--workers", self.workers, 0)
        _at_least("--threads-per-rank", self.threads_per_rank, 1)
        _at_least("--synthetic-train-samples", self.synthetic_train_samples, 1)
        _at_least("--synthetic-val-samples", self.synthetic_val_samples, 1)
        _at_least("--max-restarts", self.max_restarts, 0)
        if not 0 <= self.master_port <= 65535:
            raise UsageError(f"--master-port must be between 0 and 65535 (got {self.master_port})")
        if not self.lr > 0:
            raise UsageError(f"--lr must be positive (got {self.lr})")
        if not self.progress_every > 0:
            raise UsageError(f"--progress-every must be positive (got {self.progress_every})")
        if self.batch_size % self.world_size:
            lower = self.batch_size - self.batch_size % self.world_size
            hint = f"{lower} or {lower + self.world_size}" if lower else str(self.world_size)
            raise UsageError(
                f"--batch-size {self.batch_size} is the global batch and must divide evenly "
                f"across --world-size {self.world_size}: use {hint}"
            )
        if self.backend == "nccl" and self.device == "cpu":
            raise UsageError("--backend nccl needs GPUs but --device is cpu: use --backend gloo")
        if self.dataset != "synthetic" and not self.download and not Path(self.data_dir).is_dir():
            raise UsageError(f"--data-dir {self.data_dir} does not exist: create it with the "
                             f"{self.dataset} files, or add --download")
        if self.run_id is not None and not _is_safe_name(self.run_id):
            raise UsageError(
                f"--run-id {self.run_id!r} may hold only letters, digits, '-', '_' and '.'"
            )
        return self

    # -- persistence -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def digest(self) -> str:
        """Short digest of the settings that change results (same across ranks)."""
        fixed = {k: getattr(self, k) for k in RESUME_FIXED}
        return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:12]


def resume_mismatch(saved: dict[str, Any], config: TrainConfig) -> list[str]:
    """Flags whose value differs from the run being resumed, as `--flag old -> new`."""
    diffs = []
    for name in RESUME_FIXED:
        if name in saved and saved[name] != getattr(config, name):
            flag = "--" + name.replace("_", "-")
            diffs.append(f"{flag} {saved[name]} -> {getattr(config, name)}")
    return diffs


def _at_least(flag: str, value: int, low: int) -> None:
    if value < low:
        raise UsageError(f"{flag} must be at least {low} (got {value})")


def _is_safe_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and all(
        c.isalnum() or c in "-_." for c in name
    )


# -- command-line flags ---------------------------------------------------------


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per TrainConfig field.

    Defaults are suppressed so that `explicit_overrides` sees only what the user
    typed (a resumed run keeps its saved settings unless a flag changes them);
    the dataclass holds the defaults, and --help shows them from there.
    """
    d = TrainConfig()
    s = argparse.SUPPRESS
    g = parser.add_argument_group("training")
    g.add_argument("--world-size", "-n", type=int, default=s, metavar="N",
                   help=f"number of ranks (default {d.world_size})")
    g.add_argument("--backend", choices=BACKENDS, default=s,
                   help="collective backend; auto = nccl when every local rank has a GPU, "
                   "else gloo (default auto)")
    g.add_argument("--device", choices=DEVICES, default=s,
                   help="compute device; auto = cuda when available (default auto)")
    g.add_argument("--model", choices=MODELS, default=s, help=f"model (default {d.model})")
    g.add_argument("--dataset", choices=DATASETS, default=s,
                   help=f"dataset; synthetic is built in (default {d.dataset})")
    g.add_argument("--data-dir", default=s, metavar="DIR",
                   help=f"folder of torchvision datasets (default {d.data_dir})")
    g.add_argument("--download", action="store_true", default=s,
                   help="download the dataset into --data-dir if it is missing")
    g.add_argument("--epochs", type=int, default=s, metavar="E",
                   help=f"passes over the data (default {d.epochs})")
    g.add_argument("--batch-size", type=int, default=s, metavar="B",
                   help=f"global batch, split across ranks (default {d.batch_size})")
    g.add_argument("--lr", type=float, default=s, help=f"learning rate (default {d.lr})")
    g.add_argument("--seed", type=int, default=s, metavar="S", help=f"seed (default {d.seed})")
    g.add_argument("--sync-every", type=int, default=s, metavar="K",
                   help="also exchange global metrics every K steps (default 0: epoch ends)")
    g.add_argument("--checkpoint-every", type=int, default=s, metavar="K",
                   help="also checkpoint every K steps (default 0: epoch ends)")
    g.add_argument("--keep-checkpoints", type=int, default=s, metavar="K",
                   help=f"checkpoints kept, newest first; 0 keeps all "
                   f"(default {d.keep_checkpoints})")
    g.add_argument("--resume", action="store_true", default=s,
                   help="continue --run-id (default: the newest run) from its newest "
                   "valid checkpoint")
    g.add_argument("--workers", type=int, default=s, metavar="W",
                   help="data-loader workers in total, split across ranks (default 0)")
    g.add_argument("--threads-per-rank", type=int, default=s, metavar="T",
                   help="intra-op threads per rank (default 1)")
    g.add_argument("--synthetic-train-samples", type=int, default=s, metavar="N",
                   help=f"size of the synthetic training set "
                   f"(default {d.synthetic_train_samples})")
    g.add_argument("--synthetic-val-samples", type=int, default=s, metavar="N",
                   help=f"size of the synthetic validation set "
                   f"(default {d.synthetic_val_samples})")
    g.add_argument("--progress-every", type=float, default=s, metavar="SEC",
                   help=f"seconds between progress lines (default {d.progress_every})")
    r = parser.add_argument_group("run")
    r.add_argument("--runs-dir", default=s, metavar="DIR",
                   help=f"folder of run directories (default ${RUNS_DIR_ENV} or ./{d.runs_dir})")
    r.add_argument("--launcher", choices=LAUNCHERS, default=s,
                   help="local: ranks forked from one process that imported torch; torchrun: "
                   "the daemon runs torchrun --standalone (default local)")
    r.add_argument("--max-restarts", type=int, default=s, metavar="K",
                   help="after a rank fails, restart every rank from the newest checkpoint, "
                   "up to K times (default 0)")
    r.add_argument("--run-id", default=s, metavar="ID",
                   help="run id (default: new, timestamped)")
    r.add_argument("--master-addr", default=s, metavar="ADDR",
                   help=f"rendezvous address (default {d.master_addr})")
    r.add_argument("--master-port", type=int, default=s, metavar="PORT",
                   help="rendezvous port (default: a free one)")
    r.add_argument("--start-method", choices=START_METHODS, default=s,
                   help="forkserver imports torch once and forks every rank from it "
                   "(default forkserver)")


def explicit_overrides(namespace: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig fields the user set on the command line."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return {k: v for k, v in vars(namespace).items() if k in known}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but errors are one line naming the problem and where to look."""

    def error(self, message: str) -> Any:  # argparse declares NoReturn
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
