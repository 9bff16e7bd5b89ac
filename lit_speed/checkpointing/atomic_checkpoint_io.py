"""Checkpoints that are never half-written, and a check that finds the ones that are damaged anyway.

``torch.save`` writes a zip archive with a CRC-32 per record, but ``torch.load`` does not check it: a
checkpoint with a flipped byte in a weight tensor loads silently. :func:`verify_checkpoint` reads every
record and checks its CRC, so truncation and bit rot are both caught before a resume uses the file.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from typing_extensions import override

log = logging.getLogger(__name__)

PREVIOUS_SUFFIX = ".prev"  # last.ckpt -> last.ckpt.prev: the version a save replaced, kept as a fallback


class CorruptCheckpointError(ValueError):
    """A checkpoint file that is truncated, damaged or not a checkpoint at all (bad input: a ``ValueError``)."""


#: Errors a checkpoint write meets on a full, read-only or forbidden folder (what the user can fix by making room
#: or pointing the run elsewhere), as opposed to a bug.
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (no space, no permission, read-only folder); nothing was replaced.

    Attributes:
        path: The checkpoint that was being written.
        needed_bytes: Its size, when known.
        free_bytes: Free space in its folder at the time, when known.
    """

    def __init__(self, path: str | Path, cause: OSError, needed_bytes: int | None = None) -> None:
        self.path = Path(path)
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes(self.path.parent)
        reason = cause.strerror or str(cause)
        sizes = ""
        if needed_bytes is not None and self.free_bytes is not None:
            sizes = f" (it needs {needed_bytes / 2**20:,.1f} MiB, {self.free_bytes / 2**20:,.1f} MiB free)"
        self.message = f"could not write checkpoint {self.path}: {reason}{sizes}"
        super().__init__(cause.errno, self.message)

    def __str__(self) -> str:
        return self.message


def free_bytes(folder: Path) -> int | None:
    """Free bytes on the filesystem of ``folder`` (or of its nearest existing parent); ``None`` if unknown."""
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def previous_path(path: str | Path) -> Path:
    """Where :class:`AtomicCheckpointIO` keeps the version of ``path`` that the last save replaced."""
    path = Path(path)
    return path.with_name(path.name + PREVIOUS_SUFFIX)


def verify_checkpoint(path: str | Path, check_globals: bool = True) -> None:
    """Check that ``path`` is a complete, undamaged ``torch.save`` archive (or a folder of them).

    Every record's CRC-32 is recomputed, so a flipped byte inside a tensor is found, not only truncation,
    and a file holding objects a safe (``weights_only``) load refuses is rejected without unpickling it.
    A folder (a DeepSpeed checkpoint) passes when it holds at least one ``.pt`` file and all of them pass.

    Args:
        path: A checkpoint file, or a checkpoint folder.
        check_globals: Also refuse a file a safe (``weights_only``) load would refuse. Off for the files of a
            DeepSpeed folder, which hold DeepSpeed's own objects and which DeepSpeed loads unsafely.

    Raises:
        CorruptCheckpointError: Naming the file, what is wrong, and what to do about it.

    Example::

        verify_checkpoint("logs/train/runs/x/checkpoints/last.ckpt")
    """
    path = Path(path)
    if path.is_dir():
        parts = sorted(path.rglob("*.pt"))
        if not parts:
            raise CorruptCheckpointError(_message(path, "the folder holds no .pt files"))
        for part in parts:  # DeepSpeed pickles its own config objects and loads them unsafely, by design
            verify_checkpoint(part, check_globals=False)
        return
    if not path.exists():
        raise CorruptCheckpointError(_message(path, "the file does not exist"))
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise CorruptCheckpointError(_message(path, f"it is truncated or not a torch.save archive ({error})")) from None
    if bad is not None:
        raise CorruptCheckpointError(_message(path, f"record {bad!r} fails its CRC-32 check (damaged bytes)"))
    unsafe = unsafe_globals(path) if check_globals else []
    if unsafe:
        raise CorruptCheckpointError(_message(path, f"it holds objects other than tensors and plain data ({', '.join(unsafe)}), "
                                                    "which a safe load refuses and an unsafe load would execute"))


def unsafe_globals(path: str | Path) -> list[str]:
    """The classes and functions a ``torch.load(weights_only=True)`` of ``path`` would refuse.

    The pickle is disassembled, never run (``torch.serialization.get_unsafe_globals_in_checkpoint``), so a
    checkpoint whose unpickling would run a command is found without running it. Globals allow-listed with
    ``torch.serialization.add_safe_globals`` count as safe, exactly as in the load that follows.
    """
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception as error:  # noqa: BLE001 - any failure to disassemble means the file cannot be loaded safely
        return [f"<unreadable pickle: {type(error).__name__}>"]


def _message(path: Path, reason: str) -> str:
    return (f"Checkpoint {path} is unusable: {reason}. It was not loaded. Fix: resume with ckpt_path=last, which "
            f"skips damaged files and uses the newest checkpoint that verifies (e.g. {previous_path(path).name}), "
            "or pass ckpt_path=<another checkpoint>.")


def _fsync_dir(folder: Path) -> None:
    # the rename is durable only once the folder entry is on disk (POSIX); Windows has no directory fds
    if os.name == "posix":
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _writer_id() -> str:
    """``<pid>``, or ``t<thread>-<pid>`` off the main thread (a watchdog may save while the main thread does)."""
    if threading.current_thread() is threading.main_thread():
        return str(os.getpid())
    return f"t{threading.get_ident()}-{os.getpid()}"


