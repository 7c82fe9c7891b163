"""Opening and writing files in directories another user may write to.

A root watchdog must not follow a link planted where its lock or state file
belongs (it would create or truncate a file of the planter's choosing), and
must not block on a FIFO planted there (every probe, and the exit on SIGTERM,
would wait on its lock forever). So: O_NOFOLLOW, O_NONBLOCK for the open
itself, then fstat, and anything but a regular file is refused.

Files others read while we write (the state file, crash reports, service
definitions) are written whole or not at all: `write_atomically`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from typing import Union

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symbolic link",
}


class NotARegularFile(OSError):
    """The path is a link, a FIFO, a device...: refused, with a clear message."""


def open_regular(path: "str | os.PathLike[str]", flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """os.open(path, flags) that refuses links and non-regular files without
    blocking; the descriptor is blocking again once it is known to be a file."""
    path = os.fspath(path)
    try:
        fd = os.open(
            path,
            flags | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
            mode,
        )
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENXIO):
            raise _refused(path, _kind_of(path)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refused(path, _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file"))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: "str | os.PathLike[str]", limit: int) -> bytes:
    """At most limit bytes of the regular file at path, opened as open_regular
    opens it: a link or a FIFO planted there is refused (NotARegularFile),
    never followed nor waited on. Every file the server side can write is
    read this way (heartbeat, reports, stacks, pidfile, hostfile)."""
    with os.fdopen(open_regular(path), "rb") as handle:
        return handle.read(limit)


def write_atomically(path: "str | os.PathLike[str]", data: Union[bytes, str], *,
                     mode: int = 0o600) -> None:
    """Replace path with data: a reader sees the old file or the new one,
    never half of one. A private temporary file (mkstemp: O_EXCL, so nothing
    planted is followed) in the same folder, then os.replace."""
    folder, name = os.path.split(os.fspath(path))
    fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder or ".")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _kind_of(path: str) -> str:
    try:
        return _KINDS.get(stat.S_IFMT(os.lstat(path).st_mode), "not a regular file")
    except OSError:
        return "not a regular file"


def _refused(path: str, kind: str) -> NotARegularFile:
    exc = NotARegularFile(errno.EPERM, f"{path} is {kind}, not a regular file; refusing to use it "
                                       "(remove it, or check who planted it)")
    exc.filename = path
    return exc
