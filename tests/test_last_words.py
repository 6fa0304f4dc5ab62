"""A rank's last words are kept: the final Step message and the bye a rank sends
just before it exits can reach the daemon's sockets after the daemon has seen
the exit (a loaded machine). The daemon's loop then serves on, up to
LAST_WORDS_S, until every rank that spoke and exited cleanly has said bye; a
failed rank is not waited for. Over the relay's real ipc sockets, and end to end
through `ddtrain watch` with a rank that outlives its command."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from test_state import RUN, hello, step

from ddtop.core import wire
from ddtop.daemon.relay import LAST_WORDS_S, Relay

SERVE_TIMEOUT_S = 10.0
LATE_S = 0.3  # how long after the exit the rank's last messages arrive
WAIT_S = 8.0
LIMIT_S = 0.5


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[tuple[Relay, zmq.Socket[bytes]]]:
    relay = Relay(RUN, tmp_path / "telemetry.journal", tmp_path / "sock", world_size=3)
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    try:
        push.setsockopt(zmq.LINGER, 0)
        push.connect(relay.endpoints["telemetry"])
        yield relay, push
    finally:
        push.close(linger=0)
        context.term()
        relay.close()


def send(push: zmq.Socket[bytes], message: wire.Message) -> None:
    push.send_multipart(wire.encode(message))


def spoke(relay: Relay, push: zmq.Socket[bytes], rank: int, exit_code: int) -> None:
    """Rank `rank` said hello and a first step; then the daemon saw it exit."""
    send(push, hello(rank))
    send(push, step(rank, 1, 10))
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while relay.state.ranks.get(rank) is None or relay.state.ranks[rank].global_step != 10:
        assert time.monotonic() < deadline, relay.state.rejected
        relay.serve(0.05)
    relay.emit(wire.RankExit, exited=rank, pid=1000 + rank, exit_code=exit_code, signal=None,
               culprit=exit_code != 0, reason=None)


def test_the_final_step_and_bye_arriving_after_the_exit_are_read(
        relay: tuple[Relay, zmq.Socket[bytes]]) -> None:
    server, push = relay
    spoke(server, push, 0, 0)
    last = [step(0, 2, 15, steps=5), wire.Bye(run=RUN, rank=0, seq=3, t=103.0, exit_code=0)]
    late = threading.Timer(LATE_S, lambda: [send(push, m) for m in last])
    started = time.monotonic()
    late.start()
    try:
        server.last_words(WAIT_S)  # (a limit far above the delay: a loaded machine's)
    finally:
        late.join()
    took = time.monotonic() - started
    view = server.state.ranks[0]
    assert view.global_step == 15 and view.bye_code == 0
    assert LATE_S <= took < WAIT_S, took  # back once the bye was in, not at the limit


def test_a_clean_rank_that_never_says_bye_is_waited_for_no_longer_than_the_limit(
        relay: tuple[Relay, zmq.Socket[bytes]]) -> None:
    server, push = relay
    spoke(server, push, 0, 0)
    started = time.monotonic()
    server.last_words(LIMIT_S)
    took = time.monotonic() - started
    assert LIMIT_S <= took < LIMIT_S + 1.0, took
    assert server.state.ranks[0].bye_code is None


def test_a_failed_rank_one_that_said_bye_or_one_never_heard_is_not_waited_for(
        relay: tuple[Relay, zmq.Socket[bytes]]) -> None:
    server, push = relay
    spoke(server, push, 0, 1)  # failed: it says no more
    # Rank 2 exited cleanly, but its telemetry never reached this daemon (went elsewhere,
    # or was off): nothing of it is on the way.
    server.emit(wire.RankExit, exited=2, pid=1002, exit_code=0, signal=None, culprit=False,
                reason=None)
    spoke(server, push, 1, 0)
    send(push, wire.Bye(run=RUN, rank=1, seq=2, t=102.0, exit_code=0))
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while server.state.ranks[1].bye_code is None:
        assert time.monotonic() < deadline
        server.serve(0.05)
    assert server.state.ranks[2].exited and server.state.ranks[2].bye_code is None
    started = time.monotonic()
    server.last_words()
    assert time.monotonic() - started < LAST_WORDS_S / 2


def test_a_ranks_sender_knows_whether_the_daemon_is_connected(tmp_path: Path) -> None:
    """The sender's exit waits up to CONNECTED_LINGER_MS for its last messages to
    leave where the daemon's socket is connected, CLOSE_LINGER_MS where nobody
    listens: `connected` reads the socket's monitor, as the sender does at close."""
    from ddtop.training.sender import CLOSE_LINGER_MS, CONNECTED_LINGER_MS, LINK_EVENTS, connected

    assert CLOSE_LINGER_MS < CONNECTED_LINGER_MS
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    link = push.get_monitor_socket(LINK_EVENTS)
    pull = context.socket(zmq.PULL)
    endpoint = f"ipc://{tmp_path}/telemetry"
    try:
        push.connect(endpoint)
        assert not connected(link)  # nobody listens yet
        pull.bind(endpoint)
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while not link.poll(50):
            assert time.monotonic() < deadline
        assert connected(link)
        assert connected(link, True)  # no event since: as it was
        pull.close(linger=0)
        while not link.poll(50):
            assert time.monotonic() < deadline
        assert not connected(link)  # the daemon went away
    finally:
        push.disable_monitor()
        for sock in (link, push, pull):
            sock.close(linger=0)
        context.term()


# A rank that outlives its command: the command waits until the daemon shows the rank's
# third step, then exits 0; only then does the rank take two more steps and end. The
# daemon has seen the command (so the run) end before those two steps and the bye.
DRIVER = '''
import json, os, subprocess, sys, time
flag = sys.argv[1]
subprocess.Popen([sys.executable, sys.argv[2], flag],
                 env={**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    got = subprocess.run([sys.argv[3], "status", "late", "--json"], capture_output=True,
                         text=True)
    ranks = json.loads(got.stdout)["ranks"] if got.returncode == 0 else []
    if ranks and ranks[0]["global_step"] == 3:
        break
    time.sleep(0.1)
os.remove(flag)
'''
RANK = '''
import os, sys, time
import ddtop
command = os.getppid()
ddtop.init(total_steps=5)
for _ in range(3):
    ddtop.step(loss=1.0)
flag = sys.argv[1]
open(flag, "w").close()
deadline = time.monotonic() + 60
while os.path.exists(flag) and time.monotonic() < deadline:
    time.sleep(0.02)
while os.getppid() == command and time.monotonic() < deadline:  # until the command exited
    time.sleep(0.02)
for _ in range(2):
    ddtop.step(loss=1.0)
'''


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_ranks_steps_and_bye_after_the_command_ended_are_in_the_record(tmp_path: Path
                                                                         ) -> None:
    from helpers import DDTRAIN, ddtrain

    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "rank.py").write_text(RANK)
    run = ddtrain("watch", "--run-id", "late", "--", sys.executable, "driver.py",
                  str(tmp_path / "flag"), "rank.py", DDTRAIN, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    record = json.loads((tmp_path / "runs" / "late" / "run.json").read_text())
    assert [(r["rank"], r["global_step"], r["state"]) for r in record["ranks"]] == [
        (0, 5, "finished")], record["ranks"]
    assert run.leftovers == []
