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
0.28.0 to 0.32.2 was read and run, ARCHITECTURE.md "Patches by release"):

- a part applies whenever its shape check passes. A fix part's check proves
  the buggy code is still there verbatim, so it cannot patch code that
  changed; a fail-safe part's check proves the hook points exist.
- outside the tested range it says so: "applied (untested release 0.33.0)".
- a part whose shape does not match is skipped, and the line says what is
  missing or already fixed (a fix part past FIXED_IN says so).
"""

from .. import _hooks, config, log
from ..pairings import parse_version  # one parser for the gates and the pairings
from ..versions import mlx_lm_version, mlx_version, pairing_warning
from . import (admission, advance, disconnect, drain, extend, extract, heartbeat, held_socket,
               prompt_cache_bytes, recover, validate)
from . import exit as exit_part  # the part named exit (a module attribute, not the builtin)

# Applied in this order; each wraps what the ones before it wrapped.
# - validate wraps only what no other part wraps (APIHandler.do_POST and
#   validate_model_parameters, which stock's do_POST calls once the body is
#   read, before handle_completion), so its place changes nothing at run
#   time; it stands with the parts that gate a request, first: a bad request
#   is answered 400 in the HTTP handler before drain's check and before
#   admission's line (it never queues, never counts as in flight).
# - admission wraps a request outside every part but drain: a request waits
#   in its line before any other part (or stock) sees it.
# - drain comes after exit (it needs the exit part's stop) and heartbeat (it
#   wraps /health outside), and outside admission: a request accepted before
#   the SIGTERM is counted by the drain while it waits in admission's line
#   too, and finishes; a new one gets the drain's 503 at once, never a place
#   in the line first.
# - socket only replaces the listener's bind (no request passes it): its
#   place is free.
PATCHES = (exit_part, heartbeat, extend, advance, recover, disconnect, prompt_cache_bytes,
           extract, validate, admission, drain, held_socket)
SERVER_MODULE = "mlx_lm.server"

# name -> "applied" | "skipped: why" | "disabled" | "not loaded"
status = {}
_reported = False


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


def report_status(_module=None):
    """The one stderr line a server process gets when mlx_lm.server loads."""
    global _reported
    if _reported:
        return
    _reported = True
    log.say(status_line())


def server_loaded(_module=None):
    """This process is a server: arm the crash reports (faulthandler into the
    report folder, folding what earlier servers left), then the status line.
    Only here, never on a plain ``import mlx_lm``: a notebook or
    ``mlx_lm.generate`` with the shim on its path gets neither."""
    from .. import reports

    reports.prepare()  # never raises
    report_status()


_wanted = []  # the parts switched on, in PATCHES order


def apply_to_server_main(namespace):
    """``python -m mlx_lm.server`` (see _launch): every wanted part whose
    TARGET is the server module, applied to the ``__main__`` namespace."""
    for patch in _wanted:
        if patch.TARGET == SERVER_MODULE:
            try_apply(patch, namespace)
    server_loaded(namespace)


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
        _wanted.append(patch)
        _hooks.when_imported(patch.TARGET, lambda module, p=patch: try_apply(p, module))
    _hooks.when_imported(SERVER_MODULE, server_loaded)
    from .. import _launch

    _launch.watch_for_server_as_main(apply_to_server_main)
