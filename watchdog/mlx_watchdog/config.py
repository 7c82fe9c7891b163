"""The `watch` config file (TOML), validated whole before anything starts.

    state_file = "~/.local/state/mlx-watchdog/state.json"   # optional
    metrics_port = 9464                                      # optional
    metrics_host = "127.0.0.1"                               # optional
    log_format = "json"                                      # optional: text | json

    [instances.gemma]
    url = "http://127.0.0.1:8080"
    model = "default_model"
    heartbeat_file = "/tmp/gemma.heartbeat"      # optional, see heartbeat.py
    pidfile = "/usr/local/var/run/gemma.pid"     # optional CPU evidence
    restart = { type = "launchd", label = "com.example.mlx-gemma" }

Instance keys (defaults in defaults.py): url (required), model, api_key or
api_key_env (the name of an environment variable holding it), interval,
timeout, failures, boot_grace, health_check, heartbeat_file,
heartbeat_timeout, max_busy, cpu_busy, max_restarts, restart_window,
backoff_max (the longest wait between restarts of servers that never served,
default 60 s), stop_grace (SIGTERM to
SIGKILL, default 30 s), report_dir (where crash reports go), the memory
guard's memory_limit ("48G", "512M", "80%", "auto" or "off"; default auto:
macOS only), memory_horizon and memory_idle_wait (seconds or "6h", "5m";
defaults 6 h and 5 min), caffeinate (macOS: keep the Mac awake while the
server runs; install launchd sets it unless --allow-sleep), and at
most one of pid, pidfile, process_match (a regular expression) to find the
process for CPU evidence. A fixed pid only suits a process that is never
replaced; prefer pidfile or process_match. A signal restart's target doubles
as the CPU evidence when none is given. With a heartbeat_file, one failed
probe restarts a server whose heartbeat is older than heartbeat_timeout
(default 10 s); raise it for huge models whose single prefill step takes
longer.

The restart table (required) is one of:
    { type = "launchd", label = "...", uid = 501, domain = "gui/501" }   # uid, domain optional
    { type = "systemd", unit = "...", user = true }
    { type = "signal", pid = N | pidfile = "..." | match = "...", grace = 30 }  # grace: stop_grace
    { type = "command", argv = ["/path/to/restart", "arg"] }
    { type = "none" }                                   # watch and report only
launchd, systemd and command also take timeout (seconds).

Every mistake is a ConfigError naming the file, the key and what was
expected: `watch.toml: instances.gemma.restart.type: expected one of ...`.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from . import defaults
from .log import FORMATS
from .redact import Secret, printable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

RESTART_TYPES = ("launchd", "systemd", "signal", "command", "none")
# \Z, not $: "$" also matches before a final newline, and a name with one
# forged a log line of its own ([instances."a\n"]).
_NAME = re.compile(r"[A-Za-z0-9\[][A-Za-z0-9_.:\[\]-]*\Z")
NAME_RULE = ("instance names may hold letters, digits and _ . : - [ ] only, and start "
             "with a letter, a digit or [")


def name_problem(name: str) -> Optional[str]:
    """Why name cannot name an instance (logs, metrics, status), or None."""
    return None if _NAME.match(name) else NAME_RULE


def name_from_url(url: str) -> str:
    """The default instance name: the URL's host:port, as a valid name."""
    netloc = url.split("://", 1)[-1].split("/", 1)[0].rsplit("@", 1)[-1]
    name = re.sub(r"[^A-Za-z0-9_.:\[\]-]", "_", netloc)
    return name if _NAME.match(name) else f"[{name}]"


class ConfigError(Exception):
    """A config mistake: which file, which key, what was expected."""


@dataclass(frozen=True)
class RestartConfig:
    type: str
    label: Optional[str] = None  # launchd
    uid: Optional[int] = None  # launchd
    domain: Optional[str] = None  # launchd
    unit: Optional[str] = None  # systemd
    user: bool = True  # systemd
    pid: Optional[int] = None  # signal
    pidfile: Optional[str] = None  # signal
    match: Optional[str] = None  # signal
    grace: Optional[float] = None  # signal; None: the instance's stop_grace
    argv: Optional[Tuple[str, ...]] = None  # command
    timeout: float = defaults.ACTION_TIMEOUT_S  # launchd, systemd, command