def _remove_orphaned_temporaries(path: Path) -> None:
    """Delete the ``.<name>.tmp-<pid>`` files in ``path``'s folder left by a writer that was killed (its process
    no longer exists), whichever checkpoint it was writing."""
    for tmp in [*path.parent.glob(".*.tmp-*"), *path.parent.glob(".*.prev-*")]:
        pid = tmp.name.rpartition("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not _process_exists(int(pid)):
            tmp.unlink(missing_ok=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class _RecordingFile:
    """A binary file whose first failed ``write`` is kept: ``torch.save`` streaming into it reports a full disk as
    ``RuntimeError: unexpected pos``, and the caller needs the ``OSError`` (its errno) to say what happened."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self) -> None:
        self.file.flush()


def write_atomically(data: bytes | memoryview | Callable[[BinaryIO], None], path: str | Path,
                     keep_previous: bool = True, verify: bool = True) -> None:
    """Write ``data`` to ``path`` so that a reader sees either the old complete file or the new one.

    The bytes go to a temporary file in the same folder, are flushed to disk, optionally verified, and then
    renamed over ``path`` (``os.replace`` is atomic on POSIX and Windows). With ``keep_previous`` the
    replaced version stays reachable as ``<path>.prev`` (a hard link, so no copy is made).

    Args:
        data: The serialised checkpoint, or a function that writes it into the open file (``torch.save`` streams
            into the file: no in-memory copy of the whole checkpoint, which for a full fine-tune of a 0.5B model is
            its weights and optimizer state again, 5.9 GB).
        path: Destination file.
        keep_previous: Keep the replaced version as ``<path>.prev``.
        verify: Re-read the temporary file and check every record before it replaces ``path``.

    Raises:
        CorruptCheckpointError: If ``verify`` finds the written file damaged (the old file is left in place).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphaned_temporaries(path)
    tmp = path.with_name(f".{path.name}.tmp-{_writer_id()}")
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                recording = _RecordingFile(f)
                try:
                    data(recording)
                except RuntimeError:  # torch's zip writer turns the file's OSError (no space...) into this
                    if recording.error is not None:
                        raise recording.error from None
                    raise
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if verify:
            try:
                verify_checkpoint(tmp)
            except CorruptCheckpointError as error:
                unsafe = unsafe_globals(tmp) if "holds objects" in str(error) else []
                if not unsafe:
                    raise
                raise CorruptCheckpointError(
                    f"Refusing to write checkpoint {path}: it would hold objects other than tensors and plain data "
                    f"({', '.join(unsafe[:6])}), which a safe load (torch.load(weights_only=True)) refuses. "
                    "Fix: keep plain Python values in the module's and callbacks' state (e.g. hyperparameters "
                    "given as OmegaConf containers: convert them with OmegaConf.to_container), or register the "
                    "class with torch.serialization.add_safe_globals") from None
        if keep_previous and path.is_file():
            link_tmp = path.with_name(f".{path.name}.prev-{_writer_id()}")
            link_tmp.unlink(missing_ok=True)
            os.link(path, link_tmp)
            os.replace(link_tmp, previous_path(path))
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that writes temp-file-then-rename, verifies, keeps the previous version, and
    refuses to load a damaged checkpoint with a message that says what to do.

    Remote paths (``s3://``...) are passed to Lightning's own writer unchanged.

    Args:
        keep_previous: Keep the version each save replaces as ``<file>.prev`` (a hard link; no extra copy
            while both exist, one extra file's worth of disk after the next save).
        verify: Re-read and CRC-check every checkpoint after writing it, before it replaces the old one.

    Example::

        trainer = Trainer(plugins=[AtomicCheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
    """

    def __init__(self, keep_previous: bool = True, verify: bool = True) -> None:
        super().__init__()
        self.keep_previous = keep_previous
        self.verify = verify
        self.write_seconds = 0.0  # serialising + writing + verifying, for summary.json's time split

    def phase_seconds(self) -> dict[str, float]:
        """``{"checkpoints": seconds}`` spent in :meth:`save_checkpoint` (lit_speed.run_contract.PhaseTimer)."""
        return {"checkpoints": self.write_seconds}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path,
                        storage_options: Optional[Any] = None) -> None:
        start = time.perf_counter()
        try:
            self._save_checkpoint(checkpoint, path, storage_options)
        finally:
            self.write_seconds += time.perf_counter() - start

    def _save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Optional[Any]) -> None:
        if storage_options is not None or not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        try:  # streamed into the temporary file: no second copy of the checkpoint in memory
            write_atomically(lambda f: torch.save(checkpoint, f), path, keep_previous=self.keep_previous,
                             verify=self.verify)
        except OSError as error:  # the temporary file is gone and the previous checkpoint untouched
            if isinstance(error, CheckpointWriteError) or error.errno not in WRITE_ERRNOS:
                raise
            raise CheckpointWriteError(path, error, _tensor_bytes(checkpoint)) from error

    @override
    def load_checkpoint(self, path: str | Path, map_location: Optional[Callable] = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if _is_local(path) and Path(path).exists():
            verify_checkpoint(path)
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path: str | Path) -> None:
        super().remove_checkpoint(path)
        if _is_local(path):
            previous_path(path).unlink(missing_ok=True)

    def describe(self) -> dict[str, str]:
        """Rows for the start-up table."""
        return {"checkpoint writes": "atomic (temp file + rename)" + (", verified" if self.verify else "")
                + (", previous kept as .prev" if self.keep_previous else "")}


def _tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a checkpoint dict (about its size on disk)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _is_local(path: str | Path) -> bool:
    return isinstance(get_filesystem(path), LocalFileSystem)
