"""Fault drills, acted out by a rank (`ddtrain start --inject`; the grammar and
its checks are core/inject.py's).

`Drills.after_step(global_step, steps_per_epoch)` is called once a global
optimizer step is done: by the built-in trainer's loop, and in a user's
script (`ddtrain start train.py`) by a global optimizer step hook, so drills
need no line of the script. Each action happens right there, between two
steps:

- kill, stop, segfault: the rank sends itself SIGKILL or SIGSTOP, or reads
  address 0 (a real SIGSEGV);
- raise: a RuntimeError out of the step (the loop, or the script's
  `optimizer.step()`), reported with its traceback like any other;
- exit=CODE: the rank exits at once with CODE, without a word (`os._exit`);
- hang: the rank sleeps for good before its next collective, so the other
  ranks wait inside it (its heartbeats go on: stalled, not silent);
- slow=FACTORx: every step from then on, the rank sleeps (FACTOR - 1) times
  its step time (the median of its last steps, measured without the sleeps),
  so that it takes FACTOR times as long as it would;
- slow=FACTORx sleeps in the forward phase: its own work;
- slowdata=MSms: every step from then on, the rank's next data loading takes
  MS milliseconds longer (it sleeps in the data phase): a slow loader;
- cpuhog: every thread of the rank is pinned to one core (its rank's among
  those it may use), and a busy process is started pinned there too, which
  spins until the rank is gone: the rank gets about half a core;
- stall-data=SECONDSs: the rank's next data loading takes SECONDS longer
  (it sleeps in the data phase), once;
- desync: the rank calls a collective of its own once, an all_gather of one
  element on the world group, where the others go on to their next one (in
  the built-in trainer, the next step's DDP gradient all-reduce): the two
  sides never meet;
- p2p-hang: the rank waits in a recv of one element from the next rank
  ((R + 1) mod the world size), which never sends: the others wait for it in
  their next collective;
- oom: the rank makes a memory cgroup of its own beneath its present one
  (`ddtop-oom-PID`, a limit of OOM_LIMIT), joins it and allocates until the
  kernel's OOM killer kills it (the daemon names it so, and removes the
  cgroup: daemon/oomkill.py); where the cgroup filesystem is not writable
  (not root, a container) it says so in its log and trains on;
- skip: the rank's next step runs its backward without DDP's gradient
  all-reduce (`no_sync`, as a rank that branches around it would; the
  built-in trainer with --strategy ddp only). gloo pairs the others'
  all-reduces with its following ones, one apart, silently: the ranks' counts
  of the group's collectives (core/desync.py Counts) name it.

Drills act in the first attempt only: a run restarted after one
(`--max-restarts`) goes on.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import statistics
import subprocess
import sys
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any

from ddtop.core import inject
from ddtop.core.contract import ATTEMPT_ENV, FAULT_ENV

# Step times the slow drill takes the median of.
SLOW_WINDOW = 9


class Drills:
    """The drills aimed at this rank, acted on after each step."""

    def __init__(self, drills: list[inject.Drill], phase: Any = None,
                 collective: Any = None) -> None:
        self.drills = drills
        # A context manager factory for a phase (ddtop.phase), for stall-data.
        self.phase = phase
        # The built-in trainer's Telemetry.collective, which desync's all_gather goes
        # through, signed (None: a script's, whose collectives ddtop wraps).
        self.collective = collective
        self.step_times: deque[float] = deque(maxlen=SLOW_WINDOW)
        self._step_end: float | None = None  # monotonic, after the last step's drills
        self._announced: set[inject.Drill] = set()  # each says once that it acts
        self._skip = False  # skip: the next step's backward goes without its all-reduce
        self._hog: subprocess.Popen[bytes] | None = None  # cpuhog's busy process

    @classmethod
    def from_environ(cls, rank: int, phase: Any = None, collective: Any = None
                     ) -> Drills | None:
        """This rank's drills from DDTOP_FAULT (None: none, or not the first attempt);
        a malformed value raises UsageError (bad input, exit 2)."""
        value = os.environ.get(FAULT_ENV)
        if not value or os.environ.get(ATTEMPT_ENV, "0") != "0":
            return None
        mine = inject.for_rank(inject.parse_environ(value), rank)
        return cls(mine, phase, collective) if mine else None

    @property
    def need_epochs(self) -> bool:
        return any(d.epoch is not None for d in self.drills)

    def after_step(self, global_step: int, steps_per_epoch: int) -> None:
        now = time.monotonic()
        if self._step_end is not None:
            self.step_times.append(now - self._step_end)
        for drill in self.drills:
            first = drill.first_step(steps_per_epoch)
            if first is None:
                continue
            if drill.repeats and global_step >= first:
                if drill not in self._announced:
                    self._announce(drill, global_step)
                if drill.action == "slow":
                    self._slow(drill.value)
                else:
                    self._in_phase("data", drill.value / 1000)  # slowdata: the next batch
            elif global_step == first:
                if drill.action == "stop":
                    # The steps since the sender's last message (it sends every 0.1 s)
                    # go out first, so the frozen rank is shown where it froze.
                    time.sleep(STOP_FLUSH_S)
                self._announce(drill, global_step)
                self._act(drill, global_step)
        self._step_end = time.monotonic()

    def take_skip(self) -> bool:
        """Whether this step's backward is to skip DDP's gradient all-reduce (a skip
        drill acted after the last step); True once."""
        skip, self._skip = self._skip, False
        return skip

    def _announce(self, drill: inject.Drill, global_step: int) -> None:
        """One line in the rank's log as the drill acts, with the wall clock time
        (what bench/faults.py measures the daemon's diagnosis from)."""
        self._announced.add(drill)
        print(f"ddtop drill {drill.spec()}: acting after step {global_step} "
              f"(at {time.time():.3f})", file=sys.stderr, flush=True)

    def _slow(self, factor: float) -> None:
        if self.step_times:  # (its own work: in the forward phase)
            self._in_phase("forward", (factor - 1.0) * statistics.median(self.step_times))

    def _in_phase(self, name: str, seconds: float) -> None:
        with self.phase(name) if self.phase is not None else contextlib.nullcontext():
            time.sleep(seconds)

    def _act(self, drill: inject.Drill, global_step: int) -> None:
        what = f"injected failure at step {global_step} (--inject {drill.spec()})"
        if drill.action == "raise":
            raise RuntimeError(what)
        if drill.action == "stall-data":
            self._in_phase("data", drill.value)
            return
        if drill.action == "cpuhog":
            self._hog = _hog()
            return
        if drill.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return  # resumed (SIGCONT): trains on
        if drill.action == "skip":
            self._skip = True
            return
        if drill.action == "desync":
            _collective_of_its_own(self.collective)
            return
        if drill.action == "p2p-hang":
            _recv_that_never_comes(self.collective)
            return
        if drill.action == "oom":
            why = _out_of_memory()  # (returns only where it could not)
            print(f"ddtop drill {drill.spec()}: skipped: {why}", file=sys.stderr, flush=True)
            return
        _flush()
        if drill.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif drill.action == "exit":
            os._exit(int(drill.value))
        elif drill.action == "segfault":
            ctypes.string_at(0)  # reading address 0: SIGSEGV
            os.kill(os.getpid(), signal.SIGSEGV)  # (should reading it not fault)
        elif drill.action == "hang":
            while True:  # before the next collective, for good
                time.sleep(3600)


STOP_FLUSH_S = 0.3


def _recv_that_never_comes(collective: Any) -> None:
    """A recv of one element from the next rank, which never sends: for good (the
    run is stopped, or --hang-timeout fails it); signed as _collective_of_its_own's."""
    import torch
    import torch.distributed as dist

    from ddtop.training.collectives import p2p_entered

    peer = (dist.get_rank() + 1) % dist.get_world_size()
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    with (collective("recv", sig=p2p_entered(None, "float32", 1, peer))
          if collective is not None else contextlib.nullcontext()):
        dist.recv(torch.empty(1, device=device), src=peer)


def _collective_of_its_own(collective: Any) -> None:
    """An all_gather of one element (this rank's number) on the world group, on
    the device the group's backend takes (a CUDA device under NCCL); through
    `collective` (signed as the built-in trainer's own), or wrapped (a script's)."""
    import torch
    import torch.distributed as dist

    from ddtop.training.collectives import entered

    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    mine = torch.tensor([float(dist.get_rank())], device=device)
    parts = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    with (collective("all_gather", sig=entered(None, "float32", 1)) if collective is not None
          else contextlib.nullcontext()):
        dist.all_gather(parts, mine)


# cpuhog's busy process: it spins, pinned to the rank's core (at a higher priority
# where it may), and ends once its parent (the rank) is gone.
HOG = ("import contextlib, os, sys, time\n"
       "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
       "with contextlib.suppress(OSError):\n"
       "    os.nice(-5)  # (where it may: a neighbour that takes its share, and more)\n"
       "parent = os.getppid()\n"
       "while os.getppid() == parent:\n"
       "    end = time.monotonic() + 0.1\n"
       "    while time.monotonic() < end:\n"
       "        pass\n")


def _hog() -> subprocess.Popen[bytes]:
    """Pin every thread of this rank to one core (its rank's, among those it may
    use) and start a busy process pinned there too: the two share it."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) % len(cores)]
    for task in Path("/proc/self/task").iterdir():  # (sched_setaffinity pins one thread)
        with contextlib.suppress(OSError, ValueError):
            os.sched_setaffinity(int(task.name), {core})
    return subprocess.Popen([sys.executable, "-c", HOG, str(core)], stdin=subprocess.DEVNULL)


OOM_LIMIT = 256 << 20  # the oom drill's cgroup's limit (its rank's memory before it is
OOM_CHUNK = 16 << 20  # not charged there: only what it allocates after joining)


def _out_of_memory() -> str:
    """Join a memory cgroup of its own beneath this process's, with OOM_LIMIT, and
    allocate (every page written) until the kernel's OOM killer kills the process;
    why not, where the cgroup cannot be made or joined (the cgroup it made removed)."""
    from ddtop.core import memcg

    here = memcg.of("self")
    if here is None:
        return "no memory cgroup of this process is readable here"
    own = here / f"ddtop-oom-{os.getpid()}"
    try:
        own.mkdir()
    except OSError as e:
        return f"cannot make a memory cgroup in {here} ({e.strerror or e}): run as root"
    try:
        memcg.limit_file(own).write_text(str(OOM_LIMIT))
        (own / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        with contextlib.suppress(OSError):
            own.rmdir()
        return f"cannot join the memory cgroup {own} ({e.strerror or e})"
    _flush()
    held = []
    while True:  # until killed
        held.append(bytearray(b"\x01") * OOM_CHUNK)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


# -- a user's script ---------------------------------------------------------------------
def install_in_script() -> bool:
    """Act out this rank's drills in a user's script, after each optimizer step
    (a global optimizer step hook); False when there are none."""
    try:
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        rank = 0
    import ddtop

    drills = Drills.from_environ(rank, phase=ddtop.phase)
    if drills is None:
        return False
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_ScriptSteps(drills))
    return True


class _ScriptSteps:
    """Global optimizer steps of a script, as ddtop counts them (api.LiveRank:
    one per step of the first optimizer that steps, steps before a resume
    included), or, without telemetry, counted here the same way."""

    def __init__(self, drills: Drills) -> None:
        self.drills = drills
        self.pacer: weakref.ref[Any] | None = None
        self.counted = 0
        self.last = 0

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        from ddtop.training import api

        live = api.running()
        if live is not None and live.active:
            steps, per_epoch = live.steps, live.steps_per_epoch
        else:
            pacer = self.pacer() if self.pacer is not None else None
            if pacer is None:
                self.pacer = weakref.ref(optimizer)
            elif pacer is not optimizer:
                return
            self.counted += 1
            steps, per_epoch = self.counted, 0
        if steps == self.last:
            return  # a second optimizer in the same step (a GAN)
        self.last = steps
        if self.drills.need_epochs and not per_epoch and live is not None:
            live.warn_once("drill-epochs", "an @epoch drill cannot fire: give "
                           "ddtop.init(total_steps=..., epochs=...) so epochs are known")
        self.drills.after_step(steps, per_epoch)
