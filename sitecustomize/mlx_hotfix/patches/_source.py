"""Read a target's source for a fix part's gate (is the buggy code still there?)."""


def source_of(function):
    """The source of function (under any wrappers), or None if it cannot be read."""
    import inspect  # only when a gate runs: never at the shim's import

    try:
        return inspect.getsource(inspect.unwrap(function))
    except (OSError, TypeError, ValueError):  # no file, a builtin, a wrapper cycle
        return None


def flat(source):
    """The source with every run of whitespace made one space."""
    return " ".join(source.split())
