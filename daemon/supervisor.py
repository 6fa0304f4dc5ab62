"""The daemon of one run, set up and closed: its folder and lock, its config, the
exporter (--metrics), the relay's sockets (with the run's keys over TCP), the starter
of its ranks (which one: `make_starter`), its part in a multi-node job (hub, node, or
none) and how its ranks end.
Each part is made once, in order, and handed whole to the loop (daemon/runloop.py),
which supervises the run; every way out closes every part made, in reverse.

A start refused (a port in use, a run directory it cannot write, bad input found
late) leaves no run folder behind and raises UsageError: one line, exit code 2.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from typing import TextIO

from ddtop.core.config import TrainConfig
from ddtop.core.contract import UsageError
from ddtop.core.keys import RunKeys, write_peer_folder
from ddtop.core.processes import same_process, send_signal
from ddtop.core.rundir import RunPaths, hold_run, run_held, write_json_atomic
from ddtop.core.runinfo import RunInfo
from ddtop.core.state import RunState
from ddtop.core.text import count_of
from ddtop.daemon.exits import Exits
from ddtop.daemon.exporter import Exporter, NoExporter, open_exporter
from ddtop.daemon.hub import hub_bind_address
from ddtop.daemon.local import LocalRanks
from ddtop.daemon.noderole import NodeRole
from ddtop.daemon.relay import Relay
from ddtop.daemon.report import RunReport
from ddtop.daemon.runloop import RunLoop
from ddtop.daemon.starters import RankStarter, choose_port, rank_program
from ddtop.daemon.torchrun import TorchrunRanks
from ddtop.daemon.watching import WatchedCommand, WatchedRanks

# Which RankStarter a run gets: by `--launcher` for `ddtrain start`, by whether it
# was given a command for `ddtrain watch` (starter_name).
STARTERS: dict[str, Callable[[RunPaths, int, float], RankStarter]] = {
    "local": LocalRanks, "torchrun": TorchrunRanks,
    "watch": WatchedCommand, "watch-elsewhere": WatchedRanks}


def starter_name(config: TrainConfig) -> str:
    if config.watch is not None:
        return "watch" if config.watch else "watch-elsewhere"
    return config.launcher


def make_starter(config: TrainConfig, paths: RunPaths, port: int, started: float,
                 state: RunState) -> RankStarter:
    """The run's starter; a commandless watch ends by what `state` says of its ranks."""
    starter = STARTERS[starter_name(config)](paths, port, started)
    if isinstance(starter, WatchedRanks):
        starter.state = state
    return starter


LINGER_END_S = 5.0  # for an ended run's lingering daemon to exit on SIGTERM


def end_lingering(paths: RunPaths, err: TextIO) -> None:
    """This run's previous daemon, its run ended and its lock let go but still serving
    the final metrics (--metrics-linger), ended (SIGTERM), and waited for: its port may
    be the one this start listens on. Any other process is left alone."""
    if not paths.status.exists() or run_held(paths):
        return
    info = RunInfo.load(paths)
    daemon = info.daemon
    if info.live or daemon is None or not info.daemon_here or info.unverifiable:
        return
    if send_signal(daemon, signal.SIGTERM):
        print(f"ddtrain: ended the run's previous daemon (pid {daemon.pid}), which still "
              "served its final metrics (--metrics-linger)", file=err, flush=True)
        deadline = time.monotonic() + LINGER_END_S
        while same_process(daemon) and time.monotonic() < deadline:
            time.sleep(0.05)


