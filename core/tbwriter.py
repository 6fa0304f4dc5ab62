"""TensorBoard event files: a run's telemetry as TensorBoard reads it.

    EventFiles      one event file per folder under DIR/<run id>/ (core/tbpoints.py
                    says which folders and tags), written with tensorboard's own
                    record writer and protos, in the caller's thread
    TensorBoardTap  `ddtrain start/watch --tensorboard DIR`: the daemon's one writer
                    for all ranks, fed every message the relay folds

The files are written synchronously, not through tensorboard's EventFileWriter:
that one writes from a thread of its own, raises a failed write there (a
traceback on the daemon's stderr) and blocks its caller when its queue is full.
Here a write the file system refuses (a full disk, no permission) is an OSError
in the caller: the tap says it once, as a warning, and writes no more; the run
goes on. Records are held in memory and written every FLUSH_S and at the end.

tensorboard is imported only here, and only when a writer is made (`pip install
'ddtop[tensorboard]'`; outlets.require_tensorboard checks it first). tensorboardX
would write the same files, but it imports torch where torch is installed, which
the daemon never does.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ddtop.core import tbpoints, wire
from ddtop.core.state import RunState

FLUSH_S = 5.0  # the live writer flushes its files at most this often (and at the end)
HELD_BYTES = 1 << 20  # records held in memory before they are written all the same


def event_file_name() -> str:
    """As TensorBoard names its own (it reads the files whose name holds 'tfevents')."""
    return f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"


class EventFiles:
    """DIR/<run id>/<folder>/events.out.tfevents.*: records held in memory per folder,
    appended to its file (opened and closed again) at each flush, so that a run of
    1,024 ranks holds no 1,025 files open; they are flushed by themselves once they
    hold HELD_BYTES. Every method may raise OSError (the caller decides what a
    refused write is)."""

    def __init__(self, root: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.text import metadata as text_metadata
        from tensorboard.summary.writer.record_writer import RecordWriter

        self.root = root
        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self._tensor = _tensor_protos()
        self._text_metadata = text_metadata.create_summary_metadata("", "")
        self._record_writer = RecordWriter
        self._held: dict[str, tuple[io.BytesIO, Any]] = {}  # folder -> its records, writer
        self._made: set[str] = set()  # folders made
        self.name = event_file_name()
        root.mkdir(parents=True, exist_ok=True)

    def _writer(self, folder: str) -> Any:
        found = self._held.get(folder)
        if found is None:
            buffer = io.BytesIO()
            found = self._held[folder] = (buffer, self._record_writer(buffer))
            if folder not in self._made:  # a new file begins with its version
                found[1].write(self._event(wall_time=time.time(),
                                           file_version="brain.Event:2").SerializeToString())
        return found[1]

    def write(self, items: Iterable[tbpoints.Item]) -> None:
        Value = self._summary.Value
        for item in items:
            if isinstance(item, tbpoints.Scalars):
                values = [Value(tag=tag, simple_value=v) for tag, v in item.values]
            else:
                tensor_proto, shape = self._tensor
                values = [Value(tag=item.tag, metadata=self._text_metadata,
                                tensor=tensor_proto(dtype=7, string_val=[item.text.encode()],
                                                    tensor_shape=shape()))]  # 7: DT_STRING
            event = self._event(wall_time=item.wall, step=item.step,
                                summary=self._summary(value=values))
            self._writer(item.folder).write(event.SerializeToString())
        if sum(buffer.tell() for buffer, _ in self._held.values()) >= HELD_BYTES:
            self.flush()

    def flush(self) -> None:
        """Append what each folder holds to its file."""
        while self._held:
            folder, (buffer, _) = next(iter(self._held.items()))
            path = self.root / folder
            if folder not in self._made:
                path.mkdir(exist_ok=True)
                self._made.add(folder)
            with (path / self.name).open("ab") as file:
                file.write(buffer.getbuffer())
            del self._held[folder]

    def close(self) -> None:
        self.flush()


def _tensor_protos() -> tuple[Any, Any]:
    from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2

    return tensor_pb2.TensorProto, tensor_shape_pb2.TensorShapeProto


class TensorBoardTap:
    """The daemon's live writer (one for all ranks): `take` each message the relay
    folded, with the state it was folded into. Never raises OSError: the first
    failure is returned once as a warning, and nothing more is written."""

    def __init__(self, root: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.clock = clock
        self.translator = tbpoints.Translator()
        self.files: EventFiles | None = None
        self.error: str | None = None
        self._told = False
        self._flushed_at = clock()
        try:
            self.files = EventFiles(root)
        except OSError as e:
            self._failed(e)

    def take(self, message: wire.Message, state: RunState, received: float) -> str | None:
        """Write what `message` adds; a warning to say (once), else None."""
        if self.files is not None:
            try:
                self.files.write(self.translator.items(message, state, received))
                if self.clock() - self._flushed_at >= FLUSH_S:
                    self._flushed_at = self.clock()
                    self.files.flush()
            except OSError as e:
                self._failed(e)
        return self._untold()

    def close(self) -> str | None:
        """Flush and close; a warning line when that failed (the first time)."""
        if self.files is not None:
            try:
                self.files.close()
            except OSError as e:
                self._failed(e)
        return self._untold()

    def _untold(self) -> str | None:
        """The write error, the first time it is asked for; else None."""
        if self.error is not None and not self._told:
            self._told = True
            return self.error
        return None

    def _failed(self, error: OSError) -> None:
        if self.files is not None:
            with contextlib.suppress(OSError):  # the same disk: the first error is said
                self.files.close()
        self.files = None
        self.error = (f"tensorboard: {error.strerror or error} on "
                      f"{getattr(error, 'filename', None) or self.root}: no more TensorBoard "
                      "files are written for this run (the run goes on)")
