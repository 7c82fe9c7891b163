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

from .redact import scrub

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
        instance = getattr(record, "instance", None)
        parts = [_timestamp(record.created), f"{record.levelname:<7}"]
        if instance:
            parts.append(f"[{instance}]")
        message = record.getMessage()
        parts.append(f"{getattr(record, 'event', 'log')}: {message}")
        for key, value in getattr(record, "fields", {}).items():
            if not _said(value, message):  # one line per event, nothing said twice
                parts.append(f"{key}={json.dumps(value, default=str)}")
        text = " ".join(parts)
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
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
