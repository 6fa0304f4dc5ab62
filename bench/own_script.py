"""What watching a user's own training script costs it: steps per second of a
small-step script (a few ms per step, where per-step instrumentation hurts
most), uninstrumented against the `import ddtop` API and zero-code mode.

    .venv/bin/python bench/own_script.py [--steps 1500] [--repeats 5] [--world-size 2]

A small DDP script (gloo on CPU, an MLP, one intra-op thread per rank) is
written to a temporary folder. It times its own steady state: after `--warmup`
steps rank 0 reads the clock every 50 steps and reports the median 50-step
window as its steps/s (a burst of outside load on shared cores moves a few
windows, not the median), so process start-up (torchrun's fresh interpreters
against ddtrain's forkserver), the first steps and the shutdown are not in the
figure. The variants, interleaved
(the order reversed every other round), `--repeats` runs each:

  plain torchrun      `torchrun --standalone` the script, no DDTOP_TELEMETRY
  API, torchrun       the same with `ddtop.watch(model)` and one
                      `ddtop.step(loss=loss, samples=...)` per step, sending
                      to a ZeroMQ PULL socket this process binds and drains
                      in a thread                        baseline: plain torchrun
  ddtrain, off        the plain script under `ddtrain start --foreground`
                      with DDTOP_TELEMETRY=off: the same daemon and forkserver,
                      nothing instrumented
  zero-code           the plain script under `ddtrain start --foreground`
                      (the daemon's relay receives; every rank instrumented)
                                                          baseline: ddtrain, off
  zero-code + API     the API script under `ddtrain start --foreground`
                                                          baseline: ddtrain, off

Prints the median steps/s, min and max, the ratio of medians to the
baseline, and a verdict against the target (at least 0.99).

Part 2 (`--only pieces`) splits the cost by piece, in the same two processes
(so outside load hits every piece alike): the same MLP as several DDP models
and hook sets, alternated every `--block` steps for `--rounds` rounds: no
hook, torch's own Python `allreduce_hook`, ddtop's timed comm hook
(`ddtop.watch`), the zero-code optimizer hooks, the zero-code forward hooks,
`ddtop.step(loss=..., samples=...)`, and all of them together; median
steps/s per piece and the time it adds per step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from telemetry import Listener  # bench/telemetry.py, beside this script

BIN = Path(sys.executable).parent
TORCHRUN = str(BIN / "torchrun")
DDTRAIN = str(BIN / "ddtrain")
RESULT = re.compile(r"OWN_SCRIPT_RESULT (\{.*\})")
TARGET = 0.99
RUN_TIMEOUT_S = 300

SCRIPT = '''\
"""A user's small DDP training script (written by bench/own_script.py)."""
import argparse
import json
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1500)
parser.add_argument("--warmup", type=int, default=200)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--api", action="store_true", help="with the ddtop lines")
args = parser.parse_args()
if args.api:
    import ddtop

threads_seen = torch.get_num_threads()
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
WINDOW = 50  # steps per timed window
marks = []
for step in range(args.steps):
    if step >= args.warmup and (step - args.warmup) % WINDOW == 0:
        marks.append(time.perf_counter())
    x, y = batches[step % len(batches)]
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if args.api:
        ddtop.step(loss=loss, samples=len(x))
