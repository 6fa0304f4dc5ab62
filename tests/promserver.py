"""A real Prometheus server (Debian's `prometheus`) for the tests: scraping given
targets every second, with rule files evaluated every second, and its HTTP API."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import terminate

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
RULES = Path(__file__).resolve().parent.parent / "examples" / "prometheus" / "ddtop-alerts.yml"


def need(tool: str) -> None:
    if not Path(tool).is_file():
        pytest.skip(f"no {Path(tool).name} at {tool} (Debian's prometheus package)")


def quick_rules(folder: Path) -> Path:
    """The shipped rules with every `for:` cut to 1 s, so that they fire within a test."""
    made = folder / RULES.name
    made.write_text(re.sub(r"(?m)^(\s*for:) \S+$", r"\1 1s", RULES.read_text()))
    return made


class Prometheus:
    def __init__(self, port: int) -> None:
        self.port = port

    def api(self, path: str, **query: str) -> Any:
        """/api/v1/PATH's data, or None while the server does not answer."""
        with contextlib.suppress(OSError, ValueError):
            url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(query)}"
            with urllib.request.urlopen(url, timeout=5) as reply:
                return json.load(reply)["data"]
        return None

    def firing(self) -> list[dict[str, str]]:
        """The labels of every alert firing now."""
        found = self.api("alerts") or {"alerts": []}
        return [a["labels"] for a in found["alerts"] if a["state"] == "firing"]


@contextlib.contextmanager
def prometheus(folder: Path, targets: list[str], rules: Path | None = None
               ) -> Iterator[Prometheus]:
    """The server, scraping `targets` (host:port) at /metrics every second; stopped after."""
    need(PROMETHEUS)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    config = folder / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        + (f"rule_files: ['{rules}']\n" if rules else "")
        + "scrape_configs:\n  - job_name: ddtop\n    static_configs:\n"
        + f"      - targets: {json.dumps(targets)}\n")
    server = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(folder / "prometheus.log").open("w"),
        stdin=subprocess.DEVNULL)
    try:
        yield Prometheus(port)
    finally:
        terminate(server)


def served(reading: Any, now: float | None = None,
           openmetrics: bool = True) -> dict[str, list[Any]]:
    """What /metrics serves of a reading (daemon/metricreading.py), in OpenMetrics as
    Prometheus asks for it (or the text format), parsed by prometheus_client's own
    parser: a family's name -> its samples."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om
    from prometheus_client.parser import text_string_to_metric_families as text

    from ddtop.daemon.exposition import encode
    from ddtop.daemon.metrictable import families

    body = encode(families(reading, now), openmetrics).decode()
    return {f.name: f.samples for f in (om if openmetrics else text)(body)}
