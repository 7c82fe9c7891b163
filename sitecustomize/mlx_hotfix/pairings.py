"""Known-bad installs of mlx-lm: pairs that kill the generation thread on the
first request, and releases PyPI yanked. Data, shared by the shim (status
line, death report) and the watchdog (probe, status, doctor).

Stdlib only and import-cheap: the shim loads it when mlx_lm.server loads.

Evidence (ARCHITECTURE.md "Patches by release"): a plain ``pip install mlx-lm==X``
resolves mlx to the newest release. From mlx 0.32 the default stream is per
thread, and mlx-lm releases before 0.31.3 create their stream on the main
thread, so the generation thread dies on its first request with
``There is no Stream(cpu, 0) in current thread``. 0.28.4 and 0.29.1 also
break under transformers 5 (``BatchEncoding`` errors). Each row names the
pin that fixed it in our matrix (scripts/setup-envs keeps the same pins).
"""

# (mlx-lm from, mlx-lm below, package, bad from, bad below, what happens, fix)
# A bound of None is open.
BAD_PAIRS = (
    ("0.28.4", "0.31.3", "mlx", "0.32.0", None,
     "the generation thread dies on the first request "
     "(There is no Stream(cpu, 0) in current thread)",
     "pip install 'mlx<0.32' (tested: mlx==0.31.2)"),
    ("0.28.4", "0.30.0", "transformers", "5.0.0", None,
     "the generation thread dies on the first request (BatchEncoding errors)",
     "pip install 'transformers<5'"),
)

# mlx-lm release -> the reason PyPI shows for its yank.
YANKED = {
    "0.31.0": "Batched KV cache cross contamination",
}


def parse_version(text):
    """'0.31.3' -> (0, 31, 3); tolerant of suffixes like '0.32.0.dev1'."""
    parts = []
    for piece in str(text).split(".")[:3]:
        digits = ""
        for char in piece:
            if not char.isdigit():
                break
            digits += char
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)


def _within(version, low, high):
    v = parse_version(version)
    return (low is None or v >= parse_version(low)) and (high is None or v < parse_version(high))


def installed_version(distribution):
    """The installed version of a distribution in this interpreter, or None."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python < 3.8
        return None
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - broken metadata is not our failure
        return None


def problems(mlx_lm, mlx=None, transformers=None):
    """Every known problem with this install, one line each (may be empty)."""
    if not mlx_lm or mlx_lm == "unknown":
        return []
    found = []
    installed = {"mlx": mlx, "transformers": transformers}
    for low, high, package, bad_low, bad_high, what, fix in BAD_PAIRS:
        other = installed.get(package)
        if not other or other == "unknown":
            continue
        if _within(mlx_lm, low, high) and _within(other, bad_low, bad_high):
            found.append("mlx-lm %s with %s %s: %s; fix: %s"
                         % (mlx_lm, package, other, what, fix))
    reason = YANKED.get(".".join(str(n) for n in parse_version(mlx_lm)))
    if reason:
        found.append('mlx-lm %s was yanked from PyPI: "%s"; use another release'
                     % (mlx_lm, reason))
    return found


def warning_for(mlx_lm, mlx=None, transformers=None):
    """All problems in one line, or None."""
    found = problems(mlx_lm, mlx, transformers)
    return "; ".join(found) if found else None
