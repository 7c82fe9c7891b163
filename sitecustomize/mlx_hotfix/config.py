"""The shim's settings, read once from the environment.

MLX_HOTFIX=0                 the whole shim off (handled in sitecustomize.py)
MLX_HOTFIX_DISABLE=a,b       turn off the named parts: exit, heartbeat, extend, advance
MLX_HOTFIX_DEBUG=1           verbose
MLX_HOTFIX_EXIT_CODE=70      exit status after the generation thread dies
MLX_HOTFIX_EXIT_GRACE=1.0    at most this many seconds to answer waiting clients
MLX_HOTFIX_HEARTBEAT_FILE=P  write a heartbeat file from the generation loop
MLX_HOTFIX_HEARTBEAT_INTERVAL=1.0  at most one heartbeat write per this many s
MLX_HOTFIX_STALL_TIMEOUT=300 requests in flight and nothing delivered this long: stalled
"""

import os

PARTS = ("exit", "heartbeat", "extend", "advance")
_TRUE = ("1", "true", "yes", "on")

_current = None


class Config:
    def __init__(self, environ):
        self.warnings = []
        self.debug = environ.get("MLX_HOTFIX_DEBUG", "").strip().lower() in _TRUE
        self.disabled = self._parse_disable(environ.get("MLX_HOTFIX_DISABLE", ""))
        self.exit_code = self._number(
            environ, "MLX_HOTFIX_EXIT_CODE", 70, int, lambda v: 1 <= v <= 255,
            "an integer from 1 to 255",
        )
        self.exit_grace = self._number(
            environ, "MLX_HOTFIX_EXIT_GRACE", 1.0, float, lambda v: 0 <= v <= 60,
            "a number of seconds from 0 to 60",
        )
        self.heartbeat_file = environ.get("MLX_HOTFIX_HEARTBEAT_FILE") or None
        self.heartbeat_interval = self._number(
            environ, "MLX_HOTFIX_HEARTBEAT_INTERVAL", 1.0, float,
            lambda v: 0.05 <= v <= 3600, "a number of seconds from 0.05 to 3600",
        )
        # Longer than the longest single prefill step (see README, "Stalls").
        self.stall_timeout = self._number(
            environ, "MLX_HOTFIX_STALL_TIMEOUT", 300.0, float,
            lambda v: 1 <= v <= 86400, "a number of seconds from 1 to 86400",
        )

    def _parse_disable(self, raw):
        names = [n.strip().lower() for n in raw.split(",") if n.strip()]
        unknown = [n for n in names if n not in PARTS]
        if unknown:
            self.warnings.append(
                "MLX_HOTFIX_DISABLE: unknown name%s %s ignored; known names: %s"
                % ("s" if len(unknown) > 1 else "", ", ".join(map(repr, unknown)),
                   ", ".join(PARTS))
            )
        return frozenset(n for n in names if n in PARTS)

    def _number(self, environ, key, default, kind, valid, expected):
        raw = environ.get(key, "").strip()
        if not raw:
            return default
        try:
            value = kind(raw)
            if valid(value):
                return value
        except ValueError:
            pass
        self.warnings.append(
            "%s=%r is not %s; using %r" % (key, raw, expected, default)
        )
        return default

    def enabled(self, part):
        return part not in self.disabled


def current():
    global _current
    if _current is None:
        _current = Config(os.environ)
    return _current