class Supervisor:
    """`run()`: the run set up, supervised by a RunLoop, and closed; its exit code.
    `starter` is the run's starter once made (`ddtrain watch` reads its command's
    exit code after the run)."""

    def __init__(self, config: TrainConfig, paths: RunPaths, out: TextIO = sys.stdout,
                 err: TextIO = sys.stderr, echo: bool = True,
                 on_tick: Callable[[RunState], None] | None = None) -> None:
        self.config, self.paths, self.out, self.err = config, paths, out, err
        self.echo = echo  # echo rank logs (foreground); a detached daemon does not
        # Called with the RunState after every poll of the sockets (about 10 times a second)
        # and once at the end: `ddtrain start --foreground --headless` prints from it.
        self.on_tick = on_tick
        self.starter: RankStarter | None = None
        self.lingering: Exporter | NoExporter | None = None  # after run(): linger()

    def run(self) -> int:
        config, paths = self.config, self.paths
        report = RunReport(config, paths)
        port = choose_port(config.master_addr, config.master_port)
        lock: int | None = None
        exporter: Exporter | NoExporter = NoExporter()
        relay: Relay | None = None
        try:
            paths.create()
            lock = hold_run(paths)  # the one daemon of this run, until it exits
            write_json_atomic(paths.config, config.to_dict())
            # A port in use: refused before the journal exists (the folder is removed then).
            # This run's previous daemon still serving its final state (a resume right
            # after a stop): ended first, as it would be by ddtrain stop.
            end_lingering(paths, self.err)
            exporter = open_exporter(config, self.err)
            hub = config.multi_node and config.is_hub
            bind = hub_bind_address(config) if hub else config.bind
            keys = RunKeys.create(paths.keys) if bind else None
            if keys is not None:  # what other machines are given: no secret of this daemon's
                write_peer_folder(paths.keys, paths.peer_keys)
            watching = config.watch is not None
            relay = Relay(paths.run_id, paths.journal, paths.sockets,
                          world_size=None if watching else config.world_size,
                          bind=bind or None, keys=keys, nodes=hub,
                          tensorboard=config.tensorboard)
            exporter.prime(relay.state)  # scrapes answered at once while the ranks start
            if not config.master_port:
                # Chosen again once the relay's own ports are bound, so it cannot be one of them.
                port = choose_port(config.master_addr, 0)
            starter = self.starter = make_starter(config, paths, port, report.started,
                                                  relay.state)
            relay.believe(starter.is_rank)  # a hello from any other pid: dropped
            role = NodeRole(config, paths, relay, self.err, starter.local_ranks)
            # Signs the stop step in torch's store (training/stopping.py): this daemon's
            # own, or a multi-node job's, derived from its keys (the same on every node).
            stop_secret = secrets.token_hex(32)
            if hub:
                assert keys is not None
                stop_secret = keys.stop_secret()
                role.become_hub(bind)
            exits = Exits(paths, relay, starter, rank_program(config).stop_signal)
            loop = RunLoop(config, paths, report, relay, role, starter, exits, exporter,
                           stop_secret, self.out, self.err, self.echo, self.on_tick)
            what = (f"watching {config.program_label}" if watching
                    else count_of(config.world_size, "rank"))
            loop.status("starting", f"run {paths.run_id} starting {what}")
            if config.multi_node and not config.is_hub:
                loop.stop_secret = role.join_hub().stop_secret()
        except (OSError, UsageError) as e:
            exporter.close()
            if relay is not None:
                relay.close()
            if lock is not None:
                os.close(lock)  # the folder is free (a start refused leaves none behind)
            if isinstance(e, UsageError):
                raise
            raise UsageError(f"cannot write the run directory {paths.root}: {e.strerror}; "
                             "pick another --runs-dir") from None
        ended = False
        try:
            code = loop.run()
            ended = True
            return code
        finally:
            # Every way out, an error the loop did not survive included: its ranks
            # must not train on unsupervised, nothing they left may hold the helpers.
            loop.end_ranks(tell=False)
            role.close()
            starter.close()  # the forkserver and resource tracker, waited for
            if ended:  # its final state, kept for the last scrapes (--metrics-linger)
                exporter.finish(relay.state)
            relay.close()  # its sockets (and a private sockets folder) go with it
            if lock is not None:
                os.close(lock)  # the run's folder is free while its metrics linger
            if ended:  # its final state kept for the last scrapes: linger(), then closed
                self.lingering = exporter
            else:
                exporter.close()

    def linger(self) -> None:
        """After the run (and whatever its caller prints of it): --metrics keeps serving
        its final state for --metrics-linger seconds, then closes (SIGTERM or SIGINT
        ends the wait)."""
        exporter, self.lingering = self.lingering, None
        if exporter is not None:
            try:
                exporter.linger(self.config.metrics_linger, self.err)
            finally:
                exporter.close()
