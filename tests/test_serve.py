"""`ddtop --serve`: the dashboard in a real headless Chromium.

The in-process tests check the address, the token and the errors. The browser
tests share one Chromium (Debian's, driven by Playwright; skipped, naming what
is missing, where either is absent) and two servers:
- a recorded run replayed (tests/fixtures/runs/recorded-ok), bound beyond
  loopback (this machine's own non-loopback address, else 0.0.0.0): the page
  shows the ranks table; without the token the page, its script and its
  websocket get 403;
- a live 2-rank run on loopback: `x` in the page says stopping is off and the
  run keeps training; Ctrl-C ends the server and every session it started,
  and the run goes on.
Textual's page draws the terminal with xterm.js on a canvas: the text is read
from xterm's own buffer (what the canvas paints), its Terminal found as it is
built (a setter for the `_core` it assigns, installed before the page loads).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import BIN, Detached, running, tagged_env, tagged_pids, wait_until_gone

from ddtop.core.contract import UsageError
from ddtop.dashboard import cli
from ddtop.dashboard.serve import Address, parse_address, session_command
from ddtop.dashboard.sessions import opened

DDTOP = str(BIN / "ddtop")
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
RECORDED = Path(__file__).parent / "fixtures" / "runs" / "recorded-ok"
RUN = "served"
START_TIMEOUT_S = 30.0  # the server's first line
PAGE_TIMEOUT_S = 30.0  # the page's terminal shows what is waited for
SERVER_END_S = 15.0  # Ctrl-C: the server and its sessions gone
BROWSER_TIMEOUT_MS = 30_000

# Installed before any script of the page: xterm's Terminal assigns `this._core`
# in its constructor; the setter keeps the terminal (the one with loadAddon) in
# window.__terminals and makes `_core` an ordinary property of that object again.
FIND_TERMINAL = """
window.__terminals = [];
Object.defineProperty(Object.prototype, '_core', {
  configurable: true,
  set(value) {
    Object.defineProperty(this, '_core', {value, writable: true, configurable: true,
                                          enumerable: true});
    if (typeof this.loadAddon === 'function') window.__terminals.push(this);
  },
});
"""
SCREEN_TEXT = """() => {
  const terminal = window.__terminals[0];
  if (!terminal) return '';
  const buffer = terminal.buffer.active, lines = [];
  for (let i = 0; i < buffer.length; i++) lines.push(buffer.getLine(i).translateToString(true));
  return lines.join('\\n');
}"""


# -- in process: the address, the token, the command, the errors ---------------------
def test_addresses() -> None:
    assert parse_address("8000") == Address("127.0.0.1", 8000)
    assert parse_address("0.0.0.0:0") == Address("0.0.0.0", 0)
    assert parse_address("[::1]:8000") == Address("::1", 8000)
    assert parse_address("localhost:65535") == Address("localhost", 65535)
    for bad in ("", "http", "80a", "65536", "::1:8000", "host:", ":8000", "a/b:80", "-1",
                "[::1]8000", "a b:80"):
        with pytest.raises(UsageError, match=r"expected \[HOST:\]PORT"):
            parse_address(bad)


def test_token_is_the_first_segment_of_the_path() -> None:
    pytest.importorskip("textual_serve", reason="textual-serve is not installed: the serve extra")
    from ddtop.dashboard.sessions import token_matches

    token = "abc_DEF-123"
    assert token_matches(f"/{token}/", token)
    assert token_matches(f"/{token}/static/js/textual.js", token)
    for path in ("/", "", f"/{token}x/", f"/x{token}/", "/abc_DEF-12/", f"/static/{token}/",
                 f"{token}/", f"//{token}/"):
        assert not token_matches(path, token), path


def test_sessions_run_ddtop_on_the_same_run_without_stop() -> None:
    args = cli.build_parser().parse_args(["--serve", "0", "--replay", "--speed", "0", "x"])
    paths = cli.RunPaths(RECORDED)
    command = session_command(args, paths)
    assert command[:3] == [sys.executable, "-m", "ddtop.dashboard"]
    assert command[3] == str(RECORDED.resolve())
    assert "--no-stop" in command and "--serve" not in command
    assert command[command.index("--speed") + 1] == "0.0"
    allowed = cli.build_parser().parse_args(["--serve", "0", "--allow-stop", "x"])
    assert "--no-stop" not in session_command(allowed, paths)


def _main_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert cli.main(list(argv)) == 2
    err: str = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ddtop: error: "), err
    return err


def test_bad_flags_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    run = str(RECORDED)
    assert "expected [HOST:]PORT" in _main_error(capsys, "--serve", "nowhere:http", run)
    assert "drop --headless" in _main_error(capsys, "--serve", "0", "--headless", run)
    assert "--allow-stop is for --serve" in _main_error(capsys, "--allow-stop", run)
    assert "cannot resolve" in _main_error(capsys, "--serve", "no-such-host.invalid:0", run)
    assert "not an address of this machine" in _main_error(capsys, "--serve", "192.0.2.1:0", run)


def test_port_in_use_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _main_error(capsys, "--serve", f"127.0.0.1:{port}", "--replay", str(RECORDED))
    assert f"port {port} is in use" in err


def test_without_textual_serve(capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Where textual-serve is not installed: one line naming the extra to install."""
    monkeypatch.delitem(sys.modules, "ddtop.dashboard.sessions", raising=False)
    for name in [*(name for name in sys.modules if name.startswith("textual_serve.")),
                 "textual_serve"]:
        monkeypatch.setitem(sys.modules, name, None)  # None: import raises ImportError
    err = _main_error(capsys, "--serve", "0", "--replay", str(RECORDED))
    assert "--serve needs textual-serve" in err and "ddtop[serve]" in err


