"""The registry of patches, their gates, and the one-line status report.

A patch module defines:
    NAME      its switch name for MLX_HOTFIX_DISABLE
    TARGET    the module it patches
    REASON    why, with the upstream issue numbers
    VERSIONS  (first, below): the mlx-lm releases it is known to fit
    FIXED_IN  the release that fixed it upstream, or None
    KIND      "fail-safe" (observes or exits, changes no result: applies past
              the tested releases whenever the shape fits) or "fix"
    TEST      the test that reproduces the bug on stock and proves the fix
    check_shape(module) -> None if the target looks as expected, else why not
    apply(module)
"""

import sys

from .. import _hooks, config, log
from . import advance, exit_on_death, extend, heartbeat

PATCHES = (exit_on_death, heartbeat, extend, advance)
SERVER_MODULE = "mlx_lm.server"

# name -> "applied" | "skipped: why" | "disabled" | "not loaded"
status = {}
_reported = False


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


def mlx_lm_version():
    module = sys.modules.get("mlx_lm._version") or sys.modules.get("mlx_lm")
    version = getattr(module, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version("mlx-lm")
        except Exception:  # noqa: BLE001
            version = "unknown"
    return str(version)


def mlx_version():
    core = sys.modules.get("mlx.core")
    return str(getattr(core, "__version__", "unknown"))


def version_gate(patch, version_text):
    """None if the installed mlx-lm is in the patch's range, else why not."""
    if version_text == "unknown":
        return "cannot tell the mlx-lm version"
    version = parse_version(version_text)
    first, below = (parse_version(v) for v in patch.VERSIONS)
    if patch.FIXED_IN and version >= parse_version(patch.FIXED_IN):
        return "mlx-lm %s has the upstream fix (%s)" % (version_text, patch.FIXED_IN)
    if version < first:
        return "mlx-lm %s is older than the code this fixes (%s)" % (
            version_text, patch.VERSIONS[0])
    if version >= below and getattr(patch, "KIND", "fix") != "fail-safe":
        return "mlx-lm %s is newer than the releases this is tested on (< %s)" % (
            version_text, patch.VERSIONS[1])
    return None


def try_apply(patch, module):
    why = version_gate(patch, mlx_lm_version())
    if why is None:
        try:
            why = patch.check_shape(module)
        except Exception as exc:  # noqa: BLE001
            why = "shape check failed (%s: %s)" % (exc.__class__.__name__, exc)
    if why is not None:
        status[patch.NAME] = "skipped: " + why
        return False
    try:
        patch.apply(module)
    except Exception as exc:  # noqa: BLE001
        status[patch.NAME] = "skipped: could not apply (%s: %s)" % (
            exc.__class__.__name__, exc)
        log.debug_exception()
        return False
    status[patch.NAME] = "applied"
    version_text = mlx_lm_version()
    if parse_version(version_text) >= parse_version(patch.VERSIONS[1]):
        status[patch.NAME] = "applied (untested release %s)" % version_text
    log.debug("%s applied to %s (%s)" % (patch.NAME, patch.TARGET, patch.REASON))
    return True


def status_line():
    pieces = ["%s %s" % (p.NAME, status.get(p.NAME, "not loaded")) for p in PATCHES]
    return "mlx-lm %s, mlx %s; %s" % (mlx_lm_version(), mlx_version(), "; ".join(pieces))


def report_status(_module=None):
    """The one stderr line a server process gets when mlx_lm.server loads."""
    global _reported
    if _reported:
        return
    _reported = True
    log.say(status_line())


def register_all():
    settings = config.current()
    for patch in PATCHES:
        if not settings.enabled(patch.NAME):
            status[patch.NAME] = "disabled"
            continue
        _hooks.when_imported(patch.TARGET, lambda module, p=patch: try_apply(p, module))
    _hooks.when_imported(SERVER_MODULE, report_status)
    from . import main_module

    main_module.watch_for_server_as_main()
