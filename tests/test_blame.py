"""Whom a failed run is blamed on: the pure policy (core/blame.py) on plain
data, and how torchrun's own account of its ranks' exits is read
(daemon/torchrun.py). The cases from real failures (gloo's and NCCL's peer-loss
errors, reports left by an earlier attempt) are in test_failures_and_resume.py,
through the rank's own report writer."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ddtop.core.blame import (
    Cause,
    JobVerdict,
    Leaving,
    NodeEnd,
    RankEnd,
    blame_order,
    culprit,
    job_verdict,
    left_early,
    left_early_words,
    read_error_report,
)
from ddtop.core.contract import ErrorReport
from ddtop.core.processes import ExitedProcess
from ddtop.core.rundir import RunPaths
from ddtop.core.state import RunState
from ddtop.daemon.starters import AGENT, Rank
from ddtop.daemon.torchrun import TorchrunRanks

PEER = "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:5000"
KILLED, TERMINATED = -signal.SIGKILL, -signal.SIGTERM


def report(message: str = "ValueError: bad batch", t: float = 10.0,
           kind: str = "exception") -> ErrorReport:
    return ErrorReport(kind=kind, message=message, time=t)  # type: ignore[arg-type]


@pytest.mark.parametrize(("exits", "reports", "expected"), [
    # Bad input beats everything, even an earlier error of another rank's own.
    ({0: RankEnd(1), 1: RankEnd(2)}, {0: report(t=1.0), 1: report("bad flag", 5.0, "usage")}, 1),
    # A rank the daemon stopped, with nothing to say, is never the cause over one
    # that exited non-zero by itself.
    ({0: RankEnd(TERMINATED, stopped_by_daemon=True), 1: RankEnd(1)}, {}, 1),
    # Only ranks the daemon stopped: the lowest.
    ({0: RankEnd(TERMINATED, True), 1: RankEnd(TERMINATED, True)}, {}, 0),
    # Equal evidence: the lowest rank.
    ({2: RankEnd(KILLED), 1: RankEnd(KILLED)}, {}, 1),
    # A clean exit is never blamed, whatever it wrote.
    ({0: RankEnd(0), 1: RankEnd(1)}, {0: report(t=1.0), 1: report(PEER, 2.0)}, 1),
    # A peer-loss error loses to an error of its own, even a later one of a rank
    # the daemon then stopped while it was exiting.
    ({0: RankEnd(TERMINATED, True), 1: RankEnd(1)}, {0: report(t=3.0), 1: report(PEER, 2.0)}, 0),
])
def test_culprit(exits: dict[int, RankEnd], reports: dict[int, ErrorReport],
                 expected: int) -> None:
    assert culprit(exits, reports) == expected


def test_nobody_is_blamed_when_no_rank_failed() -> None:
    assert culprit({0: RankEnd(0), 1: RankEnd(0)}, {}) is None
    assert culprit({}, {}) is None


def test_blame_classes_in_order() -> None:
    ordered = [(RankEnd(KILLED), None), (RankEnd(1), report()), (RankEnd(3), None),
               (RankEnd(1), report(PEER)), (RankEnd(TERMINATED, True), None), (RankEnd(0), None)]
    assert [blame_order(end, r)[0] for end, r in ordered] == [0, 1, 2, 3, 4, 5]


def leaving(**changes: object) -> Leaving:
    """A rank that exited 0 at step 50 of 300 while the others ran, without a
    goodbye although its telemetry spoke: it left early; `changes` alter one fact."""
    facts: dict[str, object] = {"said_hello": True, "said_bye": False, "others_running": True,
                                "stopping": False, "global_step": 50, "total_steps": 300}
    return Leaving(**{**facts, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(("changes", "early"), [
    ({}, True),
    ({"total_steps": 0}, True),  # a script's total unknown: no goodbye is enough
    ({"said_bye": True}, False),  # it said goodbye: it ended its work itself
    ({"others_running": False}, False),  # the last to go (or all at once)
    ({"stopping": True}, False),  # a stop asked it to end
    ({"said_hello": False}, False),  # its telemetry never spoke: no goodbye could be heard
    ({"global_step": 300}, False),  # it reached the last step: finished, goodbye lost
])
def test_an_exit_0_is_leaving_early_only_with_every_sign(changes: dict[str, object],
                                                         early: bool) -> None:
    assert left_early(leaving(**changes)) is early


@pytest.mark.parametrize(("exits", "reports", "expected"), [
    # Rank 1 left early; rank 0 then lost its peer: rank 1 is blamed, also when
    # the daemon reaped rank 0 first or rank 0's report is older than the exit.
    ({0: RankEnd(1), 1: RankEnd(0, left_early=True, ended=9.0)}, {0: report(PEER, 9.5)}, 1),
    ({0: RankEnd(1), 1: RankEnd(0, left_early=True)}, {0: report(PEER, 1.0)}, 1),
    # A clean exit 0 (it finished) is never blamed: the peer-loss rank is.
    ({0: RankEnd(1), 1: RankEnd(0, ended=9.0)}, {0: report(PEER, 9.5)}, 0),
    # Leaving early is a cause of its own: the earlier of it and an error of its own.
    ({0: RankEnd(1), 1: RankEnd(0, left_early=True, ended=9.0)}, {0: report(t=8.0)}, 0),
    ({0: RankEnd(1), 1: RankEnd(0, left_early=True, ended=9.0)}, {0: report(t=9.2)}, 1),
    # A rank killed by a signal still comes first.
    ({0: RankEnd(KILLED), 1: RankEnd(0, left_early=True, ended=9.0)}, {}, 0),
    # Only a rank that left early (the others stopped by the daemon): it.
    ({0: RankEnd(TERMINATED, True), 1: RankEnd(0, left_early=True)}, {}, 1),
])
def test_a_rank_that_left_early_is_the_cause_of_its_peers_loss(
        exits: dict[int, RankEnd], reports: dict[int, ErrorReport], expected: int) -> None:
    assert culprit(exits, reports) == expected


def test_error_reports_are_read_only_when_whole_and_of_this_attempt(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.error.json"
    assert read_error_report(path, since=0.0) is None  # none written
    path.write_text('{"kind": "exception", "message": "boom", "time": 5.0}')
    found = read_error_report(path, since=5.0)
    assert found is not None and found.message == "boom"
    assert read_error_report(path, since=6.0) is None  # an earlier attempt's
    for damaged in ('{"kind": "exception", "mess', '[1]', '{"kind": "other"}', '{"time": "x"}'):
        path.write_text(damaged)
        assert read_error_report(path, since=0.0) is None, damaged


# torchrun prints this when one of its ranks fails (abridged from torch 2.x).
TORCHRUN_LOG = """\
[W1123 12:00:01] Sending process 4242 closing signal SIGTERM
torch.distributed.elastic.multiprocessing.api.SignalException: Process exited
============================================================
ddtop.training FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_12:00:01
  host      : node
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4243)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4243
============================================================
"""


def test_torchrun_ranks_are_read_from_its_failure_summary(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "tr").create()
    (paths.logs / "torchrun.log").write_text("an earlier attempt's lines\n")
    starter = TorchrunRanks(paths, port=0, launch_time=0.0)
    starter.world_size, starter.log_start = 3, len("an earlier attempt's lines\n")
    with (paths.logs / "torchrun.log").open("a") as f:
        f.write(TORCHRUN_LOG)
    state = RunState(run="tr")
    agent = Rank(AGENT, ExitedProcess(4000, 1), exitcode=1)
    ranks = starter.rank_exits(agent, state)
    assert [(r.rank, r.exitcode, r.process.pid, r.stopped_by_us) for r in ranks] == [
        (0, TERMINATED, None, True), (1, KILLED, 4243, False), (2, TERMINATED, None, True)]
    exits = {r.rank: RankEnd(r.exitcode or 0, r.stopped_by_us) for r in ranks}
    assert culprit(exits, {}) == 1


def test_a_rank_that_left_early_is_said_at_its_last_reported_step() -> None:
    """At the step it last reported; before any (its telemetry went down with it),
    never 'at step 0', which it had passed."""
    assert left_early_words(46).startswith("left early at step 46: exit code 0 while")
    assert left_early_words(0).startswith("left early before it reported a step: exit code 0")


# The job's outcome across nodes (noderole.settle asks job_verdict): the hub's own
# outcome, and how each other node ended.
FAILED_OF_ITS_OWN = NodeEnd(1, "failed", cause=Cause.OWN_ERROR)
LOST_A_PEER = NodeEnd(2, "failed", cause=Cause.LOST_PEER)
LOST_NODE = NodeEnd(3, "running", lost=True)


@pytest.mark.parametrize(("status", "ours", "others", "verdict"), [
    # Every node succeeded: the hub's outcome stands.
    ("succeeded", Cause.NONE, [NodeEnd(1, "succeeded")], JobVerdict("ours")),
    # Another node's rank failed of its own, ours only lost a peer: theirs is blamed.
    ("failed", Cause.LOST_PEER, [FAILED_OF_ITS_OWN], JobVerdict("their_rank", node=1)),
    # The same cause on both sides: ties go to the hub's own culprit.
    ("failed", Cause.OWN_ERROR, [FAILED_OF_ITS_OWN], JobVerdict("ours")),
    # Of two nodes' culprits, the likelier cause, whichever node says it first.
    ("failed", Cause.STOPPED, [LOST_A_PEER, FAILED_OF_ITS_OWN],
     JobVerdict("their_rank", node=1)),
    # A lost node is the cause when our culprit only lost a peer, or we had none.
    ("failed", Cause.LOST_PEER, [NodeEnd(1, "succeeded"), LOST_NODE],
     JobVerdict("lost", lost=(3,))),
    ("succeeded", Cause.NONE, [LOST_NODE], JobVerdict("lost", lost=(3,))),
    # ... but not when our own rank failed of its own, nor when the job was stopped.
    ("failed", Cause.OWN_ERROR, [LOST_NODE], JobVerdict("ours")),
    ("stopped", Cause.NONE, [LOST_NODE], JobVerdict("ours")),
    # A rank another node blamed comes before a lost node.
    ("failed", Cause.LOST_PEER, [LOST_NODE, FAILED_OF_ITS_OWN], JobVerdict("their_rank", node=1)),
    # We succeeded, another node failed with no rank to blame, or was stopped.
    ("succeeded", Cause.NONE, [NodeEnd(1, "succeeded"), NodeEnd(2, "failed")],
     JobVerdict("node", node=2)),
    ("succeeded", Cause.NONE, [NodeEnd(1, "stopped")], JobVerdict("node", node=1)),
    # We failed with a culprit; another node failed with none to blame: ours stands.
    ("failed", Cause.SILENT_EXIT, [NodeEnd(1, "failed")], JobVerdict("ours")),
])
def test_a_jobs_verdict_across_nodes(status: str, ours: Cause, others: list[NodeEnd],
                                     verdict: JobVerdict) -> None:
    assert job_verdict(status, ours, others) == verdict


def test_a_signal_the_daemon_did_not_send_is_the_ranks_own_end() -> None:
    """A stop ends what still runs; a rank seen to exit only now (a forkserver's,
    reaped after a peer that only lost it) is stopped by the daemon only where the
    daemon's own signal explains its exit, so a rank that killed itself is blamed."""
    from ddtop.daemon.exits import stopped_by_us

    assert stopped_by_us(-signal.SIGTERM, killed=False)
    assert stopped_by_us(-signal.SIGKILL, killed=True)  # after TERM_GRACE_S
    assert stopped_by_us(0, killed=False) and stopped_by_us(1, killed=False)
    assert not stopped_by_us(-signal.SIGKILL, killed=False)  # its own, or the OOM killer's
    assert not stopped_by_us(-signal.SIGSEGV, killed=False)
    assert not stopped_by_us(-signal.SIGSEGV, killed=True)
    own = RankEnd(-signal.SIGKILL, stopped_by_daemon=stopped_by_us(-signal.SIGKILL, False))
    peer = RankEnd(1)
    lost = ErrorReport(message="RuntimeError: Connection closed by peer", rank=0)
    assert culprit({0: peer, 1: own}, {0: lost}) == 1