# -- a real browser -------------------------------------------------------------------
@dataclass
class Server:
    proc: subprocess.Popen[str]
    tag: str
    base: str  # http://HOST:PORT, as the browser reaches it
    token: str
    lines: queue.Queue[str]
    stderr: Path

    @property
    def url(self) -> str:
        return f"{self.base}/{self.token}/"

    def sessions(self) -> list[int]:
        """The ddtop processes the server started (its tag, not its pid)."""
        return [pid for pid in tagged_pids(self.tag) if pid != self.proc.pid]

    def end(self) -> list[int]:
        """Ctrl-C; what is left of the server and its sessions after SERVER_END_S."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=SERVER_END_S)
        left = wait_until_gone(self.tag, timeout=1.0)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        return left


@contextlib.contextmanager
def serving(cwd: Path, bind: str, reach: str, *args: str,
            open_files: int | None = None) -> Iterator[Server]:
    """`ddtop --serve BIND:0 ARGS`, reached at REACH:PORT; Ctrl-C afterwards. With
    `open_files`, the server's open-files limit, soft and hard, is that."""
    tag = uuid.uuid4().hex
    stderr = cwd / f"serve-{tag}.err"

    def limit() -> None:  # in the child, before ddtop starts
        if open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    with stderr.open("w") as err:
        proc = subprocess.Popen([DDTOP, "--serve", f"{bind}:0", *args], cwd=cwd, text=True,
                                env=tagged_env(tag), stdout=subprocess.PIPE, stderr=err,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=limit if open_files is not None else None)
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout],  # type: ignore[union-attr]
                     daemon=True).start()
    server = None
    try:
        try:
            first = lines.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"no link within {START_TIMEOUT_S} s: "
                                 f"{stderr.read_text()}") from None
        found = re.search(r" at http://(\S+):(\d+)/([\w-]{43})/$", first.strip())
        assert found is not None, first
        server = Server(proc, tag, f"http://{reach}:{found.group(2)}", found.group(3), lines,
                        stderr)
        yield server
    finally:
        left = server.end() if server is not None else wait_until_gone(tag, timeout=0)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert left == [], f"left running: {left}"


