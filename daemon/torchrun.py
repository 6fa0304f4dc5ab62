"""Ranks started by torchrun: the daemon runs `torchrun --standalone` (or, one
node of a multi-node job, torchrun with c10d rendezvous) and supervises its
agent: torch.distributed.run through training/agent.py, which keeps the stores
the agent hosts on loopback when the rendezvous is there.

torchrun runs `python -m ddtop.training` once per rank; the ranks read this
run's config.json (DDTOP_CONFIG), write their own logs, and exit when the
daemon does (DDTOP_DAEMON_PID). The ranks are not the daemon's children but
its agent's: to ask them to stop, the daemon finds them below the agent in
/proc (each one's RANK from its environment), never by the pids their hello
messages claim (those are for display). Once the agent exits, how each rank
ended is read from torchrun's failure summary in its log.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys

from ddtop.core.config import TrainConfig, is_loopback
from ddtop.core.contract import ATTEMPT_ENV, CONFIG_ENV, DAEMON_PID_ENV
from ddtop.core.processes import (
    AgentProcess,
    ExitedProcess,
    LogTail,
    ProcessId,
    boot_id,
    descendants,
    environ_value,
    lineage,
    read_stat,
    same_process,
    set_parent_death_signal,
)
from ddtop.core.rundir import RunPaths, write_json_atomic
from ddtop.core.state import RunState
from ddtop.daemon.leftovers import Leftover, with_environment
from ddtop.daemon.relaunches import Relaunch
from ddtop.daemon.starters import AGENT, Rank, rank_program, stopped_by_launcher

# torch.distributed.run, with the stores its agent hosts at a loopback address
# listening there alone (started by name: the daemon imports nothing of training).
AGENT_MODULE = "ddtop.training.agent"
# torchrun's failure summary: "rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 42)"
REFUSED_MAX = 4096  # refused claims remembered, at most
FAILURE_SUMMARY = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*"
                             r"(-?\d+) \(pid: (\d+)\)")


class TorchrunRanks:
    def __init__(self, paths: RunPaths, port: int, launch_time: float) -> None:
        # torchrun --standalone picks its own rendezvous port; `port` is recorded only.
        self.paths, self.port = paths, port
        self.log = paths.logs / "torchrun.log"
        self.tails: list[tuple[str, LogTail]] = []
        self.log_start = 0  # where this attempt's part of torchrun's log begins
        self.world_size = 0
        self.nodes = False  # a multi-node job: only some of the ranks are this node's
        self.agent: ProcessId | None = None  # this attempt's agent
        self.seen: dict[int, ProcessId] = {}  # rank -> its process, as last found below the agent
        self.refused: dict[tuple[int, int], int] = {}  # (rank, pid) -> start ticks: not the rank

    def start(self, config: TrainConfig, attempt: int, started: list[Rank]) -> None:
        write_json_atomic(self.paths.config, config.to_dict())
        self.world_size = config.world_size
        self.nodes = config.multi_node
        env = {**os.environ, CONFIG_ENV: str(self.paths.config),
               DAEMON_PID_ENV: str(os.getpid()), ATTEMPT_ENV: str(attempt)}
        if config.multi_node:
            # c10d rendezvous at node 0's endpoint; the ranks' numbers come from the
            # order nodes join (each rank's node is what its node daemon reports).
            where = ["--nnodes", str(config.nnodes), "--node-rank", str(config.node_rank),
                     "--nproc-per-node", str(config.nproc_per_node), "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", config.rdzv_endpoint, "--rdzv-id", config.run_id or "",
                     "--rdzv-conf", f"is_host={'1' if config.is_hub else '0'}"]
            if config.local_addr:
                where += ["--local-addr", config.local_addr]
            if is_loopback(config.rdzv_host):  # every node on this machine: gloo on lo too,
                env.setdefault("GLOO_SOCKET_IFNAME", "lo")
                if not config.local_addr:  # and the store the workers share (AGENT_MODULE)
                    where += ["--local-addr", config.rdzv_host]
        else:
            where = ["--standalone", "--nproc-per-node", str(config.world_size),
                     "--local-addr", "127.0.0.1"]
        with self.log.open("ab") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", AGENT_MODULE, *where, "--max-restarts", "0",
                 "-m", rank_program(config).torchrun_module],
                env=env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                preexec_fn=set_parent_death_signal,
            )
        agent_tail = LogTail(self.log, from_end=True)
        self.log_start = agent_tail.offset
        self.tails = [("[torchrun]", agent_tail)] + [
            (f"[rank {k}]", LogTail(self.paths.rank_log(k), from_end=True))
            for k in range(config.world_size)]
        agent = AgentProcess(popen)
        self.agent, self.seen, self.refused = agent.identity, {}, {}
        started.append(Rank(AGENT, agent))

    def rank_processes(self) -> list[ProcessId]:
        """The agent's workers, each known by the RANK in its environment. The
        shallowest process of each rank is the rank: its own children (data
        loader workers, a user's subprocesses) inherit RANK."""
        if self.agent is None:
            return []
        found: dict[int, tuple[int, ProcessId]] = {}
        for process, depth in descendants(self.agent):
            value = environ_value(process.pid, "RANK")
            if value is None or not value.isdigit() or int(value) >= self.world_size:
                continue
            rank = int(value)
            if rank not in found or depth < found[rank][0]:
                found[rank] = (depth, process)
        self.seen.update({rank: process for rank, (_, process) in found.items()})
        return [process for _, process in found.values()]

    def relaunched(self) -> list[Relaunch]:
        return []  # the daemon restarts these ranks itself (RunLoop._restart)

    def local_ranks(self) -> list[int]:
        return sorted(self.seen)

    def numbered(self) -> dict[int, ProcessId]:
        self.rank_processes()  # who is below the agent now
        return dict(self.seen)

    def left_behind(self) -> list[Leftover]:
        """Once the agent has exited: the processes with this daemon's pid in the
        environment it gave its workers, started after it (their RANK says whose)."""
        if self.agent is None or same_process(self.agent):
            return []
        ranks = set(self.seen.values())  # a rank's own process is said as the rank's
        return [dataclasses.replace(f, own=f.process in ranks)
                for f in with_environment(DAEMON_PID_ENV, str(os.getpid()), self.agent)]

    def close(self) -> None:
        """Nothing of its own left: the agent has exited with its ranks."""

    def is_rank(self, rank: int, pid: int) -> bool:
        seen = self.seen.get(rank)
        if seen is not None and seen.pid == pid:
            return True
        # A pid not known as the rank's yet (its first message, or a claim): asked
        # of that process itself, never by scanning /proc, so a flood of claims
        # cannot make a new worker's first messages be dropped; a claim refused is
        # remembered (by pid and start time), so repeating it costs one read.
        if self.agent is None or not 0 <= rank < self.world_size:
            return False
        stat = read_stat(pid)
        if stat is None or self.refused.get((rank, pid)) == stat.start:
            return False
        if self._is_worker(rank, pid):
            self.seen[rank] = ProcessId(pid, stat.start, boot_id())
            return True
        if len(self.refused) >= REFUSED_MAX:
            self.refused.clear()
        self.refused[(rank, pid)] = stat.start
        return False

    def _is_worker(self, rank: int, pid: int) -> bool:
        """Whether `pid` is the agent's worker for `rank`: below the agent, with
        RANK=rank in its environment, and no process between them with a RANK
        (a worker's own children, data loader workers and the like, inherit it)."""
        assert self.agent is not None
        chain = lineage(pid, self.agent)
        if chain is None or environ_value(pid, "RANK") != str(rank):
            return False
        return all(environ_value(parent, "RANK") is None for parent in chain[1:])

    def rank_exits(self, exited: Rank, state: RunState) -> list[Rank]:
        """Each rank's exit, from torchrun's failure summary (exit code or signal,
        pid), else from its bye; the ranks torchrun stopped when another failed
        were stopped with SIGTERM."""
        assert exited.exitcode is not None
        with self.log.open("rb") as f:  # this attempt's part of torchrun's log
            f.seek(self.log_start)
            log = f.read().decode(errors="replace")
        failed = {int(m[1]): (int(m[2]), int(m[3])) for m in FAILURE_SUMMARY.finditer(log)}
        ranks = []
        # A multi-node job: this node's ranks only (found below the agent, or in its summary).
        local = (range(self.world_size) if not self.nodes
                 else sorted(set(self.seen) | set(failed)))
        for k in local:
            view = state.ranks.get(k)
            # Shown, never signalled: torchrun's pid, else the one found below the
            # agent, else the one the rank's hello claimed.
            seen = self.seen.get(k)
            pid = seen.pid if seen is not None else view.pid if view is not None else None
            if k in failed:
                code, pid = failed[k]
            elif exited.exitcode == 0 or (view is not None and view.bye_code == 0):
                code = 0
            else:  # torchrun stopped it when another rank failed
                code = -signal.SIGTERM
            ranks.append(Rank(k, ExitedProcess(pid, code), exitcode=code,
                              stopped_by_us=code == -signal.SIGTERM, noted=True))
        if not exited.stopped_by_us:  # torchrun's own doing, not a stop of the daemon's
            stopped_by_launcher(ranks, "torchrun")
        return ranks
