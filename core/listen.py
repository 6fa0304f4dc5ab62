"""`[HOST:]PORT`, as `--metrics` takes it: where an HTTP server of the daemon listens.

Pure and light (config.py checks the flag with it before anything starts):
loopback unless a host is given; port 0 asks the system for a free one.
"""

from __future__ import annotations

import re

from ddtop.core.bounds import MAX_PORT

LOOPBACK = "127.0.0.1"
# A host name or an IPv4 address, or an IPv6 address in brackets ([::1]).
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*|\[[0-9A-Fa-f:.]+\]")


def parse_listen(flag: str, value: str) -> tuple[str, int]:
    """(host, port) from `[HOST:]PORT`; ValueError with one line naming `flag`."""
    host, colon, port = value.rpartition(":")
    if not colon:
        host = LOOPBACK
    elif not _HOST.fullmatch(host):
        raise ValueError(f"{flag} {value!r}: give [HOST:]PORT, e.g. 9400, 0 (a free port) "
                         "or 0.0.0.0:9400 ([::1]:9400 for IPv6)")
    if not (port.isdigit() and len(port) <= 5 and int(port) <= MAX_PORT):
        raise ValueError(f"{flag} {value!r}: the port must be a number from 0 (a free one) "
                         f"to {MAX_PORT}")
    return host.strip("[]"), int(port)


def url(host: str, port: int, path: str) -> str:
    """http://HOST:PORT/path, an IPv6 host in brackets."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}{path}"
