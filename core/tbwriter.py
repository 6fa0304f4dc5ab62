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
in the caller, and the tap does what the journal does (core/journal.py): the
records it held are dropped and counted, it says so once, as a warning, and for
RETRY_S what comes is dropped and counted without touching the disk; then it
tries again, with new event files (a file a failed write may have left torn is
never appended to). Once a write goes through, it says how many records the
outage cost. The run goes on throughout. Records are held in memory and written
every FLUSH_S and at the end.

tensorboard is imported only here, and only when a writer is made (`pip install
'ddtop[tensorboard]'`; outlets.require_tensorboard checks it first). tensorboardX
would write the same files, but it imports torch where torch is installed, which
the daemon never does.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ddtop.core import tbpoints, wire
from ddtop.core.state import RunState
from ddtop.core.text import count_of

FLUSH_S = 5.0  # the live writer flushes its files at most this often (and at the end)
HELD_BYTES = 1 << 20  # records held in memory before they are written all the same
RETRY_S = 1.0  # after a refused write, records are dropped unwritten this long


def event_file_name(generation: int = 0) -> str:
    """As TensorBoard names its own (it reads the files whose name holds 'tfevents');
    a writer's later generations (after a refused write) get files of their own."""
    name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
    return f"{name}.{generation}" if generation else name


def folder_problem(flag: str, path: Path) -> str | None:
    """Why event files could not be written under `path`, found before a run
    starts (a file there, or a folder above it that is a file or cannot be
    written to), or None. Tried for real, as root too: nothing is left behind."""
    if path.exists() and not path.is_dir():
        return f"{flag} {path} is a file: give a folder (it is made if missing)"
    above = path
    while not above.exists():
        if above.parent == above:
            break
        above = above.parent
    if not above.is_dir():
        return f"{flag} {path}: {above} is a file, not a folder; pick another path"
    try:
        probe = above / f".ddtop-write-test-{os.getpid()}"
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return f"{flag} {path}: {above} cannot be written ({e.strerror or e}); pick another path"
    return None