@dataclass(frozen=True)
class InstanceConfig:
    name: str
    url: str
    restart: RestartConfig
    model: str = defaults.MODEL
    api_key: Optional[Secret] = None  # Secret: shows as '***' in any repr
    interval: float = defaults.PROBE_INTERVAL_S
    timeout: float = defaults.PROBE_TIMEOUT_S
    failures: int = defaults.FAILURES
    boot_grace: float = defaults.BOOT_GRACE_S
    health_check: bool = defaults.CHECK_HEALTH
    heartbeat_file: Optional[str] = None
    heartbeat_timeout: float = defaults.HEARTBEAT_TIMEOUT_S
    max_busy: float = defaults.MAX_BUSY_S
    cpu_busy: float = defaults.CPU_BUSY_FRACTION
    pid: Optional[int] = None
    pidfile: Optional[str] = None
    process_match: Optional[str] = None
    cacert: Optional[str] = None  # https: CA certificates instead of the system's
    max_restarts: int = defaults.MAX_RESTARTS
    restart_window: float = defaults.RESTART_WINDOW_S
    backoff_max: float = defaults.BACKOFF_MAX_S
    stop_grace: float = defaults.STOP_GRACE_S
    report_dir: Optional[str] = None
    memory_limit: str = defaults.MEMORY_LIMIT  # as written: 48G, 512M, 80%, auto, off
    memory_horizon: float = defaults.MEMORY_HORIZON_S
    memory_idle_wait: float = defaults.MEMORY_IDLE_WAIT_S
    caffeinate: bool = False  # macOS: caffeinate -i -s -w <server pid> (keep_awake.py)


@dataclass(frozen=True)
class WatchConfig:
    path: str
    instances: Tuple[InstanceConfig, ...]
    state_file: Optional[str] = None
    metrics_port: Optional[int] = None
    metrics_host: str = defaults.METRICS_HOST
    log_format: str = defaults.LOG_FORMAT
    warnings: Tuple[str, ...] = ()  # keys still accepted but no longer used


# Keys that once meant something: accepted, with a warning, so that an old
# config still starts its watchdog.
RETIRED = {
    "backoff_reset": "no longer used: a start that served ends the backoff at once "
                     "(the next restart is immediate); remove it",
}


# -- value checks: each returns the clean value or raises _Bad(expectation) ---


class _Bad(Exception):
    pass


def _string(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Bad("a non-empty string")
    return value


def _path(value: Any) -> str:
    return os.path.expanduser(_string(value))


def _url(value: Any) -> str:
    from .probe import url_problem

    problem = url_problem(value)
    if problem:
        raise _Bad(f'a URL like "http://127.0.0.1:8080" ({problem})')
    from .probe import server_root

    return server_root(value)


def _cacert(value: Any) -> str:
    from .probe import make_tls_context

    path = _path(value)
    try:
        make_tls_context(path)
    except OSError as exc:
        raise _Bad(f"a readable PEM file of CA certificates ({exc.strerror or exc})") from None
    except Exception as exc:  # noqa: BLE001 - ssl.SSLError: not PEM certificates
        raise _Bad(f"a PEM file of CA certificates ({exc})") from None
    return path


def _number(
    minimum: float, *, integer: bool = False, inclusive: bool = False, what: str = ""
) -> Callable[[Any], Any]:
    kind = "a whole number" if integer else "a number"
    bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
    expected = f"{kind}{' of ' + what if what else ''} {bound}"

    def check(value: Any) -> Any:
        types = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, types):
            raise _Bad(expected)
        # nan passes every comparison below; inf overflows timers and sleeps.
        if not math.isfinite(value) or value > MAX_NUMBER:
            raise _Bad(f"a finite {expected.removeprefix('a ')} (at most {MAX_NUMBER:g})")
        if value < minimum or (value == minimum and not inclusive):
            raise _Bad(expected)
        return value

    return check


_seconds = _number(0, what="seconds")
_seconds_or_zero = _number(0, inclusive=True, what="seconds")
_count = _number(1, integer=True, inclusive=True)
_pid = _number(1, integer=True, inclusive=True)


def _port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise _Bad("a port number from 1 to 65535")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Bad("true or false")
    return value


