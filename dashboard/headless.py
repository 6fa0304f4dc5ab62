"""`ddtop --headless`: a feed pumped into the headless printer (core/printer.py)
until the run ends; the printer's exit code is ddtop's.

Exit codes: 0 the run succeeded, 1 it failed (or was lost: its daemon was killed),
130 it was stopped, 2 bad input or no run reachable within --wait.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from ddtop.core.contract import EXIT_INTERRUPTED, EXIT_USAGE
from ddtop.core.printer import Printer
from ddtop.dashboard.feed import CONNECTING, Feed, Pacer

PUMP_S = 0.1


def watch(feed: Feed, printer: Printer, wait_s: float, err: TextIO | None = None) -> int:
    """Pump the feed and print until the run ends; 2 when it cannot be reached in time."""
    err = err or sys.stderr
    deadline = time.monotonic() + wait_s
    pacer = Pacer(feed, PUMP_S)
    try:
        while not feed.finished:
            pacer.pump()
            if feed.connection == CONNECTING and time.monotonic() > deadline:
                print(f"ddtop: error: run {feed.state.run} cannot be reached within "
                      f"{wait_s:g} s ({feed.detail or 'no answer'}); is its daemon running? "
                      "(ddtrain status)", file=err)
                return EXIT_USAGE
            with feed.lock:
                printer.tick(feed.state, feed.now())
            pacer.rest()
    except KeyboardInterrupt:
        print(f"ddtop: detached; run {feed.state.run} goes on (ddtrain stop to stop it)",
              file=err)
        return EXIT_INTERRUPTED
    with feed.lock:
        return printer.finish(feed.state, feed.now())
