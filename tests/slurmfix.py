"""A one-machine SLURM cluster for the tests: munged, slurmctld and slurmd of
Debian's `slurm-wlm` and `munge`, each under a folder of its own with a minimal
slurm.conf (proctrack/linuxproc, task/none, no accounting, one node of this
machine's CPUs, ports picked free on loopback), found by the client commands
(srun, sbatch, scancel, squeue) through SLURM_CONF.

`Slurm.up(folder)` brings it up and waits for the node to be idle; `down()`
cancels every job left and stops the three daemons by the pids they wrote,
waiting for each to be gone. It needs root (slurmd runs jobs as their user,
and runs as root itself) and the packages: `skip_reason()` says why not,
for the fixture's skip. .ci/run installs the packages where missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "scancel", "squeue", "sinfo", "mungekey")
# Seconds for the node to come up idle, and for a daemon to exit once told.
UP_TIMEOUT_S = 30.0
DOWN_TIMEOUT_S = 15.0


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def skip_reason() -> str | None:
    """Why the cluster cannot be brought up here, or None."""
    if os.geteuid() != 0:
        return "a SLURM cluster needs root (slurmd runs each job as its user)"
    missing = [n for n in (*DAEMONS, *CLIENTS) if _which(n) is None]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} missing): "
                "apt-get install slurm-wlm munge (.ci/run does)")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SLURM_CONF = """\
ClusterName=ddtoptest
SlurmctldHost={host}(127.0.0.1)
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmdSpoolDir={d}/spool
StateSaveLocation={d}/state
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
KillWait=5
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


class Slurm:
    def __init__(self, folder: Path) -> None:
        self.dir = folder
        self.host = socket.gethostname()
        self.conf = folder / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    @classmethod
    def up(cls, folder: Path) -> Slurm:
        cluster = cls(folder)
        try:
            cluster._start()
        except BaseException:
            cluster.down()
            raise
        return cluster

    def _run(self, *cmd: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        path = _which(cmd[0]) or cmd[0]
        return subprocess.run([path, *cmd[1:]], env=self.env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def _start(self) -> None:
        d = self.dir
        for sub in ("state", "spool"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        d.chmod(0o711)  # munge's socket must be reachable by every user
        self._check(self._run("mungekey", "--create", f"--keyfile={d}/munge.key"))
        (d / "munge.key").chmod(0o400)
        self._check(self._run("munged", "--force", f"--socket={d}/munge.sock",
                              f"--key-file={d}/munge.key", f"--pid-file={d}/munged.pid",
                              f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"))
        self.conf.write_text(SLURM_CONF.format(
            host=self.host, d=d, ctld_port=_free_port(), d_port=_free_port(),
            cpus=os.cpu_count() or 1))
        self._check(self._run("slurmctld", "-i"))
        self._check(self._run("slurmd"))
        deadline = time.monotonic() + UP_TIMEOUT_S
        while time.monotonic() < deadline:
            state = self._run("sinfo", "-h", "-o", "%t").stdout.strip()
            if state == "idle":
                return
            time.sleep(0.2)
        raise RuntimeError(f"the SLURM node never came up idle ({state!r}); see {d}/*.log")

    @staticmethod
    def _check(done: subprocess.CompletedProcess[str]) -> None:
        if done.returncode != 0:
            raise RuntimeError(f"{done.args[0]} failed ({done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()}")

    def jobs(self) -> list[str]:
        """The ids of the jobs still queued or running."""
        return self._run("squeue", "-h", "-o", "%i").stdout.split()

    def down(self) -> None:
        """Cancel what is left, then stop slurmd, slurmctld and munged (in that
        order), each by the pid it wrote, waiting for each to be gone."""
        if self.conf.exists():
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                if self.jobs():
                    self._run("scancel", "--full", "--user", "root")
                    deadline = time.monotonic() + DOWN_TIMEOUT_S
                    while self.jobs() and time.monotonic() < deadline:
                        time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            pid_file = self.dir / f"{name}.pid"
            try:
                pid = int(pid_file.read_text().strip())
            except (OSError, ValueError):
                continue
            if _comm(pid) != name[:15]:
                continue  # gone already, and its pid perhaps another's now
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + DOWN_TIMEOUT_S
            while _comm(pid) == name[:15] and time.monotonic() < deadline:
                time.sleep(0.1)
            if _comm(pid) == name[:15]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _comm(pid: int) -> str | None:
    """The process's name, or None once it is gone (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
    return None if state == "Z" else name
