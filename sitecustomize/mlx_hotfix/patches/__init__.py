"""The registry of patches, their gates, and the one-line status report.

A patch module defines:
    NAME      its switch name for MLX_HOTFIX_DISABLE
    TARGET    the module it patches
    REASON    why, with the upstream issue numbers
    VERSIONS  (first, tested_below): the mlx-lm releases it was tested on
    FIXED_IN  the release that fixed it upstream, or None
    KIND      "fail-safe" (observes or exits, changes no result: applies past
              the tested releases whenever the shape fits) or "fix" (changes
              what stock code computes: applies only where its check proves
              the buggy code is still there verbatim, with _source.source_of)
    TEST      the test that reproduces the bug on stock and proves the fix
    check_shape(module) -> None if the target looks as expected, else why not
    apply(module)

The shape decides, the version only labels (evidence: every release from
0.28.0 to 0.32.2 was read and run, README "Patches by release"):

- a part applies whenever its shape check passes. A fix part's check proves
  the buggy code is still there verbatim, so it cannot patch code that
  changed; a fail-safe part's check proves the hook points exist.
- outside the tested range it says so: "applied (untested release 0.33.0)".
- a part whose shape does not match is skipped, and the line says what is
  missing or already fixed (a fix part past FIXED_IN says so).
"""

import sys

from .. import _hooks, config, log
from ..pairings import parse_version  # one parser for the gates and the pairings
from . import (admission, advance, disconnect, exit_on_death, extend, extract, heartbeat,
               prompt_cache_bytes, recover)

# Applied in this order; each wraps what the ones before it wrapped. admission
# comes last, outermost: a request waits in its line before any other part
# (or stock) sees it.
PATCHES = (exit_on_death, heartbeat, extend, advance, recover, disconnect, prompt_cache_bytes,
           extract, admission)
SERVER_MODULE = "mlx_lm.server"

# name -> "applied" | "skipped: why" | "disabled" | "not loaded"
status = {}
_reported = False


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


def untested_label(patch, version_text):
    """'' inside the tested range, else ' (untested release X)'."""
    if version_text == "unknown":
        return " (untested release: cannot tell the mlx-lm version)"
    version = parse_version(version_text)
    first, below = (parse_version(v) for v in patch.VERSIONS)
    if first <= version < below:
        return ""
    return " (untested release %s)" % version_text


def skip_reason(patch, version_text, why):
    """The shape check's reason, with the upstream fix named when there is one."""
    fixed_in = getattr(patch, "FIXED_IN", None)
    if (fixed_in and version_text != "unknown"
            and parse_version(version_text) >= parse_version(fixed_in)
            and why != "already applied"):
        return "%s (fixed upstream in %s)" % (why, fixed_in)
    return why


def try_apply(patch, module):
    version_text = mlx_lm_version()
    try:
        why = patch.check_shape(module)
    except Exception as exc:  # noqa: BLE001
        why = "shape check failed (%s: %s)" % (exc.__class__.__name__, exc)
    if why is not None:
        status[patch.NAME] = "skipped: " + skip_reason(patch, version_text, why)
        return False
    try:
        patch.apply(module)
    except Exception as exc:  # noqa: BLE001
        status[patch.NAME] = "skipped: could not apply (%s: %s)" % (
            exc.__class__.__name__, exc)
        log.debug_exception()
        return False
    status[patch.NAME] = "applied" + untested_label(patch, version_text)
    describe = getattr(patch, "describe", None)  # a part with modes says which
    if describe is not None:
        status[patch.NAME] += " (%s)" % describe()
    log.debug("%s applied to %s (%s)" % (patch.NAME, patch.TARGET, patch.REASON))
    return True


def status_line():
    pieces = ["%s %s" % (p.NAME, status.get(p.NAME, "not loaded")) for p in PATCHES]
    line = "mlx-lm %s, mlx %s; %s" % (mlx_lm_version(), mlx_version(), "; ".join(pieces))
    warning = pairing_warning()
    return line + ("; WARNING: " + warning if warning else "")


def pairing_warning():
    """The known-bad-pair or yanked-release line for this process, or None."""
    try:
        from .. import pairings

        return pairings.warning_for(mlx_lm_version(), mlx_version(),
                                    pairings.installed_version("transformers"))
    except Exception:  # noqa: BLE001 - a warning must never break start-up
        return None


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
        off = getattr(patch, "opted_out", lambda: None)()  # an opt-in part not asked for
        if off:
            status[patch.NAME] = off
            continue
        _hooks.when_imported(patch.TARGET, lambda module, p=patch: try_apply(p, module))
    _hooks.when_imported(SERVER_MODULE, report_status)
    from . import main_module

    main_module.watch_for_server_as_main()
