"""The run configuration: one typed dataclass, its validation, and its flags.

It lives in the daemon (no torch here) so that `ddtrain` can reject bad input in
milliseconds, before any rank imports torch; the ranks import it from here.
Every validation error names the flag to change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from ddtop.core import outlets
from ddtop.core.bounds import (
    JOB_RANKS_WHY,
    MAX_BATCH_SIZE,
    MAX_EPOCHS,
    MAX_EVERY_STEPS,
    MAX_JOB_RANKS,
    MAX_KEEP_CHECKPOINTS,
    MAX_MACHINE_RANKS,
    MAX_METRICS_LINGER_S,
    MAX_NNODES,
    MAX_PORT,
    MAX_RESTARTS,
    MAX_RUN_ID_CHARS,
    MAX_SEED,
    MAX_STEP_DELAY_S,
    MAX_SYNTHETIC_SAMPLES,
    MAX_THREADS_PER_RANK,
    MAX_WORKERS,
    METRICS_LINGER_S,
    NAME_MAX,
    Range,
    check_ranges,
    job_size_problem,
)
from ddtop.core.contract import FR_ENTRIES, FR_ENV, MAX_FR_ENTRIES, RUNS_DIR_ENV, UsageError
from ddtop.core.flagspec import Flag, flag
from ddtop.core.strategy_names import SyncStrategy

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


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs. Each field but `extra` is a `ddtrain start` flag, and
    the string under a field is both its documentation and its flag's help."""

    world_size: int = flag(1, short="-n", metavar="N", group="ranks", low=1,
                           high=MAX_MACHINE_RANKS, why="every rank runs on this machine, and "
                           "gloo connects each rank to every other")
    """number of ranks (processes) to launch"""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """collective backend; auto = nccl when every local rank has a GPU, else gloo"""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """where each rank computes; auto = cuda:<local rank> when available, else cpu"""
    model: Literal["mlp", "cnn", "resnet18"] = "mlp"
    """model to train"""
    strategy: SyncStrategy = "ddp"
    """how ranks synchronise gradients: ddp (torch DDP, gradient buckets), allreduce
    (an all_reduce per parameter after backward), hooks / hooks-async (per-parameter
    hooks during backward, blocking / asynchronous), ring (all-reduce from send/recv
    around a ring), fsdp (FSDP2 fully_shard); see docs/strategies.md"""
    dataset: Literal["synthetic", "mnist", "fashion-mnist", "cifar10"] = "synthetic"
    """dataset; synthetic is built in and needs no download"""
    data_dir: str = flag("data", metavar="DIR")
    """folder of torchvision datasets, where --download puts them"""
    download: bool = False
    """download the dataset into --data-dir if it is missing"""
    epochs: int = flag(3, metavar="E", low=1, high=MAX_EPOCHS)
    """passes over the training set"""
    batch_size: int = flag(64, metavar="B", low=1, high=MAX_BATCH_SIZE)
    """global batch, a multiple of --world-size, split evenly across ranks"""
    lr: float = 0.003
    """learning rate of SGD with momentum 0.9"""
    fail_on_nan: bool = False
    """fail the run when a rank's loss is NaN or infinite, naming the step (without
    it, the rank warns once and trains on)"""
    seed: int = flag(0, metavar="S", low=0, high=MAX_SEED,
                     why="the trainer derives more seeds from it, within torch's 64 bits")
    """seed for data order, initial weights and the synthetic dataset"""
    sync_every: int = flag(0, metavar="K", low=0, high=MAX_EVERY_STEPS)
    """also exchange global metrics every K steps; 0: only at epoch ends"""
    checkpoint_every: int = flag(0, metavar="K", low=0, high=MAX_EVERY_STEPS)
    """also checkpoint every K steps; 0: only at epoch ends"""
    keep_checkpoints: int = flag(3, metavar="K", low=0, high=MAX_KEEP_CHECKPOINTS,
                                 why="0 keeps all")
    """checkpoints kept, newest first; 0 keeps all"""
    resume: bool = flag(False, group="run")
    """continue --run-id (default: the newest run) from its newest valid checkpoint"""
    runs_dir: str = flag("runs", metavar="DIR", group="run",
                         default_text=f"${RUNS_DIR_ENV} or ./runs")
    """folder of run directories"""
    run_id: str | None = flag(None, metavar="ID", group="run",
                              default_text="new, timestamped; with --resume, the newest run")
    """run id"""
    workers: int = flag(0, metavar="W", low=0, high=MAX_WORKERS,
                        why="each is a process on this machine")
    """data-loader worker processes in total, split across ranks"""
    threads_per_rank: int = flag(1, metavar="T", group="ranks", low=1, high=MAX_THREADS_PER_RANK)
    """intra-op threads per rank, like torchrun's OMP_NUM_THREADS=1"""
    synthetic_train_samples: int = flag(32768, metavar="N", low=1, high=MAX_SYNTHETIC_SAMPLES,
                                        why="every rank holds the whole set in memory")
    """size of the synthetic training set"""
    synthetic_val_samples: int = flag(2048, metavar="N", low=1, high=MAX_SYNTHETIC_SAMPLES,
                                      why="every rank holds the whole set in memory")
    """size of the synthetic validation set"""
    master_addr: str = flag("127.0.0.1", metavar="ADDR", group="run", torchrun=True)
    """address of rank 0's rendezvous store"""
    master_port: int = flag(0, metavar="PORT", group="run", torchrun=True,
                            default_text="a free one", low=0, high=MAX_PORT)
    """port of rank 0's rendezvous store"""
    bind: str = flag("", metavar="ADDR", group="run", default_text="local sockets only")
    """serve the daemon's sockets on TCP at ADDR (free ports), authenticated and
    encrypted with the run's CURVE keys (runs/<id>/keys), for dashboards on other
    machines; without it, unix sockets only the run's owner can reach"""
    tensorboard: str = flag("", metavar="DIR", group="run", default_text="off")
    """also write the run's telemetry, live, as TensorBoard event files in DIR/<run id>/:
    a folder per rank and one for the run (needs the tensorboard extra)"""
    start_method: Literal["forkserver", "spawn", "fork"] = flag("forkserver", group="run",
                                                                torchrun=True)
    """how the local launcher starts ranks: forkserver imports torch once and forks
    every rank from it"""
    progress_every: float = flag(2.0, metavar="SEC")
    """seconds between progress lines printed by rank 0"""
    step_delay: float = flag(0.0, metavar="SEC")
    """seconds each rank waits before every training step, counted as its data phase:
    a run to watch at leisure, or one that leaves the machine's cores to others"""
    launcher: Literal["local", "torchrun"] = flag("local", group="run")
    """local: ranks forked from one process that imported torch; torchrun: the daemon
    runs torchrun --standalone"""
    max_restarts: int = flag(0, metavar="K", group="run", torchrun=True, low=0,
                             high=MAX_RESTARTS, why="each restarts every rank")
    """after a rank fails, restart every rank from the newest checkpoint, up to K times"""
    hang_timeout: float | None = flag(None, metavar="S", group="run", default_text="off")
    """fail the run when it has hung (ranks stalled in a collective) for S seconds,
    naming the rank the others wait for; with --max-restarts it restarts"""
    flight_recorder: int | None = flag(None, metavar="N", group="run",
                                       default_text=f"${FR_ENV}, else {FR_ENTRIES}",
                                       low=0, high=MAX_FR_ENTRIES,
                                       why="each is kept in every rank's memory")
    """entries of torch's Flight Recorder each rank keeps (its last collectives, on
    every process group), dumped into the evidence of a hang or a desync; 0: off"""
    profile_stragglers: bool = flag(False, group="run")
    """profile a newly named straggler and the median rank for 5 steps (as ddtrain
    profile does), at most once every 10 minutes; what differs is told"""
    metrics: str = flag("", metavar="[HOST:]PORT", group="run", default_text="off")
    """serve every rank's metrics to Prometheus at http://HOST:PORT/metrics (HOST
    127.0.0.1 unless given; PORT 0: a free one, in run.json); docs/monitoring.md"""
    metrics_linger: float = flag(METRICS_LINGER_S, metavar="S", group="run")
    """with --metrics: after the run ends, keep serving its final state (how it ended,
    its failures by cause) for S seconds, so that the next scrapes store it (ddtrain
    stop or Ctrl-C ends it sooner); 0: the daemon exits at once"""
    metrics_auth: str = flag("", metavar="FILE", group="run", default_text="none")
    """with --metrics: every scrape must send the credential in FILE, one line: a bearer
    token, or USER:PASSWORD for basic auth (at least 16 characters of secret; the file
    private to its owner, chmod 600); else 401"""
    metrics_cert: str = flag("", metavar="FILE", group="run", default_text="plain HTTP")
    """with --metrics and --metrics-key: serve https:// with this certificate (PEM, its
    chain after it)"""
    metrics_key: str = flag("", metavar="FILE", group="run", default_text="none")
    """with --metrics-cert: its private key (PEM, unencrypted, chmod 600)"""
    nnodes: int = flag(1, metavar="N", group="multi-node", torchrun=True, low=1,
                       high=MAX_NNODES, why=JOB_RANKS_WHY)
    """machines (nodes) of the job, one `ddtrain start` on each; more than 1 runs the
    ranks through torchrun's c10d rendezvous at --rdzv-endpoint (docs/multi-node.md);
    the job's ranks, N x --nproc-per-node, at most 65536"""
    node_rank: int = flag(0, metavar="K", group="multi-node", torchrun=True, low=0,
                          high=MAX_NNODES - 1)
    """this node's number, 0 to --nnodes - 1; node 0's daemon is the job's hub"""
    nproc_per_node: int = flag(1, metavar="P", group="ranks", torchrun=True, low=1,
                               high=MAX_MACHINE_RANKS, why="every one runs on this machine")
    """ranks on this machine (torchrun's meaning): on one machine the world size, as
    -n; in a multi-node job the world size is --nnodes x P"""
    rdzv_endpoint: str = flag("", metavar="HOST:PORT", group="multi-node", torchrun=True,
                              default_text="none")
    """the job's rendezvous (torchrun --rdzv-endpoint): node 0's host and a free port"""
    local_addr: str = flag("", metavar="ADDR", group="multi-node", torchrun=True,
                           default_text="this machine's host name")
    """this node's address as the other nodes reach it (torchrun --local-addr): where
    the ranks' store is found when this node has group rank 0"""
    hub: str = flag("", metavar="tcp://HOST:PORT", group="multi-node",
                    default_text="found in the shared run directory")
    """node 1 and up, without a shared file system: the hub's control endpoint (its
    `hub.json`, written by node 0's daemon)"""
    hub_keys: str = flag("", metavar="DIR", group="multi-node",
                         default_text="the run directory's keys/")
    """with --hub: a copy of the job's keys folder (runs/<id>/keys on node 0)"""
    module: str | None = flag(None, short="-m", metavar="MODULE", group="program",
                              default_text="none")
    """run this Python module (as `python -m MODULE`) as every rank, instead of the
    built-in trainer"""
    program: str | None = field(default=None, metadata={"flag": Flag(enabled=False)})
    """the user's script run as every rank, instead of the built-in trainer (PROGRAM)"""
    program_args: list[str] = field(default_factory=list,
                                    metadata={"flag": Flag(enabled=False)})
    """the script's own arguments: what follows `--`"""
    watch: list[str] | None = field(default=None, metadata={"flag": Flag(enabled=False)})
    """`ddtrain watch`: the command it runs (empty: ranks started elsewhere); None
    for `ddtrain start`"""
    idle: float = field(default=0.0, metadata={"flag": Flag(enabled=False)})
    """`ddtrain watch` without a command: seconds without any rank's message after
    which it ends (0: never)"""
    allow_no_ranks: bool = field(default=False, metadata={"flag": Flag(enabled=False)})
    """`ddtrain watch -- COMMAND`: a command that ends with no rank seen succeeds
    when it exits 0 (by default such a watch fails: nothing was watched)"""
    workdir: str | None = field(default=None, metadata={"flag": Flag(enabled=False)})
    """the directory the script runs in: where `ddtrain start` was typed"""
    extra: dict[str, Any] = field(default_factory=dict, metadata={"flag": Flag(enabled=False)})
    """reserved for settings of later versions, so that old configs still load (no flag)"""

    # -- derived -----------------------------------------------------------------
    @property
    def runs_user_code(self) -> bool:
        """True when the ranks run the user's script or module, not the built-in trainer."""
        return self.program is not None or self.module is not None or self.watch is not None

    @property
    def program_label(self) -> str:
        """The user's program as typed: 'train.py --lr 3e-4' or '-m pkg.train'."""
        if self.watch is not None:
            return shlex.join(self.watch) if self.watch else "ranks started elsewhere"
        head = [self.program] if self.program is not None else ["-m", str(self.module)]
        return shlex.join([*head, *self.program_args])

    @property
    def batch_per_rank(self) -> int:
        return self.batch_size // self.world_size

    @property
    def workers_per_rank(self) -> int:
        return self.workers // self.world_size

    # -- validation --------------------------------------------------------------
    def validate(self) -> TrainConfig:
        """Return self, or raise UsageError naming the flag to fix."""
        self.check_ranges()
        if self.bind and not _BIND.fullmatch(self.bind):
            raise UsageError(f"--bind {self.bind!r}: give an address of this machine (e.g. "
                             "10.0.0.5 or 0.0.0.0), without a scheme or port")
        if self.run_id is not None and len(self.run_id) > MAX_RUN_ID_CHARS:
            raise UsageError(f"--run-id is {len(self.run_id)} characters long: give one of at "
                             f"most {MAX_RUN_ID_CHARS}")
        if self.run_id is not None and not _is_safe_name(self.run_id):
            raise UsageError(
                f"--run-id {self.run_id!r} may hold only letters, digits, '-', '_' and '.'"
            )
        _check_path("--runs-dir", self.runs_dir)
        if self.tensorboard:
            _check_path("--tensorboard", self.tensorboard)
            from ddtop.core.tbwriter import folder_problem  # tensorboard is imported later

            if (problem := folder_problem("--tensorboard", Path(self.tensorboard))) is not None:
                raise UsageError(problem)
        self.check_nodes()
        try:
            if self.tensorboard:
                outlets.require_tensorboard("--tensorboard")
            if self.metrics or self.metrics_auth or self.metrics_cert or self.metrics_key:
                outlets.check_metrics(self.metrics, self.is_hub, self.node_rank,
                                      self.metrics_auth, self.metrics_cert, self.metrics_key)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if not 0 <= self.metrics_linger <= MAX_METRICS_LINGER_S:  # NaN too
            raise UsageError(f"--metrics-linger must be a number of seconds from 0 to "
                             f"{MAX_METRICS_LINGER_S:g} (got {self.metrics_linger:g})")
        if self.hang_timeout is not None and not (
                math.isfinite(self.hang_timeout) and self.hang_timeout > 0):
            raise UsageError(f"--hang-timeout must be a positive, finite number of seconds "
                             f"(got {self.hang_timeout}); leave it out to never fail a hang")
        if self.runs_user_code:
            return self  # the built-in trainer's settings below do not apply
        _check_path("--data-dir", self.data_dir)
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UsageError(f"--lr must be positive and finite (got {self.lr})")
        if not self.progress_every > 0:
            raise UsageError(f"--progress-every must be positive (got {self.progress_every})")
        if not 0 <= self.step_delay <= MAX_STEP_DELAY_S:
            raise UsageError(f"--step-delay must be 0 to {MAX_STEP_DELAY_S:g} seconds "
                             f"(got {self.step_delay})")
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
        return self

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def is_hub(self) -> bool:
        """This daemon gathers the job: a single-node run's, or node 0's."""
        return self.node_rank == 0

    def check_nodes(self) -> None:
        """The multi-node flags, consistent with each other (UsageError otherwise)."""
        if not self.multi_node:
            for name in ("node_rank", "rdzv_endpoint", "hub", "hub_keys", "local_addr"):
                if getattr(self, name) != TrainConfig.__dataclass_fields__[name].default:
                    raise UsageError(f"--{name.replace('_', '-')} is for a multi-node job: add "
                                     "--nnodes N (N > 1), or leave it out")
            return
        if self.node_rank >= self.nnodes:
            raise UsageError(f"--node-rank {self.node_rank} must be below --nnodes "
                             f"{self.nnodes} (nodes are numbered from 0)")
        if self.watch is not None:  # `ddtrain watch`: the ranks' rendezvous is theirs
            self._check_hub()
            return
        if not self.rdzv_endpoint:
            raise UsageError("a multi-node job needs --rdzv-endpoint HOST:PORT (node 0's host "
                             "and a free port, the same on every node)")
        host, _, port = self.rdzv_endpoint.rpartition(":")
        if not host or not _BIND.fullmatch(host.strip("[]")) or not port.isdigit() or not (
                0 < int(port) <= 65535):
            raise UsageError(f"--rdzv-endpoint {self.rdzv_endpoint!r}: give HOST:PORT, e.g. "
                             "node0:29400")
        if self.world_size != self.nnodes * self.nproc_per_node:
            raise UsageError(f"--world-size {self.world_size} must be --nnodes x "
                             f"--nproc-per-node = {self.nnodes * self.nproc_per_node}: leave "
                             "--world-size out of a multi-node job")
        self._check_hub()

    def _check_hub(self) -> None:
        """The flags by which the nodes of a job find their hub (node 0)."""
        if self.run_id is None:
            raise UsageError("a multi-node job needs --run-id ID, the same on every node")
        if self.hub and (self.is_hub or not re.fullmatch(r"tcp://[^\s/]+:\d+", self.hub)):
            raise UsageError(f"--hub {self.hub!r}: give node 0's control endpoint "
                             "tcp://HOST:PORT (from its hub.json), on nodes 1 and up only")
        if self.local_addr and not _BIND.fullmatch(self.local_addr):
            raise UsageError(f"--local-addr {self.local_addr!r}: give this node's address or "
                             "host name, without a scheme or port")
        if bool(self.hub) != bool(self.hub_keys):
            raise UsageError("--hub and --hub-keys go together: the hub's endpoint and a copy "
                             "of the job's keys folder")
        if self.max_restarts:
            raise UsageError("--max-restarts is not supported for a multi-node job yet: "
                             "leave it out")

    @property
    def rdzv_host(self) -> str:
        return self.rdzv_endpoint.rpartition(":")[0].strip("[]")

    def check_ranges(self) -> TrainConfig:
        """Return self, or raise UsageError for the first number out of its Range
        (a config.json written by hand or damaged is checked with this too); a
        multi-node job's world size counts the whole job's ranks (MAX_JOB_RANKS)."""
        if not self.multi_node:
            problem = check_ranges(self)
        else:
            problem = (check_ranges(self, {"world_size": None})
                       or job_size_problem(self.nnodes, self.nproc_per_node)
                       or _JOB_WORLD.problem("--world-size", self.world_size))
        if problem is not None:
            raise UsageError(problem)
        return self

    # -- persistence -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> TrainConfig:
        """From config.json's contents: every field's type checked, unknown keys
        (settings of later versions) ignored; UsageError names what is wrong."""
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as e:
            raise UsageError(f"invalid run settings: {e}") from None

    def digest(self) -> str:
        """Short digest of the settings that change results (same across ranks)."""
        fixed = {k: getattr(self, k) for k in RESUME_FIXED}
        return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:12]


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, or localhost) is this machine's loopback."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


_BIND = re.compile(r"[A-Za-z0-9:][A-Za-z0-9.:_-]*")
_JOB_WORLD = Range(1, MAX_JOB_RANKS, JOB_RANKS_WHY)  # a multi-node job's --world-size


def resume_mismatch(saved: dict[str, Any], config: TrainConfig) -> list[str]:
    """Flags whose value differs from the run being resumed, as `--flag old -> new`."""
    diffs = []
    for name in RESUME_FIXED:
        if name in saved and saved[name] != getattr(config, name):
            flag = "--" + name.replace("_", "-")
            diffs.append(f"{flag} {saved[name]} -> {getattr(config, name)}")
    return diffs


def _check_path(flag: str, path: str) -> None:
    """A path the file system would refuse as too long, refused here as bad input."""
    if any(len(part.encode(errors="surrogateescape")) > NAME_MAX for part in Path(path).parts):
        raise UsageError(f"{flag}: a folder name in it is longer than {NAME_MAX} bytes, "
                         "more than file systems take")


def _is_safe_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and all(
        c.isalnum() or c in "-_." for c in name
    )
