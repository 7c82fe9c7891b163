"""Opening files in directories another user may write to.

A root watchdog must not follow a link planted where its lock or state file
belongs (it would create or truncate a file of the planter's choosing), and
must not block on a FIFO planted there (every probe, and the exit on SIGTERM,
would wait on its lock forever). So: O_NOFOLLOW, O_NONBLOCK for the open
itself, then fstat, and anything but a regular file is refused.
"""

from __future__ import annotations

import errno
import os
import stat

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