def outside_address() -> str | None:
    """This machine's own address beyond loopback, if it has one (nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route is looked up
        except OSError:
            return None
        host: str = probe.getsockname()[0]
    return None if host.startswith("127.") or host == "0.0.0.0" else host


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian's chromium package)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright (python) is not installed: the test extra")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS,
                                              timeout=BROWSER_TIMEOUT_MS)
        try:
            yield chromium
        finally:
            chromium.close()


@contextlib.contextmanager
def page_of(browser: Any, url: str) -> Iterator[Any]:
    page = browser.new_page(viewport={"width": 1600, "height": 900})
    page.set_default_timeout(BROWSER_TIMEOUT_MS)
    page.add_init_script(FIND_TERMINAL)
    try:
        response = page.goto(url)
        assert response is not None and response.status == 200
        yield page
    finally:
        page.close()


def screen_until(page: Any, pattern: str) -> str:
    """The terminal's text once `pattern` (a regex, multiline) is found in it."""
    deadline = time.monotonic() + PAGE_TIMEOUT_S
    text = ""
    while time.monotonic() < deadline:
        text = page.evaluate(SCREEN_TEXT)
        if re.search(pattern, text, re.MULTILINE):
            return text
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} not in the page within {PAGE_TIMEOUT_S} s:\n{text}")


def status_code(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                    timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The recorded run, at once (--speed 0), served beyond loopback."""
    cwd = tmp_path_factory.mktemp("serve-replay")
    outside = outside_address()
    with serving(cwd, outside or "0.0.0.0", outside or "127.0.0.1", "--replay", "--speed",
                 "0", str(RECORDED)) as server:
        yield server


RANK_ROW = r"^\s+{rank}\s+\S+\s+\S+\s+(succeeded|running|finished)"


@pytest.mark.processes
def test_the_page_shows_the_ranks_table(browser: Any, replayed: Server) -> None:
    with page_of(browser, replayed.url) as page:
        text = screen_until(page, RANK_ROW.format(rank=1))
    assert "ddtop run recorded-ok" in text
    assert re.search(r"^\s+RANK\S*\s+HOST\s+DEVICE\s+STATE", text, re.MULTILINE), text
    assert re.search(RANK_ROW.format(rank=0), text, re.MULTILINE), text


@pytest.mark.processes
def test_the_page_asks_nothing_of_another_machine(browser: Any, replayed: Server) -> None:
    """No web font (textual-serve's page asks Google for one: a page that waits on the
    internet, or leaks that it was opened): every request goes to the server itself."""
    page = browser.new_page(viewport={"width": 1600, "height": 900})
    asked: list[str] = []
    page.on("request", lambda request: asked.append(request.url))
    page.add_init_script(FIND_TERMINAL)
    try:
        page.goto(replayed.url)
        screen_until(page, RANK_ROW.format(rank=1))
    finally:
        page.close()
    origin = urllib.parse.urlsplit(replayed.url).netloc
    assert asked and all(urllib.parse.urlsplit(url).netloc == origin for url in asked), asked
    assert any(url.endswith("/static/js/textual.js") for url in asked), asked


@pytest.mark.processes
def test_a_deep_link_opens_a_rank_or_a_view(browser: Any, replayed: Server) -> None:
    """#rank=1 opens rank 1's detail, #view=map the rank map: a link to paste in a chat."""
    with page_of(browser, replayed.url + "#rank=1") as page:
        text = screen_until(page, r"^\s*rank 1\s+finished")
    assert "per step (ms)" in text and not re.search(RANK_ROW.format(rank=0), text, re.M)
    with page_of(browser, replayed.url + "#view=map") as page:
        text = screen_until(page, r"cursor r0")  # the map's line under its legend
    assert not re.search(RANK_ROW.format(rank=0), text, re.MULTILINE), text
    with page_of(browser, replayed.url + "#rank=x") as page:  # not a rank: the table
        screen_until(page, RANK_ROW.format(rank=1))


def test_what_a_deep_link_asks_is_checked() -> None:
    assert opened("rank-3") == ["--rank", "3"] and opened("view-map") == ["--view", "map"]
    assert opened("view-table") == ["--view", "table"] and opened(None) == []
    for bad in ("rank-", "rank--1", "rank-1e3", "rank-9999999", "rank-65536", "view-x",
                "x-1", "rank-3;rm", "", "rank-٣"):
        assert opened(bad) == [], bad


@pytest.mark.processes
def test_without_the_token_nothing_is_served(browser: Any, replayed: Server) -> None:
    base, token = replayed.base, replayed.token
    assert not base.startswith("http://127.") or outside_address() is None  # beyond loopback
    assert "reachable beyond this machine" in replayed.stderr.read_text()
    assert status_code(f"{base}/{token}/static/js/textual.js") == 200  # the server answers
    near = token[:-1] + ("A" if token[-1] != "A" else "B")
    upgrade = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
    for path in ("/", "/static/js/textual.js", "/static/", "/download/x", f"/{near}/",
                 f"/{near}/static/js/textual.js", f"/?token={token}", f"/static/{token}/",
                 f"/{token.lower()}/"):
        assert status_code(base + path) == 403, path
    for path in ("/ws", f"/{near}/ws"):
        assert status_code(base + path, upgrade) == 403, path
    page = browser.new_page()
    try:
        response = page.goto(base + "/")
        assert response is not None and response.status == 403
        assert "403" in page.content() and "xterm" not in page.content()
    finally:
        page.close()


async def _talk(url: str, frames: list[str]) -> list[Any]:
    """Open the page's websocket as a client, send `frames`, then a ping: what comes
    back as text (the pong, if the session survived what came before)."""
    import aiohttp

    async with aiohttp.ClientSession() as client, client.ws_connect(url) as ws:
        for frame in frames:
            await ws.send_str(frame)
        await ws.send_str('["ping", "after"]')
        async with asyncio.timeout(PAGE_TIMEOUT_S):
            async for message in ws:
                if message.type == aiohttp.WSMsgType.TEXT:
                    return [json.loads(message.data)]
        return []


@pytest.mark.processes
def test_what_a_page_sends_is_checked(replayed: Server) -> None:
    """A token holder's client that sends nonsense on the websocket: dropped, one by
    one; the session goes on (the ping after it is answered)."""
    url = replayed.url.replace("http://", "ws://") + "ws?width=80&height=24"
    nonsense = ["not json", "{}", "[]", '"stdin"', '["stdin", 5]', '["resize", {"width": "x"}]',
                '["resize", {"width": 1e9, "height": -1}]', '["resize", [1, 2]]', '["ping"]',
                '["resize", {"width": 100000000, "height": 100000000}]', "[" * 10_000]
    answers: list[Any] = []
    # A thread of its own: Playwright's sync API keeps an event loop in this one.
    talker = threading.Thread(target=lambda: answers.extend(asyncio.run(_talk(url, nonsense))))
    talker.start()
    talker.join(PAGE_TIMEOUT_S + 10)
    assert answers == [["pong", "after"]]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Detached, Server]]:
    """A live 2-rank run, served on loopback."""
    cwd = tmp_path_factory.mktemp("serve-live")
    with running(cwd, RUN, "-n", "2", "--epochs", "1000", "--step-delay", "0.05") as run, \
            serving(cwd, "127.0.0.1", "127.0.0.1", str(cwd / "runs" / RUN)) as server:
        yield run, server


