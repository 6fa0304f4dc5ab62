"""torch.profiler on this rank for the steps `ddtrain profile` (or the dashboard's
`P`) asks for: the same global steps on every rank asked.

The request is a file of the run, `logs/profile.json` (core/profilereq.py
writes it): its id, the ranks, the global step after which to begin, and how
many steps. Nothing listens for it: the sender thread looks at the file's size
and time each pass (one stat, every 0.1 s at most: `poll`), as it does for the
stacks file, and reads a new request whole. The training thread, as it counts
each global step (api.LiveRank), asks `at_step`: nothing to do is one global
read. At the request's step it starts torch.profiler (CPU, and CUDA where the
rank uses it), and N steps later stops it; a thread of its own then writes, in
`profiles/<id>/` of the run:

    rank-K.trace.json.gz   the trace (Chrome / Perfetto JSON, gzipped)
    rank-K.top.json        the steps it covers, the top operators by self time
                           (name, self and total microseconds, calls), and the
                           seconds from its last step to this file (written_s),
                           written last: the rank's profile is done

A rank already past the step begins at its next one, and says from which.
Requests that come while one runs wait their turn (the newest 8). A
rank whose own program runs a profiler already is not profiled: its top.json
says so in one line (`refused`). What the request file holds is checked
(bounded, typed): a bad one is skipped.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtop.core import profilereq

TOP = 20  # operators kept in top.json, by self time

_request: Path | None = None  # logs/profile.json, once watched
_seen: tuple[int, int] = (-1, -1)  # its (size, mtime_ns) as last read
_rank = -1
# Requests for this rank, oldest first: appended by the sender thread, taken one at a
# time by the training thread (a deque: both ends safe between threads).
_plans: deque[Plan] = deque(maxlen=8)
_running: tuple[Plan, Any, int] | None = None  # the plan, its profiler, the step it began after
_done: set[str] = set()  # the requests this rank has answered


@dataclass(frozen=True)
class Plan:
    id: str
    start: int  # begin after this global step
    steps: int
    folder: Path  # profiles/<id>/


def watch(stacks: Path) -> None:
    """Look for profile requests beside `stacks` (logs/rank-K.stacks: rank K's), from
    now on: one made before this process (a rank restarted) is not acted on again."""
    global _request, _rank, _seen
    number = stacks.name.removeprefix("rank-").removesuffix(".stacks")
    if number.isdigit():
        _request, _rank = profilereq.request_path(stacks.parent), int(number)
        with contextlib.suppress(OSError):
            st = _request.stat()
            _seen = (st.st_size, st.st_mtime_ns)


def poll() -> None:
    """On the sender thread, each pass: a new request for this rank, queued."""
    global _seen
    path = _request
    if path is None:
        return
    try:
        st = path.stat()
    except OSError:
        return
    seen = (st.st_size, st.st_mtime_ns)
    if seen == _seen:
        return
    _seen = seen
    asked = profilereq.read(path)
    if asked is None or asked.id in _done or not asked.covers(_rank):
        return
    if any(plan.id == asked.id for plan in _plans):
        return
    _plans.append(Plan(asked.id, asked.start, asked.steps,
                       profilereq.profiles_path(path.parent.parent) / asked.id))


def at_step(global_step: int) -> None:
    """On the training thread, as global step `global_step` is counted."""
    global _running
    if _running is None:
        if not _plans or global_step < _plans[0].start:
            return
        plan = _plans.popleft()
        profiler = _start(plan, global_step)
        if profiler is not None:
            _running = (plan, profiler, global_step)
        return
    plan, profiler, began = _running
    if global_step - began >= plan.steps:
        _running = None
        _done.add(plan.id)
        stopped = time.monotonic()
        with contextlib.suppress(Exception):  # (a profiler that fails: said in its file)
            profiler.stop()
        threading.Thread(target=_write, args=(plan, profiler, began, global_step, stopped),
                         name="ddtop-profile", daemon=True).start()


def _start(plan: Plan, global_step: int) -> Any:
    """The profiler started for `plan` (None: refused, and said so)."""
    import torch

    if _profiling_already(torch):
        _done.add(plan.id)
        _answer(plan, {"rank": _rank, "refused": "its own program runs a profiler already: "
                       "not profiled (stop it, or profile with it)"})
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        profiler = torch.profiler.profile(activities=activities, record_shapes=False)
        profiler.start()
    except Exception as e:  # noqa: BLE001 - the program goes on, unprofiled
        _done.add(plan.id)
        _answer(plan, {"rank": _rank, "refused": f"torch.profiler did not start: {e}"})
        return None
    return profiler


def _profiling_already(torch: Any) -> bool:
    with contextlib.suppress(Exception):
        return bool(torch.autograd.profiler._is_profiler_enabled)
    return False


def _write(plan: Plan, profiler: Any, began: int, ended: int, stopped: float) -> None:
    """The trace, gzipped, then the top operators (last: the rank's profile is done)."""
    folder = plan.folder
    try:
        folder.mkdir(parents=True, exist_ok=True)
        raw = folder / f".rank-{_rank}.trace.json"
        profiler.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(folder / f"rank-{_rank}.trace.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink(missing_ok=True)
        top = sorted(profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)[:TOP]
        ops = [{"name": str(e.key)[:200], "self_us": round(e.self_cpu_time_total, 1),
                "total_us": round(e.cpu_time_total, 1), "calls": int(e.count)} for e in top]
        _answer(plan, {"rank": _rank, "from_step": began + 1, "to_step": ended,
                       "steps": ended - began, "top": ops,
                       "written_s": round(time.monotonic() - stopped, 3)})
    except Exception as e:  # noqa: BLE001 - said in its file, never raised into training
        _answer(plan, {"rank": _rank, "refused": f"the profile could not be written: {e}"})


def _answer(plan: Plan, record: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        plan.folder.mkdir(parents=True, exist_ok=True)
        tmp = plan.folder / f".rank-{_rank}.top.json.{os.getpid()}"
        tmp.write_text(json.dumps({**record, "time": time.time()}))
        tmp.replace(plan.folder / f"rank-{_rank}.top.json")
