"""The HTTP server of `--metrics`: GET /metrics, every connection on one asyncio loop.

Why not prometheus_client's server: it starts a thread per connection and keeps it
while the connection stays open, with no timeout. Another user holding 6,000 idle
connections to the port made a daemon 2,582 threads (RSS 37 to 106 MB), counted
against its owner's RLIMIT_NPROC and the cgroup's pids.max, so the owner's next rank
or shell could not start. Here, whatever the connections:

- threads: one runs the loop that holds every connection; RENDER_WORKERS make the
  exposition text (the registry's collect waits for the daemon's loop, which the
  event loop must never do); so 1 + RENDER_WORKERS threads in all;
- connections: at most MAX_CONNECTIONS; a newcomer beyond that closes the oldest one
  waiting for a request (none waiting: the newcomer is closed);
- with TLS, of those, at most MAX_TLS_CONNECTIONS whose handshake has begun (asyncio's
  TLS holds 256 KiB for each), the oldest waiting one closed likewise; a connection
  that never speaks holds no TLS state at all;
- time: a request's head must arrive within HEAD_S of the connection (the TLS handshake
  included) or of the previous answer (keep-alive), and an answer must be taken within
  WRITE_S, else the connection is closed;
- requests: parsed here, strictly (`parse_head`, pure): a head of at most
  MAX_HEAD_BYTES and MAX_HEADER_LINES lines, GET only, no body;
- with a credential (`--metrics-auth`, core/outlets.py), a request without it is
  answered 401 with `WWW-Authenticate` (`authorized`, pure: compared in constant
  time).

`MetricServer` is given `render(accept) -> (body, content type)`; daemon/exporter.py
gives the run's reading written out by daemon/exposition.py.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import gzip
import hashlib
import hmac
import socket
import ssl
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ddtop.core.outlets import MetricsAuth

HEAD_S = 10.0  # for a request's head, from the connection or the previous answer
WRITE_S = 10.0  # for the peer to take an answer (or a close)
MAX_CONNECTIONS = 512  # well under a default RLIMIT_NOFILE of 1,024, with the daemon's own
# With TLS, of those, the ones whose handshake has begun: asyncio's TLS holds 256 KiB
# for each (512 would be about 200 MB).
MAX_TLS_CONNECTIONS = 64
RENDER_WORKERS = 2  # threads making the exposition text (a scrape waits for the loop there)
MAX_HEAD_BYTES = 8192  # request line and headers; Prometheus sends about 300 bytes
MAX_HEADER_LINES = 64
BACKLOG = 128  # connections the kernel holds before the loop accepts them
STOP_S = 10.0  # for the loop's thread to end at close
ACCEPT_PAUSE_S = 0.1  # after an accept that failed (out of descriptors)
PATH = "/metrics"
REALM = "ddtop"
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           405: "Method Not Allowed", 431: "Request Header Fields Too Large",
           505: "HTTP Version Not Supported"}

Render = Callable[[str], tuple[bytes, str]]  # Accept header -> (body, Content-Type)


class BadRequest(ValueError):
    """A request head refused: its HTTP status, and the connection closed after it."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


@dataclass(frozen=True)
class Request:
    """A request's head, as parse_head read it."""

    method: str
    target: str
    version: str  # HTTP/1.0 or HTTP/1.1
    headers: dict[str, str]  # names in lower case; a repeated one's values joined by ", "

    @property
    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.version == "HTTP/1.0":
            return "keep-alive" in tokens
        return "close" not in tokens


def parse_head(head: bytes) -> Request:
    """A request line and its headers, ending in an empty line (CRLF line ends), or
    BadRequest: not ASCII, a malformed line, too many lines, an HTTP other than 1.0
    and 1.1, a second Authorization, a body announced (a GET has none)."""
    if len(head) > MAX_HEAD_BYTES:
        raise BadRequest(431, "request head too long")
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        raise BadRequest(400, "not ASCII") from None
    if not text.endswith("\r\n\r\n"):
        raise BadRequest(400, "no empty line after the headers")
    lines = text[:-4].split("\r\n")
    if len(lines) > MAX_HEADER_LINES + 1:
        raise BadRequest(431, "too many header lines")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[1]:
        raise BadRequest(400, "malformed request line")
    method, target, version = parts
    if not version.startswith("HTTP/"):
        raise BadRequest(400, "malformed request line")
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise BadRequest(505, f"{version} is not served")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip() or not name.isprintable():
            raise BadRequest(400, "malformed header line")  # obsolete folding included
        name, value = name.lower(), value.strip(" \t")
        if name == "authorization" and name in headers:
            raise BadRequest(400, "two Authorization headers")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
        raise BadRequest(400, "a request with a body")
    return Request(method, target, version, headers)