class EventFiles:
    """DIR/<run id>/<folder>/events.out.tfevents.*: records held in memory per folder,
    appended to its file (opened and closed again) at each flush, so that a run of
    1,024 ranks holds no 1,025 files open; they are flushed by themselves once they
    hold HELD_BYTES. Every method may raise OSError (the caller decides what a
    refused write is)."""

    def __init__(self, root: Path, generation: int = 0) -> None:
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
        self._counts: dict[str, int] = {}  # folder -> records held (the version record too)
        self.name = event_file_name(generation)
        root.mkdir(parents=True, exist_ok=True)

    @property
    def held(self) -> int:
        """Records held in memory, not yet written."""
        return sum(self._counts.values())

    def _writer(self, folder: str) -> Any:
        found = self._held.get(folder)
        if found is None:
            buffer = io.BytesIO()
            found = self._held[folder] = (buffer, self._record_writer(buffer))
            self._counts[folder] = 0
            if folder not in self._made:  # a new file begins with its version
                found[1].write(self._event(wall_time=time.time(),
                                           file_version="brain.Event:2").SerializeToString())
        self._counts[folder] += 1
        return found[1]

    def write(self, items: Iterable[tbpoints.Item]) -> None:
        Value = self._summary.Value
        for item in items:
            if isinstance(item, tbpoints.HParams):
                from tensorboard.plugins.hparams import summary_v2

                summary = summary_v2.hparams_pb(dict(item.values), trial_id=item.trial,
                                                start_time_secs=item.wall)
                event = self._event(wall_time=item.wall, step=0, summary=summary)
                self._writer(item.folder).write(event.SerializeToString())
                continue
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
                path.mkdir(parents=True, exist_ok=True)
                self._made.add(folder)
            with (path / self.name).open("ab") as file:
                file.write(buffer.getbuffer())
            del self._held[folder], self._counts[folder]

    def close(self) -> None:
        self.flush()

    def remove(self) -> None:
        """Forget what is held; remove the files it wrote, then the folders it made
        and its root where they are left empty (nothing else is removed). Never
        raises: what cannot be removed stays."""
        self._held.clear()
        self._counts.clear()
        for folder in sorted(self._made, key=lambda f: -f.count("/")):  # a life's first
            with contextlib.suppress(OSError):
                (self.root / folder / self.name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                (self.root / folder).rmdir()
        with contextlib.suppress(OSError):
            self.root.rmdir()


def _tensor_protos() -> tuple[Any, Any]:
    from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2

    return tensor_pb2.TensorProto, tensor_shape_pb2.TensorShapeProto


def first_life(root: Path) -> int:
    """The life a writer's folders begin in under `root` (DIR/<run id>): 0 where nothing
    is written there yet; else the one after the highest there (a resumed run: its
    points begin again from a checkpoint's step, in folders of their own)."""
    try:
        if not any(root.rglob("*tfevents*")):
            return 0
        lives = [int(m.group(1)) for path in root.rglob(f"{tbpoints.LIFE}*")
                 if (m := re.fullmatch(rf"{tbpoints.LIFE}(\d+)", path.name))]
    except OSError:
        return 0  # (the writer says what it cannot do as it writes)
    return max(lives, default=0) + 1


class TensorBoardTap:
    """The daemon's live writer (one for all ranks): `take` each message the relay
    folded, with the state it was folded into. Never raises OSError: a refused
    write drops what was held, is said once (returned as a warning), and is tried
    again after RETRY_S with new files; the first write that goes through after
    it is said too, with what the outage cost."""

    def __init__(self, root: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.clock = clock
        self.translator = tbpoints.Translator(first_life(root))
        self.files: EventFiles | None = None
        self.error: str | None = None  # the outage now going on, in words
        self.dropped = 0  # records not written, in all
        self._outage_from = 0  # self.dropped as the outage now going on began
        self._retry_at = 0.0
        self._generation = 0
        self._say: str | None = None  # what to return next
        self._flushed_at = clock()
        self._open()

    def _open(self) -> None:
        try:
            self.files = EventFiles(self.root, self._generation)
        except OSError as e:
            self._failed(e)

    def take(self, message: wire.Message, state: RunState, received: float) -> str | None:
        """Write what `message` adds; a warning to say, else None."""
        items = self.translator.items(message, state, received)
        if self.files is None and self.clock() >= self._retry_at:
            self._generation += 1
            self._open()
        if self.files is None:
            self.dropped += len(items)
            return self._told()
        try:
            self.files.write(items)
            if self.clock() - self._flushed_at >= FLUSH_S:
                self._flushed_at = self.clock()
                self._flush()
        except OSError as e:
            self._failed(e)
        return self._told()

    def close(self) -> str | None:
        """Flush and close; a warning line when that failed, or what to say."""
        if self.files is not None:
            try:
                self._flush()
            except OSError as e:
                self._failed(e)
        return self._told()

    def _flush(self) -> None:
        assert self.files is not None
        self.files.write(self.translator.pending())  # the newest step's lines, so far
        self.files.flush()
        if self.error is not None:  # written again: the outage is over
            lost = self.dropped - self._outage_from
            self._say = (f"tensorboard: writing to {self.root} again; dropped meanwhile: "
                         f"{count_of(lost, 'record')}")
            self.error = None

    def _told(self) -> str | None:
        said, self._say = self._say, None
        return said

    def _failed(self, error: OSError) -> None:
        new = self.error is None  # a new outage: said once
        if new:
            self._outage_from = self.dropped
        if self.files is not None:
            self.dropped += self.files.held
            self.files = None
        self._retry_at = self.clock() + RETRY_S
        if new:
            self.error = (f"tensorboard: {error.strerror or error} on "
                          f"{getattr(error, 'filename', None) or self.root}: TensorBoard records "
                          f"are dropped until it can be written again, tried every "
                          f"{RETRY_S:g} s (the run goes on)")
            self._say = self.error
