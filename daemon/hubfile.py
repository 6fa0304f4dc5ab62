"""hub.json: where the nodes of a multi-node job find the hub (daemon/hub.py).

Node 0's daemon writes it in the shared run directory (its control and `nodes`
endpoints, the job's peer keys, and which process it is); node K's daemon reads it,
waiting for it, or is given --hub and --hub-keys instead.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from ddtop.core.config import TrainConfig
from ddtop.core.contract import UsageError
from ddtop.core.keys import RunKeys
from ddtop.core.processes import ProcessId, same_process
from ddtop.core.rundir import RunPaths, write_json_atomic
from ddtop.daemon.hub import HUB_WAIT_S


def write_hub_file(paths: RunPaths, control: str, nodes: str) -> None:
    """hub.json in the run directory: where nodes 1 and up find the hub (owner-only)."""
    me = ProcessId.of(os.getpid())
    write_json_atomic(paths.hub_file, {"control": control, "nodes": nodes,
                                       "keys": str(paths.peer_keys.absolute()),
                                       "pid": os.getpid(), "host": socket.gethostname(),
                                       "start": me.start if me else None,
                                       "boot": me.boot if me else ""})


def find_hub(config: TrainConfig, job: RunPaths, say: Any) -> tuple[str, RunKeys]:
    """Node K: the hub's control endpoint and the job's keys, from --hub/--hub-keys,
    else from the shared run directory (waiting up to HUB_WAIT_S for node 0). A
    hub.json whose hub is gone (a dead earlier run's of the same run id, on this
    machine) is waited out as if absent, then refused naming the file."""
    if config.hub:
        if (Path(config.hub_keys) / "server.key_secret").exists():
            say(f"note: --hub-keys {config.hub_keys} holds the hub's secret key "
                "(server.key_secret), which a node does not need: give it a copy of the "
                "job's peer-keys folder instead (docs/multi-node.md)")
        return config.hub, RunKeys.load(config.hub_keys)
    deadline = time.monotonic() + HUB_WAIT_S
    said = 0.0
    hub_file = job.hub_file
    stale: str | None = None
    while True:
        found = read_hub_file(hub_file)
        if found is not None:
            control, folder, stale = found
            if stale is None:
                return control, RunKeys.load(folder)  # a damaged keys folder: UsageError
        now = time.monotonic()
        if now > deadline:
            if stale is not None:
                raise UsageError(f"node {config.node_rank}: {hub_file} names a hub that is "
                                 f"gone ({stale}): a dead earlier run's with the same --run-id; "
                                 "remove it, or start node 0 of this run")
            raise UsageError(f"node {config.node_rank}: no hub after {HUB_WAIT_S:g} s: "
                             f"{hub_file} did not appear; start node 0 with the same --runs-dir "
                             "and --run-id on a shared file system, or give --hub and --hub-keys")
        if now - said >= 10:
            said = now
            why = f" ({hub_file} is a dead hub's: {stale})" if stale else ""
            say(f"waiting for node 0's daemon (the hub) to write {hub_file}{why}")
        time.sleep(0.2)


def read_hub_file(path: Path) -> tuple[str, Path, str | None] | None:
    """hub.json's control endpoint, keys folder, and why its hub is known to be gone
    (it ran on this machine and its process is not there: "pid N on HOST"), else
    None; None while it is not there, or not a hub file (anything else in its
    place is waited out, then said)."""
    try:
        found = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(found, dict):
        return None
    control, folder = found.get("control"), found.get("keys")
    if not isinstance(control, str) or not isinstance(folder, str) or "\0" in folder:
        return None
    pid, start, boot, host = (found.get("pid"), found.get("start"), found.get("boot"),
                              found.get("host"))
    stale = None
    if (host == socket.gethostname() and isinstance(pid, int) and 0 < pid < 2**22
            and isinstance(start, int) and isinstance(boot, str)
            and not same_process(ProcessId(pid, start, boot))):
        stale = f"pid {pid} on {host} is not running"
    return control, Path(folder), stale
