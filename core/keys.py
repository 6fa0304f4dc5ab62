"""A run's CURVE keys: who may talk to its daemon over TCP.

With `ddtrain start --bind ADDR` the daemon's sockets listen on TCP, and TCP
is reachable by anyone on the network, so every one of them is a ZeroMQ CURVE
server (authenticated and encrypted). The keys are made per run, owner-only,
in the run directory:

    runs/<id>/keys/            0700
        server.key             the daemon's public key
        server.key_secret      the daemon's key pair (0600)
        client.key             the public key every peer of the run presents
        client.key_secret      the peer key pair (0600): ranks, dashboards,
                               `ddtrain status/stop`, and later node daemons

A peer needs `client.key_secret` and `server.key`, never `server.key_secret`
(with that one anyone could pose as the daemon): `write_peer_folder` writes
those two (and `client.key`) to a folder of their own, runs/<id>/peer-keys/,
which is what a multi-node job's other nodes and a dashboard on another machine
are given (docs/security.md). The daemon's ZAP handler
(relay.py) admits exactly the run's client key: no key, a wrong key or
another run's key completes no handshake, and each refusal is counted.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85

from ddtop.core.contract import UsageError

# Where a rank finds its run's keys when DDTOP_TELEMETRY is a tcp:// endpoint
# (set by the daemon for its ranks; set it by hand for ranks started another way).
KEYS_ENV = "DDTOP_KEYS"
ZAP_DOMAIN = b"ddtop"
KEY_BYTES, KEY_Z85_CHARS = 32, 40


@dataclass(frozen=True)
class RunKeys:
    server_public: bytes
    client_public: bytes
    client_secret: bytes
    server_secret: bytes | None = None  # only the daemon holds it

    @classmethod
    def create(cls, folder: Path) -> RunKeys:
        """New keys for a run (kept when the folder already has them: a resume)."""
        if not (folder / "server.key_secret").exists():
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            folder.chmod(0o700)
            for name in ("server", "client"):
                zmq.auth.create_certificates(folder, name)
            for secret in folder.glob("*.key_secret"):
                secret.chmod(0o600)
        return cls.load(folder, server=True)

    @classmethod
    def load(cls, folder: Path | str, server: bool = False) -> RunKeys:
        """The keys a peer (or, with `server`, the daemon) needs, from `folder`, each
        checked whole here (40 characters of Z85, 32 bytes, a secret that makes its
        public key): a damaged file is one UsageError naming it, never a socket
        option refused later."""
        folder = Path(folder)
        server_public, server_secret = read_key_file(
            folder / ("server.key_secret" if server else "server.key"), secret=server)
        client_public, client_secret = read_key_file(folder / "client.key_secret", secret=True)
        assert client_secret is not None
        return cls(server_public, client_public, client_secret,
                   server_secret if server else None)

    @property
    def client_public_raw(self) -> bytes:
        """The client public key as ZAP hands it over: 32 bytes, not Z85 text."""
        return zmq.utils.z85.decode(self.client_public)

    def stop_secret(self) -> str:
        """The job's secret for the stop step in torch's store (training/stopping.py),
        derived from the client key pair every node of the job holds: the same on
        every node, known to no one without the keys folder."""
        return hmac.new(self.client_secret, b"ddtop stop agreement",
                        hashlib.sha256).hexdigest()

    def serve(self, sock: zmq.Socket[bytes]) -> None:
        """Make `sock` (before it binds) a CURVE server of this run."""
        assert self.server_secret is not None
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN

    def client(self, sock: zmq.Socket[bytes]) -> None:
        """Make `sock` (before it connects) a CURVE client of this run's daemon."""
        sock.curve_secretkey = self.client_secret
        sock.curve_publickey = self.client_public
        sock.curve_serverkey = self.server_public


PEER_FILES = ("server.key", "client.key", "client.key_secret")


def write_peer_folder(keys: Path, folder: Path) -> Path:
    """`folder` (0700) with what a peer needs of the run's `keys` folder, and
    nothing of the daemon's secret: server.key, client.key and client.key_secret
    (0600). Written again each time (a resume)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    for name in PEER_FILES:
        target = folder / name
        target.write_bytes((keys / name).read_bytes())
        target.chmod(0o600)
    return folder


def needs_keys(endpoint: str) -> bool:
    """A daemon's endpoint over TCP speaks CURVE; ipc:// is closed by the file system."""
    return endpoint.startswith("tcp://")


def peer_keys(endpoint: str | None, keys: RunKeys | Path | str | None = None
              ) -> RunKeys | None:
    """The keys a peer presents to the daemon at `endpoint` (None: not known yet):
    `keys` (loaded, or a keys folder), else the folder DDTOP_KEYS names; None
    where the endpoint needs none (ipc://) or no keys are named. A damaged key
    file raises UsageError naming it."""
    if endpoint is not None and not needs_keys(endpoint):
        return None
    if isinstance(keys, RunKeys):
        return keys
    folder = keys if keys is not None else os.environ.get(KEYS_ENV)
    return RunKeys.load(folder) if folder else None


def secure(sock: zmq.Socket[bytes], endpoint: str,
           keys: RunKeys | Path | str | None = None) -> None:
    """Before `sock` connects to `endpoint`: the run's client keys when the
    endpoint needs them and `keys` (loaded, or a keys folder; else DDTOP_KEYS) names them."""
    found = peer_keys(endpoint, keys)
    if found is not None:
        found.client(sock)


def read_key_file(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    """A key file's public key and (with `secret`, required) its secret key, each
    checked; a damaged file is a UsageError naming it and what is wrong."""
    try:
        path.read_bytes()
        public, secret_key = zmq.auth.load_certificate(path)
        why = _bad_key(public, "public")
        if why is None and secret:
            why = _bad_key(secret_key, "secret")
            if why is None and secret_key is not None and zmq.curve_public(secret_key) != public:
                why = "holds a secret key that is not its public key's"
    except FileNotFoundError:
        why = "is missing"
    except IsADirectoryError:
        why = "is a directory, not a key file"
    except OSError as e:
        why = f"cannot be read ({e.strerror or e})"
    except ValueError:  # load_certificate: no public-key line at all
        why = "holds no public key"
    if why is not None:
        raise UsageError(f"the run's CURVE key file {path} {why}: copy the run's keys folder "
                         "(runs/<id>/keys) again, with its permissions")
    return public, secret_key


def _bad_key(key: bytes | None, which: str) -> str | None:
    """What is wrong with a Z85 key from a key file, or None: 40 characters that
    decode to 32 bytes."""
    if not key:
        return f"holds no {which} key"
    try:
        ok = len(key) == KEY_Z85_CHARS and len(zmq.utils.z85.decode(key)) == KEY_BYTES
    except (ValueError, KeyError, struct.error):  # odd length, not Z85, out of range
        ok = False
    if not ok:
        return (f"holds a damaged {which} key ({len(key)} characters; a CURVE key is "
                f"{KEY_Z85_CHARS} characters of Z85)")
    return None