def _choice(*options: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in options:
            raise _Bad("one of " + ", ".join(f'"{o}"' for o in options))
        return value

    return check


def _regex(value: Any) -> str:
    text = _string(value)
    try:
        re.compile(text)
    except re.error as exc:
        raise _Bad(f"a valid regular expression ({exc})") from None
    return text


def _argv(value: Any) -> Tuple[str, ...]:
    expected = 'a list of strings like ["/usr/local/bin/restart-mlx", "--now"]'
    if isinstance(value, str):
        raise _Bad(expected + " (a list, not one string: no shell is involved)")
    if not isinstance(value, list) or not value or not all(isinstance(a, str) and a for a in value):
        raise _Bad(expected)
    return tuple(value)


def _memory_limit(value: Any) -> str:
    from .memory import FORMS, MemoryLimitError, parse_memory_limit

    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise _Bad(f"{FORMS}, as text: \"48G\"")
    try:
        parse_memory_limit(value)
    except MemoryLimitError as exc:
        raise _Bad(f"{FORMS} ({exc})") from None
    return str(value).strip()


def _duration(value: Any) -> float:
    from .memory import parse_duration

    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _Bad('seconds or a duration such as "90s", "30m", "6h"')
    try:
        seconds = parse_duration(value, "duration")
    except ValueError:
        raise _Bad('a positive number of seconds or a duration such as "90s", "30m", '
                   '"6h"') from None
    if seconds > MAX_NUMBER:
        raise _Bad(f"a duration of at most {MAX_NUMBER:g} seconds")
    return seconds


def _env_var(value: Any) -> str:
    name = _string(value)
    if name not in os.environ:
        raise _Bad(f"the name of a set environment variable ({name} is not set)")
    return name


REQUIRED = object()
MAX_NUMBER = 1e7  # seconds (115 days) or counts; more overflows sleeps and timers

_GLOBAL = {
    "state_file": (_path, None),
    "metrics_port": (_port, None),
    "metrics_host": (_string, defaults.METRICS_HOST),
    "log_format": (_choice(*FORMATS), defaults.LOG_FORMAT),
    "instances": (None, REQUIRED),  # checked on its own
}

_INSTANCE = {
    "url": (_url, REQUIRED),
    "restart": (None, REQUIRED),  # checked on its own
    "model": (_string, defaults.MODEL),
    "api_key": (_string, None),
    "api_key_env": (_env_var, None),
    "cacert": (_cacert, None),
    "interval": (_seconds, defaults.PROBE_INTERVAL_S),
    "timeout": (_seconds, defaults.PROBE_TIMEOUT_S),
    "failures": (_count, defaults.FAILURES),
    "boot_grace": (_seconds_or_zero, defaults.BOOT_GRACE_S),
    "health_check": (_bool, defaults.CHECK_HEALTH),
    "heartbeat_file": (_path, None),
    "heartbeat_timeout": (_seconds, defaults.HEARTBEAT_TIMEOUT_S),
    "max_busy": (_seconds_or_zero, defaults.MAX_BUSY_S),
    "cpu_busy": (_number(0, what="cores"), defaults.CPU_BUSY_FRACTION),
    "pid": (_pid, None),
    "pidfile": (_path, None),
    "process_match": (_regex, None),
    "max_restarts": (_count, defaults.MAX_RESTARTS),
    "restart_window": (_seconds, defaults.RESTART_WINDOW_S),
    "backoff_max": (_seconds_or_zero, defaults.BACKOFF_MAX_S),
    "stop_grace": (_seconds_or_zero, defaults.STOP_GRACE_S),
    "report_dir": (_path, None),
    "memory_limit": (_memory_limit, defaults.MEMORY_LIMIT),
    "memory_horizon": (_duration, defaults.MEMORY_HORIZON_S),
    "memory_idle_wait": (_duration, defaults.MEMORY_IDLE_WAIT_S),
    "caffeinate": (_bool, False),
}

_ACTION_TIMEOUT = (_seconds, defaults.ACTION_TIMEOUT_S)
_RESTART = {
    "launchd": {
        "label": (_string, REQUIRED),
        "uid": (_number(0, integer=True, inclusive=True), None),
        "domain": (_string, None),
        "timeout": _ACTION_TIMEOUT,
    },
    "systemd": {"unit": (_string, REQUIRED), "user": (_bool, True), "timeout": _ACTION_TIMEOUT},
    "signal": {
        "pid": (_pid, None),
        "pidfile": (_path, None),
        "match": (_regex, None),
        "grace": (_seconds_or_zero, None),
    },
    "command": {"argv": (_argv, REQUIRED), "timeout": _ACTION_TIMEOUT},
    "none": {},
}
_SECRET_KEYS = {"api_key"}


class _Reader:
    def __init__(self, path: str):
        self.path = path

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.path}: {key}: {message}")

    def table(self, value: Any, key: str) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise self.error(key, f"expected a table, got {_shown(value)}")
        return value

    def fields(
        self, data: Mapping[str, Any], prefix: str, spec: Mapping[str, Tuple[Any, Any]]
    ) -> Dict[str, Any]:
        for key in data:
            if key not in spec:
                close = difflib.get_close_matches(key, list(spec), n=1)
                hint = f' (did you mean "{close[0]}"?)' if close else ""
                known = ", ".join(sorted(spec))
                raise self.error(f"{prefix}{key}", f"unknown key{hint}; expected one of: {known}")
        values = {}
        for key, (check, default) in spec.items():
            if key not in data:
                if default is REQUIRED:
                    expected = "a table" if check is None else _expectation(check)
                    raise self.error(f"{prefix}{key}", f"missing; expected {expected}")
                values[key] = default
            elif check is None:
                values[key] = data[key]
            else:
                try:
                    values[key] = check(data[key])
                except _Bad as bad:
                    got = "" if key in _SECRET_KEYS else f", got {_shown(data[key])}"
                    raise self.error(f"{prefix}{key}", f"expected {bad}{got}") from None
        return values


