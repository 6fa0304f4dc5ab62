"""What watching a user's own training script costs it: steps per second of a
small-step script (about 2 ms per step here, where per-step instrumentation
hurts most), uninstrumented against the `import ddtop` API and zero-code mode.

    .venv/bin/python bench/own_script.py [--rounds 6] [--steps-each 1500] [--width 256]

Every figure is a ratio of speeds, instrumented over uninstrumented (1.0: no
cost; the target is at least 0.99), read two ways:

- wall: steps per second by the clock, what a user sees, and what any other
  load on the machine moves;
- CPU: the CPU seconds a step costs its rank processes, every thread of them
  (the training thread, gloo's threads, ddtop's sender thread and ZeroMQ's),
  from `time.process_time()`: baseline CPU per step over instrumented CPU per
  step. Other programs on the same cores move it less than the clock, but do
  move it (cache misses, a descheduled virtual CPU), so it is paired too.

Each ratio is the median of paired ratios (an instrumented measurement over
its baseline taken beside it), with a 95% interval for that median that
assumes nothing about how the ratios are distributed (the sign test's, from
the order statistics, bench/stats.py; with fewer than six pairs it is unbounded). The
verdict reads the interval: "meets 0.99" when its low end is at least 0.99,
"below 0.99" when its high end is under 0.99, else "cannot tell (the
interval spans 0.99)".

1. Whole runs (`--only launchers`): a small DDP script (gloo on CPU, an MLP,
   one intra-op thread per rank) is written to a temporary folder and run
   under each launcher, `--rounds` rounds, each in a random order with a
   launcher's variants side by side. After `--warmup` steps each rank reads
   both clocks every 50 steps; a run's wall figure is rank 0's median 50-step
   window, its CPU figure the median window of both ranks' CPU together, so
   process start-up (torchrun's fresh interpreters against ddtrain's
   forkserver) and shutdown are in neither. CPU-io is the CPU per step from
   each thread's own counter over all timed steps, less gloo's I/O thread
   (which runs no ddtop code and spends CPU as ranks wait on each other).
   Pairs are within a round, each launcher against itself:

     plain torchrun      `torchrun --standalone`, no DDTOP_TELEMETRY
     API, torchrun       the same with `ddtop.watch(model)` and one
                         `ddtop.step(loss=loss, samples=...)` per step,
                         sending to a ZeroMQ PULL socket this process binds
                         and drains in a thread       baseline: plain torchrun
     ddtrain, off        the plain script under `ddtrain start --foreground`
                         with DDTOP_TELEMETRY=off: the same daemon and
                         forkserver, nothing instrumented
     zero-code           the plain script under `ddtrain start --foreground`
                         (the daemon's relay receives; every rank
                         instrumented)                 baseline: ddtrain, off
     zero-code + API     the API script under `ddtrain start --foreground`
                                                       baseline: ddtrain, off

   Whole runs pair poorly on shared cores (runs seconds apart, different
   processes): few pairs, wide intervals.

2. Same processes (`--only pieces`): two gloo ranks hold a pool of DDP
   models (the same MLP, by comm hook: none, torch's, ddtop's), dealt out to
   the configurations afresh each round, and step them in turn: one step of
   every configuration per round, in a new random order
   each round (a barrier before each step), `--steps-each` rounds. A burst of
   outside load lands on a whole round, so each step pairs with the round's
   uninstrumented step taken a few ms away. The configurations: no hook, and
   no hook again on a second model (the noise floor: it should read 1.0);
   torch's own Python `allreduce_hook` (what any Python comm hook costs);
   ddtop's timed comm hook (what a model on a GPU gets); DDP stats
   (`ddtop.watch` on CPU: DDP's own statistics, read after the forward now
   and then); the zero-code optimizer hooks; zero-code's wrapped DDP forward
   (marking the phases); `ddtop.step(loss=..., samples=...)`; and the modes:
   API (`ddtop.watch` + `ddtop.step`), zero-code (`ddtop.watch` + optimizer
   hooks + phases) and zero-code + API (all of them). ddtop's
   own threads (sender, ZeroMQ) run throughout and are measured apart; the
   modes' verdicts charge their CPU to each step.

`--pin` pins each rank process (all its threads) to a core of its own;
`--modes-only` steps only the baseline, the noise floor and the three modes
in part 2, for more rounds in the same time (narrower intervals).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stats import Estimate, median_interval  # bench/stats.py, beside this script
from telemetry import Listener  # bench/telemetry.py, beside this script

BIN = Path(sys.executable).parent
TORCHRUN = str(BIN / "torchrun")
DDTRAIN = str(BIN / "ddtrain")
RUN_TIMEOUT_S = 300
WINDOW = 50  # part 1: steps per timed window

# Helpers both parts run in each rank (part 1 writes them into its script).
# Pinning takes every thread the process has now (torch's, a forkserver's,
# ddtop's sender when it started first) and, by inheritance, every thread it
# starts later. Thread CPU comes from /proc (the scheduler's own nanoseconds).
RANK_HELPERS = '''\
def pin_to_core(index):
    import os
    cpus = sorted(os.sched_getaffinity(0))
    core = {cpus[index % len(cpus)]}
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), core)
        except OSError:
            pass  # a thread that ended meanwhile


def thread_cpu():
    """CPU seconds so far of this process's threads: ddtop's own (its sender
    thread and ZeroMQ's), gloo's I/O loop, and all the others."""
    import os
    import threading
    names = {t.native_id: t.name for t in threading.enumerate()}
    seconds = {"ddtop": 0.0, "gloo_io": 0.0, "other": 0.0}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue  # a thread that ended meanwhile
        name = names.get(int(tid), comm)
        if name.startswith("ddtop") or comm.startswith("ZMQbg"):
            seconds["ddtop"] += ns / 1e9
        elif comm.startswith("gloo_tcp_loop"):
            seconds["gloo_io"] += ns / 1e9
        else:
            seconds["other"] += ns / 1e9
    return seconds
'''

SCRIPT = '''\
"""A user's small DDP training script (written by bench/own_script.py)."""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1200)
parser.add_argument("--warmup", type=int, default=200)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--api", action="store_true", help="with the ddtop lines")
parser.add_argument("--pin", action="store_true", help="one core per rank")
parser.add_argument("--out", required=True, help="folder for each rank's timings")
args = parser.parse_args()
if args.pin:
    pin_to_core(int(os.environ["LOCAL_RANK"]))
if args.api:
    import ddtop

torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1, whatever the launcher
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(64, args.width), nn.ReLU(),
                          nn.Linear(args.width, args.width), nn.ReLU(),
                          nn.Linear(args.width, 10)))
