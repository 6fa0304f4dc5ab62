"""What a run sends out beyond its own folder, checked before anything starts:
`--metrics` (Prometheus, daemon/exporter.py) and `--tensorboard` (TensorBoard
files, core/tbwriter.py). Each check raises ValueError with one line naming
the flag and the fix; config.py (and `ddtop export`) report it as a UsageError.

`[HOST:]PORT`, as `--metrics` takes it (where an HTTP server of the daemon listens), is
read here too: loopback unless a host is given; port 0 asks the system for a free one.
So are the doors of that server (daemon/metricserver.py): `--metrics-auth FILE`, one
line holding a bearer token, or USER:PASSWORD for basic auth (a bearer token is RFC
6750's b64token, which has no ':', so the two cannot be confused), and
`--metrics-cert FILE --metrics-key FILE` for TLS. The files that hold a secret (the
credential, the key) must be private to their owner, as ssh wants its keys.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ddtop.core.bounds import MAX_PORT

if TYPE_CHECKING:
    import ssl

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


def url(host: str, port: int, path: str, scheme: str = "http") -> str:
    """http://HOST:PORT/path (or another scheme), an IPv6 host in brackets."""
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}{path}"



def require_tensorboard(flag: str) -> None:
    """ValueError in one line when tensorboard (core/tbwriter.py) is not installed."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError(f"{flag} writes TensorBoard files, which needs the tensorboard "
                         "package, not installed here: pip install 'ddtop[tensorboard]'")


def check_metrics(value: str, is_hub: bool, node_rank: int, auth: str = "",
                  cert: str = "", key: str = "") -> None:
    """`--metrics [HOST:]PORT`: a valid address, and given on the hub only; its
    credential file and its certificate and key, when given, read as the server will."""
    door = next((f for f, v in (("--metrics-auth", auth), ("--metrics-cert", cert),
                                ("--metrics-key", key)) if v), None)
    if not value:
        if door is not None:
            raise ValueError(f"{door} is for the --metrics endpoint: add --metrics "
                             "[HOST:]PORT, or leave it out")
        return
    parse_listen("--metrics", value)
    if not is_hub:
        raise ValueError(f"--metrics is served by node 0 (the hub) for the whole job: "
                         f"leave it out on node {node_rank}")
    if auth:
        read_metrics_auth(auth)
    if cert or key:
        metrics_tls(cert, key)


# A credential's secret (the token, or the password), in characters: enough that it
# cannot be guessed a scrape at a time; `openssl rand -hex 32` makes one.
MIN_SECRET_CHARS = 16
MAX_AUTH_FILE_BYTES = 4096  # one line; anything longer is not a credential file
_B64TOKEN = re.compile(r"[A-Za-z0-9._~+/-]+=*")  # RFC 6750's b64token: a bearer token
_USER = re.compile(r"[^:\x00-\x1f\x7f]+")  # RFC 7617: a user-id has no ':' (nor controls)


@dataclass(frozen=True)
class MetricsAuth:
    """What every scrape must send, from `--metrics-auth FILE`: `Authorization: Bearer
    TOKEN`, or `Authorization: Basic` with USER:PASSWORD. Only the SHA-256 of the
    secret is kept (what a request's credential is compared with, in constant time)."""

    scheme: Literal["Bearer", "Basic"]
    digest: bytes  # sha256 of the token, or of `user:password` in UTF-8


def read_metrics_auth(path: str) -> MetricsAuth:
    """The credential in `path` (--metrics-auth): one line, surrounding blanks ignored
    (as Prometheus reads its credentials files); ValueError with one line naming the flag."""
    raw = _read_private("--metrics-auth", path, MAX_AUTH_FILE_BYTES)
    try:
        line = raw.decode().strip()
    except UnicodeDecodeError:
        raise ValueError(f"--metrics-auth {path}: not UTF-8 text; give one line, a bearer "
                         "token or USER:PASSWORD") from None
    user, colon, password = line.partition(":")
    if not line or "\n" in line or "\r" in line:
        raise ValueError(f"--metrics-auth {path}: give one line, a bearer token or "
                         f"USER:PASSWORD ({'empty' if not line else 'more than one line'})")
    if colon:
        if not _USER.fullmatch(user) or not password or not password.isprintable():
            raise ValueError(f"--metrics-auth {path}: USER:PASSWORD needs a user and a "
                             "password, both printable")
        _check_strength(path, "password", password)
        return MetricsAuth("Basic", hashlib.sha256(line.encode()).digest())
    if not _B64TOKEN.fullmatch(line):
        raise ValueError(f"--metrics-auth {path}: a bearer token may hold letters, digits "
                         "and -._~+/ (then =), nothing else; or give USER:PASSWORD")
    _check_strength(path, "token", line)
    return MetricsAuth("Bearer", hashlib.sha256(line.encode()).digest())


def _check_strength(path: str, what: str, secret: str) -> None:
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"--metrics-auth {path}: the {what} has {len(secret)} characters; "
                         f"give one of at least {MIN_SECRET_CHARS} (openssl rand -hex 32)")


def metrics_tls(cert: str, key: str) -> ssl.SSLContext:
    """The server's TLS context from `--metrics-cert` and `--metrics-key` (PEM; the
    certificate file may hold its chain after it): TLS 1.2 and up. ValueError with one
    line: one without the other, a file that is not there, not private (the key), not a
    certificate, not its key, or an encrypted key (nobody is there to type its passphrase)."""
    import ssl

    if not (cert and key):
        given, missing = ("--metrics-cert", "--metrics-key") if cert else (
            "--metrics-key", "--metrics-cert")
        raise ValueError(f"{given} needs {missing} too: TLS takes a certificate and its "
                         "private key (PEM files)")
    _read_regular("--metrics-cert", cert, None)
    _read_private("--metrics-key", key, None)

    def encrypted() -> str:
        raise ValueError(f"--metrics-key {key}: the key is encrypted; give it unencrypted "
                         "(the daemon has no terminal to ask for its passphrase)")

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key, password=encrypted)
    except ssl.SSLError as e:
        raise ValueError(f"--metrics-cert {cert} --metrics-key {key}: not a PEM certificate "
                         f"and its private key ({e.reason or e.strerror or e})") from None
    except OSError as e:
        raise ValueError(f"--metrics-cert {cert}: cannot read it ({e.strerror or e})") from None
    return context


def _read_regular(flag: str, path: str, limit: int | None) -> tuple[bytes, os.stat_result]:
    """The bytes of a regular file (up to `limit`; None: none read) and its status;
    ValueError naming `flag` for a file that is missing, unreadable, not a file
    (opened without blocking: a FIFO must not hang the start) or too long."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise ValueError(f"{flag} {path}: not a regular file")
        raw = b"" if limit is None else os.read(fd, limit + 1)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if limit is not None and len(raw) > limit:
        raise ValueError(f"{flag} {path}: longer than {limit} bytes; give one line")
    return raw, status


def _read_private(flag: str, path: str, limit: int | None) -> bytes:
    """`_read_regular`'s bytes of a file that holds a secret, refused when anyone but
    its owner has access (a secret other users can read is no secret)."""
    raw, status = _read_regular(flag, path, limit)
    if status.st_mode & 0o077:
        raise ValueError(f"{flag} {path}: others have access to it (mode "
                         f"{stat.S_IMODE(status.st_mode):04o}); it holds a secret: chmod 600 "
                         f"{path}")
    return raw
