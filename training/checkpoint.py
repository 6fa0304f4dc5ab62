"""Checkpoints: everything needed to continue a run exactly where it stopped.

Rank 0 writes them atomically (temporary file, fsync, rename), so a crash while
writing leaves the previous checkpoint intact; the temporary file a killed
writer leaves (`.step-*.pt.*.tmp`) is removed at the next save or resume. A
checkpoint the disk has no room for (or refuses otherwise) fails with an
OSError naming the file and the reason ("No space left on device"), never
torch's `unexpected pos`, and leaves nothing behind. They hold only tensors and
plain Python values and load with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import torch

from ddtop.core.config import TrainConfig, resume_mismatch
from ddtop.core.contract import UsageError
from ddtop.core.rundir import CHECKPOINT_GLOB, CHECKPOINT_TEMP_GLOB, atomic_file, checkpoint_name

FORMAT = 1


@dataclass(frozen=True)
class Position:
    """Where training continues: `step` steps of `epoch` are already done."""

    epoch: int
    step: int


def rng_state(device: torch.device) -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    random.setstate(_as_tuple(state["python"]))


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list | tuple) else value


def checkpoint_path(folder: Path, global_step: int) -> Path:
    return folder / checkpoint_name(global_step)


class CheckpointWriteError(OSError):
    """A checkpoint the file system did not take; says which and why."""

    def __init__(self, path: Path, cause: OSError) -> None:
        why = cause.strerror or str(cause)  # "No space left on device"
        super().__init__(cause.errno, why, str(path))
        self.message = f"cannot write checkpoint {path}: {why}"

    def __str__(self) -> str:
        return self.message


class _Recording:
    """A file for torch.save that keeps the OSError of a failed write: torch
    reports it as its own RuntimeError ('unexpected pos ...')."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.file.flush()


def save(folder: Path, state: dict[str, Any], keep: int) -> Path:
    """Write atomically, then delete all but the `keep` newest (0 keeps all).
    Raises CheckpointWriteError when the file system refuses it."""
    remove_stale_temps(folder)  # only rank 0 writes here: any temp file is a dead writer's
    path = checkpoint_path(folder, state["global_step"])
    recording: _Recording | None = None
    try:
        with atomic_file(path, "wb") as f:
            recording = _Recording(f)
            # torch.save needs write and flush only.
            torch.save({"format": FORMAT, **state}, cast(IO[bytes], recording))
    except OSError as e:  # the flush or fsync after torch was done
        raise CheckpointWriteError(path, e) from e
    except RuntimeError as e:
        if recording is None or recording.error is None:
            raise
        raise CheckpointWriteError(path, recording.error) from e
    if keep:
        for old in sorted(folder.glob(CHECKPOINT_GLOB))[:-keep]:
            old.unlink(missing_ok=True)
    return path


def remove_stale_temps(folder: Path) -> None:
    """Remove what writers killed mid-write left (atomic_file's temporary files)."""
    for temp in folder.glob(CHECKPOINT_TEMP_GLOB):
        temp.unlink(missing_ok=True)


def load_newest_valid(folder: Path) -> tuple[Path, dict[str, Any]] | None:
    """Newest checkpoint that loads and is complete; damaged ones are skipped
    with a warning, since an older checkpoint is better than none. What a
    writer killed mid-write left is removed first."""
    remove_stale_temps(folder)
    for path in sorted(folder.glob(CHECKPOINT_GLOB), reverse=True):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any damage means "try the previous one"
            print(f"warning: skipping unreadable checkpoint {path.name}: {e}", file=sys.stderr)
            continue
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            print(f"warning: skipping {path.name}: not a checkpoint of this version",
                  file=sys.stderr)
            continue
        return path, state
    return None


def check_compatible(path: Path, state: dict[str, Any], config: TrainConfig) -> None:
    diffs = resume_mismatch(state["config"], config)
    if diffs:
        raise UsageError(
            f"checkpoint {path} was written with different settings ({'; '.join(diffs)}): "
            "resume with the run's own settings, or start a new run without --resume"
        )
