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

A peer needs `client.key_secret` and `server.key` (copy the folder to another
machine to watch from there: docs/security.md). The daemon's ZAP handler
(relay.py) admits exactly the run's client key: no key, a wrong key or
another run's key completes no handshake, and each refusal is counted.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85

from ddtop.daemon.config import UsageError

# Where a rank finds its run's keys when DDTOP_TELEMETRY is a tcp:// endpoint
# (set by the daemon for its ranks; set it by hand for ranks started another way).
KEYS_ENV = "DDTOP_KEYS"
ZAP_DOMAIN = b"ddtop"


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
        """The keys a peer (or, with `server`, the daemon) needs, from `folder`."""
        folder = Path(folder)
        try:
            server_public, server_secret = zmq.auth.load_certificate(
                folder / ("server.key_secret" if server else "server.key"))
            client_public, client_secret = zmq.auth.load_certificate(
                folder / "client.key_secret")
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read the run's CURVE keys in {folder} ({e}): this "
                             "command needs the run's keys folder (runs/<id>/keys), copied "
                             "with its permissions") from None
        if client_secret is None or (server and server_secret is None):
            raise UsageError(f"{folder}: a key file has no secret key: copy the run's keys "
                             "folder again")
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


def needs_keys(endpoint: str) -> bool:
    """A daemon's endpoint over TCP speaks CURVE; ipc:// is closed by the file system."""
    return endpoint.startswith("tcp://")


def secure(sock: zmq.Socket[bytes], endpoint: str, keys: Path | str | None) -> None:
    """Before `sock` connects to `endpoint`: the run's client keys when the
    endpoint needs them and `keys` (a keys folder; else DDTOP_KEYS) names them."""
    folder = keys if keys is not None else os.environ.get(KEYS_ENV)
    if needs_keys(endpoint) and folder:
        RunKeys.load(folder).client(sock)
