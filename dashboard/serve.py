"""`ddtop --serve [HOST:]PORT [RUN]`: the dashboard in a browser.

    ddtop --serve 8000 RUN             on 127.0.0.1:8000; open the link it prints
    ddtop --serve 0.0.0.0:8000 RUN     on every address of this machine
    ddtop --serve 8000 --replay RUN    a recorded run, played back in each tab

textual-serve serves a page, and runs a command for every browser tab that
connects to it (a websocket): here that command is `ddtop` itself, the same
RUN (resolved once, when the server starts) and the same options, under
Textual's web driver. Nothing of the dashboard is written twice: a tab shows
the app a terminal shows. Each tab is a session of its own, ended when the
tab closes, and all of them when the server ends (Ctrl-C).

A page is easier to reach than a terminal, so:
- every address the server answers starts with an unguessable token
  (secrets.token_urlsafe, printed once on start, as Jupyter's): a request
  without it (the page, its websocket, its scripts) gets 403, the token
  compared in constant time. On loopback too: the run directory is the
  owner's alone, and a port on 127.0.0.1 is open to every user of the machine;
- the server binds to 127.0.0.1 unless a HOST is given;
- no user can shut the owner out by holding connections: each must complete
  a request's headers within 3 s; they are bounded per address and in total,
  the oldest without a request closed for a newcomer beyond a bound, those
  that carried the token never (dashboard/sessions.py: Doors); what is turned
  away is one counted line on stderr now and then, never a traceback;
- a session cannot stop the run (`ddtop --no-stop`) unless --allow-stop.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import socket
import sys
from dataclasses import dataclass

from ddtop.core.contract import UsageError
from ddtop.core.rundir import RunPaths

DEFAULT_HOST = "127.0.0.1"
TOKEN_BYTES = 32  # secrets.token_urlsafe: 43 characters, 256 bits
INSTALL_HINT = "pip install 'ddtop[serve]'"
BACKLOG = 16  # until the server's loop starts; then sessions.ACCEPT_BACKLOG
_WILDCARDS = ("0.0.0.0", "::")


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    @property
    def wildcard(self) -> bool:
        return self.host in _WILDCARDS

    def url(self, token: str) -> str:
        """The link to open: this machine's name for a wildcard bind."""
        host = socket.gethostname() if self.wildcard else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/{token}/"


def parse_address(text: str) -> Address:
    """`[HOST:]PORT`, an IPv6 HOST in brackets: `8000`, `0.0.0.0:8000`, `[::1]:8000`.
    PORT 0 takes a free port (the link printed says which)."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host = DEFAULT_HOST
    elif host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 address without brackets: the port is ambiguous
    if not host or not port_text.isdecimal() or int(port_text) > 65535 or any(
            c.isspace() or c in "/[]@?#" for c in host):
        raise UsageError(f"--serve {text!r}: expected [HOST:]PORT, e.g. 8000, "
                         "0.0.0.0:8000 or [::1]:8000 (PORT from 0 to 65535)")
    return Address(host, int(port_text))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen(address: Address) -> tuple[socket.socket, Address]:
    """A listening socket on `address`, and the address it got (PORT 0: the port the
    system picked). Every way it can fail, in one line."""
    where = f"{address.host}:{address.port}"
    try:
        infos = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise UsageError(f"--serve {where}: cannot resolve {address.host!r} "
                         f"({getattr(e, 'strerror', None) or e})") from None
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        reason = {errno.EADDRINUSE: f"port {address.port} is in use there: pick another PORT",
                  errno.EADDRNOTAVAIL: f"{address.host} is not an address of this machine",
                  errno.EACCES: f"port {address.port} needs privileges: pick one above 1023",
                  }.get(e.errno or 0, e.strerror or str(e))
        raise UsageError(f"--serve {where}: cannot listen: {reason}") from None
    sock.setblocking(False)
    return sock, Address(address.host, int(sock.getsockname()[1]))


def session_command(args: argparse.Namespace, paths: RunPaths | None) -> list[str]:
    """The command each browser tab runs: this ddtop with the run already found
    (its directory, or --connect's endpoint) and the same options that apply;
    --no-stop unless --allow-stop."""
    command = [sys.executable, "-m", "ddtop.dashboard"]
    if paths is None:
        command += ["--connect", args.connect]
    else:
        command.append(str(paths.root.resolve()))
    if args.replay:
        command.append("--replay")
    if args.speed is not None:
        command += ["--speed", repr(args.speed)]
    command += ["--wait", repr(args.wait), "--fps", repr(args.fps)]
    if not args.allow_stop:
        command.append("--no-stop")
    return command


def serve(args: argparse.Namespace, paths: RunPaths | None) -> int:
    """Serve until Ctrl-C (or SIGTERM): 0. Bad input: UsageError, before anything
    is served."""
    import secrets

    address = parse_address(args.serve)
    try:
        from ddtop.dashboard.sessions import DashboardServer
    except ImportError as e:
        raise UsageError(f"--serve needs textual-serve ({e.name or e} is missing): "
                         f"{INSTALL_HINT}") from None
    sock, address = listen(address)
    token = secrets.token_urlsafe(TOKEN_BYTES)
    what = f"run {paths.run_id}" if paths is not None else args.connect
    stop = ("on" if args.allow_stop else "off (--allow-stop turns it on)")
    print(f"ddtop: serving {what} at {address.url(token)}\n"
          f"ddtop: open that link (its token is the key: share it as a password); "
          f"stopping the run from the page is {stop}; Ctrl-C ends the server and its "
          "sessions", flush=True)
    if not is_loopback(address.host):
        print(f"ddtop: note: {address.host} is reachable beyond this machine, and the page is "
              "plain HTTP: an SSH tunnel to 127.0.0.1 is safer (docs/dashboard.md)",
              file=sys.stderr, flush=True)
    server = DashboardServer(session_command(args, paths), token, title=f"ddtop {what}")
    server.run(sock)
    return 0
