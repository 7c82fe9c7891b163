"""Structured logging: `--log-format text` for people, `json` for machines.

JSON is one object per line: time, level, event, instance, message, and the
event's own fields at the top level. Known secrets are scrubbed from every
line, whatever the format.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from datetime import datetime
from typing import IO, Any, Optional

from .redact import printable, scrub

LOGGER = logging.getLogger("mlx_watchdog")
FORMATS = ("text", "json")
_RESERVED = {"time", "level", "event", "instance", "message"}


def _timestamp(created: float) -> str:
    return datetime.fromtimestamp(created).astimezone().isoformat(timespec="milliseconds")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": _timestamp(record.created),
            "level": record.levelname.lower(),
            "event": getattr(record, "event", "log"),
            "instance": getattr(record, "instance", None),
            "message": record.getMessage(),
        }
        for key, value in getattr(record, "fields", {}).items():
            line[f"field_{key}" if key in _RESERVED else key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return scrub(json.dumps(line, default=str))


def colour_wanted(no_color: bool = False) -> bool:
    """Colour on a terminal, unless --no-color or NO_COLOR (no-color.org: set
    and not empty) says otherwise."""
    return sys.stdout.isatty() and not no_color and not os.environ.get("NO_COLOR")


def _said(value: Any, message: str) -> bool:
    """Whether the message already says value (as a whole word)."""
    if isinstance(value, (dict, list, tuple)) or value is None or value == "":
        return False
    text = re.escape(str(value))
    return re.search(rf"(?<![\w.-]){text}(?![\w-]|\.\d)", message) is not None


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        # One event, one line: control characters in a name or a message
        # (a newline, ESC) are escaped, so nothing forges a line or drives
        # the terminal. A traceback keeps its lines, each escaped.
        instance = getattr(record, "instance", None)
        parts = [_timestamp(record.created), f"{record.levelname:<7}"]
        if instance:
            parts.append(f"[{printable(instance)}]")
        message = record.getMessage()
        parts.append(f"{printable(getattr(record, 'event', 'log'))}: {printable(message)}")
        for key, value in getattr(record, "fields", {}).items():
            if not _said(value, message):  # one line per event, nothing said twice
                parts.append(f"{printable(key)}={json.dumps(value, default=str)}")
        text = " ".join(parts)
        if record.exc_info:
            trace = self.formatException(record.exc_info)
            text += "\n" + "\n".join(printable(line) for line in trace.split("\n"))
        return scrub(text)


def setup_logging(
    fmt: str = "text", stream: Optional[IO[str]] = None, level: int = logging.INFO
) -> logging.Handler:
    """Send mlx_watchdog's log events to stream (default stderr) in fmt."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    for old in list(LOGGER.handlers):
        LOGGER.removeHandler(old)
    LOGGER.addHandler(handler)
    LOGGER.setLevel(level)
    LOGGER.propagate = False
    return handler


class Events:
    """Log events about one instance: `events.warning("restart", "...", cause="wedged")`."""

    def __init__(self, instance: Optional[str] = None, logger: logging.Logger = LOGGER):
        self.instance = instance
        self.logger = logger

    def log(self, level: int, event: str, message: str, /, **fields: Any) -> None:
        self.logger.log(
            level, message, extra={"event": event, "instance": self.instance, "fields": fields}
        )

    def info(self, event: str, message: str, /, **fields: Any) -> None:
        self.log(logging.INFO, event, message, **fields)

    def warning(self, event: str, message: str, /, **fields: Any) -> None:
        self.log(logging.WARNING, event, message, **fields)

    def error(self, event: str, message: str, /, **fields: Any) -> None:
        self.log(logging.ERROR, event, message, **fields)

    def exception(self, event: str, message: str, /, **fields: Any) -> None:
        """An error with the current exception's traceback."""
        self.logger.exception(
            message, extra={"event": event, "instance": self.instance, "fields": fields}
        )


class LoopFailures:
    """For a long-running loop that must survive its own exceptions: each
    failure is said once, with its traceback, not at every turn. The same
    failure again is said again only after the loop recovered or failed
    differently in between; a recovery is said too."""

    def __init__(self, events: Events, event: str, message: str):
        self.events = events
        self.event = event
        self.message = message
        self._last: Optional[str] = None  # the failure said last, while it lasts

    def failed(self) -> None:
        """Call from the `except` block."""
        exc = sys.exc_info()[1]
        what = f"{type(exc).__name__}: {exc}"
        if what != self._last:
            self.events.exception(self.event, self.message)
            self._last = what

    def ok(self) -> None:
        """Call after a turn that went through."""
        if self._last is not None:
            self.events.info(self.event, f"recovered after: {self._last}")
            self._last = None
