"""The web server of `ddtop --serve`: textual-serve's, with a token and owned sessions.

textual-serve's Server serves the page, its scripts and a websocket; for each
websocket its AppService runs a command under Textual's web driver. Three
things change here (dashboard/serve.py says why):
- every route lives under /TOKEN/ (an aiohttp sub-application, so that the
  page's links carry it), and a middleware answers 403 to any request whose
  path does not start with it, compared in constant time; no response sends a
  Referer (the page loads a font from elsewhere);
- a session's command is run without a shell, in a session of its own (the
  terminal's Ctrl-C reaches the server alone), and the server keeps every one;
- the server ends on SIGINT or SIGTERM, and ends its sessions first: each is
  told to quit, then SIGTERM, then SIGKILL, and waited for. None outlives it;
- its connections pass through Doors (dashboard/doors.py): bounded per address
  and in total, each closed unless it completes a request's headers within
  HEADER_TIMEOUT_S. A newcomer beyond a bound closes the oldest that has not (on loopback the
  owner and any other user share 127.0.0.1: refusing newcomers would refuse
  the owner too); one that carried the token is never closed for another.
  What is turned away is one counted line on stderr now and then, never a
  traceback (Refusals).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import signal
import socket
from asyncio.subprocess import Process
from pathlib import Path

from aiohttp import WSMsgType, web
from aiohttp.typedefs import Handler
from textual_serve.app_service import AppService
from textual_serve.server import Server

from ddtop.core.bounds import MAX_JOB_RANKS
from ddtop.dashboard.doors import (
    ACCEPT_BACKLOG,
    KEEPALIVE_S,
    Doors,
    Limits,
    Refusals,
    counted_errors,
    raise_open_files_limit,
)

SESSION_QUIT_S = 3.0  # a session told to quit has this long to exit before SIGTERM
SESSION_TERM_S = 2.0  # ... and this long after SIGTERM before SIGKILL
SHUTDOWN_S = 2.0  # aiohttp's wait for the handlers still running when it stops
MAX_SESSIONS = 16  # browser tabs at once: each is a ddtop process
MAX_CELLS = 1000  # the most columns or lines a tab may ask for
TEMPLATES = Path(__file__).parent / "templates"  # the page (app_index.html)
# A Host header the page may use for its websocket's address (a name or address, a port).
_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?")
FORBIDDEN = ("ddtop: 403: this server answers only the link with its token, "
             "as printed when it started\n")

log = logging.getLogger("ddtop.serve")



def token_matches(path: str, token: str) -> bool:
    """`path` starts with /TOKEN/ (compared in constant time)."""
    first = path.split("/", 2)[1] if path.startswith("/") else ""
    return hmac.compare_digest(first.encode(), token.encode())


class Session(AppService):
    """One browser tab's ddtop: started without a shell, in a session of its own."""

    def __init__(self, argv: list[str], **kwargs: object) -> None:
        super().__init__(" ".join(argv), **kwargs)  # type: ignore[arg-type]
        self.argv = argv

    async def _open_app_process(self, width: int = 80, height: int = 24) -> Process:
        environment = self._build_environment(width=width, height=height)
        self._process = process = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=environment, start_new_session=True)
        assert process.stdin is not None
        self._stdin = process.stdin
        return process

    async def end(self) -> None:
        """Told to quit, then SIGTERM, then SIGKILL; waited for."""
        process = self._process
        if process is None or process.returncode is not None:
            return
        await self.send_meta({"type": "quit"})
        for then, wait_s in ((signal.SIGTERM, SESSION_QUIT_S), (signal.SIGKILL, SESSION_TERM_S)):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), wait_s)
                return
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(then)
        await process.wait()