def _expectation(check: Callable[[Any], Any]) -> str:
    try:
        check(object())
    except _Bad as bad:
        return str(bad)
    return "a value"  # pragma: no cover


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"' if len(value) <= 60 else f'"{value[:57]}..."'
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def load_config(path: "str | os.PathLike[str]") -> WatchConfig:
    """Read and validate path; ConfigError for any mistake."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {_toml_message(exc)}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {exc.start}); TOML files must be UTF-8"
        ) from None
    return parse_config(data, path)


def _toml_message(exc: Exception) -> str:
    text = str(exc)
    twice = re.match(r"Cannot declare \((.*)\) twice(.*)", text)
    if twice:
        key = ".".join(re.findall(r"'([^']*)'", twice.group(1)))
        what = "duplicate instance name" if key.startswith("instances.") else "declared twice"
        return f"{key}: {what}{twice.group(2)}"
    return f"TOML syntax error: {text}"


def parse_config(data: Mapping[str, Any], path: str = "<config>") -> WatchConfig:
    """Validate an already parsed TOML document."""
    reader = _Reader(path)
    top = reader.fields(data, "", _GLOBAL)
    instances = reader.table(top.pop("instances"), "instances")
    if not instances:
        raise reader.error("instances", "expected at least one [instances.NAME] table")
    warnings: list = []
    parsed = tuple(_instance(reader, name, body, warnings) for name, body in instances.items())
    return WatchConfig(path=path, instances=parsed, warnings=tuple(warnings), **top)


def _instance(reader: _Reader, name: str, body: Any, warnings: list) -> InstanceConfig:
    prefix = f"instances.{name}"
    if name_problem(name):
        raise reader.error(printable(prefix), NAME_RULE)
    body = dict(reader.table(body, prefix))
    for key in sorted(RETIRED.keys() & body.keys()):
        del body[key]
        warnings.append(f"{reader.path}: {prefix}.{key}: {RETIRED[key]}")
    values = reader.fields(body, prefix + ".", _INSTANCE)
    if values["api_key"] is not None and values["api_key_env"] is not None:
        raise reader.error(f"{prefix}.api_key_env", "expected api_key or api_key_env, not both")
    key_env = values.pop("api_key_env")
    api_key = values.pop("api_key") or (os.environ[key_env] if key_env else None)
    if key_env and not api_key.strip():
        raise reader.error(f"{prefix}.api_key_env", f"the variable {key_env} is empty")
    evidence = [k for k in ("pid", "pidfile", "process_match") if values[k] is not None]
    if len(evidence) > 1:
        raise reader.error(
            f"{prefix}.{evidence[1]}", "expected at most one of pid, pidfile, process_match"
        )
    restart = _restart(reader, values.pop("restart"), f"{prefix}.restart")
    secret = Secret(api_key) if api_key else None  # stripped of whitespace
    return InstanceConfig(name=name, restart=restart, api_key=secret, **values)


def _restart(reader: _Reader, body: Any, prefix: str) -> RestartConfig:
    table = dict(reader.table(body, prefix))
    expected = "one of " + ", ".join(f'"{t}"' for t in RESTART_TYPES)
    if "type" not in table:
        raise reader.error(f"{prefix}.type", f"missing; expected {expected}")
    kind = table.pop("type")
    if kind not in RESTART_TYPES:
        raise reader.error(f"{prefix}.type", f"expected {expected}, got {_shown(kind)}")
    values = reader.fields(table, prefix + ".", _RESTART[kind])
    if kind == "signal" and sum(values[k] is not None for k in ("pid", "pidfile", "match")) != 1:
        expected = 'expected exactly one of pid, pidfile or match for type = "signal"'
        raise reader.error(prefix, expected)
    return RestartConfig(type=kind, **values)
