"""The shim's files in folders other users may write: never through a name
someone else planted.

write_atomically   a file whole or not at all (heartbeat, reports)
create_private     a fresh file kept open (faulthandler's fatal and stacks files)
read_regular       a regular file's text, never a link's target or a FIFO
"""

import os


def _fresh_temp(path, mode):
    """(descriptor, temporary name) of a new file next to path, with mode."""
    import tempfile  # lazily: the drop-in imports only os and sys up front

    directory, name = os.path.split(os.path.abspath(path))
    descriptor, temporary = tempfile.mkstemp(prefix="." + name + ".", suffix=".tmp",
                                             dir=directory)
    try:
        os.fchmod(descriptor, mode)
    except OSError:
        pass
    return descriptor, temporary


def create_private(path, *, mode=0o600):
    """A new, empty file at path, open for writing (text), mode 0600.

    Created under a random name (mkstemp: O_EXCL) and renamed onto path, so a
    symlink or file planted at path is replaced, never followed, truncated or
    chmod'ed.
    """
    descriptor, temporary = _fresh_temp(path, mode)
    try:
        os.replace(temporary, path)
    except BaseException:
        os.close(descriptor)
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    return os.fdopen(descriptor, "w")


def read_regular(path, limit):
    """Up to limit bytes of path as text, if it is a regular file (OSError if not).

    O_NOFOLLOW: a planted symlink is not read through; O_NONBLOCK and the
    regular-file check: a FIFO never blocks the reader.
    """
    import stat

    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    descriptor = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise OSError("%s is not a regular file" % path)
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(descriptor, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks).decode(errors="replace")
    finally:
        os.close(descriptor)


def write_atomically(path, text, *, mode=0o600):
    """Replace path with text through a fresh temp file in its directory.

    mkstemp creates the temp file with O_EXCL and a random name, so a name
    planted by another user (a symlink to the owner's file) is never
    followed; os.replace then swaps the name itself, never a link's target.
    """
    descriptor, temporary = _fresh_temp(path, mode)
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
