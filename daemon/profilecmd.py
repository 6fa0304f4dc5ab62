"""`ddtrain profile`: torch.profiler on chosen ranks of a live run, for the same
optimizer steps, and their top operators side by side.

    ddtrain profile [RUN] --ranks 0,3|all [--steps N]    profile now, wait, print
    ddtrain profile [RUN] --show [ID]                    print one done (the newest)

It writes the request into the run folder (core/profilereq.py): the ranks
begin after the fastest asked rank's global step plus a second of steps, so
that every one of them is still before it, and profile N steps (each rank's sender
thread reads the request, its training thread starts and stops the profiler:
training/profiling.py). Nothing new listens: the run folder is the channel,
the run owner's alone. It then waits for each rank's `top.json`, saying what
it waits for, and prints each rank's top operators by self time per step, side
by side, and the straggler (or the slowest rank asked) against the median of
the others. What a rank wrote is read as display only: bounded, checked, cut.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Literal

from ddtop.core import control, profilereq, protocol
from ddtop.core.contract import EXIT_FAILED, EXIT_OK, UsageError
from ddtop.core.flagspec import default_runs_dir
from ddtop.core.rundir import RunPaths, locate_run
from ddtop.core.runinfo import RunInfo
from ddtop.core.text import rank_list

WAIT_EXTRA_S = 30.0  # beyond the steps' own time (the slowest rank's step time)
ROWS = 12  # operators shown
NAME_WIDTH = 40
MAX_TOP_BYTES = 256 << 10  # a rank's top.json read at most this much


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", default=None, metavar="LIST",
                   help="the ranks to profile: 0,3 or 2-5 or all")
    p.add_argument("--steps", type=int, default=5, metavar="N",
                   help=f"optimizer steps to profile, 1 to {profilereq.MAX_STEPS} (default 5)")
    p.add_argument("--show", nargs="?", const="", default=None, metavar="ID",
                   help="print a profile already taken (default: the newest) and exit")


def cmd_profile(args: argparse.Namespace) -> int:
    paths = locate_run(args.runs_dir or default_runs_dir(), args.run)
    if args.show is not None:
        return show(paths, args.show)
    info = RunInfo.load(paths)
    if args.ranks is None:
        raise UsageError("say which ranks: --ranks 0,3 (or 2-5, or all); --show prints one "
                         "already taken")
    if not 1 <= args.steps <= profilereq.MAX_STEPS:
        raise UsageError(f"--steps {args.steps}: give 1 to {profilereq.MAX_STEPS}")
    world = max(info.world_size, 1)
    ranks = parse_ranks(args.ranks, world)
    if not info.live or info.control is None:
        raise UsageError(f"run {paths.run_id} is not running ({info.status}): only a live run "
                         "can be profiled")
    try:
        reply = control.request(info.control, protocol.Status(), control.STOP_REQUEST_TIMEOUT_S,
                                keys=info.keys)
    except control.Unreachable as e:
        raise UsageError(f"the daemon of run {paths.run_id} does not answer: {e}") from None
    summary = reply.summary
    if not reply.ok or summary is None:
        raise UsageError(f"the daemon of run {paths.run_id} gave no status: {reply.error}")
    asked: list[int] = list(range(world)) if ranks == "all" else ranks
    known = {r.rank: r for r in summary.ranks}
    slowest = min((known[r].global_step for r in asked if r in known), default=0)
    step_s = max((known[r].step_time_s or 0.0 for r in asked if r in known), default=0.0)
    start = profilereq.start_after([known[r].global_step for r in asked if r in known], step_s)
    try:
        request = profilereq.write(paths.logs, ranks, start, args.steps)
    except OSError as e:
        raise UsageError(f"the profile request cannot be written in {paths.logs}: {e}") from None
    folder = profilereq.profiles_path(paths.root) / request.id
    limit = WAIT_EXTRA_S + step_s * (start - slowest + args.steps)
    print(f"ddtrain: profiling {'every rank' if ranks == 'all' else rank_list(asked)} "
          f"for steps {start + 1}-{start + args.steps} into {folder} (waiting for them, "
          f"{limit:.0f} s at most)", file=sys.stderr, flush=True)
    expected = set(asked)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if expected <= _answered(folder):
            break
        time.sleep(0.2)
    tops = read_tops(folder)
    print_tops(folder, tops, summary.stragglers)
    missing = sorted(expected - set(tops))
    if missing:
        print(f"ddtrain: no profile from {rank_list(missing)} within {limit:.0f} s (stopped, "
              "ended, or still before the step; it may still come: ddtrain profile --show "
              f"{request.id})", file=sys.stderr)
        return EXIT_FAILED
    refused = [r for r, record in tops.items() if "refused" in record]
    return EXIT_FAILED if refused else EXIT_OK


def parse_ranks(text: str, world: int) -> list[int] | Literal["all"]:
    """'all', or a list of ranks ('0,3', '2-5'); UsageError naming the problem."""
    if text.strip() == "all":
        return "all"
    ranks: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or len(part) > 20:
            raise UsageError(f"--ranks {text}: give ranks as 0,3 or 2-5, or all")
        first, last = int(low), int(high if dash else low)
        if last < first:
            raise UsageError(f"--ranks {text}: {part.strip()} runs backwards: write "
                             f"{last}-{first}")
        if last >= world:
            raise UsageError(f"--ranks {text}: the run has ranks 0-{world - 1}, not "
                             f"{rank_list(sorted({r for r in (first, last) if r >= world}))}")
        ranks.update(range(first, last + 1))
    return sorted(ranks)


def show(paths: RunPaths, wanted: str) -> int:
    root = profilereq.profiles_path(paths.root)
    taken = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if not taken:
        raise UsageError(f"run {paths.run_id} has no profiles yet: ddtrain profile --ranks ...")
    folder = taken[-1] if not wanted else root / wanted
    if not folder.is_dir() or folder.parent != root:
        raise UsageError(f"no profile {wanted!r} in {root}: there are "
                         f"{', '.join(p.name for p in taken[-5:])}")
    tops = read_tops(folder)
    print_tops(folder, tops, [])
    return EXIT_OK if tops else EXIT_FAILED


def _answered(folder: Path) -> set[int]:
    found = set()
    for path in folder.glob("rank-*.top.json"):
        number = path.name.removeprefix("rank-").removesuffix(".top.json")
        if number.isdigit():
            found.add(int(number))
    return found


def read_tops(folder: Path) -> dict[int, dict[str, Any]]:
    """Each rank's top.json in `folder` that reads as one (display only)."""
    tops = {}
    for rank in sorted(_answered(folder)):
        try:
            with (folder / f"rank-{rank}.top.json").open("rb") as f:
                record = json.loads(f.read(MAX_TOP_BYTES))
        except (OSError, ValueError, RecursionError):
            continue
        if isinstance(record, dict):
            tops[rank] = record
    return tops


