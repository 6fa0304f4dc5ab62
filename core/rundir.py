"""Run directories: where a run keeps its config, status, logs and checkpoints.

    runs/<run-id>/
        config.json           the TrainConfig, as started (rewritten on resume)
        run.json              status, ranks, exit codes, endpoints, restarts; rewritten atomically
        metrics.jsonl         global metrics, one object per sync (rank 0)
        telemetry.journal     every telemetry message the daemon accepted (core/journal.py)
        daemon.log            the daemon's own output (detached runs)
        logs/rank-<k>.log     stdout and stderr of rank k
        logs/rank-<k>.error.json   why rank k failed, written by the rank itself
        checkpoints/step-<global step>.pt
        sock/                 the daemon's ipc sockets: telemetry, publish, control
        keys/                 the run's CURVE keys, with --bind (core/keys.py)

A run directory and everything in it is its owner's alone (0700 folders, 0600
files): `ddtrain start` creates them under an owner-only umask (docs/security.md).
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TextIO

from ddtop.core.contract import UsageError

# Checkpoint files, named by the global step after which they were written.
CHECKPOINT_GLOB = "step-*.pt"
NODES_DIR = "nodes"  # runs/<id>/nodes/<K>/: node K's daemon's files (multi-node jobs)
# What atomic_file leaves of a checkpoint whose writer was killed mid-write.
CHECKPOINT_TEMP_GLOB = f".{CHECKPOINT_GLOB}.*.tmp"


def checkpoint_name(global_step: int) -> str:
    return f"step-{global_step:08d}.pt"


def is_run_dir(path: Path) -> bool:
    """A folder that holds a run (its config.json), whatever its name."""
    return (path / "config.json").is_file()


def new_run_id(now: float | None = None) -> str:
    """Sortable by start time, unique without coordination: 20261122-145301-3fa2."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{stamp}-{secrets.token_hex(2)}"


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def run_id(self) -> str:
        # runs/<id>/nodes/<K>/: node K's own files of a multi-node job (docs/multi-node.md)
        if self.root.parent.name == NODES_DIR and self.root.name.isdigit():
            return self.root.parent.parent.name
        return self.root.name

    def node(self, k: int) -> RunPaths:
        """Node k's own folder of a multi-node job (node 0, the hub, keeps the run's)."""
        return self if k == 0 else RunPaths(self.root / NODES_DIR / str(k))

    @property
    def hub_file(self) -> Path:
        """Where node 0's daemon writes its endpoints for the other nodes."""
        return self.root / "hub.json"

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def status(self) -> Path:
        return self.root / "run.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def journal(self) -> Path:
        return self.root / "telemetry.journal"

    @property
    def daemon_log(self) -> Path:
        return self.root / "daemon.log"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def sockets(self) -> Path:
        return self.root / "sock"

    @property
    def keys(self) -> Path:
        return self.root / "keys"

    @property
    def peer_keys(self) -> Path:
        """What a peer on another machine needs of `keys` (core/keys.py), to copy there."""
        return self.root / "peer-keys"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    def rank_error(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.error.json"

    def remove_error_reserves(self) -> None:
        """The room ranks held for their error reports (training/errorreport.py),
        left by ranks that were stopped or killed: the run is over."""
        try:
            for room in self.logs.glob(".rank-*.error.json.reserve"):  # error_report_reserve
                room.unlink(missing_ok=True)
        except OSError:
            pass

    def rank_stacks(self, rank: int) -> Path:
        """Rank k's Python stacks, appended at each `ddtrain stacks` (daemon/stacks.py)."""
        return self.logs / f"rank-{rank}.stacks"

    @property
    def evidence(self) -> Path:
        """The evidence gathered of a hang or desync, a folder each (daemon/evidence.py)."""
        return self.root / "evidence"

    def checkpoint_files(self) -> list[Path]:
        """The run's checkpoints, oldest first (names sort by global step)."""
        return sorted(self.checkpoints.glob(CHECKPOINT_GLOB))

    def newest_checkpoint(self) -> Path | None:
        found = self.checkpoint_files()
        return found[-1] if found else None

    def create(self) -> RunPaths:
        """The run's folders, owner-only (also one made by an earlier version)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root.chmod(0o700)
        for folder in (self.logs, self.checkpoints):
            folder.mkdir(mode=0o700, exist_ok=True)
        return self


def locate_run(runs_dir: str | Path, run: str | None) -> RunPaths:
    """RUN as the commands that watch a run take it: a run directory, or a run
    id under `runs_dir` (see find_run)."""
    if run is not None and is_run_dir(Path(run)):
        return RunPaths(Path(run))
    return find_run(runs_dir, run)


class NoSuchRun(UsageError):
    """No run (or no run of that id) under the runs directory, yet: a watcher
    told to wait may look again."""


def find_run(runs_dir: str | Path, run_id: str | None) -> RunPaths:
    """The run named by id (a unique prefix is enough), or the newest run: the
    one whose config was written last (started or resumed last; run ids of the
    user's choosing do not sort by time)."""
    base = Path(runs_dir)
    configs = [p / "config.json" for p in base.glob("*") if is_run_dir(p)]
    runs = [c.parent for c in sorted(configs, key=lambda c: (c.stat().st_mtime_ns, c.parent.name))]
    if not runs:
        raise NoSuchRun(f"no runs under {base}/: start one first, or pass --runs-dir")
    if run_id is None:
        return RunPaths(runs[-1])
    matches = [p for p in runs if p.name == run_id]
    matches = matches or [p for p in runs if p.name.startswith(run_id)]
    if not matches:
        raise NoSuchRun(f"no run {run_id!r} under {base}/: see the folders there for run ids")
    if len(matches) > 1:
        names = ", ".join(p.name for p in matches[:4])
        raise UsageError(f"run id {run_id!r} is ambiguous ({names}): give more of it")
    return RunPaths(matches[0])


def error_report_reserve(report: Path) -> Path:
    """The hidden file beside a rank's error report holding room for it."""
    return report.with_name(f".{report.name}.reserve")


@contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Write to a temporary file beside `path`, fsync, rename: a reader sees the
    old file or the new one, never half of one; on error the old one stays."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class DroppingFile(io.RawIOBase):
    """A log file's descriptor as a raw file that never fails a write: what the
    disk refuses (full, over quota) is dropped and counted, and the first write
    it takes again says how much is missing. Leaves the descriptor open."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.dropped = 0  # bytes not written since the last write that worked
        self.error = ""  # why, in words

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        try:
            if self.dropped:
                os.write(self.fd, f"[ddtrain: {self.dropped} bytes of output not written "
                                  f"here: {self.error}]\n".encode())
                self.dropped = 0
            return os.write(self.fd, data)
        except OSError as e:  # whatever the disk says, a log line is not worth the process
            self.dropped += size
            self.error = e.strerror or str(e)
            return size


def log_stream(fd: int) -> TextIO:
    """A line-buffered text stream on `fd` (a log in the run directory) for
    sys.stdout or sys.stderr: a disk that fills up loses lines, never the rank or
    the daemon that prints them."""
    return io.TextIOWrapper(io.BufferedWriter(DroppingFile(fd)), encoding="utf-8",
                            errors="backslashreplace", line_buffering=True)


def write_json_atomic(path: Path, data: Any) -> None:
    with atomic_file(path) as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def read_json(path: Path) -> Any:
    """A JSON file's contents; ValueError (not RecursionError) for one nested too deeply."""
    with path.open() as f:
        try:
            return json.load(f)
        except RecursionError:
            raise ValueError(f"{path} is nested too deeply to be ours") from None


def hold_run(paths: RunPaths) -> int:
    """The run's lock, held by the one process that supervises it for as long as
    it lives (an open descriptor with an exclusive flock on `daemon.lock`): a
    second daemon for the same run directory is refused, however close together
    the two were started."""
    fd = os.open(paths.root / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UsageError(f"run {paths.run_id} is already being run by another ddtrain daemon: "
                         f"watch it with: ddtop {paths.run_id}, or stop it first") from None
    return fd


def run_held(paths: RunPaths) -> bool:
    """Whether a daemon holds the run's lock now (it supervises the run, or still ends
    it); False once it has let go (gone, or only serving the final metrics)."""
    try:
        fd = os.open(paths.root / "daemon.lock", os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (a lock taken here goes with the descriptor)
    return False


# What a start writes before its first status (run.json) and before any rank.
BEFORE_ANY_RANK = {"config.json", "daemon.lock", "daemon.log", "keys", "peer-keys", "logs",
                   "checkpoints", "sock"}


def remove_unstarted(paths: RunPaths) -> bool:
    """A run's folder whose start was refused before it began (a --bind address
    that cannot be listened on, say): removed, so that `ddtrain list` shows no
    `lost` run for it; what was wrong was said on the terminal. Only a folder
    with no run.json that holds nothing but what a start writes first, its
    logs and checkpoints folders empty, and no daemon holding it. Whether it was
    removed."""
    try:
        if paths.status.exists() or {p.name for p in paths.root.iterdir()} - BEFORE_ANY_RANK:
            return False
        if any(paths.logs.iterdir()) or any(paths.checkpoints.iterdir()):
            return False
        lock = hold_run(paths)  # a daemon that holds the folder keeps it
    except (OSError, UsageError):  # gone, not ours to read, or in use: left as it is
        return False
    try:
        shutil.rmtree(paths.root, ignore_errors=True)
    finally:
        os.close(lock)
    return True


def new_run(runs_dir: str, run_id: str | None, node_rank: int = 0) -> RunPaths:
    """A new run's directory, claimed (`run_id` None: a new, timestamped one);
    UsageError if the run exists or the folder cannot be written."""
    run_id = run_id or new_run_id()
    # Node K > 0 of a multi-node job keeps its own files in runs/<id>/nodes/<K>/.
    paths = RunPaths(Path(runs_dir) / run_id).node(node_rank)
    if paths.config.exists():
        raise UsageError(f"run {run_id} already exists in {runs_dir}/: add --resume to "
                         "continue it, or pick another --run-id")
    try:
        claim_new_run(paths)  # atomic: two starts with one --run-id cannot both win
    except OSError as e:
        raise UsageError(f"cannot write the run directory {paths.root}: {e.strerror}; "
                         "pick another --runs-dir") from None
    return paths


def claim_new_run(paths: RunPaths) -> None:
    """Make a new run's directory, atomically: of two starts with one run id, one wins."""
    paths.root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        paths.root.mkdir(mode=0o700)
    except FileExistsError:
        if paths.root.name != NODES_DIR and not paths.config.exists() and {
                p.name for p in paths.root.iterdir()} <= {NODES_DIR}:
            return  # a multi-node job's folder where another node came first
        what = "already exists" if paths.config.exists() else "exists (a folder that holds no run)"
        raise UsageError(f"run {paths.run_id} {what} in {paths.root.parent}/: add --resume to "
                         "continue it, or pick another --run-id") from None