if args.api:
    model = ddtop.watch(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()
generator = torch.Generator().manual_seed(rank)
batches = [(torch.randn(args.batch, 64, generator=generator),
            torch.randint(0, 10, (args.batch,), generator=generator)) for _ in range(16)]
WINDOW = @WINDOW@  # steps per timed window
wall, cpu = [], []
threads = None
for step in range(args.steps):
    if step >= args.warmup and (step - args.warmup) % WINDOW == 0:
        wall.append(time.perf_counter())
        cpu.append(time.process_time())  # every thread of this process
        if threads is None:
            threads = thread_cpu()
    x, y = batches[step % len(batches)]
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if args.api:
        ddtop.step(loss=loss, samples=len(x))
wall.append(time.perf_counter())
cpu.append(time.process_time())
threads = {kind: seconds - threads[kind] for kind, seconds in thread_cpu().items()}
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump({"wall": wall, "cpu": cpu, "threads": threads, "timed": args.steps - args.warmup,
               "params": sum(p.numel() for p in model.parameters())}, f)
dist.destroy_process_group()
'''.replace("@WINDOW@", str(WINDOW))


# -- part 1: whole runs -----------------------------------------------------------------------
@dataclass
class Variant:
    name: str
    launcher: str  # "torchrun" or "ddtrain"
    api: bool
    env: dict[str, str | None]  # None: removed from the environment
    baseline: str | None


def variants(endpoint: str) -> list[Variant]:
    return [
        Variant("plain torchrun", "torchrun", False, {"DDTOP_TELEMETRY": None}, None),
        Variant("API, torchrun", "torchrun", True, {"DDTOP_TELEMETRY": endpoint},
                "plain torchrun"),
        Variant("ddtrain, off", "ddtrain", False, {"DDTOP_TELEMETRY": "off"}, None),
        Variant("zero-code", "ddtrain", False, {"DDTOP_TELEMETRY": None}, "ddtrain, off"),
        Variant("zero-code + API", "ddtrain", True, {"DDTOP_TELEMETRY": None},
                "ddtrain, off"),
    ]


@dataclass
class RunResult:
    rate: float  # steps/s, rank 0's median window
    cpu: float  # CPU seconds per step, both ranks together, median window
    cpu_core: float  # the same, mean over the timed steps, less gloo's I/O thread
    ddtop_cpu: float  # CPU seconds per step of ddtop's threads, both ranks together
    params: int


def run_once(variant: Variant, script: Path, tmp: Path, args: argparse.Namespace) -> RunResult:
    out = Path(tempfile.mkdtemp(dir=tmp))
    script_args = ["--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--width", str(args.width), "--out", str(out)]
    if variant.api:
        script_args.append("--api")
    if args.pin:
        script_args.append("--pin")
    if variant.launcher == "torchrun":
        cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script), *script_args]
    else:
        cmd = [DDTRAIN, "start", "--foreground", "-n", "2", "--runs-dir", str(tmp / "runs"),
               str(script), "--", *script_args]
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # each launcher's own default; the script sets 1
    for key, value in variant.env.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    # A session of its own, so that a run past its timeout is ended with every
    # process it started (torchrun's ranks, ddtrain's daemon and ranks).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=tmp, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _end_group(proc)
        sys.exit(f"{variant.name}: no result within {RUN_TIMEOUT_S} s")
    finally:
        _end_group(proc)
    try:
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    except FileNotFoundError:
        sys.exit(f"{variant.name} failed ({proc.returncode}):\n{output[-4000:]}")
    if proc.returncode != 0:  # e.g. gloo aborting in a rank's teardown, after the result
        print(f"  ({variant.name}: exit {proc.returncode} after its result; "
              f"{output.strip().splitlines()[-1][:120]})", file=sys.stderr)
    walls = [b - a for a, b in zip(ranks[0]["wall"], ranks[0]["wall"][1:], strict=False)]
    cpus = [sum(rank["cpu"][i + 1] - rank["cpu"][i] for rank in ranks)
            for i in range(len(ranks[0]["cpu"]) - 1)]
    ddtop_cpu = sum(rank["threads"]["ddtop"] / rank["timed"] for rank in ranks)
    core = sum((rank["threads"]["ddtop"] + rank["threads"]["other"]) / rank["timed"]
               for rank in ranks)
    return RunResult(WINDOW / statistics.median(walls), statistics.median(cpus) / WINDOW,
                     core, ddtop_cpu, ranks[0]["params"])


def _end_group(proc: subprocess.Popen[str]) -> None:
    """End whatever is left of the process group this bench started for a run."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break  # nothing left
        for _ in range(50):  # up to 5 s for the group to go
            if proc.poll() is not None and not _group_alive(proc.pid):
                return
            time.sleep(0.1)
    proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def launchers(args: argparse.Namespace) -> dict[str, tuple[Estimate, Estimate]]:
    listener = Listener()
    configs = variants(listener.endpoint)
    results: dict[str, list[RunResult]] = {v.name: [] for v in configs}
    rng = random.Random(1)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        script = tmp / "train.py"
        script.write_text(RANK_HELPERS + SCRIPT)
        launchers = [[v for v in configs if v.launcher == name] for name in ("torchrun", "ddtrain")]
        for i in range(args.rounds):
            # A random order, a launcher's variants side by side: a pair is at most
            # two runs apart.
            order = [v for group in rng.sample(launchers, 2) for v in rng.sample(group, len(group))]
            for variant in order:
                result = run_once(variant, script, tmp, args)
                results[variant.name].append(result)
                print(f"  round {i + 1} {variant.name:<16} {result.rate:7.1f} steps/s, "
                      f"{result.cpu * 1e3:6.3f} CPU ms/step ({result.cpu_core * 1e3:6.3f} less "
                      f"gloo's I/O thread), ddtop threads "
                      f"{result.ddtop_cpu * 1e6:4.1f} us/step",
                      file=sys.stderr)
    listener.close()
    timed = args.steps - args.warmup
    params = results["plain torchrun"][0].params
    print(f"\n1. Whole runs: 2 gloo ranks on CPU, MLP of {params:,} parameters, {timed} timed "
          f"steps per run (after {args.warmup} warm-up), {args.rounds} rounds in random order"
          f"{', ranks pinned' if args.pin else ''}")
    print("   ratio: median of the rounds' paired ratios to the baseline [95% interval, "
          "sign test]; CPU: both ranks, all threads; CPU-io: less gloo's I/O thread; "
          "ddtop: its threads' CPU")
    print(f"{'variant':<16} | {'steps/s':>7} | {'wall ratio':<21} | {'CPU ms':>6} | "
          f"{'CPU ratio':<21} | {'CPU-io':>6} | {'CPU-io ratio':<21} | {'ddtop us':>8}")
    print("-" * 126)
    found: dict[str, tuple[Estimate, Estimate]] = {}
    verdicts: list[str] = []
    for v in configs:
        mine = results[v.name]
        cells = ["-", "-", "-"]
        if v.baseline:
            base = results[v.baseline]
            pairs = list(zip(mine, base, strict=True))
            wall = median_interval([m.rate / b.rate for m, b in pairs])
            cpu = median_interval([b.cpu / m.cpu for m, b in pairs])
            core = median_interval([b.cpu_core / m.cpu_core for m, b in pairs])
            found[v.name] = (wall, cpu)
            cells = [wall.cell(), cpu.cell(), core.cell()]
            verdicts.append(f"verdict, whole runs, {v.name}: wall {wall.verdict()}; CPU "
                            f"{cpu.verdict()}; CPU-io {core.verdict()}")
        print(f"{v.name:<16} | {statistics.median(r.rate for r in mine):7.1f} | "
              f"{cells[0]:<21} | {statistics.median(r.cpu for r in mine) * 1e3:6.3f} | "
              f"{cells[1]:<21} | {statistics.median(r.cpu_core for r in mine) * 1e3:6.3f} | "
              f"{cells[2]:<21} | {statistics.median(r.ddtop_cpu for r in mine) * 1e6:8.1f}")
    print(f"(the bench's PULL socket received {listener.count} messages from the API runs)")
    print("\n".join(verdicts))
    return found


# -- part 2: the pieces, in the same processes --------------------------------------------------
PIECES = {  # name: (comm timing, optimizer hooks, wrapped forward, ddtop.step)
    "no hook": (None, False, False, False),
    "no hook, again": (None, False, False, False),  # the noise floor: same as the baseline
    "torch allreduce_hook": ("torch", False, False, False),
    "timed comm hook": ("hook", False, False, False),  # ddtop's hook (what a GPU model gets)
    "DDP stats": ("watch", False, False, False),  # ddtop.watch on CPU: DDP's statistics
    "optimizer hooks": (None, True, False, False),
    "wrapped forward": (None, False, True, False),
    "ddtop.step": (None, False, False, True),
    "API": ("watch", False, False, True),
    "zero-code": ("watch", True, True, False),
    "zero-code + API": ("watch", True, True, True),
}
BASE = "no hook"
READ_ONE_IN = 6  # 10 ms (commtimer.READ_EVERY_S) of ~1.7 ms steps
MODES = ("API", "zero-code", "zero-code + API")
WARM_ROUNDS = 20
PIECES_TIMEOUT_S = 900


def _pieces_rank(rank: int, port: int, endpoint: str, rounds: int, width: int, pin: bool,
                 out: str, names: list[str]) -> None:
    helpers: dict[str, Any] = {}
    exec(RANK_HELPERS, helpers)  # the same code part 1's script runs
    if pin:
        helpers["pin_to_core"](rank)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2", DDTOP_TELEMETRY=endpoint)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import ddtop
    from ddtop.training import api, autowatch, watched
    from ddtop.training.commtimer import CommTimer, timed_allreduce

    rank_api = api.current()
    assert rank_api is not None
    watched.wrap_forward()  # as ddtop.watch and install() do

    # Models by comm hook, two more of each kind than the configurations that use
    # it, dealt out afresh every round: each step runs on a different model (no
    # configuration finds the caches warm from the step before), and no
    # configuration keeps one model's placement in memory, which alone moves a
    # step's time by a percent or two.
    pools: dict[str | None, list[tuple[Any, Any]]] = {}
    configs = {name: PIECES[name] for name in names}
    for comm in dict.fromkeys(comm for comm, _, _, _ in configs.values()):  # in a fixed order
        for _ in range(sum(c == comm for c, _, _, _ in configs.values()) + 2):
            torch.manual_seed(0)
            model = DDP(nn.Sequential(nn.Linear(64, width), nn.ReLU(),
                                      nn.Linear(width, width), nn.ReLU(),
                                      nn.Linear(width, 10)))
            if comm == "torch":
                model.register_comm_hook(None, allreduce_hook)
            elif comm == "hook":
                model.register_comm_hook(CommTimer(rank_api.telemetry, cuda=False),
                                         timed_allreduce)
            elif comm == "watch":
                model = ddtop.watch(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            pools.setdefault(comm, []).append((model, optimizer))
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(32, 64, generator=generator),
                torch.randint(0, 10, (32,), generator=generator)) for _ in range(16)]
    loss_fn = nn.CrossEntropyLoss()
    wall: dict[str, list[float]] = {name: [] for name in configs}
    cpu: dict[str, list[float]] = {name: [] for name in configs}
    order = list(configs)
    rng = random.Random(2)  # the same order on both ranks
    clock, cpu_clock = time.perf_counter, time.process_time
    threads = helpers["thread_cpu"]()
    began = clock()
    for r in range(WARM_ROUNDS + rounds):  # the first rounds warm every model up, untimed
        rng.shuffle(order)
        dealt = {comm: rng.sample(pool, len(pool)) for comm, pool in pools.items()}
        x, y = batches[r % len(batches)]
        for name in order:
            comm, optimizer_hooks, forward_hooks, step_call = configs[name]
            model, optimizer = dealt[comm].pop()
            handles = []
            if optimizer_hooks:
                handles += [register_optimizer_step_pre_hook(autowatch._optimizer_starts),
                            register_optimizer_step_post_hook(autowatch._optimizer_done)]
            # Zero-code's hooks and phases (the wrapped forward marks phases for the
            # rank install() made) for the configurations that have them.
            autowatch._installed = rank_api if optimizer_hooks or forward_hooks else None
            watched.mark_phases(autowatch._installed)
            if forward_hooks and comm is None:  # zero-code's wrapped forward, for this model
                watched.mark_forward(model, rank_api, None)
            if comm == "watch":
                # DDP's statistics are read at most every 10 ms (commtimer.READ_EVERY_S);
                # here a model steps only every few rounds, so it is told when: as in a
                # steady run of this model's step time, one step in READ_ONE_IN (both
                # ranks alike: the same rng).
                stats = model.__dict__[api.WATCHED_ATTR].stats
                stats._next_read = -math.inf if rng.random() < 1 / READ_ONE_IN else math.inf
            dist.barrier()  # both ranks start the step together
            start, start_cpu = clock(), cpu_clock()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step_call:
                ddtop.step(loss=loss, samples=len(x))
            end, end_cpu = clock(), cpu_clock()
            for handle in handles:
                handle.remove()
            if forward_hooks and comm is None:
                model.__dict__.pop(api.WATCHED_ATTR, None)
            if r >= WARM_ROUNDS:
                wall[name].append(end - start)
                cpu[name].append(end_cpu - start_cpu)
    duration = clock() - began
    threads = {kind: s - threads[kind] for kind, s in helpers["thread_cpu"]().items()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"wall": wall, "cpu": cpu, "threads": threads, "duration": duration,
         "steps": (WARM_ROUNDS + rounds) * len(configs)}))
    dist.barrier()
    dist.destroy_process_group()


def pieces(args: argparse.Namespace) -> dict[str, tuple[Estimate, Estimate]]:
    import socket

    import torch.multiprocessing as mp

    names = [BASE, "no hook, again", *MODES] if args.modes_only else list(PIECES)
    listener = Listener()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(_pieces_rank, args=(port, listener.endpoint,
                                                         args.steps_each, args.width, args.pin,
                                                         out, names),
                                     nprocs=2, start_method="spawn", join=False)
        assert context is not None
        deadline = time.monotonic() + PIECES_TIMEOUT_S
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                    process.join()
                sys.exit(f"part 2: no result within {PIECES_TIMEOUT_S} s")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    listener.close()
    if args.save:
        Path(args.save).write_text(json.dumps(ranks))
    wall = ranks[0]["wall"]  # the ranks step together: rank 0's clock is the run's
    cpu = {name: [a + b for a, b in zip(ranks[0]["cpu"][name], ranks[1]["cpu"][name],
                                        strict=True)] for name in names}
    print(f"\n2. Same processes: the MLP (width {args.width}) in 2 gloo ranks, models dealt "
          f"out afresh each round, one step of each configuration per round in random "
          f"order, {args.steps_each} rounds"
          f"{', ranks pinned' if args.pin else ''}")
    print("   ratio: median of the rounds' paired ratios to 'no hook' [95% interval, "
          "sign test]; us: median time added per step (CPU: both ranks)")
    print(f"{'configuration':<20} | {'ms/step':>7} | {'wall ratio':<21} | {'us':>5} | "
          f"{'CPU ms':>6} | {'CPU ratio':<21} | {'CPU us':>6}")
    print("-" * 104)
    found: dict[str, tuple[Estimate, Estimate]] = {}
    for name in names:
        w = median_interval([b / m for m, b in zip(wall[name], wall[BASE], strict=True)])
        c = median_interval([b / m for m, b in zip(cpu[name], cpu[BASE], strict=True)])
        found[name] = (w, c)
        added_wall = statistics.median(m - b for m, b in zip(wall[name], wall[BASE],
                                                             strict=True))
        added_cpu = statistics.median(m - b for m, b in zip(cpu[name], cpu[BASE], strict=True))
        print(f"{name:<20} | {statistics.median(wall[name]) * 1e3:7.3f} | {w.cell():<21} | "
              f"{added_wall * 1e6:+5.0f} | {statistics.median(cpu[name]) * 1e3:6.3f} | "
              f"{c.cell():<21} | {added_cpu * 1e6:+6.0f}")
    # ddtop's own threads run the whole time, whichever step is on: their CPU is
    # charged to no configuration above, so it is given here, per second and per
    # step the rank counted.
    background = sum(rank["threads"]["ddtop"] for rank in ranks)
    duration = ranks[0]["duration"]
    print(f"ddtop's threads (sender, ZeroMQ), both ranks: {background * 1e3:.1f} ms of CPU in "
          f"{duration:.1f} s ({background / duration * 100:.2f}% of a core), "
          f"{background / ranks[0]['steps'] * 1e6:.1f} us per step of any configuration; "
          f"the bench's PULL socket received {listener.count} messages")
    # Every mode runs ddtop's threads: with their CPU per second charged to each
    # step at that step's length, the CPU ratio of the mode as a whole.
    per_second = background / duration
    for name in MODES:
        w, c = found[name]
        whole = median_interval([b / (m + per_second * t) for m, b, t in
                                 zip(cpu[name], cpu[BASE], wall[name], strict=True)])
        found[name] = (w, whole)
        print(f"verdict, same processes, {name}: wall {w.verdict()}; CPU with ddtop's threads "
              f"{whole.cell()}: {whole.verdict()}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800, help="part 1: steps per run")
    parser.add_argument("--warmup", type=int, default=200,
                        help="part 1: first steps left out of the timing")
    parser.add_argument("--rounds", type=int, default=6, help="part 1: runs of each variant")
    parser.add_argument("--steps-each", type=int, default=1500,
                        help="part 2: rounds (timed steps of each configuration)")
    parser.add_argument("--width", type=int, default=256,
                        help="the MLP's hidden width (256: 85,002 parameters, one bucket)")
    parser.add_argument("--pin", action="store_true", help="pin each rank to a core")
    parser.add_argument("--modes-only", action="store_true",
                        help="part 2: only the baseline, the noise floor and the three modes "
                             "(more rounds in the same time: narrower intervals)")
    parser.add_argument("--save", help="part 2: write the raw timings to this JSON file")
    parser.add_argument("--only", choices=["launchers", "pieces"], help="run one part only")
    args = parser.parse_args()
    if args.warmup + 2 * WINDOW > args.steps:
        parser.error(f"--steps must leave at least {2 * WINDOW} timed steps after --warmup")
    if args.only in (None, "launchers"):
        launchers(args)
    if args.only in (None, "pieces"):
        pieces(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
