"""What ddtop's Lightning callback costs a Lightning run: steps per second of a
small-step Lightning script (a few ms per batch, where per-step work shows most),
bare against zero-code watching alone and zero-code with the callback.

    .venv/bin/python bench/frameworks.py [--rounds 6] [--batches 700] [--width 256]

Two gloo ranks on CPU train an MLP under `ddtrain start --foreground -n 2`
(Lightning finds torchrun's environment there and spawns nothing), one
intra-op thread per rank, `self.log("train_loss", loss)` in the training step
as a user's module would. The variants, each a whole run:

    bare                  DDTOP_TELEMETRY=off: nothing instrumented, no callback
    callback, off         DDTOP_TELEMETRY=off with `DdtopCallback()` in the Trainer:
                          what leaving the callback in costs a run not watched
    zero-code             watched, no callback (the optimizer hook counts steps,
                          DDP timed, phases)
    zero-code + callback  watched, with `DdtopCallback()`: loss, samples, lr,
                          `self.log` metrics per step

They run `--rounds` rounds, each round every variant once, in a new random
order. In each rank a timing callback of the bench's own (in every variant
alike, ahead of ddtop's) reads both clocks every 50 batches after `--warmup`
batches: a run's wall figure is rank 0's median 50-batch window (so start-up,
the sanity check and shutdown are in no figure), its CPU figure the median
window of both ranks' CPU together (`time.process_time()`: every thread,
ddtop's sender and ZeroMQ's included). Each ratio is instrumented speed over
its baseline's, the median of the rounds' paired ratios with the sign test's
95% interval for it (bench/stats.py; unbounded under six rounds); 1.0 is no
cost. The rows: each variant against bare, and zero-code + callback against
zero-code (the callback's own cost). Whole runs pair poorly on shared cores
(runs seconds apart): few pairs, wide intervals. So the callback's per-batch
hook (`on_train_batch_end`, where all its per-step work is) is also timed by
the clock around each call, in both variants that have it: what it costs the
training thread directly, whatever the other runs on the machine do.
"""

from __future__ import annotations

import argparse
import json
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

from own_script import RANK_HELPERS  # bench/own_script.py: a rank's CPU by thread
from stats import Estimate, median_interval, percentile  # bench/stats.py, beside this

BIN = Path(sys.executable).parent
DDTRAIN = str(BIN / "ddtrain")
RUN_TIMEOUT_S = 300
WINDOW = 50  # batches per timed window

SCRIPT = '''\
"""A small Lightning run (written by bench/frameworks.py)."""
import argparse
import json
import os
import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--batches", type=int, default=700)
parser.add_argument("--warmup", type=int, default=200)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--callback", action="store_true", help="with ddtop's callback")
parser.add_argument("--out", required=True, help="folder for each rank's timings")
args = parser.parse_args()
torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1
WINDOW = @WINDOW@


class Timing(L.Callback):
    """The bench's clock, in every variant alike."""

    def __init__(self):
        self.batches, self.wall, self.cpu, self.threads = 0, [], [], None

    def on_train_batch_end(self, trainer, module, outputs, batch, index):
        self.batches += 1
        if self.batches >= args.warmup and (self.batches - args.warmup) % WINDOW == 0:
            self.wall.append(time.perf_counter())
            self.cpu.append(time.process_time())  # every thread of this process
            if self.threads is None:
                self.threads = thread_cpu()

    def on_train_end(self, trainer, module):
        hook = callbacks[-1].spent[args.warmup:] if args.callback else []
        threads = {kind: s - self.threads[kind] for kind, s in thread_cpu().items()}
        timed = self.batches - args.warmup
        with open(os.path.join(args.out, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"wall": self.wall, "cpu": self.cpu, "hook": hook,
                       "threads": {kind: s / timed for kind, s in threads.items()}}, f)


class MLP(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, args.width), nn.ReLU(),
                                 nn.Linear(args.width, args.width), nn.ReLU(),
                                 nn.Linear(args.width, 10))

    def training_step(self, batch, index):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


callbacks = [Timing()]
if args.callback:
    from ddtop.lightning import DdtopCallback

    class TimedDdtop(DdtopCallback):
        """ddtop's callback, its per-batch hook timed by the clock."""

        def __init__(self):
            super().__init__()
            self.spent = []

        def on_train_batch_end(self, *hook_args):
            start = time.perf_counter()
            super().on_train_batch_end(*hook_args)
            self.spent.append(time.perf_counter() - start)

    callbacks.append(TimedDdtop())
torch.manual_seed(0)
samples = args.batches * args.batch * 2
data = TensorDataset(torch.randn(samples, 64), torch.randint(0, 10, (samples,)))
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1,
                    accumulate_grad_batches=args.accumulate, num_sanity_val_steps=0,
                    callbacks=callbacks, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(MLP(), DataLoader(data, batch_size=args.batch))
'''.replace("@WINDOW@", str(WINDOW))


