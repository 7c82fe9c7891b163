"""Writing a file whole or not at all: the shim's one atomic writer."""

import os


def write_atomically(path, text, *, mode=0o600):
    """Replace path with text through a fresh temp file in its directory.

    mkstemp creates the temp file with O_EXCL and a random name, so a name
    planted by another user (a symlink to the owner's file) is never
    followed; os.replace then swaps the name itself, never a link's target.
    """
    import tempfile  # lazily: the drop-in imports only os and sys up front

    directory, name = os.path.split(os.path.abspath(path))
    descriptor, temporary = tempfile.mkstemp(prefix="." + name + ".", suffix=".tmp",
                                             dir=directory)
    try:
        try:
            os.fchmod(descriptor, mode)
        except OSError:
            pass
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