def print_tops(folder: Path, tops: dict[int, dict[str, Any]], stragglers: list[int]) -> None:
    """Each rank's top operators by self time per step, side by side, then the
    straggler (or the slowest) against the median of the others."""
    print(f"{folder}:")
    per_step: dict[int, dict[str, float]] = {}
    for rank, record in tops.items():
        if isinstance(record.get("refused"), str):
            print(f"  rank {rank}: not profiled: {record['refused'][:300]}")
            continue
        mine = per_step_ms({rank: record}).get(rank)
        if mine is None:
            print(f"  rank {rank}: its top.json does not read as a profile")
            continue
        per_step[rank] = mine
        print(f"  rank {rank}: steps {record.get('from_step')}-{record.get('to_step')}, "
              f"trace {folder / f'rank-{rank}.trace.json.gz'}")
    if not per_step:
        return
    ranks = sorted(per_step)
    totals = _totals(per_step)
    names = sorted(totals, key=lambda n: -totals[n])[:ROWS]
    print(f"\n  {'self ms/step':<{NAME_WIDTH}}" + "".join(f"{f'rank {r}':>10}" for r in ranks))
    for name in names:
        cells = "".join(f"{per_step[r].get(name, 0.0):>10.2f}" for r in ranks)
        print(f"  {_cut(name):<{NAME_WIDTH}}{cells}")
    if len(ranks) >= 2:
        print(f"\n  {against(per_step, stragglers)}")


def _totals(per_step: dict[int, dict[str, float]]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for ops in per_step.values():
        for name, ms in ops.items():
            totals[name] = totals.get(name, 0.0) + ms
    return totals


def against(per_step: dict[int, dict[str, float]], stragglers: list[int]) -> str:
    """'rank 1 (the straggler) against the median of rank 0: aten::addmm +12.00 ms; ...':
    the operators where the straggler (or the slowest rank) spends most above the
    median of the others, per step."""
    ranks = sorted(per_step)
    totals = _totals(per_step)
    sums = {r: sum(per_step[r].values()) for r in ranks}
    odd = next((r for r in stragglers if r in per_step), max(ranks, key=lambda r: sums[r]))
    others = [r for r in ranks if r != odd]
    median = {name: statistics.median(per_step[r].get(name, 0.0) for r in others)
              for name in totals}
    diffs = sorted(((per_step[odd].get(n, 0.0) - median[n], n) for n in totals), reverse=True)
    who = "the straggler" if odd in stragglers else "the slowest asked"
    said = "; ".join(f"{_cut(n, 30)} {d:+.2f} ms" for d, n in diffs[:3] if d > 0) or "none above"
    return f"rank {odd} ({who}) against the median of {rank_list(others)}: {said}"


def per_step_ms(tops: dict[int, dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Each profiled rank's operators, self milliseconds per step (refused ones left out)."""
    found = {}
    for rank, record in tops.items():
        steps, ops = record.get("steps"), record.get("top")
        if isinstance(steps, int) and 1 <= steps <= profilereq.MAX_STEPS and isinstance(ops, list):
            found[rank] = {str(op.get("name", "?"))[:200]: _ms(op["self_us"]) / steps
                           for op in ops[:100] if isinstance(op, dict)
                           and isinstance(op.get("self_us"), (int, float))}
    return found


def _ms(us: float) -> float:
    """Microseconds as milliseconds, within what a profile can hold (else 0)."""
    try:
        ms = float(us) / 1000
    except (OverflowError, ValueError):
        return 0.0
    return ms if math.isfinite(ms) and 0 <= ms <= 1e9 else 0.0


def _cut(name: str, width: int = NAME_WIDTH) -> str:
    clean = "".join(ch if ch.isprintable() else "?" for ch in name)
    return clean if len(clean) <= width else clean[: width - 1] + "…"
