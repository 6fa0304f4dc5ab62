"""What is known about a run, live or finished, for `status`, `list` and `stop`.

A run is *live* when its run.json names a daemon pid that still exists and a
non-final status. A live run answers `status` from its daemon's RunState; a
finished one from its journal (the same fold, replayed) and run.json. A
run.json that says "running" while its daemon is gone means the daemon was
killed: such a run is shown as `lost`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtop.daemon import control, journal
from ddtop.daemon.runs import RunPaths, read_json

FINAL = ("succeeded", "failed", "stopped")
LOST = "lost"


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) is not alive
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


@dataclass
class RunInfo:
    paths: RunPaths
    record: dict[str, Any]  # run.json ({} when missing or unreadable)
    config: dict[str, Any]  # config.json

    @classmethod
    def load(cls, paths: RunPaths) -> RunInfo:
        def read(path: Path) -> dict[str, Any]:
            try:
                data = read_json(path)
            except (OSError, ValueError):
                return {}
            return data if isinstance(data, dict) else {}

        return cls(paths, read(paths.status), read(paths.config))

    @property
    def daemon_pid(self) -> int | None:
        pid = self.record.get("daemon_pid") or self.record.get("launcher_pid")
        return pid if isinstance(pid, int) else None

    @property
    def live(self) -> bool:
        return self.record.get("status") not in FINAL and pid_alive(self.daemon_pid)

    @property
    def status(self) -> str:
        status = self.record.get("status", "unknown")
        if status not in FINAL and not self.live:
            return LOST
        return str(status)

    @property
    def control(self) -> str | None:
        endpoint = self.record.get("endpoints", {}).get("control")
        return endpoint if isinstance(endpoint, str) else None

    def summary(self, timeout_s: float = 2.0) -> dict[str, Any]:
        """The RunState summary: from the daemon when live, else from the journal."""
        summary: dict[str, Any] | None = None
        if self.live and self.control:
            try:
                reply = control.request(self.control, "status", timeout_s)
                if reply.get("ok"):
                    summary = reply["summary"]
            except control.Unreachable:
                pass
        if summary is None:
            summary = self._replayed()
        summary.update({
            "run_id": self.paths.run_id, "status": self.status, "dir": str(self.paths.root),
            "daemon_pid": self.daemon_pid, "daemon_alive": self.live,
            "restarts": self.record.get("restarts", summary.get("restarts", 0)),
            "timeline": self.record.get("timeline", summary.get("timeline", [])),
            "started": self.record.get("started"), "ended": self.record.get("ended"),
            "exit_code": self.record.get("exit_code"),
        })
        if "failure" in self.record:
            summary["failure"] = {**(summary.get("failure") or {}), **self.record["failure"]}
        self._merge_processes(summary)
        return summary

    def _replayed(self) -> dict[str, Any]:
        if self.paths.journal.exists():
            state, _ = journal.replay(self.paths.journal, self.paths.run_id)
            return state.summary(state.updated or time.time())
        return {"ranks": [], "world_size": self.config.get("world_size", 0),
                "model": self.config.get("model"), "dataset": self.config.get("dataset")}

    def _merge_processes(self, summary: dict[str, Any]) -> None:
        """run.json knows each rank's pid and exit status from the OS: it wins."""
        by_rank = {r["rank"]: r for r in summary.get("ranks", [])}
        for proc in self.record.get("ranks", []):
            row = by_rank.setdefault(proc["rank"], {"rank": proc["rank"], "state": "starting"})
            row["pid"] = proc.get("pid")
            if proc.get("exitcode") is not None:
                row["exit_code"] = proc["exitcode"] if proc["exitcode"] >= 0 else None
                row["signal"] = proc.get("signal")
                row["state"] = "finished" if proc["exitcode"] == 0 else "dead"
                row["stopped_by_daemon"] = proc.get("stopped_by_launcher", False)
            elif not self.live:
                row["state"] = LOST
        summary["ranks"] = [by_rank[r] for r in sorted(by_rank)]


def list_runs(runs_dir: Path) -> list[RunInfo]:
    """Every run under `runs_dir`, oldest first."""
    found = [RunInfo.load(RunPaths(p.parent))
             for p in runs_dir.glob("*/config.json") if p.is_file()]
    return sorted(found, key=lambda i: (i.record.get("started") or 0, i.paths.run_id))
