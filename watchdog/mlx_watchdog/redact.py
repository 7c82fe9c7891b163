"""Keeping the API key out of logs, state, metrics and reprs."""

from __future__ import annotations

from typing import Optional, Set
from urllib.parse import urlsplit, urlunsplit

MASK = "***"

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
        self._value = value
        if value:
            _known.add(value)

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
    """Wrap value in a Secret; None and "" mean no secret."""
    return Secret(value) if value else None


def scrub(text: str) -> str:
    """text with every known secret replaced by ***."""
    for value in _known:
        if value in text:
            text = text.replace(value, MASK)
    return text


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


_SECRET_WORDS = ("key", "token", "secret", "password", "passwd", "auth")


def redact_argv(argv: "list[str]") -> "list[str]":
    """Values of flags that look secret become *** (--api-key K, --token=K)."""
    out, hide_next = [], False
    for arg in argv:
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        secret_flag = flag.startswith("-") and any(w in flag.lower() for w in _SECRET_WORDS)
        if secret_flag and eq:
            out.append(f"{flag}={MASK}")
        else:
            out.append(scrub(arg))
            hide_next = secret_flag
    return out
