"""A watched launcher's restarts as daemon/relaunches.py tells them: new lives of
the same ranks, the failed life named from torchrun's own lines (as torch 2.14's
elastic agent writes them; tests/test_watch.py runs the real one)."""

from __future__ import annotations

import signal
from pathlib import Path

from ddtop.daemon.relaunches import Lives
from ddtop.daemon.watching import LAST_WORDS_CHARS, last_words

KILLED = ("E1206 22:40:42.290000 19089 torch/distributed/elastic/multiprocessing/api.py:1002] "
          "failed (exitcode: -9) local_rank: 1 (pid: 201) of binary: /usr/bin/python\n")
STOPPED = ("W1206 22:40:42.225000 19089 torch/distributed/elastic/multiprocessing/api.py:1028] "
           "Sending process 200 closing signal SIGTERM\n")


def first_lives(lives: Lives) -> None:
    lives.verified(0, 200, replaced=False, attempt="0")
    lives.verified(1, 201, replaced=False, attempt="0")


def test_the_life_that_failed_is_named_once_for_its_attempt(tmp_path: Path) -> None:
    log = tmp_path / "command.log"
    log.write_text("some output of the program\n" + STOPPED + KILLED)
    lives = Lives()
    first_lives(lives)
    assert lives.take(log, 0) == []  # nobody started again yet
    lives.verified(0, 300, replaced=True, attempt="1")  # rank 0's new life says hello first
    [told] = lives.take(log, 0)
    assert (told.attempt, told.rank, told.pid, told.code, told.ranks) == (
        1, 1, 201, -signal.SIGKILL, (0,))
    assert told.reason == "was killed by SIGKILL"
    lives.verified(1, 301, replaced=True, attempt="1")  # the same restart's other life
    assert lives.take(log, 0) == []


def test_a_second_restart_reads_only_what_came_after_the_first(tmp_path: Path) -> None:
    log = tmp_path / "command.log"
    log.write_text(KILLED)
    lives = Lives()
    first_lives(lives)
    lives.verified(1, 301, replaced=True, attempt="1")
    assert lives.take(log, 0)[0].pid == 201
    with log.open("a") as f:
        f.write(KILLED.replace("exitcode: -9", "exitcode: 3").replace("pid: 201", "pid: 301"))
    lives.verified(1, 401, replaced=True, attempt="2")
    [told] = lives.take(log, 0)
    assert (told.attempt, told.rank, told.pid, told.code) == (2, 1, 301, 3)
    assert told.reason == "exited with code 3"


def test_without_the_launchers_words_the_first_rank_started_again_is_named(tmp_path: Path
                                                                           ) -> None:
    log = tmp_path / "command.log"
    log.write_text(KILLED.replace("pid: 201", "pid: 999"))  # not a pid seen as a rank
    lives = Lives()
    first_lives(lives)
    lives.verified(1, 301, replaced=True, attempt=None)  # a launcher with no attempt number
    lives.verified(0, 300, replaced=True, attempt=None)
    [told] = lives.take(log, 0)
    assert (told.attempt, told.rank, told.pid, told.code, told.ranks) == (None, 0, None, None,
                                                                          (0, 1))
    assert told.reason == "ended without saying goodbye (its launcher started it again)"


def test_a_stopped_life_is_named_only_where_no_life_failed_by_itself(tmp_path: Path) -> None:
    log = tmp_path / "command.log"
    log.write_text(KILLED.replace("exitcode: -9", "exitcode: -15").replace("201", "200"))
    lives = Lives()
    first_lives(lives)
    lives.verified(0, 300, replaced=True, attempt="1")
    [told] = lives.take(log, 0)
    assert (told.rank, told.code) == (0, -signal.SIGTERM)


def test_a_missing_log_or_a_bad_attempt_is_no_error(tmp_path: Path) -> None:
    lives = Lives()
    first_lives(lives)
    lives.verified(1, 301, replaced=True, attempt="x" * 20)
    [told] = lives.take(tmp_path / "absent.log", 0)
    assert (told.attempt, told.rank, told.code) == (None, 1, None)


def test_a_rank_the_launcher_stopped_is_stopped_in_its_current_life_only() -> None:
    lives = Lives()
    first_lives(lives)
    lives.verified(1, 301, replaced=True, attempt="1")
    log = STOPPED + STOPPED.replace("200", "201") + STOPPED.replace("200", "999")
    # Rank 0's life 200 is current: stopped; rank 1's 201 is an old life; 999 no rank's.
    assert lives.stopped(log, {0: 200, 1: 301}) == {0: (-signal.SIGTERM, 200)}


def test_a_commands_last_words_are_its_last_printable_line_cut_short() -> None:
    assert last_words("usage: torchrun ...\ntorchrun: error: no such flag\n\n  \n") == (
        "torchrun: error: no such flag")
    assert last_words("ok\n\x1b[31mred\x07\n") == "[31mred"  # shown, never obeyed
    long = last_words("x" * 5000)
    assert len(long) == LAST_WORDS_CHARS + 3 and long.endswith("...")
    assert last_words("") == last_words("\n\t\n") == ""