def _step(run: Detached) -> int:
    return min(rank["global_step"] for rank in run.status(RUN)["ranks"])


@pytest.mark.processes
def test_the_stop_key_does_nothing_in_a_page(browser: Any,
                                             live: tuple[Detached, Server]) -> None:
    run, server = live
    with page_of(browser, server.url) as page:
        screen_until(page, RANK_ROW.format(rank=1).replace("(succeeded|running|finished)",
                                                           "running"))
        page.focus(".xterm-helper-textarea")
        page.keyboard.press("x")
        screen_until(page, r"stopping is off in this dashboard")
        page.keyboard.press("y")  # what would confirm a stop
        page.keyboard.press("e")  # nor is the evidence gathered from a page
        screen_until(page, r"evidence is off in this dashboard")
        before = _step(run)
        run.wait_for(RUN, lambda s: s["status"] == "running"
                     and min(r["global_step"] for r in s["ranks"]) > before + 2)
    assert not (run.cwd / "runs" / RUN / "evidence").exists()


@pytest.mark.processes
def test_ctrl_c_ends_the_server_and_its_sessions(browser: Any,
                                                 live: tuple[Detached, Server]) -> None:
    run, server = live
    with page_of(browser, server.url) as page, page_of(browser, server.url) as other:
        for shown in (page, other):
            screen_until(shown, RANK_ROW.format(rank=0))
        assert len(server.sessions()) == 2
        started = time.monotonic()
        assert server.end() == []
        assert server.proc.returncode == 0
        took = time.monotonic() - started
        assert took < SERVER_END_S
        for shown in (page, other):  # the page says its session ended
            shown.wait_for_selector("body.-closed", state="attached")
    assert run.status(RUN)["status"] == "running"  # the run goes on
