"""Keeping the API key out of logs, state, metrics and reprs."""

from __future__ import annotations

import json
from typing import Any, Optional, Set
from urllib.parse import urlsplit, urlunsplit

from . import contract

MASK = contract.MASK

# Every secret the process knows about; the log formatters scrub these as a
# last line of defence, in case one slips into a message.
_known: Set[str] = set()


class Secret:
    """A string that shows as *** whenever it is printed, logged or repr'd.

    Only `.reveal()` gives the value back, so it cannot leak by accident
    through an f-string or a dataclass repr; json.dumps refuses it outright.
    """

    __slots__ = ("_value",)

    def __init__(self, value: str):
        # A key read from a file or a Kubernetes secret usually ends in a
        # newline: that is never part of the key, and sent as is it breaks the
        # header (and once leaked through the error's repr).
        value = value.strip()
        self._value = value
        if value:
            _known.update(_shown_forms(value))

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return repr(MASK)

    def __str__(self) -> str:
        return MASK

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


def secret(value: Optional[str]) -> Optional[Secret]:
    """Wrap value in a Secret; None, "" and blanks mean no secret."""
    return Secret(value) if value and value.strip() else None


def _shown_forms(value: str) -> Set[str]:
    """value as it may appear in output: as is, inside a repr() (str or
    bytes) and JSON-escaped (the state file, JSON logs)."""
    forms = {value, repr(value)[1:-1], json.dumps(value)[1:-1]}
    try:
        forms.add(repr(value.encode())[2:-1])
    except UnicodeEncodeError:  # pragma: no cover - lone surrogates
        pass
    return {form for form in forms if form}


def scrub(text: str) -> str:
    """text with every known secret (in each shown form) replaced by ***."""
    if not _known or not isinstance(text, str):
        return text
    for value in sorted(_known, key=len, reverse=True):  # longest first
        if value in text:
            text = text.replace(value, MASK)
    return text


def scrub_all(value: Any) -> Any:
    """scrub() applied to every string inside value (dicts, lists, tuples)."""
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, dict):
        return {scrub_all(k): scrub_all(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(scrub_all(v) for v in value)
    return value


def redact_url(url: str) -> str:
    """url without a password in it (http://user:***@host/)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:{MASK}@{netloc[-1]}"))


# Control characters (C0, DEL, C1) shown as \xNN: a server's error text with
# terminal escape sequences must not drive the operator's terminal through
# the log or `status`.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}


def printable(text: Any) -> str:
    """str(text) with every control character escaped, newlines and tabs too."""
    return str(text).translate(_CONTROLS)


def redact_argv(argv: "list[str]") -> "list[str]":
    """Values of flags that look secret become *** (--api-key K, --token=K), as
    the shim redacts its reports' argv (the contract's SECRET_WORDS); known
    secrets elsewhere are scrubbed."""
    return contract.redact_argv(argv, scrub)


def printable_lines(lines: "list[str]") -> str:
    """Lines joined, each with its control characters escaped."""
    return "\n".join(printable(line) for line in lines)
