"""What a TensorBoard server shows of a run, read over its HTTP API as its web page reads
it (TensorBoard 2.21 and its Rust data server, the default): every point of a rank's
lives, a restart included, and every event.

The server keeps one point a step per series, and a step given again drops the points
past it (its reservoir's "preemption": a restarted program's steps replace the old
ones). So after a restart, which begins again from a checkpoint's step, each rank's
points go on in a folder of their own (`rank<k>/restart<n>`), and the run's lines of one
step are one text. A real run (`--max-restarts 1 --inject 1:kill@step=50
--checkpoint-every 20 --step-delay 0.02 --tensorboard DIR`: its steps go back from about
50 to the checkpoint's 40) is checked point for point against its journal, with
EventAccumulator (its defaults) and with the server, and every event it folded is a
line the server shows. The server's HParams plugin lists the run's configuration, and
the ranks' spread (ranks/max, median, min) is drawn.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers import ddtrain, terminate

from ddtop.core import journal, tbpoints, wire
from ddtop.core.state import RunState

accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard is not installed (the test extra has it)")
TENSORBOARD = str(Path(sys.executable).with_name("tensorboard"))


@contextlib.contextmanager
def server(logdir: Path) -> Any:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    proc = subprocess.Popen([TENSORBOARD, "--logdir", str(logdir), "--host", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=(logdir.parent / "tensorboard.log").open("w"),
                            stdin=subprocess.DEVNULL)

    def get(path: str, body: dict[str, Any] | None = None, **query: str) -> Any:
        """GET /data/PATH?QUERY, or POST `body` as JSON (the HParams plugin's way)."""
        url = f"http://127.0.0.1:{port}/data/{path}?{urllib.parse.urlencode(query)}"
        request = urllib.request.Request(url) if body is None else urllib.request.Request(
            url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(
                    request, timeout=10) as reply:
                return json.load(reply)
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError(f"TensorBoard did not answer {url}")
            time.sleep(0.3)

    try:
        yield get
    finally:
        terminate(proc)


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_every_life_of_a_rank_and_every_event_is_shown(tmp_path: Path) -> None:
    run = ddtrain("start", "--foreground", "-n", "2", "--epochs", "1", "--run-id", "lives",
                  "--max-restarts", "1", "--inject", "1:kill@step=50", "--step-delay", "0.02",
                  "--checkpoint-every", "20", "--tensorboard", "tb", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.leftovers == []
    records = [wire.decode([r.frame]) for r in
               journal.read(tmp_path / "runs" / "lives" / "telemetry.journal")]
    written = tmp_path / "tb" / "lives"
    # Each rank's Step messages, split where its steps go back (the restart).
    lives: dict[str, list[wire.Step]] = {}
    top: dict[int, int] = {}
    life: dict[int, int] = {}
    for m in records:
        if isinstance(m, wire.Step) and m.steps > 0:
            if m.global_step < top.get(m.rank, -1):
                life[m.rank] = life.get(m.rank, 0) + 1
                top[m.rank] = -1
            top[m.rank] = max(top.get(m.rank, -1), m.global_step)
            n = life.get(m.rank, 0)
            lives.setdefault(f"rank{m.rank}" + (f"/restart{n}" if n else ""), []).append(m)
    assert {"rank0", "rank1", "rank0/restart1", "rank1/restart1"} <= set(lives), sorted(lives)
    # Every event of the fold (what ddtop lists), as the daemon folded the journal.
    state = RunState(run="lives")
    for r in journal.read(tmp_path / "runs" / "lives" / "telemetry.journal"):
        state.apply(wire.decode([r.frame]), r.received)
    events = state.event_count
    assert events > 10
    kept = accumulator.EventAccumulator(str(written / "run"), size_guidance={"tensors": 0})
    kept.Reload()
    # A step's text is written again as its lines grow (at each flush): the last is whole.
    last = {e.step: e.tensor_proto.string_val[0].decode()
            for e in kept.Tensors(tbpoints.EVENTS_TAG)}
    written_lines = [line for text in last.values() for line in text.split(tbpoints.LINE_BREAK)]
    assert len(written_lines) >= events  # (and the straggler and hang lines, if any)
    # EventAccumulator, its defaults: each life's points, all of them.
    for folder, steps in lives.items():
        found = accumulator.EventAccumulator(str(written / folder))
        found.Reload()
        assert [p.step for p in found.Scalars("step/seconds")] == [
            m.global_step for m in steps], folder
    # The server, as its web page asks: every point of every life, every line.
    with server(tmp_path / "tb") as get:
        runs = get("runs")
        for folder, steps in lives.items():
            points = get("plugin/scalars/scalars", run=f"lives/{folder}", tag="step/seconds")
            assert [p[1] for p in points] == [m.global_step for m in steps], folder
        texts = get("plugin/text/text", run="lives/run", tag=tbpoints.EVENTS_TAG)
        experiment = get("plugin/hparams/experiment", {"experimentName": ""})
        spread = get("plugin/scalars/scalars", run="lives/ranks/max", tag="step/seconds")
    assert f"lives/rank1/{tbpoints.LIFE}1" in runs, runs
    lines = [line for t in texts for line in re.split(r"<hr\s*/?>", t["text"])]
    assert len(lines) == len(written_lines), (len(lines), len(written_lines))
    # The run's configuration, for the HParams plugin to compare runs by; the global
    # metrics are its metrics; the ranks' spread is drawn.
    hparams = {h["name"]: h for h in experiment["hparamInfos"]}
    assert {"model", "dataset", "program", "strategy", "backend", "world_size",
            "global_batch", "epochs", "lr"} == set(hparams), hparams
    assert hparams["model"]["domainDiscrete"] == ["mlp"]
    assert hparams["world_size"]["domainInterval"]["minValue"] == 2.0
    assert {"group": "run", "tag": "global/val_loss"} in [
        m["name"] for m in experiment["metricInfos"]]
    assert len(spread) > 3 and all(p[2] > 0 for p in spread)
    said = " ".join(lines)
    assert "restart 1/1: rank 1 was killed by SIGKILL" in said and "run succeeded" \
        in said, said[-500:]