class DashboardServer(Server):
    """textual-serve's Server: routes under /TOKEN/, sessions kept and ended."""

    def __init__(self, argv: list[str], token: str, title: str) -> None:
        # ddtop's page (dashboard/templates): no web font, and the deep links.
        super().__init__(" ".join(argv), title=title, templates_path=TEMPLATES)
        self.argv, self.token = argv, token
        self.sessions: set[Session] = set()
        self.sockets: set[web.WebSocketResponse] = set()
        self.doors: Doors | None = None  # while serving

    async def _make_app(self) -> web.Application:
        root = web.Application(middlewares=[self._guard])
        app = await super()._make_app()
        app.router.add_get("/ws/{open}", self.handle_websocket)  # a page's #rank=N, #view=
        root.add_subapp(f"/{self.token}/", app)
        root.on_response_prepare.append(self._no_referrer)
        return root

    @web.middleware
    async def _guard(self, request: web.Request,
                     handler: Handler) -> web.StreamResponse:
        """403 and the connection closed without the token; with it, the connection
        is the owner's, never closed for another (Doors.answered)."""
        matches = token_matches(request.path, self.token)
        if self.doors is not None:
            self.doors.answered(request.protocol, trusted=matches)
        if not matches:
            forbidden = web.HTTPForbidden(text=FORBIDDEN)
            forbidden.force_close()
            raise forbidden
        return await handler(request)

    @staticmethod
    async def _no_referrer(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["Referrer-Policy"] = "no-referrer"

    async def on_startup(self, app: web.Application) -> None:
        """serve.py prints what to open (textual-serve prints its logo here)."""

    async def handle_index(self, request: web.Request) -> web.StreamResponse:
        """The page, its websocket's address the one the browser used (through an
        SSH tunnel, or a wildcard bind, the server's own would not be)."""
        if not _HOST.fullmatch(request.host):
            raise web.HTTPBadRequest(text="ddtop: a Host header that is no address\n")
        self.public_url = f"http://{request.host}"
        response: web.StreamResponse = await super().handle_index(request)
        return response

    async def handle_websocket(self, request: web.Request) -> web.WebSocketResponse:
        """textual-serve's, with a Session kept by the server until it ends."""
        if len(self.sessions) >= MAX_SESSIONS:
            raise web.HTTPServiceUnavailable(
                text=f"ddtop: {MAX_SESSIONS} pages are open already: close one\n")
        websocket = web.WebSocketResponse(heartbeat=15)
        width = _size(request.query.get("width"), 80)
        height = _size(request.query.get("height"), 24)
        session: Session | None = None
        try:
            await websocket.prepare(request)
            self.sockets.add(websocket)
            session = Session(self.argv + opened(request.match_info.get("open")),
                              write_bytes=websocket.send_bytes,
                              write_str=websocket.send_str, close=websocket.close,
                              download_manager=self.download_manager)
            self.sessions.add(session)
            await session.start(width, height)
            await self._process_messages(websocket, session)
        except asyncio.CancelledError:
            await websocket.close()
        except (OSError, RuntimeError) as e:  # a tab gone mid-message
            log.warning("ddtop: a browser session ended: %s", e)
        finally:
            self.sockets.discard(websocket)
            if session is not None:
                await session.end()
                await session.stop()
                self.sessions.discard(session)
        return websocket

    async def _process_messages(self, websocket: web.WebSocketResponse,
                                app_service: AppService) -> None:
        """What the page sends, checked (textual-serve's asserts and indexes it): keys,
        a new size, a ping, focus. Anything else is dropped."""
        async for message in websocket:
            if message.type != WSMsgType.TEXT:
                continue
            try:
                envelope = json.loads(message.data)
            except (ValueError, RecursionError):  # not JSON; nested past the parser's depth
                continue
            match envelope:
                case ["stdin", str(keys)]:
                    await app_service.send_bytes(keys.encode("utf-8", "replace"))
                case ["resize", {"width": int(width), "height": int(height)}]:
                    await app_service.set_terminal_size(_size(width, 80), _size(height, 24))
                case ["ping", str(data)]:
                    await websocket.send_json(["pong", data])
                case ["blur"]:
                    await app_service.blur()
                case ["focus"]:
                    await app_service.focus()

    def run(self, sock: socket.socket) -> None:
        """Serve on `sock` until SIGINT or SIGTERM; then every session ends."""
        asyncio.run(self._serve(sock))

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        refusals = Refusals(loop)
        self.doors = doors = Doors(Limits.for_open_files(raise_open_files_limit()), refusals)
        runner = web.AppRunner(await self._make_app(), handle_signals=False, access_log=None,
                               shutdown_timeout=SHUTDOWN_S, keepalive_timeout=KEEPALIVE_S)
        await runner.setup()
        assert runner.server is not None
        ended = asyncio.Event()
        for number in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(number, ended.set)
        with counted_errors(loop, refusals):
            # aiohttp's SockSite, with every connection through the doors.
            listening = await loop.create_server(doors.wrap(runner.server), sock=sock,
                                                 backlog=ACCEPT_BACKLOG)
            try:
                await ended.wait()
            finally:
                listening.close()
                await asyncio.gather(*(session.end() for session in list(self.sessions)))
                for websocket in list(self.sockets):
                    await websocket.close()
                await runner.cleanup()
                refusals.say()


def opened(asked: str | None) -> list[str]:
    """The session's ddtop options for what a page's address asked (its #rank=N: rank-N,
    its #view=map: view-map), checked; nothing for anything else."""
    if asked is None:
        return []
    what, _, value = asked.partition("-")
    if (what == "rank" and value.isascii() and value.isdigit() and len(value) <= 6
            and int(value) < MAX_JOB_RANKS):
        return ["--rank", str(int(value))]
    if what == "view" and value in ("map", "table"):
        return ["--view", value]
    return []


def _size(given: str | int | None, default: int) -> int:
    """A terminal size the browser sent, within reason."""
    try:
        return max(1, min(MAX_CELLS, int(given or default)))
    except ValueError:
        return default
