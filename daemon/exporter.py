"""`--metrics [HOST:]PORT`: the run's state served to Prometheus at /metrics.

Nothing is done per message: the daemon folds its messages into the RunState as
always, and a scrape reads that state. The state belongs to the daemon's loop
(one thread; the fold is not thread-safe), so a scrape, on the HTTP server's
thread, asks the loop for a reading, wakes it (a byte on a pipe the loop waits
on with its sockets), and waits: at once, not at its next pass (every 0.1 s),
the loop copies the numbers a scrape shows into a `Reading`, plain and frozen,
between two messages, so that every number of one scrape comes from the same
moment; no lock is held while it is copied or formatted. A loop that does not
pass within ANSWER_S (50 ms: starting or stopping ranks, waiting for other nodes) is
answered for with the previous reading, its age served with it; the first is taken as
soon as the run's state exists (`prime`), before any rank starts. Between scrapes the
loop checks one flag a pass.

`read` (daemon/metricreading.py) and `families` (daemon/metrictable.py: SERIES, the table
of every family served) are pure; `Exporter` is the hand-off, and the server
(daemon/metricserver.py: bounded threads and connections, timeouts, and the doors of
--metrics-auth and --metrics-cert/--metrics-key; bound to 127.0.0.1 unless a host is
given); the text is daemon/exposition.py's. `NoExporter` stands in without
--metrics. docs/monitoring.md lists what is served.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from typing import Any, TextIO

from ddtop.core import outlets
from ddtop.core.config import TrainConfig
from ddtop.core.contract import UsageError
from ddtop.core.outlets import parse_listen, url
from ddtop.core.state import RunState
from ddtop.daemon.exposition import encode, negotiate
from ddtop.daemon.metricreading import Reading, read
from ddtop.daemon.metrictable import Family, families

# Seconds a scrape waits for the daemon's loop to take a reading before it is
# answered with the previous one.
# Short: a scrape is answered within 100 ms at all times, with the reading before where
# the loop is busy (starting or stopping ranks); ddtop_run_reading_age_seconds says how
# old its numbers are then.
ANSWER_S = 0.05
LINGER_TICK_S = 0.2  # a lingering daemon looks for SIGTERM or SIGINT this often


class Exporter:
    """The /metrics server (daemon/metricserver.py), and the hand-off of readings from
    the daemon's loop (`serve`, every pass) to scrapes (`collect`, the server's render
    workers). `auth`, `cert` and `key`: the files of --metrics-auth, --metrics-cert and
    --metrics-key (core/outlets.py reads them), or none."""

    def __init__(self, address: str, auth: str = "", cert: str = "", key: str = "") -> None:
        from ddtop.daemon.metricserver import MetricServer

        try:  # checked by config.py already; read again here, as the server uses them
            host, port = parse_listen("--metrics", address)
            credential = outlets.read_metrics_auth(auth) if auth else None
            tls = outlets.metrics_tls(cert, key) if cert or key else None
        except ValueError as e:  # a config.json written by hand, a file changed since
            raise UsageError(str(e)) from None
        self._asked = threading.Event()  # a scrape waits for a reading
        self._fresh = threading.Event()  # the loop has taken it
        self._one = threading.Lock()  # one scrape at a time asks
        # Written by a scrape, read by the daemon's loop, which waits on it with its
        # sockets (`fds`): a scrape wakes the loop at once, not at its next pass.
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.fds: tuple[int, ...] = (self._wake_read,)
        self._reading: Reading | None = None
        self._closed = False
        self._final = False  # the run has ended: its last reading answers every scrape
        self._host = socket.gethostname()  # its own ranks' host, before they say hello

        def render(accept: str) -> tuple[bytes, str]:  # a render worker: the text asked for
            openmetrics, content_type = negotiate(accept)
            return encode(self.collect(), openmetrics), content_type

        try:
            self.server = MetricServer(host, port, render, credential, tls)
        except OSError as e:
            raise UsageError(f"--metrics {address}: cannot listen there "
                             f"({e.strerror or e}); a run that ended may still serve its "
                             "final metrics there (ddtrain stop RUN ends that)") from None
        self.url = url(host, self.server.port, "/metrics", "https" if tls else "http")

    @property
    def endpoints(self) -> dict[str, str]:
        return {"metrics": self.url}

    def serve(self, state: RunState) -> None:
        """The daemon's loop: a reading for the scrape waiting, if one is."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_read, 4096)
        if self._asked.is_set():
            self._asked.clear()
            self._reading = read(state, time.time(), self._host)
            self._fresh.set()

    def collect(self) -> list[Family]:
        """A scrape (a render worker): the loop's next reading, as metric families."""
        with self._one:
            if not self._closed and not self._final:
                self._fresh.clear()
                self._asked.set()
                with contextlib.suppress(BlockingIOError):  # full: the loop is waking anyway
                    os.write(self._wake_write, b"!")
                self._fresh.wait(ANSWER_S)
            reading = self._reading
        return [] if reading is None else families(reading, time.time())

    def prime(self, state: RunState) -> None:
        """The first reading, taken before the loop runs (the daemon's thread): a scrape
        while the ranks start is answered with it at once."""
        self._reading = read(state, time.time(), self._host)

    def finish(self, state: RunState) -> None:
        """The run has ended (the daemon's loop is over): its final reading answers every
        scrape from now on, at once."""
        self._reading = read(state, time.time(), self._host)
        self._final = True
        self._fresh.set()  # a scrape waiting is answered now

    def linger(self, seconds: float, err: TextIO) -> None:
        """Serve the final reading for `seconds` more (--metrics-linger), said on `err`;
        SIGTERM (ddtrain stop) or SIGINT (Ctrl-C) ends it sooner."""
        if seconds <= 0:
            return
        print(f"ddtrain: metrics at {self.url} kept for {seconds:g} s more, for the last "
              "scrapes (--metrics-linger; ddtrain stop or Ctrl-C ends it)", file=err, flush=True)
        over: list[int] = []  # a flag the handler sets (no lock: a handler may run anywhere)
        previous: dict[signal.Signals, Any] = {}
        with contextlib.suppress(ValueError):  # not the main thread: the full time, then
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, lambda number, _: over.append(number))
        try:
            deadline = time.monotonic() + seconds
            while not over and (left := deadline - time.monotonic()) > 0:
                time.sleep(min(left, LINGER_TICK_S))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def close(self) -> None:
        self._closed = True
        self._fresh.set()  # a scrape waiting is answered now
        self.server.close()
        for fd in (self._wake_read, self._wake_write):
            os.close(fd)


class NoExporter:
    """Without --metrics: nothing served, nothing done."""

    url = ""
    fds: tuple[int, ...] = ()

    @property
    def endpoints(self) -> dict[str, str]:
        return {}

    def serve(self, state: RunState) -> None:
        pass

    def prime(self, state: RunState) -> None:
        pass

    def finish(self, state: RunState) -> None:
        pass

    def linger(self, seconds: float, err: TextIO) -> None:
        pass

    def close(self) -> None:
        pass


def open_exporter(config: TrainConfig, err: TextIO) -> Exporter | NoExporter:
    """The server for `--metrics ADDRESS` (and its --metrics-auth, --metrics-cert and
    --metrics-key), its address said on `err` (UsageError: a bad address, a port in
    use, a credential or certificate refused), or the stand-in without it."""
    if not config.metrics:
        return NoExporter()
    exporter = Exporter(config.metrics, config.metrics_auth, config.metrics_cert,
                        config.metrics_key)
    print(f"ddtrain: metrics at {exporter.url}", file=err, flush=True)
    return exporter
