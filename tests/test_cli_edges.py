"""ddtop and `ddtrain status` at the edges, with real processes: a run's CURVE
keys damaged in every shape a copy can take, a run watched before it exists,
and a daemon that does not answer.

One detached 1-rank run over TCP (`--bind 127.0.0.1`, so it has keys) is shared;
a damaged key is tried on a copy of its folder (run.json and config.json: the
same live daemon), so the run itself keeps its good keys.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import BIN, DDTRAIN, Detached, ddtrain, finish, running, start, tagged_env

from ddtop.core.contract import UsageError
from ddtop.core.keys import RunKeys

pytestmark = pytest.mark.processes  # every test here starts processes, or shares a run that does

DDTOP = str(BIN / "ddtop")
RUN = "edges"
COMMAND_TIMEOUT_S = 30  # a command that hangs (what damaged keys did) fails the test here


@pytest.fixture(scope="module")
def over_tcp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Detached, Path]]:
    cwd = tmp_path_factory.mktemp("edges")
    with running(cwd, RUN, "-n", "1", "--epochs", "200",
                 "--step-delay", "0.05", "--bind", "127.0.0.1") as run:
        yield run, cwd / "runs" / RUN


# -- damaged keys --------------------------------------------------------------------
SHAPES = ("empty", "truncated secret", "truncated public", "garbage", "wrong length",
          "not z85", "missing", "a directory", "another pair's secret")


def _secret_key(text: str) -> str:
    found = re.search(r'secret-key = "(.*)"', text)
    assert found is not None, text
    return found.group(1)


def damaged_copy(keys: Path, into: Path, shape: str) -> Path:
    """A copy of the keys folder `keys` at `into`, one file damaged as `shape`: that file."""
    shutil.copytree(keys, into)
    secret, public = into / "client.key_secret", into / "server.key"
    text, key = secret.read_text(), _secret_key(secret.read_text())
    if shape == "empty":
        secret.write_bytes(b"")
    elif shape == "truncated secret":  # cut inside the secret key
        secret.write_text(text[:text.index(key) + 20])
    elif shape == "truncated public":
        public.write_text(public.read_text()[:public.read_text().index("public-key") + 30])
        return public
    elif shape == "garbage":
        secret.write_bytes(bytes(range(256)) * 4)
    elif shape == "wrong length":  # valid Z85, 45 characters: 36 bytes
        secret.write_text(text.replace(key, key + "abcde"))
    elif shape == "not z85":  # '~' is not in the Z85 alphabet
        secret.write_text(text.replace(key, "~" + key[1:]))
    elif shape == "missing":
        public.unlink()
        return public
    elif shape == "a directory":
        secret.unlink()
        secret.mkdir()
    elif shape == "another pair's secret":  # a sound key, but not the public key's
        other = into.parent / f"{into.name}-other"
        RunKeys.create(other)
        secret.write_text(text.replace(key, _secret_key(
            (other / "client.key_secret").read_text())))
    else:
        raise AssertionError(shape)
    return secret


def test_every_damaged_key_file_is_named_at_load(tmp_path: Path) -> None:
    good = tmp_path / "good"
    RunKeys.create(good)
    RunKeys.load(good)
    RunKeys.load(good, server=True)
    for n, shape in enumerate(SHAPES):
        folder = tmp_path / f"damaged-{n}"
        path = damaged_copy(good, folder, shape)
        with pytest.raises(UsageError) as raised:
            RunKeys.load(folder)
        message = str(raised.value)
        assert message.startswith(f"the run's CURVE key file {path} "), (shape, message)
        assert "\n" not in message and "copy the run's keys folder" in message, shape


def run_together(commands: list[tuple[list[str], dict[str, str]]]
                 ) -> list[subprocess.CompletedProcess[str]]:
    """The commands at once, each with COMMAND_TIMEOUT_S: a hang fails, killed."""
    procs = [subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
             for cmd, env in commands]
    done = []
    for proc, (cmd, _) in zip(procs, commands, strict=True):
        try:
            out, err = proc.communicate(timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.communicate()
            raise AssertionError(f"{' '.join(cmd)} hung past {COMMAND_TIMEOUT_S} s") from None
        done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    return done


def test_damaged_keys_are_one_line_naming_the_file_and_exit_2(
        over_tcp: tuple[Detached, Path], tmp_path: Path) -> None:
    """Each damage shape, on a copy of the live run's folder, through `ddtop --headless
    RUN --wait 2`, `ddtop --connect` with DDTOP_KEYS, or `ddtrain status`: one line
    naming the key file, exit 2 (before: a silent hang for good, tracebacks, or
    'does not answer (Invalid argument)')."""
    run, root = over_tcp
    control = json.loads((root / "run.json").read_text())["endpoints"]["control"]
    env = tagged_env(run.tag)
    commands, expected = [], []
    for n, shape in enumerate(SHAPES):
        copy = tmp_path / str(n) / RUN
        copy.mkdir(parents=True)
        for name in ("run.json", "config.json"):
            shutil.copy2(root / name, copy / name)
        path = damaged_copy(root / "keys", copy / "keys", shape)
        # Each shape by one of the three commands in turn (every shape is read by the
        # same RunKeys.load, tried on each above): 3 shapes each, 9 processes in all.
        commands.append([
            ([DDTOP, "--headless", str(copy), "--wait", "2"], env),
            ([DDTOP, "--headless", "--connect", control, "--wait", "2"],
             {**env, "DDTOP_KEYS": str(copy / "keys")}),
            ([DDTRAIN, "status", str(copy)], env),
        ][n % 3])
        expected.append((shape, "ddtrain" if n % 3 == 2 else "ddtop", path))
    started = time.monotonic()
    results = run_together(commands)  # all at once: a hang costs COMMAND_TIMEOUT_S once
    print(f"{len(commands)} commands at once: {time.monotonic() - started:.1f} s")
    for result, (shape, prog, path) in zip(results, expected, strict=True):
        said = f"{shape}: {' '.join(result.args)}: {result.stdout}{result.stderr}"
        assert result.returncode == 2, said
        assert result.stdout == "", said
        assert result.stderr.startswith(f"{prog}: error: the run's CURVE key file {path} "), said
        assert len(result.stderr.strip().splitlines()) == 1, said
    assert run.status(RUN)["status"] == "running"  # the run's own keys were never touched


# -- a daemon that does not answer ----------------------------------------------------
def test_status_says_when_the_daemon_does_not_answer(over_tcp: tuple[Detached, Path]) -> None:
    """A daemon stopped (SIGSTOP): `ddtrain status` says that the daemon (pid N) does
    not answer and that what follows is run.json's last record; --json says so in
    `daemon_answered`. Then SIGCONT, and the run answers again."""
    run, root = over_tcp
    pid = json.loads((root / "run.json").read_text())["daemon_pid"]
    assert run.status(RUN)["daemon_answered"] is True
    os.kill(pid, signal.SIGSTOP)
    try:
        text = run.cli("status", RUN)
        doc = run.cli("status", RUN, "--json")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert text.returncode == 0 and doc.returncode == 0, text.stderr + doc.stderr
    warning = text.stderr.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith(
        f"ddtrain: warning: the daemon (pid {pid}) does not answer"), text.stderr
    assert "last record" in warning[0]
    assert text.stdout.startswith(f"run {RUN}: running (daemon pid {pid}, not answering; ")
    status = json.loads(doc.stdout)
    assert status["daemon_answered"] is False and status["daemon_alive"] is True
    assert status["status"] == "running"
    assert run.status(RUN)["daemon_answered"] is True  # continued: it answers again


# -- a run watched before it exists ---------------------------------------------------
def test_ddtop_waits_for_a_run_that_does_not_exist_yet_and_follows_it(tmp_path: Path) -> None:
    """`ddtop --headless --wait 30 late` started before the run (as CI and a multi-node
    job's node 0 start it): one line says it waits; then the run starts, and ddtop
    follows it live and exits with its outcome (1: a rank raised). Before: exit 2 at
    once, 'no runs under runs/'."""
    watcher, tag = start([DDTOP, "--headless", "--format", "jsonl", "--interval", "0.5",
                          "--wait", "30", "late"], tmp_path)
    assert watcher.stderr is not None
    ready, _, _ = select.select([watcher.stderr], [], [], COMMAND_TIMEOUT_S)
    first = watcher.stderr.readline() if ready else ""
    if not first.startswith("ddtop: waiting up to 30 s for run 'late' to appear under runs/"):
        finish(watcher, tag, timeout=1)  # what it said instead, or that it hung
        raise AssertionError(f"no waiting line: {first!r}")
    run = ddtrain("start", "--foreground", "-n", "1", "--epochs", "1", "--run-id", "late",
                  "--inject", "0:raise@step=150", cwd=tmp_path)
    assert run.returncode == 1 and run.leftovers == [], run.stderr
    watched = finish(watcher, tag, timeout=COMMAND_TIMEOUT_S)
    assert watched.returncode == 1, watched.stderr
    lines = [json.loads(line) for line in watched.stdout.splitlines()]
    assert any(r["kind"] == "progress" and r["status"] == "running" for r in lines), lines
    assert lines[-1]["kind"] == "summary" and lines[-1]["status"] == "failed"
    assert watched.stderr == ""  # the waiting line was read above; nothing else


def test_ddtop_gives_up_on_a_run_that_does_not_appear_within_wait(tmp_path: Path) -> None:
    started = time.monotonic()
    result = subprocess.run([DDTOP, "--headless", "--wait", "2", "never"], cwd=tmp_path,
                            env=tagged_env("ddtop"), text=True, capture_output=True,
                            stdin=subprocess.DEVNULL, timeout=COMMAND_TIMEOUT_S)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "ddtop: waiting up to 2 s for run 'never' to appear under runs/ (--wait)",
        "ddtop: error: no run 'never' appeared under runs/ within 2 s: start it, or check "
        "the run id and --runs-dir (--wait S waits longer)"]
    assert time.monotonic() - started >= 2
