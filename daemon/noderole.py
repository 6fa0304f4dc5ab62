"""A daemon's part in a multi-node job: node 0's hub, node K's forwarder, or none.

The supervisor runs the ranks of its own node the same whatever its part; this
is what the part adds (daemon/hub.py has the hub's node table, daemon/forwarder.py
the forwarder's sockets):

- node 0 (`become_hub`): serves the node daemons and writes hub.json; each tick
  turns their silences into `unreachable` events and passes a stop on to every
  node; once its own ranks have ended, `settle` waits (bounded) for every node to
  say how it ended and gives the job's one outcome: the rank or node to blame.
- node K (`join_hub`): sums up its ranks' messages for the hub, beats once a
  second, says when the hub stops answering, takes a stop from the hub's reply,
  and at the end tells the hub how it ended (`record_final`, `close`).
- a single-node run: every method does nothing (a null part, not a branch in
  the supervisor).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TextIO

from ddtop.core import blame, protocol, wire
from ddtop.core.config import TrainConfig
from ddtop.core.contract import EXIT_FAILED, ErrorReport, signal_name
from ddtop.core.keys import RunKeys
from ddtop.core.processes import ExitedProcess
from ddtop.core.rundir import RunPaths
from ddtop.core.state import RunState
from ddtop.daemon.forwarder import Forwarder
from ddtop.daemon.hub import (
    DONE,
    FORWARD_HWM,
    LOST,
    NODE_FINAL_WAIT_S,
    NODE_TIMEOUT_S,
    UNREACHABLE,
    UP,
    Hub,
    NodeSeen,
    public,
)
from ddtop.daemon.hubfile import find_hub, write_hub_file
from ddtop.daemon.relay import Relay
from ddtop.daemon.report import Outcome
from ddtop.daemon.starters import AGENT, Rank

# Seconds between looks at the sockets while the hub waits for the nodes' ends.
SETTLE_POLL_S = 0.1


class NodeRole:
    def __init__(self, config: TrainConfig, paths: RunPaths, relay: Relay, err: TextIO,
                 local_ranks: Callable[[], list[int]]) -> None:
        self.config, self.paths, self.relay, self.err = config, paths, relay, err
        self.local_ranks = local_ranks  # this node's ranks, as its starter knows them
        self.hub: Hub | None = None
        self.forwarder: Forwarder | None = None
        self.final: protocol.NodeFinal | None = None  # how this node ended, for the hub
        self.ranks_said: list[int] = []  # this node's own ranks, as last said
        self.hub_silent = False  # node K: the hub has not answered for a while

    def _say(self, message: str) -> None:
        print(f"ddtrain: {message}", file=self.err, flush=True)

    # -- joining -------------------------------------------------------------------
    def become_hub(self, bind: str) -> None:
        """Node 0: serve the node daemons, and tell them where (hub.json)."""
        self.hub = Hub(self.config, self.relay, self.local_ranks)
        self.relay.serve_hub(self.hub)
        # On every interface: as the rendezvous names this host (a watch has none: its name).
        host = (self.config.rdzv_host or socket.gethostname()) if bind in ("0.0.0.0", "::") \
            else bind
        endpoints = self.relay.endpoints
        self.hub.nodes_endpoint = public(endpoints["nodes"], host)
        control = public(endpoints["control"], host)
        write_hub_file(self.paths, control, self.hub.nodes_endpoint)
        self._say(f"node 0 is the hub of {self.config.nnodes} nodes: {control} "
                  f"(the other nodes' keys in {self.paths.peer_keys}; written to "
                  f"{self.paths.hub_file})")

    def join_hub(self) -> RunKeys:
        """Node K: find the hub (shared run directory, or --hub), forward to it; the
        job's keys."""
        job = RunPaths(self.paths.root.parent.parent)
        control, keys = find_hub(self.config, job, self._say)
        self.forwarder = Forwarder(self.config, control, keys, self.relay.run,
                                   lambda: self.relay.state.ranks)
        self.relay.forward_to(self.forwarder.forward)
        self._say(f"node {self.config.node_rank} forwards to the hub at {control}")
        return keys

    def gathering(self, bundle: str) -> None:
        """This daemon begins a bundle of evidence: a hub's is every node's too."""
        if self.hub is not None:
            self.hub.evidence = bundle

    def stopping(self, timeout: float) -> None:
        """This daemon begins a stop (asked, or Ctrl-C): the hub's is every node's too."""
        if self.hub is not None and self.hub.stop is None:
            self.hub.stop = timeout

    # -- every tick ----------------------------------------------------------------
    def tick(self) -> None:
        relay = self.relay
        if self.hub is not None:
            self.hub.check()
            self._say_ranks(0, local=False)
        if self.forwarder is not None:
            ranks = self._say_ranks(self.config.node_rank, local=True)
            self.forwarder.tick(ranks, relay.state.status)
            self._watch_hub()
            if self.forwarder.evidence_asked:  # the hub gathers: this node its own ranks'
                relay.asked.put(protocol.Evidence(hub=self.forwarder.evidence_asked),
                                time.monotonic())
                self.forwarder.evidence_asked = ""
            if self.forwarder.stop is not None:  # the hub's stop: this node's too
                relay.asked.put(protocol.Stop(timeout=self.forwarder.stop), time.monotonic())

    def _say_ranks(self, node: int, local: bool) -> list[int]:
        """This node's ranks, said once each time they change (node K's are shown
        on node K, the hub re-says them for the job)."""
        ranks = self.local_ranks()
        if ranks != self.ranks_said:
            self.ranks_said = ranks
            host = socket.gethostname()
            self.relay.emit(wire.Event, type="info",
                            node=wire.node_news(node, UP, ranks, host, local),
                            message=f"node {node} ({host}): ranks {', '.join(map(str, ranks))}")
        return ranks

    def _watch_hub(self) -> None:
        """Node K: say when the hub stops answering (this node trains on, holding
        what it forwards up to the high-water mark) and when it answers again."""
        assert self.forwarder is not None
        heard = self.forwarder.heard or self.forwarder.started
        silent = time.monotonic() - heard > NODE_TIMEOUT_S
        if silent != self.hub_silent:
            self.hub_silent = silent
            message = (f"the hub (node 0) has not answered for {NODE_TIMEOUT_S:g} s; "
                       f"this node goes on, holding up to {FORWARD_HWM:,} summaries for it"
                       if silent else "the hub (node 0) answers again")
            self._say(f"{'warning: ' if silent else ''}{message}")
            self.relay.emit(wire.Event, type="warning" if silent else "info", message=message,
                            data={"local": True})

    # -- the end -------------------------------------------------------------------
    def record_final(self, outcome: Outcome, headline: str) -> None:
        """Node K: how it ended, for the hub: status, headline, the rank it blamed."""
        if self.forwarder is None:
            return
        failure = None
        rank = outcome.failed_rank
        if outcome.status == "failed" and rank is not None and rank.exitcode is not None:
            report = outcome.report
            cause, _ = blame.blame_order(rank.end(), report)
            failure = protocol.NodeFailure(
                rank=rank.rank, pid=rank.process.pid, exit_code=rank.exitcode, cause=cause,
                how=headline.partition(": ")[2][:protocol.MAX_HOW_CHARS],
                message=(report.message if report else "")[:protocol.MAX_REPORT_CHARS])
        self.final = protocol.NodeFinal(status=outcome.status, failure=failure,
                                        message=headline[:protocol.MAX_HEADLINE_CHARS])

    def close(self) -> None:
        """Node K: say how it ended (failed, when it never got to say), let the last
        messages go."""
        if self.forwarder is not None:
            self.forwarder.close(self.local_ranks(),
                                 self.final or protocol.NodeFinal(status="failed"))

    def settle(self, outcome: Outcome, note_exits: Callable[[], None],
               on_tick: Callable[[RunState], None] | None) -> Outcome:
        """The hub, once its own ranks ended: wait (bounded) for every node to say
        how it ended; a node that went silent is lost; the job's outcome names the
        node and rank to blame. Any other part: `outcome` as it is."""
        hub, relay = self.hub, self.relay
        if hub is None:
            return outcome
        note_exits()
        deadline = time.monotonic() + NODE_FINAL_WAIT_S + NODE_TIMEOUT_S
        while not hub.settled() and time.monotonic() < deadline:
            relay.serve(SETTLE_POLL_S)
            relay.guarded("nodes", hub.check)  # as in the supervisor's loop
            if on_tick is not None:
                relay.guarded("tick", lambda: on_tick(relay.state))
        for k in hub.missing():  # never heard from
            hub.nodes[k] = NodeSeen(k, state=UNREACHABLE)
        for seen in hub.nodes.values():
            if seen.state == UP:  # still running at the deadline: silent to us
                seen.state = UNREACHABLE
        hub.lose_unreachable()
        ours = outcome.failed_rank
        our_cause = blame.Cause.NONE
        if outcome.status == "failed" and ours is not None and ours.exitcode is not None:
            our_cause = blame.blame_order(ours.end(), outcome.report)[0]
        verdict = blame.job_verdict(outcome.status, our_cause, [
            blame.NodeEnd(s.node, s.status, lost=s.state == LOST,
                          cause=s.failure.cause if s.state == DONE and s.failure
                          else None) for s in hub.nodes.values()])
        if verdict.kind == "their_rank":
            return self._their_rank_failed(hub.nodes[verdict.node])
        if verdict.kind == "lost":
            gone = [hub.nodes[k] for k in verdict.lost]
            first = gone[0]
            names = ", ".join(f"node {s.node} ({s.host or '?'})" for s in gone)
            ranks = ", ".join(str(r) for s in gone for r in hub.ranks_of(s)) or "unknown"
            reason = (f"lost: its daemon (pid {first.pid}) stopped answering the hub; "
                      f"ranks {ranks} unreachable")
            return self._node_failed(first, reason, names)
        if verdict.kind == "node":
            worst = hub.nodes[verdict.node]
            return self._node_failed(worst, worst.message or worst.status,
                                     f"node {worst.node} ({worst.host})")
        return outcome

    def _their_rank_failed(self, seen: NodeSeen) -> Outcome:
        """The job's culprit is a rank of node `seen` (as its node daemon blamed it):
        named in the state as in the headline."""
        f = seen.failure
        assert f is not None
        code, pid, rank = f.exit_code, f.pid, f.rank
        how = f.how.partition(f"rank {rank} ")[2] or "failed"
        message = f.message
        early = code == 0  # blamed with exit code 0: it left early (its node said how)
        self.relay.emit(wire.RankExit, exited=rank, pid=pid,  # the job's culprit, named
                        exit_code=code if code >= 0 else None, signal=signal_name(code),
                        message=message or None, culprit=True, left_early=early,
                        reason=how if early else None)
        return Outcome("failed", EXIT_FAILED,
                       Rank(rank, ExitedProcess(pid, code), exitcode=code, noted=True),
                       ErrorReport(rank=rank, message=message) if message else None,
                       reason=how, who=f"rank {rank} on node {seen.node} ({seen.host})",
                       log=f"{self.paths.node(seen.node).rank_log(rank)} on node "
                           f"{seen.node} ({seen.host})")

    def _node_failed(self, seen: NodeSeen, reason: str, who: str) -> Outcome:
        """The job failed because of node `seen` as a whole (lost, or failed with no
        rank to blame): the one culprit, in the state (run.json, status, the
        headless summary, dashboards) as in the headline."""
        self.relay.emit(wire.RankExit, exited=AGENT, pid=seen.pid, exit_code=None, signal=None,
                        culprit=True, reason=reason, node=seen.node)
        return Outcome("failed", EXIT_FAILED,
                       Rank(AGENT, ExitedProcess(seen.pid, 1), exitcode=1, noted=True),
                       reason=reason, who=who)