@dataclass
class Variant:
    name: str
    callback: bool
    watched: bool


VARIANTS = [Variant("bare", False, False), Variant("callback, off", True, False),
            Variant("zero-code", False, True), Variant("zero-code + callback", True, True)]
# (variant, its baseline): the rows of the table.
PAIRS = [("callback, off", "bare"), ("zero-code", "bare"), ("zero-code + callback", "bare"),
         ("zero-code + callback", "zero-code")]


@dataclass
class RunResult:
    rate: float  # batches/s, rank 0's median window
    cpu: float  # CPU seconds per batch, both ranks together, median window
    hook: list[float]  # seconds in ddtop's on_train_batch_end, each timed batch, both ranks
    threads: dict[str, float]  # CPU seconds per batch by thread kind, both ranks together


def run_once(variant: Variant, script: Path, tmp: Path, args: argparse.Namespace) -> RunResult:
    out = Path(tempfile.mkdtemp(dir=tmp))
    script_args = ["--batches", str(args.batches), "--warmup", str(args.warmup),
                   "--width", str(args.width), "--accumulate", str(args.accumulate),
                   "--out", str(out)]
    if variant.callback:
        script_args.append("--callback")
    cmd = [DDTRAIN, "start", "--foreground", "-n", "2", "--runs-dir", str(tmp / "runs"),
           str(script), "--", *script_args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDTOP_")}
    env.pop("OMP_NUM_THREADS", None)  # the script sets one thread itself
    if not variant.watched:
        env["DDTOP_TELEMETRY"] = "off"
    # A session of its own: a run past its timeout is ended with all it started.
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
    if proc.returncode != 0:
        sys.exit(f"{variant.name} failed ({proc.returncode}):\n{output[-4000:]}")
    walls = [b - a for a, b in zip(ranks[0]["wall"], ranks[0]["wall"][1:], strict=False)]
    windows = min(len(rank["cpu"]) for rank in ranks) - 1
    cpus = [sum(rank["cpu"][i + 1] - rank["cpu"][i] for rank in ranks) for i in range(windows)]
    return RunResult(WINDOW / statistics.median(walls), statistics.median(cpus) / WINDOW,
                     ranks[0]["hook"] + ranks[1]["hook"],
                     {kind: sum(rank["threads"][kind] for rank in ranks)
                      for kind in ranks[0]["threads"]})


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


def bench(args: argparse.Namespace) -> dict[tuple[str, str], tuple[Estimate, Estimate]]:
    results: dict[str, list[RunResult]] = {v.name: [] for v in VARIANTS}
    rng = random.Random(1)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        script = tmp / "train.py"
        script.write_text(RANK_HELPERS + SCRIPT)
        for i in range(args.rounds):
            for variant in rng.sample(VARIANTS, len(VARIANTS)):
                result = run_once(variant, script, tmp, args)
                results[variant.name].append(result)
                print(f"  round {i + 1} {variant.name:<20} {result.rate:7.1f} batches/s, "
                      f"{result.cpu * 1e3:6.3f} CPU ms/batch (ddtop's threads "
                      f"{result.threads['ddtop'] * 1e6:5.1f} us, gloo's I/O "
                      f"{result.threads['gloo_io'] * 1e6:5.1f} us)", file=sys.stderr)
    timed = args.batches - args.warmup
    print(f"\nLightning {_version()}: 2 gloo ranks on CPU, MLP of width {args.width}, "
          f"accumulate_grad_batches={args.accumulate}, {timed} timed batches per run (after "
          f"{args.warmup} warm-up), {args.rounds} rounds in random order")
    print("ratio: median of the rounds' paired ratios, instrumented speed over the "
          "baseline's [95% interval, sign test]; CPU: both ranks, all threads")
    print("CPU per batch, both ranks: all threads (median window), and over all timed "
          "batches by thread: the rest (training thread, Lightning's), gloo's I/O, ddtop's")
    print(f"{'variant':<20} | {'batches/s':>9} | {'CPU ms':>6} | {'rest ms':>7} | "
          f"{'gloo us':>7} | {'ddtop us':>8}")
    print("-" * 72)
    for v in VARIANTS:
        mine = results[v.name]

        def kind(name: str, runs: list[RunResult] = mine) -> float:
            return statistics.median(r.threads[name] for r in runs)

        print(f"{v.name:<20} | {statistics.median(r.rate for r in mine):9.1f} | "
              f"{statistics.median(r.cpu for r in mine) * 1e3:6.3f} | "
              f"{kind('other') * 1e3:7.3f} | {kind('gloo_io') * 1e6:7.1f} | "
              f"{kind('ddtop') * 1e6:8.1f}")
    print(f"\n{'variant':<20} | {'baseline':<10} | {'wall ratio':<21} | {'CPU ratio':<21}")
    print("-" * 82)
    found: dict[tuple[str, str], tuple[Estimate, Estimate]] = {}
    for name, base in PAIRS:
        pairs = list(zip(results[name], results[base], strict=True))
        wall = median_interval([m.rate / b.rate for m, b in pairs])
        cpu = median_interval([b.cpu / m.cpu for m, b in pairs])
        found[(name, base)] = (wall, cpu)
        print(f"{name:<20} | {base:<10} | {wall.cell():<21} | {cpu.cell():<21}")
    for (name, base), (wall, cpu) in found.items():
        print(f"verdict, {name} over {base}: wall {wall.verdict()}; CPU {cpu.verdict()}")
    print("\nddtop's on_train_batch_end on the training thread, per batch, by the clock "
          "(every timed batch of both ranks, all rounds):")
    for name in ("callback, off", "zero-code + callback"):
        spent = [s for r in results[name] for s in r.hook]
        batch_s = 1 / statistics.median(r.rate for r in results[name])
        print(f"  {name:<20} median {statistics.median(spent) * 1e6:6.1f} us, p90 "
              f"{percentile(spent, 90) * 1e6:6.1f} us, mean {statistics.fmean(spent) * 1e6:6.1f} "
              f"us ({statistics.median(spent) / batch_s:.2%} of a {batch_s * 1e3:.2f} ms batch)")
    return found


def _version() -> str:
    done = subprocess.run([sys.executable, "-c", "import lightning; print(lightning.__version__)"],
                          capture_output=True, text=True, timeout=120)
    return done.stdout.strip() or "(not installed)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=700, help="training batches per rank")
    parser.add_argument("--warmup", type=int, default=200,
                        help="first batches left out of the timing")
    parser.add_argument("--rounds", type=int, default=6, help="runs of each variant")
    parser.add_argument("--width", type=int, default=256, help="the MLP's hidden width")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="Lightning's accumulate_grad_batches")
    args = parser.parse_args()
    if args.warmup + 2 * WINDOW > args.batches:
        parser.error(f"--batches must leave at least {2 * WINDOW} timed batches after --warmup")
    bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
