"""What a run sends out beyond its own folder, checked before anything starts:
`--metrics` (Prometheus, daemon/exporter.py) and `--tensorboard` (TensorBoard
files, core/tbwriter.py). Each check raises ValueError with one line naming
the flag and the fix; config.py (and `ddtop export`) report it as a UsageError.

`[HOST:]PORT`, as `--metrics` takes it (where an HTTP server of the daemon listens), is
read here too: loopback unless a host is given; port 0 asks the system for a free one.
"""

from __future__ import annotations

import importlib.util
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



def require_tensorboard(flag: str) -> None:
    """ValueError in one line when tensorboard (core/tbwriter.py) is not installed."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError(f"{flag} writes TensorBoard files, which needs the tensorboard "
                         "package, not installed here: pip install 'ddtop[tensorboard]'")


def check_metrics(value: str, is_hub: bool, node_rank: int) -> None:
    """`--metrics [HOST:]PORT`: a valid address, and given on the hub only."""
    parse_listen("--metrics", value)
    if not is_hub:
        raise ValueError(f"--metrics is served by node 0 (the hub) for the whole job: "
                         f"leave it out on node {node_rank}")
