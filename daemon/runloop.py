"""The daemon's loop (RunLoop): start the ranks, supervise them, relay their
telemetry, and end the run with one outcome. It is built whole, from the parts the
Supervisor set up (daemon/supervisor.py), and owns none of their set-up or closing.

One loop waits on the ranks' process sentinels and the relay's sockets together. Each
rank's stdout and stderr go to its own log file (echoed with a `[rank K]` prefix in the
foreground). When a rank fails, the supervisor lets the ranks that already reported an
error exit by themselves, stops the others (they would otherwise wait in their next
collective until it times out), names the culprit (core/blame.py), and either restarts
every rank from the newest checkpoint (`--max-restarts`) or ends the run as failed.

Stopping: a `stop` request (or the first Ctrl-C) is graceful: every rank of the built-in
trainer gets SIGUSR1, the ranks agree on a step to stop after, rank 0 checkpoints, they
exit (a user's program gets SIGTERM, as torchrun would send it); whatever is still running
after the timeout is terminated. SIGTERM (or a second Ctrl-C) stops at once.

How ranks are started is a `RankStarter`'s business (daemon/starters.py); what is written
down and printed at the end, the report's (daemon/report.py); --metrics, the exporter's
(daemon/exporter.py); what the control socket asked, requests.Asked's.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from types import FrameType
from typing import TextIO

from ddtop.core import protocol, wire
from ddtop.core.config import TrainConfig
from ddtop.core.contract import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    FAULT_ENV,
    PORT_PICKED_ENV,
    STOP_SECRET_ENV,
    TELEMETRY_ENV,
    ErrorReport,
    describe_exit,
    signal_name,
)
from ddtop.core.events import EVIDENCE_KEY
from ddtop.core.keys import KEYS_ENV
from ddtop.core.processes import ExitedProcess, send_signal
from ddtop.core.rundir import RunPaths
from ddtop.core.state import RunState
from ddtop.core.summary import ProcessRecord
from ddtop.core.text import count_of
from ddtop.daemon import evidence, leftovers
from ddtop.daemon.autoprofile import AutoProfile
from ddtop.daemon.exits import Exits
from ddtop.daemon.exporter import Exporter, NoExporter
from ddtop.daemon.hangtimeout import HangTimer
from ddtop.daemon.hub import reachable
from ddtop.daemon.noderole import NodeRole
from ddtop.daemon.relaunches import Relaunch
from ddtop.daemon.relay import Relay
from ddtop.daemon.report import Outcome, RunReport
from ddtop.daemon.stacks import signal_stacks
from ddtop.daemon.starters import (
    COMMAND,
    Rank,
    RankStarter,
    process_name,
    rank_program,
)

# Seconds between looks at the sockets and the ranks' logs while they run.
POLL_S = 0.1
# Seconds ranks get to stop gracefully after the first Ctrl-C.
INTERRUPT_STOP_TIMEOUT_S = 30.0
# Starts again after rank 0 found the port the daemon picked taken by another
# process (a race between the daemon's choice and rank 0's bind): not restarts.
PORT_RETRIES = 3


class Stopped(Exception):
    """The daemon was asked to stop at once (a second Ctrl-C, or SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class RunLoop:
    """One run supervised, built whole from the parts the Supervisor set up: the relay
    (sockets, state, journal), the node role, the starter, how the ranks end (exits),
    the report and the exporter. `run` is the loop, to the run's one outcome."""

    def __init__(self, config: TrainConfig, paths: RunPaths, report: RunReport, relay: Relay,
                 role: NodeRole, starter: RankStarter, exits: Exits,
                 exporter: Exporter | NoExporter, stop_secret: str, out: TextIO, err: TextIO,
                 echo: bool, on_tick: Callable[[RunState], None] | None) -> None:
        self.config, self.paths, self.report = config, paths, report
        self.relay, self.role, self.starter, self.exits = relay, role, starter, exits
        self.exporter = exporter  # --metrics (daemon/exporter.py), or none
        # Signs the stop step in torch's store (training/stopping.py): this daemon's
        # own, or a multi-node job's, derived from its keys (the same on every node).
        self.stop_secret = stop_secret
        self.out, self.err = out, err
        self.echo = echo  # echo rank logs (foreground); a detached daemon does not
        # Called with the RunState after every poll of the sockets (about 10 times a second)
        # and once at the end: `ddtrain start --foreground --headless` prints from it.
        self.on_tick = on_tick
        self.restarts = 0
        self.port_retries = 0  # starts again after a picked port was taken (_port_taken)
        self.launch = 0  # starts of the ranks so far, less one: the attempt they are told
        self.port_taken = ""  # why the ranks are started again on a fresh port (_port_taken)
        self.stopping: float | None = None  # deadline of a graceful stop in progress
        self.stop_timeout = 0.0  # the seconds it was given
        self.interrupted = False  # the stop came from Ctrl-C
        self.late: list[Rank] = []  # ranks a stop had to kill (SIGKILL) after its timeout
        self.hang = HangTimer(config.hang_timeout)
        self.evidence = evidence.Gatherer(paths, starter.numbered, role.gathering,
                                          config.nnodes)
        self.world_told = 0  # `ddtrain watch`: the world size run.json has
        self.autoprofile = AutoProfile(paths, config.profile_stragglers)

    def run(self) -> int:
        """Supervise the run to its end; its exit code."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                outcome = self.role.settle(self._attempts(), self.exits.note, self._on_state)
            except Stopped as stop:
                for s in previous:  # a second Ctrl-C must not interrupt the clean-up
                    signal.signal(s, signal.SIG_IGN)
                self.end_ranks()
                code = EXIT_INTERRUPTED if stop.signum == signal.SIGINT else 128 + stop.signum
                outcome = Outcome("stopped", code)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        self.evidence.close()  # a bundle still being finished is named by the final run.json
        self.exits.oom.close()
        self._evidence_told()
        self._echo_logs(final=True)
        headline = self.report.headline(outcome)
        if self.late:  # the ranks a stop had to kill: named, not blamed
            names = ", ".join(process_name(r.rank) for r in self.late)
            headline += f" ({names} did not stop in time and was killed with SIGKILL)"
            print(f"ddtrain: {names} did not stop in time and was killed with SIGKILL",
                  file=self.err, flush=True)
        self.status(outcome.status, headline, exit_code=outcome.exit_code)
        self.role.record_final(outcome, headline)
        self.relay.guarded("tick", self._tick)
        self.report.print_outcome(outcome, self.out, self.err)
        return outcome.exit_code

    def _attempts(self) -> Outcome:
        """Run the ranks; after a failure restart them, up to --max-restarts times.
        A port the daemon picked that another process took first is picked again,
        and the ranks started again, up to PORT_RETRIES times: not a restart."""
        while True:
            self._start_ranks()
            outcome = self._supervise()
            self.end_ranks()  # the ranks have ended: so does what they left running
            if self._port_taken(outcome):
                continue
            if (outcome.status != "failed" or outcome.exit_code == EXIT_USAGE
                    or self.restarts >= self.config.max_restarts or self.stopping is not None):
                return outcome
            self._restart(outcome)

    def _port_taken(self, outcome: Outcome) -> bool:
        """Rank 0 found the port the daemon picked taken (PortTaken): said, and the
        next start gets a fresh one; False when that is not what happened, or after
        PORT_RETRIES such starts."""
        if (outcome.report is None or outcome.report.kind != "port_taken"
                or self.port_retries >= PORT_RETRIES or self.stopping is not None):
            return False
        self.port_retries += 1
        self.launch += 1  # a later launch: the starter picks a fresh port (LocalRanks.start)
        self.port_taken = outcome.report.message  # said once the new port is known
        self.status("restarting", f"{self.port_taken}: starting the ranks again on a fresh "
                    "port", write=False)  # no failure: not the run's
        self.exits.begin()
        self.relay.retire_senders()
        self.hang.reset()
        return True

    def _restart(self, outcome: Outcome) -> None:
        rank = outcome.failed_rank
        assert rank is not None and rank.exitcode is not None
        self.restarts += 1
        self.launch += 1
        newest = self.paths.newest_checkpoint()
        view = self.relay.state.ranks.get(rank.rank)
        reason = outcome.reason or describe_exit(rank.exitcode, None)
        step = view.global_step if view else None
        entry = wire.Restart(
            restart=self.restarts, rank=rank.rank, pid=rank.process.pid, reason=reason,
            exit_code=rank.exitcode if rank.exitcode >= 0 else None,
            signal=signal_name(rank.exitcode), global_step=step,
            checkpoint=newest.name if newest else None, time=time.time())
        source = ("(the program resumes by its own means)" if self.config.runs_user_code
                  else f"from {newest.name}" if newest else "from the start (no checkpoint yet)")
        message = (f"restart {self.restarts}/{self.config.max_restarts}: rank {rank.rank} "
                   f"{reason} at step {step}; restarting {source}")
        print(f"ddtrain: {message}", file=self.err, flush=True)
        self.relay.emit(wire.Restarting, message=message, restart=entry)
        self.status("restarting", message, write=False)
        self.config = replace(self.config, resume=newest is not None)
        self.exits.begin()  # a signal before the new ranks exist stops at once
        self.relay.retire_senders()  # the old processes' pids are not the ranks' now
        self.hang.reset()

    def _relaunched(self, r: Relaunch) -> None:
        """The watched command's launcher started the ranks again (torchrun's
        --max-restarts): a restart, counted and told as the daemon's own are,
        naming the life that failed; the new lives are followed as the same ranks."""
        self.restarts += 1
        view = self.relay.state.ranks.get(r.rank)
        step = view.global_step if view else None  # its last life's (not yet stepped again)
        entry, message = r.told(self.restarts, step)
        print(f"ddtrain: {message}", file=self.err, flush=True)
        self.relay.emit(wire.Restarting, message=message, restart=entry)
        self.status("restarting", message, write=False)  # the old lives' failure is over
        self.status("running", f"watching {count_of(self.relay.state.world_size, 'rank')}")

    # -- start -----------------------------------------------------------------
    @property
    def watching(self) -> bool:
        """`ddtrain watch`: ranks this daemon did not start."""
        return self.config.watch is not None

    def _start_ranks(self) -> None:
        # Set before the forkserver starts, so that it and every rank inherit
        # them: one intra-op thread per rank unless told otherwise (as torchrun
        # does), and where to send telemetry (this daemon, unless the user said).
        if not self.watching:  # a watched command's threads are its own business
            os.environ.setdefault("OMP_NUM_THREADS", str(self.config.threads_per_rank))
        if not os.environ.get(TELEMETRY_ENV) or self.watching:
            endpoint = self.relay.endpoints["telemetry"]  # a watch's ranks may be elsewhere
            os.environ[TELEMETRY_ENV] = reachable(endpoint) if self.watching else endpoint
            if self.relay.keys is not None:  # over TCP: the run's keys let the ranks in
                os.environ[KEYS_ENV] = str(self.paths.keys.resolve())
        if self.config.runs_user_code:  # only the built-in trainer reads it
            os.environ.pop(STOP_SECRET_ENV, None)
        else:
            os.environ[STOP_SECRET_ENV] = self.stop_secret
        drills = os.environ.get(FAULT_ENV)
        if drills and not self.launch:  # --inject (checked by ddtrain start)
            message = f"fault drills armed: {drills} (in the first attempt only)"
            self._tell("info", message)
        os.environ[PORT_PICKED_ENV] = "0" if self.config.master_port else "1"
        self.starter.start(self.config, self.launch, self.exits.begin())
        if self.port_taken:
            self._tell("warning", f"{self.port_taken}: starting the ranks again on port "
                                  f"{self.starter.port} (not a restart; {self.port_retries} "
                                  f"of at most {PORT_RETRIES})")
            self.port_taken = ""
        self.status("running", f"watching {self.config.program_label}" if self.watching
                     else f"{count_of(self.config.world_size, 'rank')} started")

    # -- supervise -------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.stopping is None and self.ranks:
            self.interrupted = True  # the first Ctrl-C: graceful; the loop acts on it
            self.relay.asked.interrupt(INTERRUPT_STOP_TIMEOUT_S)
            return
        raise Stopped(signum)

    @property
    def ranks(self) -> list[Rank]:
        """The supervised processes of this attempt."""
        return self.exits.ranks

    def _supervise(self) -> Outcome:
        while True:
            running = self.exits.running()
            if not running:
                self.relay.last_words()  # their final steps and byes, still on the way
                if self.stopping is not None:
                    return Outcome("stopped", EXIT_INTERRUPTED)
                if self.config.watch and not self.relay.state.ranks:
                    return self._no_rank_seen()
                return Outcome("succeeded", EXIT_OK)
            # A scrape (--metrics) wakes the loop too: its reading is taken at once.
            self.relay.serve(POLL_S, [*(r.process.sentinel for r in running),
                                      *self.exporter.fds])
            # What these act on came from outside (the printer's reading of the state,
            # the other nodes, requests, the ranks' output): an exception in one is
            # said and counted by the relay, and the ranks stay supervised.
            self.relay.guarded("tick", self._tick)
            self.relay.guarded("nodes", self.role.tick)
            self._serve_requests()
            self.relay.guarded("logs", self._echo_logs)
            stopping = self.stopping is not None
            if self.exits.collect(running, stopping):
                self.exits.settle(stopping)
                self.exits.stop_all()  # the others would wait in their next collective
                return self.exits.failure(stopping)
            hung = self._check_hang()
            if hung is not None:
                return hung

    def _no_rank_seen(self) -> Outcome:
        """`ddtrain watch -- COMMAND`: the command ended well, and no process of it
        reported as a rank. Nothing was watched, which a CI gate must not read as a
        success: a failure naming the command, unless --allow-no-ranks."""
        if self.config.allow_no_ranks:
            self._tell("warning", "no rank seen: the command ended (exit 0) and no process "
                                  "of it reported as a rank (--allow-no-ranks)")
            return Outcome("succeeded", EXIT_OK)
        pid = self.ranks[0].process.pid if self.ranks else None
        reason = ("ended (exit 0) with no rank seen: none of its processes initialised a "
                  "torch.distributed process group (a launcher told to start one plain "
                  "process, or a script that never calls init_process_group); "
                  "--allow-no-ranks accepts that")
        self.relay.emit(wire.RankExit, exited=COMMAND, pid=pid, exit_code=0, signal=None,
                        culprit=True, reason=reason)
        return Outcome("failed", EXIT_FAILED,
                       Rank(COMMAND, ExitedProcess(pid, 0), exitcode=0, noted=True),
                       reason=reason, hint="each launcher's spelling that starts ranks: "
                                           "docs/own-scripts.md#every-launcher")

    def _tick(self) -> None:
        for relaunch in self.starter.relaunched():
            self._relaunched(relaunch)
        self.exits.oom.sample(self.starter.numbered())  # (once a second: cgroups, RSS)
        world = self.relay.state.world_size
        if self.watching and world != self.world_told and self.stopping is None:
            self.world_told = world  # run.json says the ranks' world size once they do
            self.status("running", f"watching {count_of(world, 'rank')}")
        if (desync := self.hang.desync_news(self.relay.state, time.time())) is not None:
            self._tell("warning", desync)
            self.evidence.gather(self.relay.state, "desync", desync)
        self.evidence.pending(self.relay.state)
        self._evidence_told()
        for line in self.autoprofile.tick(self.relay.state):  # (--profile-stragglers)
            self._tell("info", line)
        self._on_state(self.relay.state)

    def _on_state(self, state: RunState) -> None:  # every pass of the loop
        self.exporter.serve(state)  # a reading for a scrape waiting, if one is
        if self.on_tick is not None:
            self.on_tick(state)

    def _serve_requests(self) -> None:
        """What the control socket was asked since the last pass (daemon/requests.py):
        a stop begun, the ranks asked for their stacks; then a stop's deadline."""
        asked = self.relay.asked.take()
        stop = next((r for r in asked if isinstance(r, protocol.Stop)), None)
        if stop is not None and self.stopping is None:
            self._begin_stop(stop.timeout)
        elif self.stopping is not None and time.monotonic() > self.stopping:
            self._stop_late()
        stacks = [r.rank for r in asked if isinstance(r, protocol.Stacks)]
        if stacks:
            numbered, rank_stacks = self.starter.numbered, self.paths.rank_stacks

            def ask() -> None:  # (py-spy's threads, if any, go on by themselves)
                signal_stacks(numbered(), stacks, rank_stacks)

            self.relay.guarded("stacks", ask)
        wanted = next((r for r in asked if isinstance(r, protocol.Evidence)), None)
        if wanted is not None:
            hang = self.relay.state.hang(time.time())
            if wanted.hub:  # (node K: the hub's bundle asks for this node's ranks')
                self.evidence.gather(self.relay.state, "hub", f"asked with the hub's evidence "
                                     f"{wanted.hub}" + (f": {hang}" if hang else ""))
            else:
                self.evidence.gather(self.relay.state, "asked",
                                     hang or "asked for (ddtrain evidence): no hang named")

    def _begin_stop(self, timeout: float) -> None:
        self.role.stopping(timeout)  # a hub's stop is every node's too
        self.stop_timeout = timeout
        self.stopping = time.monotonic() + timeout
        how = "Ctrl-C" if self.interrupted else "a stop request"
        what = ("the ranks get SIGTERM" if self.config.runs_user_code
                else "ranks finish their step, rank 0 checkpoints")
        message = f"stopping on {how}: {what}; anything left after {timeout:g} s is terminated"
        if self.interrupted:
            message += " (Ctrl-C again to stop at once)"
        # Only processes the starter started (or its agent did), each checked to be
        # still that process: never a pid a telemetry message claimed. Rank 0 last: the
        # built-in trainer's rank 0 picks the step every rank stops after as soon as it
        # sees the signal, 3 steps ahead, so the others must have theirs first (signalled
        # first and the daemon descheduled before the next, rank 1 once ran past the
        # target and waited forever for rank 0). The ranks first, then run.json (an
        # fsync): another node's ranks must hear of the stop before the target step
        # rank 0 picks (training/stopping.py).
        numbered = self.starter.numbered()
        for rank in sorted(numbered, key=lambda k: (k == 0, k)):
            send_signal(numbered[rank], rank_program(self.config).stop_signal)
        self._tell("stop_requested", message)
        self.status("stopping", message)

    def _stop_late(self) -> None:
        """A stop's deadline passed: whatever is left is terminated, then killed."""
        late = [r for r in self.ranks if r.process.exitcode is None]
        message = (f"{self.exits.describe(late)} did not stop within "
                   f"{self.stop_timeout:g} s: terminating (SIGTERM, then SIGKILL)")
        self._tell("warning", message)
        self.exits.stop_all()
        self.late = [r for r in late if r.process.exitcode == -signal.SIGKILL]

    def _check_hang(self) -> Outcome | None:
        """--hang-timeout: a hang the state has declared (core/state.py: ranks
        stalled in a collective) for that long fails the run, blamed on the rank
        the others wait for; every rank is stopped."""
        if self.stopping is not None:
            return None
        if (judged := self.hang.judge(self.relay.state, time.time())) is None:
            return None
        blamed, reason, text = judged
        message = f"rank {blamed} {reason}: {text}"
        self._tell("warning", message, f"; stopping the ranks (their stacks first: "
                   f"{self.paths.logs}/rank-K.stacks)")
        verdict = ErrorReport(rank=blamed, message=f"{reason}: {text}")
        self.exits.verdicts[blamed] = verdict
        numbered = self.starter.numbered()
        # Where each rank hangs, kept: the evidence (daemon/evidence.py), their Python
        # and native stacks among it (py-spy reads the live process: waited for,
        # evidence.budget at most).
        self.evidence.gather(self.relay.state, "hang", message, wait=True)
        self._evidence_told()
        for r in self.ranks:
            if r.process.exitcode is None:
                r.stopped_by_us = True
                r.process.terminate()
        # A rank frozen with SIGSTOP dies of its pending SIGTERM once continued (at
        # once, taking no step; it writes no stacks), not 5 s later of SIGKILL.
        for process in numbered.values():
            send_signal(process, signal.SIGCONT)
        self.end_ranks(culprit=blamed)
        ends = self.exits.ends(self.ranks)
        failed = next((e for e in ends if e.rank == blamed), None) or next(
            p for p in self.ranks if p.exitcode is not None)
        return Outcome("failed", EXIT_FAILED, failed, verdict,
                       reason=f"{reason} and was stopped")

    # -- the end of an attempt ---------------------------------------------------
    def end_ranks(self, culprit: int | None = None, tell: bool = True) -> None:
        """The one clean-up of an attempt, whatever ended it: every rank still
        running stopped (daemon/exits.py), each exit told (the culprit's first)
        unless `tell` is False (the way out of an error), and what the ranks left
        running ended (daemon/leftovers.py), named in one line per rank, so that
        nothing they started outlives the run or keeps the command waiting."""
        self.exits.stop_all()
        if tell:
            self.exits.note(culprit)
        found, killed = leftovers.end(self.starter.left_behind)
        for line in leftovers.describe(found, killed):
            self._tell("warning", line)

    def _tell(self, type: wire.EventType, message: str, more: str = "",
              data: dict[str, str] | None = None) -> None:
        """Said twice, once: on the daemon's stderr (`more` added there) and as the
        run's event (every dashboard, the journal), with `data`."""
        print(f"ddtrain: {message}{more}", file=self.err, flush=True)
        self.relay.emit(wire.Event, type=type, message=message, data=data or {})

    def _evidence_told(self) -> None:
        """Where the evidence finished since went: said, and its folder in the event
        (the state keeps it: run.json and the summaries name it)."""
        for kind, line, folder in self.evidence.told():
            self._tell("info" if kind == "info" else "warning", line,
                       data=None if folder is None else {EVIDENCE_KEY: folder})

    def status(self, status: wire.RunStatusName, message: str, write: bool = True,
                exit_code: int | None = None) -> None:
        """Announce the run's status (state, journal, dashboards), then record it in
        run.json from the state it is now in."""
        # A watched run's world size is what its ranks say (0: not known here).
        world = 0 if self.watching else self.config.world_size
        self.relay.emit(wire.RunStatus, status=status, world_size=world,
                        restarts=self.restarts, message=message, exit_code=exit_code)
        if status in wire.FINAL_STATUSES:  # served from now on, before run.json says it
            self.exporter.finish(self.relay.state)
        if write:
            self.report.write(self.relay.state, {**self.relay.endpoints,
                                                 **self.exporter.endpoints}, self.starter.port,
                              [ProcessRecord.of(r.rank, r.process.pid, r.process.identity)
                               for r in self.ranks],
                              ended=status in wire.FINAL_STATUSES)

    def _echo_logs(self, final: bool = False) -> None:
        if not self.echo:
            return
        for prefix, tail in self.starter.tails:
            for line in tail.lines(final):
                print(f"{prefix} {line}" if prefix else line, file=self.out, flush=True)

