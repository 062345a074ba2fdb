"""Writing (and reading) a file inside a directory without following symbolic links, and without half-written files.

A write goes to a temporary file beside the target and is renamed over it once
complete (os.replace), so a reader sees the old file or the new one, never a mix,
and a failed write leaves the old file as it was. The path below the directory
is opened one component at a time relative to its parent, with O_NOFOLLOW: a
symbolic link anywhere below the directory (the file itself included) is
refused, so a write can never land outside it. The directory itself is the
caller's choice and may be reached through links. read_text reads the same way,
so a report in an artifact cannot show a file from elsewhere.
"""
from __future__ import annotations

import os
import secrets
import stat
import zipfile
from pathlib import Path, PurePath
from typing import BinaryIO, Callable, Mapping

import numpy as np
from numpy.lib import format as npy_format

from tessel.ir.errors import TesselError

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


class FileWriteError(TesselError):
    """A file may not or cannot be written: it exists, a link leads elsewhere, or the file system refuses."""


class FileReadError(TesselError):
    """A file may not or cannot be read: a link leads elsewhere, or it is missing or unreadable."""


def write_file(directory: str | os.PathLike, relative: str | os.PathLike, write: Callable[[BinaryIO], None], *,
               overwrite: bool = True, make_dirs: bool = False) -> Path:
    """Write `directory/relative` atomically with `write(file)`; return its path.

    Refuses (FileWriteError) a symbolic link on the way or at the file, an existing file unless `overwrite`,
    and reports a file-system failure (read-only, full, permission) as FileWriteError; nothing is left behind.
    `make_dirs` creates missing directories below `directory`.
    """
    target = Path(directory) / relative
    parts = _checked_parts(target, relative)
    parent_fd = _open_parent(directory, target, parts[:-1], make_dirs)
    name = parts[-1]
    temporary = f".{name}.{secrets.token_hex(4)}.tmp"
    try:
        _check_target(parent_fd, name, target, overwrite)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=parent_fd)
        try:
            with os.fdopen(fd, "wb") as file:
                write(file)
                file.flush()
                os.fsync(file.fileno())
            _check_target(parent_fd, name, target, overwrite)  # the run may have taken long: look again
            os.replace(temporary, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        except BaseException:
            _remove_quietly(temporary, parent_fd)
            raise
    except OSError as exc:
        raise FileWriteError(f"{target}: cannot write it ({exc.strerror or exc})") from exc
    finally:
        os.close(parent_fd)
    return target


def write_bytes(directory: str | os.PathLike, relative: str | os.PathLike, data: bytes, **options) -> Path:
    """Write bytes to `directory/relative` atomically, never through a symbolic link (see write_file)."""
    return write_file(directory, relative, lambda file: file.write(data), **options)


def write_text(directory: str | os.PathLike, relative: str | os.PathLike, text: str, **options) -> Path:
    """Write UTF-8 text to `directory/relative` atomically, never through a symbolic link (see write_file)."""
    return write_bytes(directory, relative, text.encode("utf-8"), **options)


def write_npz(directory: str | os.PathLike, relative: str | os.PathLike, arrays: Mapping[str, np.ndarray],
              **options) -> Path:
    """Write arrays by name as an .npz (what numpy.load reads) atomically, never through a symbolic link.

    Unlike numpy.savez(file, **arrays), any name works: an array named 'file' or 'allow_pickle' is saved too.
    """
    def write(file: BinaryIO) -> None:
        with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name, array in arrays.items():
                with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                    npy_format.write_array(member, np.asanyarray(array), allow_pickle=False)

    return write_file(directory, relative, write, **options)


def check_writable(directory: str | os.PathLike, relative: str | os.PathLike, *, overwrite: bool) -> Path:
    """Raise FileWriteError now if write_file(directory, relative, overwrite=overwrite) would be refused;
    lets a command refuse before long work rather than after it. Returns the target's path."""
    target = Path(directory) / relative
    parts = _checked_parts(target, relative)
    parent_fd = _open_parent(directory, target, parts[:-1], make_dirs=False)
    try:
        _check_target(parent_fd, parts[-1], target, overwrite)
        if not os.access(".", os.W_OK, dir_fd=parent_fd):
            raise FileWriteError(f"{target}: cannot write it (its directory is not writable)")
    finally:
        os.close(parent_fd)
    return target


def read_text(directory: str | os.PathLike, relative: str | os.PathLike) -> str:
    """The UTF-8 text of `directory/relative`, refusing (FileReadError) a symbolic link on the way or at the file."""
    target = Path(directory) / relative
    parts = _checked_parts(target, relative, FileReadError, "read")
    parent_fd = _open_parent(directory, target, parts[:-1], make_dirs=False, error=FileReadError, verb="read")
    try:
        _refuse_link(parent_fd, parts[-1], target, None, FileReadError, "read")
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW, dir_fd=parent_fd)
        with os.fdopen(fd, "rb") as file:
            return file.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise FileReadError(f"{target}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from exc
    finally:
        os.close(parent_fd)


def _checked_parts(target: Path, relative: str | os.PathLike, error=FileWriteError, verb="write") -> tuple[str, ...]:
    parts = PurePath(relative).parts
    if not parts or PurePath(relative).is_absolute() or any(part in ("..", ".") for part in parts):
        raise error(f"{target}: not a plain relative path inside its directory; refusing to {verb} it")
    return parts


def _open_parent(directory: str | os.PathLike, target: Path, parts: tuple[str, ...], make_dirs: bool,
                 error=FileWriteError, verb="write") -> int:
    """A descriptor of the target's directory, reached from `directory` without following any link."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise error(f"{target}: cannot {verb} it ({directory}: {exc.strerror or exc})") from exc
    for index, part in enumerate(parts):
        shown = Path(*parts[:index + 1])
        try:
            if make_dirs:
                try:
                    os.mkdir(part, dir_fd=fd)
                except FileExistsError:
                    pass
            _refuse_link(fd, part, target, shown, error, verb)
            next_fd = os.open(part, _DIRECTORY_FLAGS, dir_fd=fd)
        except OSError as exc:
            raise error(f"{target}: cannot {verb} it ({shown}: {exc.strerror or exc})") from exc
        finally:
            os.close(fd)
        fd = next_fd
    return fd


def _check_target(parent_fd: int, name: str, target: Path, overwrite: bool) -> None:
    _refuse_link(parent_fd, name, target, None)
    try:
        mode = os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        raise FileWriteError(f"{target}: is a directory; choose a file name")
    if not overwrite:
        raise FileWriteError(f"{target}: already exists; choose another file or pass --force")


def _refuse_link(parent_fd: int, name: str, target: Path, shown: Path | None, error=FileWriteError,
                 verb: str = "write") -> None:
    """Raise if `name` in the directory `parent_fd` is a symbolic link; `shown` names it, None for the target."""
    try:
        mode = os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        what = "is a symbolic link" if shown is None else f"{shown} is a symbolic link"
        raise error(f"{target}: {what}; refusing to {verb} through it (remove the link or choose another path)")


def _remove_quietly(name: str, parent_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=parent_fd)
    except OSError:
        pass