def authorized(auth: MetricsAuth, header: str) -> bool:
    """Whether an Authorization header's value holds `auth`'s credential. The SHA-256 of
    what was sent is compared with the secret's in constant time (hmac.compare_digest),
    so neither the secret's bytes nor its length can be timed."""
    scheme, _, credentials = header.strip().partition(" ")
    given = credentials.strip().encode("latin-1", "replace")
    if auth.scheme == "Basic":
        try:
            given = base64.b64decode(given, validate=True)
        except binascii.Error:
            given = b""
    same = hmac.compare_digest(hashlib.sha256(given).digest(), auth.digest)
    return same and scheme.lower() == auth.scheme.lower()


def verdict(request: Request, auth: MetricsAuth | None) -> int:
    """The status a request gets: 200 (a scrape to answer), 401, 405 or 404."""
    if auth is not None and not authorized(auth, request.headers.get("authorization", "")):
        return 401
    if request.method != "GET":
        return 405
    if request.target.partition("?")[0] != PATH:
        return 404
    return 200


def response(status: int, body: bytes = b"", content_type: str = "text/plain; charset=utf-8",
             keep_alive: bool = True, extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    """One HTTP/1.1 response, its head and body."""
    if status != 200 and not body:
        body = f"{status} {REASONS[status]}\n".encode()
    lines = [f"HTTP/1.1 {status} {REASONS[status]}", f"Content-Type: {content_type}",
             f"Content-Length: {len(body)}",
             f"Connection: {'keep-alive' if keep_alive else 'close'}",
             *(f"{name}: {value}" for name, value in extra)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class MetricServer:
    """GET /metrics at (host, port) on one asyncio loop in one daemon thread; `render`
    run by RENDER_WORKERS threads. OSError when it cannot listen there."""

    def __init__(self, host: str, port: int, render: Render, auth: MetricsAuth | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self._render, self._auth, self._tls = render, auth, tls
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        self._socket = socket.create_server(address[:2], family=family, backlog=BACKLOG)
        self._socket.setblocking(False)
        self.port: int = self._socket.getsockname()[1]
        self._pool = ThreadPoolExecutor(RENDER_WORKERS, thread_name_prefix="metrics-render")
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._pool)  # nothing may start threads of its own
        self._tasks: set[asyncio.Task[None]] = set()  # every connection's, until it ends
        self._open: set[asyncio.Task[None]] = set()  # those counted (not closed for another)
        self._tls_open: set[asyncio.Task[None]] = set()  # of those, past TLS' first byte
        self._waiting: dict[asyncio.Task[None], None] = {}  # for a request, oldest first
        self._stop = asyncio.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)
        self._thread.start()
        if not self._ready.wait(STOP_S):
            self.close()
            raise OSError("its server did not start")

    @property
    def connections(self) -> int:
        """Connections held now (read from another thread: a moment's count)."""
        return len(self._open)

    def close(self) -> None:
        """Stop listening, drop every connection, end the thread and the workers."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(STOP_S)
        self._socket.close()
        self._pool.shutdown(wait=True, cancel_futures=True)

    # -- the loop's thread -------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        accepting = asyncio.create_task(self._accept())
        self._ready.set()
        await self._stop.wait()
        accepting.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(accepting, *self._tasks, return_exceptions=True)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._socket)
            except OSError:  # out of descriptors, say: a pause, as asyncio's own server makes
                await asyncio.sleep(ACCEPT_PAUSE_S)
                continue
            if len(self._open) >= MAX_CONNECTIONS and not self._evict(self._open):
                conn.close()  # every one is being answered: the newcomer is turned away
                continue
            task = asyncio.create_task(self._connection(conn, loop.time() + HEAD_S))
            self._open.add(task)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _evict(self, among: set[asyncio.Task[None]]) -> bool:
        """The oldest connection of `among` waiting for a request, closed: its task
        cancelled (it closes its socket); False when none of them waits."""
        oldest = next((t for t in self._waiting if t in among), None)
        if oldest is None:
            return False
        self._forget(oldest)
        oldest.cancel()
        return True

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._open.discard(task)
        self._tls_open.discard(task)
        self._waiting.pop(task, None)

    async def _connection(self, conn: socket.socket, deadline: float) -> None:
        """One connection, until it closes or is closed; its head due by `deadline`."""
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        assert me is not None
        transport: asyncio.Transport | None = None
        try:
            self._waiting[me] = None
            if self._tls is not None:
                async with asyncio.timeout_at(deadline):
                    await self._readable(conn)
                # asyncio's TLS holds a 256 KiB buffer per connection from here on.
                if len(self._tls_open) >= MAX_TLS_CONNECTIONS and not self._evict(
                        self._tls_open):
                    return
                self._tls_open.add(me)
            reader = asyncio.StreamReader(limit=MAX_HEAD_BYTES)
            protocol = asyncio.StreamReaderProtocol(reader)
            async with asyncio.timeout_at(deadline):
                transport, _ = await loop.connect_accepted_socket(
                    lambda: protocol, conn, ssl=self._tls,
                    ssl_handshake_timeout=HEAD_S if self._tls is not None else None)
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
            await self._exchanges(me, reader, writer, deadline)
            writer.close()  # after its last answer (with TLS, a close_notify)
            await asyncio.wait_for(writer.wait_closed(), WRITE_S)
        # The peer went away, was too slow, or spoke TLS badly: its connection ends, and
        # nothing else needs to know. (One closed for a newcomer ends cancelled.)
        except (OSError, TimeoutError, EOFError, asyncio.LimitOverrunError):
            pass
        finally:
            self._forget(me)
            if transport is not None:
                transport.abort()
            conn.close()  # a transport that failed to start has let go of it already

    @staticmethod
    async def _readable(conn: socket.socket) -> None:
        """Until `conn` has bytes to read (none read): nothing is held for a peer that
        never speaks."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def wake() -> None:  # called at every pass of the loop while readable
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(conn.fileno(), wake)
        try:
            await ready
        finally:
            loop.remove_reader(conn.fileno())

    async def _exchanges(self, me: asyncio.Task[None], reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter, deadline: float) -> None:
        """Requests answered one after another, until one closes the connection; each
        head due by `deadline`, HEAD_S after the answer before it."""
        writer.transport.set_write_buffer_limits(high=0)  # drain(): until the kernel has it
        while True:
            self._waiting[me] = None
            try:
                async with asyncio.timeout_at(deadline):
                    head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.LimitOverrunError:
                await self._send(writer, response(431, keep_alive=False))
                return
            finally:
                self._waiting.pop(me, None)
            try:
                request = parse_head(head)
            except BadRequest as e:
                await self._send(writer, response(e.status, keep_alive=False))
                return
            answer = await self._answer(request)
            await self._send(writer, answer)
            if not request.keep_alive:
                return
            deadline = asyncio.get_running_loop().time() + HEAD_S

    async def _answer(self, request: Request) -> bytes:
        status, keep = verdict(request, self._auth), request.keep_alive
        if status == 200:
            body, content_type, encoding = await asyncio.get_running_loop().run_in_executor(
                self._pool, self._made, request)
            return response(200, body, content_type, keep, encoding)
        if status == 401:
            challenge = (f'Basic realm="{REALM}", charset="UTF-8"' if self._auth
                         and self._auth.scheme == "Basic" else f'Bearer realm="{REALM}"')
            return response(401, keep_alive=keep, extra=(("WWW-Authenticate", challenge),))
        return response(status, keep_alive=keep,
                        extra=(("Allow", "GET"),) if status == 405 else ())

    def _made(self, request: Request) -> tuple[bytes, str, tuple[tuple[str, str], ...]]:
        """A render worker: the body (gzipped when the scraper takes it) and its headers."""
        body, content_type = self._render(request.headers.get("accept", ""))
        codings = {c.split(";")[0].strip().lower()
                   for c in request.headers.get("accept-encoding", "").split(",")}
        if "gzip" in codings:
            return gzip.compress(body, compresslevel=6), content_type, (
                ("Content-Encoding", "gzip"),)
        return body, content_type, ()

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await asyncio.wait_for(writer.drain(), WRITE_S)