marks.append(time.perf_counter())
if rank == 0:
    timed = args.steps - args.warmup
    elapsed = marks[-1] - marks[0]
    windows = sorted(b - a for a, b in zip(marks[:-2], marks[1:-1]))  # whole windows
    print("OWN_SCRIPT_RESULT " + json.dumps({
        "steps_per_s": WINDOW / windows[len(windows) // 2],
        "mean_steps_per_s": timed / elapsed, "ms_per_step": elapsed / timed * 1e3,
        "threads_seen": threads_seen,
        "params": sum(p.numel() for p in model.parameters())}), flush=True)
dist.destroy_process_group()
'''


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


def run_once(variant: Variant, script: Path, tmp: Path, args: argparse.Namespace) -> dict:
    script_args = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    if variant.api:
        script_args.append("--api")
    if variant.launcher == "torchrun":
        cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(args.world_size),
               str(script), *script_args]
    else:
        cmd = [DDTRAIN, "start", "--foreground", "-n", str(args.world_size),
               "--runs-dir", str(tmp / "runs"), str(script), "--", *script_args]
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
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _end_group(proc)
        sys.exit(f"{variant.name}: no result within {RUN_TIMEOUT_S} s")
    finally:
        _end_group(proc)
    match = RESULT.search(out)
    if match is None:
        sys.exit(f"{variant.name} failed ({proc.returncode}):\n{out[-4000:]}")
    if proc.returncode != 0:  # e.g. gloo aborting in a rank's teardown, after the result
        print(f"  ({variant.name}: exit {proc.returncode} after its result; "
              f"{out.strip().splitlines()[-1][:120]})", file=sys.stderr)
    return json.loads(match.group(1))


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


PIECES = {  # name: (model, optimizer hooks, forward hooks, ddtop.step)
    "no hook": ("plain", False, False, False),
    "torch allreduce_hook": ("torch_hook", False, False, False),
    "timed comm hook": ("watched", False, False, False),
    "optimizer hooks": ("plain", True, False, False),
    "forward hooks": ("plain", False, True, False),
    "ddtop.step": ("plain", False, False, True),
    "all of them": ("watched", True, True, True),
}


def _pieces_rank(rank: int, port: int, endpoint: str, block: int, rounds: int,
                 out: str) -> None:
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
    from ddtop.training import api, autowatch

    autowatch._installed = api.current()  # the hooks' target, without patching DDP

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, 10))

    torch_hook = DDP(mlp())
    torch_hook.register_comm_hook(None, allreduce_hook)
    models = {"plain": DDP(mlp()), "watched": ddtop.watch(DDP(mlp())),
              "torch_hook": torch_hook}
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
                  for k, m in models.items()}
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(32, 64, generator=generator),
                torch.randint(0, 10, (32,), generator=generator)) for _ in range(16)]
    loss_fn = nn.CrossEntropyLoss()
    rates: dict[str, list[float]] = {name: [] for name in PIECES}
    for r in range(rounds + 1):  # round 0 warms every model up, untimed
        for name in PIECES if r % 2 == 0 else reversed(PIECES):
            key, optimizer_hooks, forward_hooks, step_call = PIECES[name]
            model, optimizer = models[key], optimizers[key]
            handles = []
            if optimizer_hooks:
                handles += [register_optimizer_step_pre_hook(autowatch._optimizer_starts),
                            register_optimizer_step_post_hook(autowatch._optimizer_done)]
            if forward_hooks:
                handles += [model.register_forward_pre_hook(autowatch._forward_starts),
                            model.register_forward_hook(autowatch._forward_done)]
            dist.barrier()
            start = time.perf_counter()
            for i in range(block):
                x, y = batches[i % len(batches)]
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if step_call:
                    ddtop.step(loss=loss, samples=len(x))
            elapsed = time.perf_counter() - start
            for handle in handles:
                handle.remove()
            if r:
                rates[name].append(block / elapsed)
    if rank == 0:
        Path(out).write_text(json.dumps(rates))
    dist.barrier()
    dist.destroy_process_group()


def pieces(block: int, rounds: int) -> None:
    import socket

    import torch.multiprocessing as mp

    listener = Listener()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        mp.start_processes(_pieces_rank, args=(port, listener.endpoint, block, rounds,
                                               out.name), nprocs=2, start_method="spawn")
        rates = json.loads(Path(out.name).read_text())
    listener.close()
    base = statistics.median(rates["no hook"])
    print(f"\n2. Per piece: the same MLP in the same 2 gloo ranks, pieces alternated every "
          f"{block} steps, median of {rounds} blocks each")
    print(f"{'piece':<21} | {'steps/s':>8} | {'ms/step':>7} | {'ratio':>5} | {'us/step':>7}")
    print("-" * 62)
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"{name:<21} | {med:8.1f} | {1e3 / med:7.3f} | {med / base:5.3f} | "
              f"{(1 / med - 1 / base) * 1e6:+7.0f}")
    print(f"(the bench's PULL socket received {listener.count} messages)")


def launchers(args: argparse.Namespace) -> None:
    listener = Listener()
    configs = variants(listener.endpoint)
    rates: dict[str, list[float]] = {v.name: [] for v in configs}
    info: dict = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        script = tmp / "train.py"
        script.write_text(SCRIPT)
        for i in range(args.repeats):
            order = configs if i % 2 == 0 else list(reversed(configs))
            for variant in order:
                result = run_once(variant, script, tmp, args)
                rates[variant.name].append(result["steps_per_s"])
                info.setdefault(variant.name, result)
                print(f"  run {i + 1} {variant.name:<16} {result['steps_per_s']:7.1f} steps/s "
                      f"(mean {result['mean_steps_per_s']:.1f}, threads seen "
                      f"{result['threads_seen']})", file=sys.stderr)
    listener.close()
    med = {name: statistics.median(values) for name, values in rates.items()}
    timed = args.steps - args.warmup
    print(f"\n1. Whole runs: {args.world_size} gloo ranks on CPU, MLP of "
          f"{info['plain torchrun']['params']:,} parameters, {timed} timed steps per run "
          f"(after {args.warmup} warm-up), median of {args.repeats} interleaved runs")
    print(f"{'variant':<16} | {'steps/s':>8} | {'ms/step':>7} | {'min':>7} | {'max':>7} | "
          f"{'ratio':>5} | baseline")
    print("-" * 78)
    verdicts = []
    for v in configs:
        values = rates[v.name]
        ratio = med[v.name] / med[v.baseline] if v.baseline else 1.0
        if v.baseline:
            verdicts.append((v.name, ratio))
        print(f"{v.name:<16} | {med[v.name]:8.1f} | {1e3 / med[v.name]:7.2f} | "
              f"{min(values):7.1f} | {max(values):7.1f} | {ratio:5.3f} | {v.baseline or '-'}")
    print(f"(the bench's PULL socket received {listener.count} messages from the API runs)")
    low = [f"{name} {ratio:.3f}" for name, ratio in verdicts if ratio < TARGET]
    if low:
        print(f"verdict: below the {TARGET} target: {', '.join(low)}")
    else:
        print(f"verdict: every ratio at least {TARGET} "
              f"({', '.join(f'{n} {r:.3f}' for n, r in verdicts)})")



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500, help="steps per run")
    parser.add_argument("--warmup", type=int, default=200,
                        help="first steps left out of the timing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--block", type=int, default=25, help="part 2: steps per block")
    parser.add_argument("--rounds", type=int, default=60, help="part 2: blocks per piece")
    parser.add_argument("--only", choices=["launchers", "pieces"], help="run one part only")
    args = parser.parse_args()
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps")
    if args.only in (None, "launchers"):
        launchers(args)
    if args.only in (None, "pieces"):
        pieces(args.block, args.rounds)
    return 0

if __name__ == "__main__":
    sys.exit(main())
