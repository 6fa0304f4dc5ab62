"""Faults: how fast the daemon names what went wrong, and what watching costs.

    .venv/bin/python bench/faults.py [--repeats 3] [--world-size 4]
                                     [--phase-seconds 10] [--frozen-seconds 60]
                                     [--cycles 2]
                                     [--no-drills] [--drills NAME,...] [--no-dashboard]
                                     [--step-delay S]
                                     [--tui-fps N] [--tui-pairs N] [--headless-pairs N]
                                     [--attached-pairs N] [--frozen-pairs N]
                                     [--waker-pairs N]
                                     [--pair-phase-seconds 4]

Part 1, drills. Each drill of `ddtrain start --inject` runs on the built-in
trainer (`ddtrain start --foreground`, world size 4 by default), --repeats
times, and the table gives the median (min-max) time from the fault to the
right words in the run's RunState: the state `ddtrain status`, ddtop and the
headless output all show. The fault's time is the wall clock the rank writes
to its log as the drill acts; the state is rebuilt afterwards from the run's
telemetry journal, every record folded at the time the daemon received it,
and asked every 50 ms what it says (what `ddtrain status` would have said
then; the hang rule depends on the time asked, so it is asked at each point):

  dead ranks   kill / segfault / raise / exit=3: the failure names the rank with
               its signal or exit code (raise: with the error and a traceback);
               oom: killed by the kernel's OOM killer, named so (the drill's time
               is as it begins to allocate; where no memory cgroup can be made
               here, it is left out, said so);
  hang         the state's hang names the rank as the one the others wait for,
               and the collective they wait in; --hang-timeout 2: the failure;
  stop         (SIGSTOP) the same, the rank called silent;
  slow=1.5x    from step 100: optimizer steps of the slowed rank until it is
               named the straggler (its global step in the state at the first
               50 ms moment naming it), whether it stays named, and any other
               rank named; a clean run: samples (every 250 ms) naming anyone.

Part 2, watching. One long run (detached) in phases of --phase-seconds, --cycles
times: no dashboard, `ddtop --headless` attached, no dashboard, ddtop (the TUI,
in a pseudo-terminal of 120x40) attached, no dashboard; then a ddtop frozen
with SIGSTOP for --frozen-seconds, and no dashboard. Steps per second of each
phase (the slowest rank's global step from the daemon's status), each watched
phase's ratio to the mean of the no-dashboard phases either side of it (median
over cycles), and the daemon's resident memory before and after.

Part 3 (--tui-pairs N, --headless-pairs N), a dashboard's cost, paired: one
long run with one dashboard attached (the TUI, or `ddtop --headless`), in N
pairs of phases of --pair-phase-seconds, the dashboard running in one and
frozen with SIGSTOP in the other (in a random order; a thawed one gets 1.5 s
to catch up before its phase): running steps/s over frozen, the median with
a sign-test interval, the mean with a 95% t interval (bench/stats.py), and the
dashboard's CPU while running. Phases a few seconds apart see the same load,
which part 2's longer ones do not. --attached-pairs N: pairs of a TUI attached (a new one
each time, 5 s after its start) and no dashboard at all, attached over none;
--frozen-pairs N: the same with the TUI frozen for 10 s before its phase.
--waker-pairs N, a control: running against frozen, as for the TUI, with a
process that does nothing but wake 40 times a second.

Numbers in docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import pty
import random
import re
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stats import mean_interval, median_interval  # bench/stats.py, beside this script

from ddtop.core import control, journal, memcg, protocol, wire
from ddtop.core.rundir import RunPaths
from ddtop.core.runinfo import RunInfo
from ddtop.core.state import RunState
from ddtop.core.summary import RunSummary

BIN = Path(sys.executable).parent
DDTRAIN, DDTOP = str(BIN / "ddtrain"), str(BIN / "ddtop")
TICK_S = 0.05
ANNOUNCE = re.compile(r"ddtop drill (\S+): acting after step (\d+) \(at ([\d.]+)\)")
FAULT_STEP = 60
SLOW_FROM = 100
HANG_TIMEOUT_S = 2


@dataclass
class Drill:
    name: str
    spec: str  # with RANK first
    check: str  # what the state must say: dead | hang | slow | clean
    signal: str | None = None
    exit_code: int | None = None
    extra: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """What --drills calls it: kill, segfault, raise, exit, hang, stop, slow, clean."""
        return self.name.split()[0].split("=")[0]

    @property
    def rank(self) -> int:
        return int(self.spec.split(":")[0]) if self.spec else -1


def drills(world: int) -> list[Drill]:
    last = world - 1
    return [
        Drill("kill", f"1:kill@step={FAULT_STEP}", "dead", signal="SIGKILL"),
        Drill("segfault", f"{last}:segfault@step={FAULT_STEP}", "dead", signal="SIGSEGV"),
        Drill("raise", f"0:raise@step={FAULT_STEP}", "dead", exit_code=1),
        Drill("exit=3", f"1:exit=3@step={FAULT_STEP}", "dead", exit_code=3),
        Drill("oom", f"1:oom@step={FAULT_STEP}", "dead", signal="SIGKILL"),
        Drill("hang", f"{last}:hang@step={FAULT_STEP}", "hang",
              extra=("--hang-timeout", str(HANG_TIMEOUT_S))),
        Drill("stop (SIGSTOP)", f"1:stop@step={FAULT_STEP}", "hang",
              extra=("--hang-timeout", str(HANG_TIMEOUT_S))),
        Drill("slow=1.5x", f"1:slow=1.5x@step={SLOW_FROM}", "slow"),
        Drill("clean", "", "clean"),
    ]


def run_args(world: int, steps: int) -> list[str]:
    per_rank = 16
    return ["-n", str(world), "--batch-size", str(per_rank * world),
            "--synthetic-train-samples", str(per_rank * world * steps),
            "--synthetic-val-samples", str(per_rank * world)]


# -- the state, as it was at each moment -------------------------------------------------------
def moments(path: Path, run: str, until_s: float = 5.0) -> Iterator[tuple[float, RunState]]:
    """(t, the state then) every TICK_S from the first journal record to
    `until_s` after the last: records folded at the time the daemon got them."""
    records = [(r.received, wire.decode([r.frame])) for r in journal.read(path)]
    state = RunState(run=run)
    if not records:
        return
    t, i = records[0][0], 0
    end = records[-1][0] + until_s
    while t <= end:
        while i < len(records) and records[i][0] <= t:
            state.apply(records[i][1], records[i][0])
            i += 1
        yield t, state
        t += TICK_S


def first(path: Path, run: str, since: float, says: Callable[[float, RunState], bool]
          ) -> float | None:
    """Seconds from `since` to the first moment the state `says` so; None: never."""
    for t, state in moments(path, run):
        if t >= since and says(t, state):
            return t - since
    return None


@dataclass
class Result:
    named_s: float | None = None  # fault -> the right words
    failed_s: float | None = None  # fault -> failed by --hang-timeout
    steps: int | None = None  # slow: steps of the rank until named
    kept: float | None = None  # slow: share of samples after naming that name it
    wrong: int = 0  # samples naming another rank (slow) / anyone (clean)
    samples: int = 0


def run_drill(drill: Drill, world: int, root: Path, index: int,
              step_delay: float = 0.0) -> Result:
    steps = 450 if drill.check in ("slow", "clean") else 300
    run_id = re.sub(r"[^A-Za-z0-9]+", "-", drill.name.split()[0]) + f"-{index}"
    cwd = root / run_id
    cwd.mkdir()
    inject = ["--inject", drill.spec] if drill.spec else []
    cmd = [DDTRAIN, "start", "--foreground", "--run-id", run_id, "--epochs", "1",
           *run_args(world, steps), *(["--step-delay", f"{step_delay:g}"] if step_delay else []),
           *inject, *drill.extra]
    with (cwd / "out.log").open("w") as out:
        code = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=600, check=False).returncode
    paths = RunPaths(cwd / "runs" / run_id)
    expected = 0 if drill.check in ("slow", "clean") else 1
    if code != expected:
        sys.exit(f"{drill.name}: exit {code}, expected {expected}; see {cwd / 'out.log'}")
    fault_t = fault_step = None
    if drill.spec:
        found = ANNOUNCE.search(paths.rank_log(drill.rank).read_text(errors="replace"))
        if found is None:
            sys.exit(f"{drill.name}: the drill never acted; see {paths.rank_log(drill.rank)}")
        fault_step, fault_t = int(found[2]), float(found[3])
    result = Result()
    k = drill.rank
    if drill.check == "dead":
        def dead(t: float, s: RunState) -> bool:
            f = s.failure
            return (f is not None and f.rank == k and f.signal == drill.signal
                    and (drill.exit_code is None or f.exit_code == drill.exit_code)
                    and (drill.name != "raise" or ("injected failure" in (f.message or "")
                                                   and bool(f.traceback)))
                    and (drill.name != "oom" or "OOM killer" in (f.reason or "")))
        assert fault_t is not None
        result.named_s = first(paths.journal, run_id, fault_t, dead)
    elif drill.check == "hang":
        def hung(t: float, s: RunState) -> bool:
            found = s.hung(t)
            silent = drill.name.startswith("stop")
            return (found is not None and k in found[0] and " wait in " in found[1]
                    and (not silent or f"rank {k} is silent" in found[1]))

        def failed(t: float, s: RunState) -> bool:
            return s.failure is not None and s.failure.rank == k and "hung for" in (
                s.failure.message or "")
        assert fault_t is not None
        result.named_s = first(paths.journal, run_id, fault_t, hung)
        result.failed_s = first(paths.journal, run_id, fault_t, failed)
    else:
        named_at, samples, kept, after, wrong = None, 0, 0, 0, 0
        for i, (t, state) in enumerate(moments(paths.journal, run_id, until_s=0)):
            if state.status not in ("running", "starting"):
                continue
            names = state.stragglers()[2]
            if drill.check == "slow" and named_at is None and names == [k]:
                named_at = state.ranks[k].global_step  # asked every 50 ms, as status may be
                assert fault_t is not None
                result.named_s = t - fault_t
            if i % 5:
                continue  # the samples: every 250 ms while it runs
            samples += 1
            if drill.check == "clean":
                wrong += bool(names)
                continue
            if named_at is not None:
                after += 1
                kept += names == [k]
            wrong += any(r != k for r in names)
        result.samples, result.wrong = samples, wrong
        if drill.check == "slow":
            assert fault_step is not None
            result.steps = named_at - fault_step if named_at is not None else None
            result.kept = kept / after if after else None
    return result


def spread(values: list[float | None], unit: str = " s", digits: int = 2) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "never"
    missed = len(values) - len(got)
    low, high = f"{min(got):.{digits}f}", f"{max(got):.{digits}f}"
    text = f"{statistics.median(got):.{digits}f}{unit} ({low}-{high})"
    return text + (f", {missed} never" if missed else "")


def part_drills(world: int, repeats: int, root: Path, only: set[str] | None = None,
                step_delay: float = 0.0) -> None:
    chosen = [d for d in drills(world) if only is None or d.key in only]
    if any(d.key == "oom" for d in chosen) and (why := memcg.why_not_writable()):
        print(f"  oom: left out: {why}", file=sys.stderr)
        chosen = [d for d in chosen if d.key != "oom"]
    results: dict[str, list[Result]] = {}
    for index in range(repeats):
        for drill in chosen:
            started = time.monotonic()
            result = run_drill(drill, world, root, index, step_delay)
            results.setdefault(drill.name, []).append(result)
            print(f"  {drill.name:<15} run {index + 1}: named {result.named_s} s, failed "
                  f"{result.failed_s} s, steps {result.steps}, wrong {result.wrong}/"
                  f"{result.samples} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    print(f"\nPart 1: drills at world size {world}, median (min-max) of {repeats} runs")
    print(f"{'drill':<16} | {'fault -> named in status':<34} | "
          f"fault -> failed (--hang-timeout {HANG_TIMEOUT_S})")
    print("-" * 96)
    for drill in chosen:
        got = results[drill.name]
        if drill.check == "dead":
            how = drill.signal or f"exit code {drill.exit_code}"
            print(f"{drill.name:<16} | {spread([r.named_s for r in got]):<34} | "
                  f"(rank {drill.rank}, {how})")
        elif drill.check == "hang":
            print(f"{drill.name:<16} | {spread([r.named_s for r in got]):<34} | "
                  f"{spread([r.failed_s for r in got])}")
        elif drill.check == "slow":
            steps = spread([float(r.steps) if r.steps is not None else None for r in got],
                           " steps", 0)
            kept = spread([100 * r.kept if r.kept is not None else None for r in got], "%", 0)
            wrong = sum(r.wrong for r in got)
            steps += f", {spread([r.named_s for r in got])}"
            print(f"{drill.name:<16} | {steps:<34} | named in {kept} of the samples after; "
                  f"another rank named in {wrong} of {sum(r.samples for r in got)}")
        else:
            wrong = sum(r.wrong for r in got)
            print(f"{drill.name:<16} | {'-':<34} | samples naming a straggler: {wrong} of "
                  f"{sum(r.samples for r in got)}")


# -- part 2: watching ------------------------------------------------------------------------
def status(info: RunInfo) -> RunSummary:
    assert info.control is not None
    summary = control.request(info.control, protocol.Status(), 5.0, keys=info.keys).summary
    assert summary is not None
    return summary


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Tui:
    """ddtop (the Textual app) in a pseudo-terminal of 120x40, its output drained."""

    def __init__(self, run_id: str, cwd: Path, fps: float | None = None) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}
        rate = ["--fps", f"{fps:g}"] if fps is not None else []
        self.proc = subprocess.Popen([DDTOP, run_id, *rate], cwd=cwd, stdin=slave, stdout=slave,
                                     stderr=slave, env=env, start_new_session=True)
        os.close(slave)
        self.master = master
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                if not os.read(self.master, 65536):
                    return
            except OSError:
                return

    def close(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


def _stop_watcher(watcher: Any) -> None:
    """A dashboard this part started, gone (a Tui, or a ddtop --headless process)."""
    if isinstance(watcher, Tui):
        if watcher.proc.poll() is None:  # not closed by its phase already
            watcher.close()
    elif watcher.poll() is None:
        watcher.terminate()
        try:
            watcher.wait(10)
        except subprocess.TimeoutExpired:
            watcher.kill()
            watcher.wait()


@contextlib.contextmanager
def long_run(world: int, root: Path, run_id: str) -> Iterator[tuple[Path, RunInfo]]:
    """A detached run of the built-in trainer that ends only when stopped (it is,
    however the caller ends), past its start-up: its folder and its RunInfo."""
    cwd = root / run_id
    cwd.mkdir()
    args = [*run_args(world, 500), "--epochs", "1000"]
    start = subprocess.run([DDTRAIN, "start", "--run-id", run_id, *args],
                           cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    if start.returncode != 0:
        sys.exit(f"could not start the run: {start.stderr}")
    try:
        info = RunInfo.load(RunPaths(cwd / "runs" / run_id))
        deadline = time.monotonic() + 120
        while not status(info).global_step:  # past start-up
            if time.monotonic() > deadline:
                sys.exit("the run took no step within 120 s (see its logs)")
            time.sleep(0.5)
        time.sleep(2)
        yield cwd, info
    finally:
        subprocess.run([DDTRAIN, "stop", run_id, "--timeout", "20"], cwd=cwd,
                       capture_output=True, timeout=120, check=False)


def steps_per_second(info: RunInfo, seconds: float) -> float:
    """The run's steps per second (the slowest rank's) over the next `seconds`."""
    a, t0 = status(info).global_step, time.monotonic()
    time.sleep(seconds)
    b, t1 = status(info).global_step, time.monotonic()
    return (b - a) / (t1 - t0)


def part_dashboard(world: int, phase_s: float, frozen_s: float, cycles: int, root: Path,
                   fps: float | None = None) -> None:
    with long_run(world, root, "watch") as (cwd, info):
        _watch_phases(cwd, info, world, phase_s, frozen_s, cycles, fps)


def _watch_phases(cwd: Path, info: RunInfo, world: int, phase_s: float, frozen_s: float,
                  cycles: int, fps: float | None) -> None:
    run_id = info.paths.run_id
    daemon = info.record.daemon_pid
    assert daemon is not None
    rows: list[tuple[str, float, float]] = []
    rss_before = rss_kib(daemon)

    def phase(name: str, seconds: float) -> None:
        rows.append((name, steps_per_second(info, seconds), seconds))
        print(f"  {name}: {rows[-1][1]:.1f} steps/s", file=sys.stderr)

    watchers: list[Any] = []  # every dashboard started, stopped however the part ends
    try:
        phase("none", phase_s)
        for _ in range(cycles):
            headless = subprocess.Popen([DDTOP, "--headless", run_id], cwd=cwd,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            watchers.append(headless)
            time.sleep(2)
            phase("ddtop --headless attached", phase_s)
            headless.terminate()
            headless.wait(10)
            phase("none", phase_s)
            tui = Tui(run_id, cwd, fps)
            watchers.append(tui)
            time.sleep(3)
            phase("ddtop (TUI) attached", phase_s)
            tui.close()
            phase("none", phase_s)
        tui = Tui(run_id, cwd, fps)
        watchers.append(tui)
        time.sleep(3)
        os.kill(tui.proc.pid, signal.SIGSTOP)
        phase(f"ddtop (TUI) frozen with SIGSTOP for {frozen_s:g} s", frozen_s)
        rss_frozen = rss_kib(daemon)
        tui.close()
        phase("none", phase_s)
        rss_after = rss_kib(daemon)
    finally:
        for watcher in watchers:
            _stop_watcher(watcher)
    # Each watched phase against the mean of the no-dashboard phases either side of it.
    ratios: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}
    for i, (name, rate, _) in enumerate(rows):
        rates.setdefault(name, []).append(rate)
        if name != "none":
            base = statistics.mean([rows[i - 1][1], rows[i + 1][1]])
            ratios.setdefault(name, []).append(rate / base)
    print(f"\nPart 2: watching, world size {world}, one run, phases of {phase_s:g} s, "
          f"{cycles} cycles")
    print(f"{'phase':<46} | {'steps/s':>8} | ratio to no dashboard either side")
    print("-" * 96)
    for name, got in rates.items():
        ratio = ("-" if name == "none" else
                 f"{statistics.median(ratios[name]):.3f} "
                 f"({', '.join(f'{r:.3f}' for r in ratios[name])})")
        print(f"{name if name != 'none' else 'no dashboard':<46} | "
              f"{statistics.median(got):>8.1f} | {ratio}")
    print(f"\ndaemon RSS: {rss_before / 1024:.1f} MiB before, {rss_frozen / 1024:.1f} MiB "
          f"after {frozen_s:g} s with a frozen ddtop, {rss_after / 1024:.1f} MiB at the end")


SETTLE_S = {"frozen": 0.5, "running": 1.5}  # before a phase: a thawed dashboard catches up


WAKER = "import time\nwhile True:\n    time.sleep(0.025)"  # wakes 40 times a second, no work


def start_watcher(kind: str, run_id: str, cwd: Path, fps: float | None) -> tuple[Any, int]:
    """A watcher of `kind` on the run (a Tui, or a process), and its pid."""
    if kind == "tui":
        tui = Tui(run_id, cwd, fps)
        return tui, tui.proc.pid
    command = ([DDTOP, "--headless", run_id] if kind == "headless"
               else [sys.executable, "-c", WAKER])
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return proc, proc.pid


def watcher_name(kind: str, fps: float | None) -> str:
    return {"headless": "ddtop --headless",
            "waker": "a process that only wakes 40 times a second (no dashboard)",
            "tui": f"the TUI ({'--fps ' + format(fps, 'g') if fps else 'its default fps'})"}[kind]


def part_pairs(kind: str, world: int, pairs: int, phase_s: float, root: Path,
               fps: float | None) -> None:
    """One watcher (the TUI, `ddtop --headless`, or the waker: a control) on one
    long run, frozen (SIGSTOP) and running in turn: each pair of phases, in a
    random order, gives running steps/s over frozen steps/s."""
    rng = random.Random(1)
    ratios: list[float] = []
    watcher_cpu = watcher_time = 0.0
    with long_run(world, root, f"pairs-{kind}") as (cwd, info):
        watcher, pid = start_watcher(kind, info.paths.run_id, cwd, fps)
        try:
            time.sleep(5)  # its start-up
            for i in range(pairs):
                rates = {}
                for state in rng.sample(["running", "frozen"], 2):
                    os.kill(pid, signal.SIGSTOP if state == "frozen" else signal.SIGCONT)
                    time.sleep(SETTLE_S[state])
                    before = process_cpu_s(pid)
                    rates[state] = steps_per_second(info, phase_s)
                    if state == "running":
                        watcher_cpu += process_cpu_s(pid) - before
                        watcher_time += phase_s
                ratios.append(rates["running"] / rates["frozen"])
                print(f"  pair {i + 1}: running {rates['running']:.1f}, frozen "
                      f"{rates['frozen']:.1f} steps/s: {ratios[-1]:.3f}", file=sys.stderr)
        finally:
            os.kill(pid, signal.SIGCONT)
            _stop_watcher(watcher)
    print(f"\nPart 3: {watcher_name(kind, fps)} running against frozen, world size {world}, "
          f"{pairs} pairs of {phase_s:g} s")
    report_ratios(ratios, f"it took {watcher_cpu / watcher_time * 100:.1f}% of a core "
                  "while running")


FROZEN_FOR_S = 10.0  # a frozen TUI's phase starts this long after it was frozen


def part_attach_pairs(frozen: bool, world: int, pairs: int, phase_s: float, root: Path,
                      fps: float | None) -> None:
    """Pairs of phases, in a random order: a TUI attached (a new one each time,
    5 s after its start; `frozen`: then frozen with SIGSTOP for FROZEN_FOR_S
    before its phase, so that what the daemon sends it piles up unread) and no
    dashboard at all; steps/s with the TUI over steps/s without."""
    rng = random.Random(2 if frozen else 3)
    ratios: list[float] = []
    tui_cpu = tui_time = 0.0
    what = "frozen" if frozen else "attached"
    with long_run(world, root, f"pairs-{what}") as (cwd, info):
        for i in range(pairs):
            rates = {}
            for state in rng.sample([what, "none"], 2):
                if state == "none":
                    time.sleep(SETTLE_S["frozen"])
                    rates[state] = steps_per_second(info, phase_s)
                    continue
                tui = Tui(info.paths.run_id, cwd, fps)
                try:
                    time.sleep(5)  # its start-up, connected and drawing
                    if frozen:
                        os.kill(tui.proc.pid, signal.SIGSTOP)
                        time.sleep(FROZEN_FOR_S)
                    before = process_cpu_s(tui.proc.pid)
                    rates[state] = steps_per_second(info, phase_s)
                    tui_cpu += process_cpu_s(tui.proc.pid) - before
                    tui_time += phase_s
                finally:
                    _stop_watcher(tui)
                time.sleep(1)  # its exit
            ratios.append(rates[what] / rates["none"])
            print(f"  pair {i + 1}: {what} {rates[what]:.1f}, none {rates['none']:.1f} "
                  f"steps/s: {ratios[-1]:.3f}", file=sys.stderr)
    how = (f"frozen (for {FROZEN_FOR_S:g} s before its phase)" if frozen
           else "attached (5 s after its start)")
    print(f"\nPart 3: the TUI {how} against no dashboard, world size {world}, {pairs} pairs "
          f"of {phase_s:g} s")
    report_ratios(ratios, "" if frozen else
                  f"it took {tui_cpu / tui_time * 100:.1f}% of a core while attached")


def report_ratios(ratios: list[float], also: str) -> None:
    found = median_interval(ratios)
    print(f"steps/s ratio {found.cell()} (median [95% interval, sign test]): "
          f"{found.verdict()}{'; ' + also if also else ''}")
    if len(ratios) >= 2:
        mean, half = mean_interval(ratios)
        print(f"mean ratio {mean:.4f} [{mean - half:.4f}, {mean + half:.4f}] (95%, Student's "
              f"t; pairs' standard deviation {statistics.stdev(ratios):.4f})")


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each drill (default 3)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--phase-seconds", type=float, default=10.0)
    parser.add_argument("--frozen-seconds", type=float, default=60.0)
    parser.add_argument("--cycles", type=int, default=2,
                        help="none / headless / none / TUI / none cycles (default 2)")
    parser.add_argument("--no-drills", action="store_true")
    parser.add_argument("--drills", metavar="NAME,...",
                        help="only these drills: " + ", ".join(
                            d.key for d in drills(4)) + " (default: all)")
    parser.add_argument("--no-dashboard", action="store_true")
    parser.add_argument("--step-delay", type=float, default=0.0, metavar="S",
                        help="part 1: each step S seconds longer (ddtrain start --step-delay: "
                             "a step of 0.1 s sends a Step message a step, as a real model's "
                             "does; the built-in model's 5 ms steps pack 20 to a message)")
    parser.add_argument("--tui-fps", type=float, metavar="N",
                        help="the TUI's --fps in parts 2 and 3 (default: ddtop's own)")
    for flag, what in (("tui", "TUI running / frozen"),
                       ("headless", "ddtop --headless running / frozen"),
                       ("attached", "a TUI attached / no dashboard"),
                       ("frozen", "a frozen TUI / no dashboard"),
                       ("waker", "running / frozen (a control: a process that only wakes "
                                 "40 times a second)")):
        parser.add_argument(f"--{flag}-pairs", type=int, default=0, metavar="N",
                            help=f"part 3: N pairs of {what} phases (default 0: not run)")
    parser.add_argument("--pair-phase-seconds", type=float, default=4.0)
    args = parser.parse_args()
    only = None
    if args.drills:
        only = set(args.drills.split(","))
        known = {d.key for d in drills(args.world_size)}
        if only - known:
            parser.error(f"unknown drill {', '.join(sorted(only - known))}; "
                         f"choose from {', '.join(sorted(known))}")
    print(f"{os.cpu_count()} CPUs; world size {args.world_size}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_drills:
            part_drills(args.world_size, args.repeats, Path(tmp), only, args.step_delay)
        if not args.no_dashboard:
            part_dashboard(args.world_size, args.phase_seconds, args.frozen_seconds,
                           args.cycles, Path(tmp), args.tui_fps)
        for kind, pairs in (("headless", args.headless_pairs), ("tui", args.tui_pairs),
                            ("waker", args.waker_pairs)):
            if pairs > 0:
                part_pairs(kind, args.world_size, pairs, args.pair_phase_seconds,
                           Path(tmp), args.tui_fps)
        for frozen, pairs in ((False, args.attached_pairs), (True, args.frozen_pairs)):
            if pairs > 0:
                part_attach_pairs(frozen, args.world_size, pairs, args.pair_phase_seconds,
                                  Path(tmp), args.tui_fps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
