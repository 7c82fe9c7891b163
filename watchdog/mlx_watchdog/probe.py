"""Probe: one real, one-token chat completion against an mlx_lm.server.

A probe reports what it observed and nothing more; deciding what that means
is judge.py's job. It never raises.

- ``ok``: the server produced at least one token.
- ``unhealthy``: it answered wrongly or not in time: a timeout, HTTP 5xx, a
  4xx error body (mlx-lm 0.32 answers 404 {"error": "generation thread died"}
  once its generation thread is gone), 503 from /health, or a 200 without
  tokens or with a malformed body.
- ``unreachable``: nothing listens there (connection refused, unknown host).

The completion has no ``seed`` and uses the configured model name: in mlx-lm a
request whose seed or model differs from the running batch drains that batch,
so a probe must look like ordinary traffic.

The HTTP client is the standard library's http.client rather than requests:
a probe is two small requests every few seconds per server, and requests
costs several times the CPU for each; http.client also hands over the socket
the total deadline needs (see _Deadline).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import ssl
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple
from urllib.parse import urlsplit

from . import defaults
from .defaults import PROBE_HEADER
from .redact import Secret, printable, redact_url, scrub, secret

OK = "ok"
UNHEALTHY = "unhealthy"
UNREACHABLE = "unreachable"

DEAD_THREAD_ERROR = "generation thread died"  # mlx-lm 0.32's error text
COMPLETIONS_PATH = "/v1/chat/completions"
HEALTH_PATH = "/health"
_REASON_CHARS = 200
_WARNING_CHARS = 600  # two known problems fit in one line


@dataclass(frozen=True)
class ProbeResult:
    status: str  # OK | UNHEALTHY | UNREACHABLE
    latency_s: float
    tokens: int = 0
    reason: str = ""
    http_status: Optional[int] = None  # of the request that decided the result
    # The server itself said its generation thread is gone (503 from /health,
    # or "generation thread died" in an error body): a definite wedge signal.
    dead_thread: bool = False
    # The hotfix shim's one-line warning, from /health or an error answer: a
    # known-bad install (an mlx-lm and mlx pair that dies on the first
    # request, a yanked release).
    warning: Optional[str] = None
    # The probe stopped waiting (timeout, give-up) for the answer to a
    # request the server had been sent: that request may stay in flight on
    # the server until it answers it or is restarted.
    abandoned: bool = False
    # The shim refused the probe because the server is busy (503, error type
    # "server_busy": its queue is full), and how long ago it last delivered a
    # token to anyone (None: not said). Busy and delivering is not wedged.
    shedding: bool = False
    last_delivery_age_s: Optional[float] = None

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_dict(self) -> dict:
        return asdict(self)


class Probe:
    """Callable: `Probe(url)()` sends one probe and returns a ProbeResult.

    `timeout` bounds the whole probe (/health and the completion together),
    not each socket read: a server that dribbles one byte at a time would
    otherwise hold a per-read timeout off forever.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = defaults.PROBE_TIMEOUT_S,
        model: str = defaults.MODEL,
        api_key: "Optional[str | Secret]" = None,
        check_health: bool = defaults.CHECK_HEALTH,
        max_body: int = defaults.MAX_BODY_BYTES,
        cacert: Optional[str] = None,
        give_up: Optional[Callable[[], Optional[str]]] = None,
    ):
        self.url = url.rstrip("/")
        self.cacert = cacert  # a PEM file of CA certificates for https, else the system's
        self.timeout = float(timeout)
        self.model = model
        self.api_key = api_key if isinstance(api_key, Secret) else secret(api_key)
        self.check_health = check_health
        self.max_body = max_body
        # Other evidence that settles the question before the timeout (the
        # shim's heartbeat gone stale): a reason to stop waiting, or None.
        self.give_up = give_up

    def __repr__(self) -> str:
        key = ", api_key='***'" if self.api_key else ""
        return (
            f"Probe(url={redact_url(self.url)!r}, model={self.model!r}, "
            f"timeout={self.timeout:g}{key})"
        )

    def __call__(self) -> ProbeResult:
        started = time.monotonic()
        answers: Dict[str, Any] = {}  # bodies that may carry the shim's warning
        try:
            with _Deadline(self.timeout, self.give_up) as deadline:
                fields = self._exchange(deadline, answers)
        except _Failed as failure:
            fields = failure.fields
        except Exception as exc:  # noqa: BLE001 - never raise: a probe failure is an observation
            fields = dict(status=UNHEALTHY, reason=_short(f"probe error: {exc!r}"))
        # /health says it when asked; a shim's error answer says it too.
        fields["warning"] = _warning(answers.get("health")) or _warning(answers.get("error"))
        return ProbeResult(latency_s=round(time.monotonic() - started, 4), **fields)

    # -- internals ---------------------------------------------------------

    def _exchange(self, deadline: "_Deadline", answers: Dict[str, Any]) -> dict:
        target = _Target.parse(self.url)
        if self.check_health:
            status, answers["health"] = self._send(target, deadline, "GET", HEALTH_PATH)
            # 503 {"status": "memory"}: the memory guard's soft line sends new
            # work elsewhere; the server serves, so the completion decides.
            if status == 503 and not _says_memory(answers["health"]):
                return dict(
                    status=UNHEALTHY,
                    reason="/health: 503, generation thread not running",
                    http_status=503,
                    dead_thread=True,
                )
            # Any other answer: carry on. Proxies and older servers may lack
            # /health; the completion is the real test.
        payload = {
            "model": self.model,
            "messages": [{"role": "user", "content": "ping"}],
            "max_tokens": 1,
            "stream": False,
        }
        status, body = self._send(target, deadline, "POST", COMPLETIONS_PATH, payload)
        if status != 200:
            answers["error"] = body
        return _read_completion(status, body)

    def _send(
        self,
        target: "_Target",
        deadline: "_Deadline",
        method: str,
        path: str,
        payload: Optional[dict] = None,
    ) -> Tuple[int, bytes]:
        remaining = deadline.remaining()
        if remaining <= 0:
            raise self._timed_out(deadline)
        headers = {"Host": target.netloc, "Accept": "application/json", "Connection": "close",
                   # The shim keeps a probe out of the server's log and counters.
                   PROBE_HEADER: "1"}
        body = None
        if payload is not None:
            body = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key.reveal()}"
        conn = _Connection(target, remaining, deadline, self.cacert)
        try:
            try:
                conn.connect()
            except OSError as exc:
                if deadline.expired or isinstance(exc, (socket.timeout, TimeoutError)):
                    raise self._timed_out(deadline) from None
                if isinstance(exc, ssl.SSLError):
                    raise _Failed(UNHEALTHY, f"TLS handshake with {target.netloc} failed: {exc}") from None
                # refused, unknown host, no route
                raise _Failed(UNREACHABLE, f"cannot connect to {target.netloc}: {_oserror(exc)}") from None
            try:
                conn.request(method, target.path + path, body=body, headers=headers)
                deadline.awaiting = True
                response = conn.getresponse()
                data = response.read(self.max_body + 1)
                deadline.awaiting = False
            except (OSError, http.client.HTTPException) as exc:
                if deadline.expired or isinstance(exc, (socket.timeout, TimeoutError)):
                    raise self._timed_out(deadline) from None
                raise _Failed(UNHEALTHY, f"{path}: connection broken: {_oserror(exc)}") from None
        finally:
            conn.close()
        if deadline.expired:  # the body may have been cut short by the deadline
            raise self._timed_out(deadline)
        if len(data) > self.max_body:
            too_big = f"{path}: body larger than {self.max_body} bytes"
            raise _Failed(UNHEALTHY, too_big, response.status)
        return response.status, data

    def _timed_out(self, deadline: "_Deadline") -> "_Failed":
        if deadline.gave_up:
            waited = self.timeout - max(0.0, deadline.ends_in())
            failed = _Failed(UNHEALTHY, f"no answer after {waited:.0f}s, and {deadline.gave_up}")
        else:
            failed = _Failed(UNHEALTHY, f"timed out after {self.timeout:g}s")
        failed.fields["abandoned"] = deadline.awaiting
        return failed


def _read_completion(status: int, body: bytes) -> dict:
    data = _json(body)
    if status == 200:
        if not isinstance(data, dict):
            return dict(status=UNHEALTHY, reason="200 with a malformed body", http_status=200)
        tokens = _count_tokens(data)
        if tokens < 1:
            return dict(status=UNHEALTHY, reason="200 without any tokens", http_status=200)
        return dict(status=OK, tokens=tokens, reason="ok", http_status=200)
    error = data.get("error") if isinstance(data, dict) else None
    shedding = False
    if isinstance(error, dict):  # OpenAI style {"error": {"message": ...}}
        shedding = status == 503 and error.get("type") == defaults.BUSY_ERROR_TYPE
        error = error.get("message")
    text = str(error) if error is not None else body[:_REASON_CHARS].decode("utf-8", "replace")
    age = data.get("last_delivery_age_s") if shedding else None
    return dict(
        status=UNHEALTHY,
        reason=_short(f"HTTP {status}: {text.strip() or '(empty body)'}"),
        http_status=status,
        dead_thread=DEAD_THREAD_ERROR in text,
        shedding=shedding,
        last_delivery_age_s=float(age) if _is_age(age) else None,
    )


def _says_memory(body: Optional[bytes]) -> bool:
    """A /health body that says the memory soft line (the shim's 503 memory)."""
    data = _json(body or b"")
    return isinstance(data, dict) and data.get("status") == "memory"


def _is_age(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 <= value < float("inf"))


def _warning(body: Optional[bytes]) -> Optional[str]:
    """The shim's "warning" in a JSON body, made safe to print; or None."""
    data = _json(body) if body else None
    text = data.get("warning") if isinstance(data, dict) else None
    if not isinstance(text, str) or not text.strip():
        return None
    text = printable(scrub(" ".join(text.split())))
    return text if len(text) <= _WARNING_CHARS else text[: _WARNING_CHARS - 3] + "..."


def _count_tokens(data: dict) -> int:
    usage = data.get("usage")
    if isinstance(usage, dict):
        count = usage.get("completion_tokens")
        if isinstance(count, int) and not isinstance(count, bool) and count >= 1:
            return count
    choices = data.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        for text in (message.get("content"), message.get("reasoning"), choice.get("text")):
            if isinstance(text, str) and text:
                return 1
    return 0


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:  # also UnicodeDecodeError
        return None


class _Failed(Exception):
    def __init__(self, status: str, reason: str, http_status: Optional[int] = None):
        super().__init__(reason)
        self.fields = dict(status=status, reason=_short(reason), http_status=http_status)


def _oserror(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _short(text: str) -> str:
    # scrub: a server may echo the key back in an error message; printable:
    # its terminal escape sequences must not reach logs and `status` raw.
    text = printable(scrub(" ".join(text.split())))
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 3] + "..."


def check_url(url: str) -> str:
    """url without a trailing slash, or ValueError saying what is wrong.

    For the CLI and the config, up front: a typo (htp://, a port out of
    range) is a usage error, not a server that never answers.
    """
    problem = url_problem(url)
    if problem:
        shown = redact_url(url) if isinstance(url, str) else repr(url)
        raise ValueError(
            f"invalid URL {shown!r}: {problem}; expected http(s)://HOST[:PORT], "
            'like "http://127.0.0.1:8080"'
        )
    return server_root(url)


def server_root(url: str) -> str:
    """url without a trailing slash or a trailing /v1: what OpenAI clients are
    given (http://host:8080/v1) names the same server as its root, which is
    what the probe needs (it adds /v1/chat/completions and /health itself)."""
    url = url.rstrip("/")
    if url.lower().endswith("/v1"):
        url = url[: -len("/v1")].rstrip("/")
    return url


def url_problem(url: object) -> Optional[str]:
    """What is wrong with url as a server's base URL, or None."""
    if not isinstance(url, str) or not url:
        return "empty"
    if any(c.isspace() or not c.isprintable() for c in url):
        return "whitespace or a control character in it"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return str(exc)
    if parts.scheme.lower() not in ("http", "https"):
        return f"scheme {parts.scheme!r} is not http or https" if parts.scheme else "no scheme"
    if not parts.hostname:
        return "no host"
    if port == 0:
        return "port 0"
    if parts.query or parts.fragment:
        return "a ?query or #fragment"
    return None


@dataclass(frozen=True)
class _Target:
    tls: bool
    host: str
    port: int
    netloc: str  # host:port as shown, without credentials
    path: str  # a prefix, for a server mounted below / behind a proxy

    @classmethod
    def parse(cls, url: str) -> "_Target":
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise _Failed(UNREACHABLE, f"invalid URL {redact_url(url)!r}: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            expected = "expected http(s)://host:port"
            raise _Failed(UNREACHABLE, f"invalid URL {redact_url(url)!r}: {expected}")
        tls = parts.scheme == "https"
        port = port or (443 if tls else 80)
        host = parts.hostname
        shown = f"[{host}]" if ":" in host else host
        return cls(tls, host, port, f"{shown}:{port}", parts.path.rstrip("/"))


# -- the connection and the total deadline ----------------------------------
#
# The deadline is a timer that shuts the probe's socket down when the budget
# runs out, which makes any blocked read return at once. No thread is left
# behind, whatever the server does.


class _Deadline:
    # How often give_up is asked while the probe waits.
    GIVE_UP_EVERY_S = 0.5

    def __init__(self, seconds: float, give_up: Optional[Callable[[], Optional[str]]] = None):
        self.seconds = seconds
        self._ends = time.monotonic() + seconds
        self._sockets: List[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(seconds, 0.0), self._expire)
        self._timer.daemon = True
        self.expired = False
        self.gave_up: Optional[str] = None  # why the probe stopped waiting early
        self.awaiting = False  # a request was sent, its answer not read yet
        self._give_up = give_up
        self._done = threading.Event()

    def remaining(self) -> float:
        return 0.0 if self.expired else self._ends - time.monotonic()

    def ends_in(self) -> float:
        return self._ends - time.monotonic()

    def _ask(self) -> None:
        while not self._done.wait(self.GIVE_UP_EVERY_S):
            try:
                why = self._give_up()
            except Exception:  # noqa: BLE001 - other evidence failing is no reason to stop
                why = None
            if why and not self._done.is_set():
                self.gave_up = why
                self._expire()
                return

    def track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if not self.expired:
                return
        _shutdown(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shutdown(sock)

    def __enter__(self) -> "_Deadline":
        self._timer.start()
        if self._give_up is not None:
            threading.Thread(target=self._ask, name="probe-give-up", daemon=True).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._timer.cancel()


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class _Connection(http.client.HTTPConnection):
    """HTTP or HTTPS; the socket is handed to the deadline as soon as it exists.

    The name is resolved under the deadline too (see _resolve), then the
    resolved address is connected to; the Host header and TLS SNI keep the
    name.
    """

    def __init__(
        self, target: _Target, timeout: float, deadline: _Deadline, cacert: Optional[str] = None
    ):
        super().__init__(target.host, target.port, timeout=timeout)
        self._target = target
        self._deadline = deadline
        self._cacert = cacert
        self._create_connection = self._connect_resolved

    def _connect_resolved(self, address, timeout=None, source_address=None) -> socket.socket:
        host, port = address
        error: Optional[OSError] = None
        for family, kind, proto, _, sockaddr in _resolve(host, port, self._deadline):
            remaining = self._deadline.remaining()
            if remaining <= 0:
                raise socket.timeout("timed out")
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(remaining)
                sock.connect(sockaddr)
                return sock
            except OSError as exc:
                sock.close()
                error = exc
        raise error or OSError(f"no address for {host}")

    def connect(self) -> None:
        super().connect()  # TCP only
        if self._target.tls:
            # Hand over the TLS socket (wrapping detaches the plain one), then
            # shake hands under the deadline.
            self.sock = _tls_context(self._cacert).wrap_socket(
                self.sock, server_hostname=self._target.host, do_handshake_on_connect=False
            )
            self._deadline.track(self.sock)
            self.sock.do_handshake()
        else:
            self._deadline.track(self.sock)


# -- name resolution under the deadline --------------------------------------
#
# getaddrinfo cannot be interrupted, and a resolver that never answers holds
# it for as long as the system's resolver timeouts add up (10 s and more). So
# it runs on a daemon thread that the probe waits for only until the
# deadline. A lookup still pending is shared by the next probes of that name
# instead of starting another: a dead resolver costs one thread, not one per
# probe.


class _Lookup:
    def __init__(self, host: str, port: int):
        self.done = threading.Event()
        self.result: list = []
        self.error: Optional[OSError] = None
        thread = threading.Thread(
            target=self._run, args=(host, port), name=f"resolve {host}", daemon=True
        )
        thread.start()

    def _run(self, host: str, port: int) -> None:
        try:
            self.result = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            self.error = exc
        finally:
            self.done.set()


_lookups: Dict[Tuple[str, int], _Lookup] = {}
_lookups_lock = threading.Lock()


def _resolve(host: str, port: int, deadline: "_Deadline") -> list:
    try:  # an address needs no resolver
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except OSError:
        pass
    key = (host, port)
    with _lookups_lock:
        lookup = _lookups.get(key)
        if lookup is None or lookup.done.is_set():
            lookup = _lookups[key] = _Lookup(host, port)
    if not lookup.done.wait(max(0.0, deadline.remaining())):
        raise _Failed(UNHEALTHY, f"timed out after {deadline.seconds:g}s resolving {host}")
    with _lookups_lock:
        if _lookups.get(key) is lookup:
            del _lookups[key]
    if lookup.error is not None:
        raise lookup.error
    return lookup.result


_tls: Dict[Optional[str], ssl.SSLContext] = {}


def _tls_context(cacert: Optional[str] = None) -> ssl.SSLContext:
    """The system's trust store (which honours SSL_CERT_FILE and
    SSL_CERT_DIR), or cacert alone when given.

    certifi (a declared dependency; still optional here, so a trimmed install
    works) is added to the system store, not put in its
    place: on a macOS python.org build the system store of OpenSSL may be
    empty, while a private CA lives in SSL_CERT_FILE or the system store.
    When SSL_CERT_FILE or SSL_CERT_DIR is set, that is what the user chose:
    no certifi then.
    """
    context = _tls.get(cacert)
    if context is None:
        context = make_tls_context(cacert)
        _tls[cacert] = context
    return context


def make_tls_context(cacert: Optional[str] = None) -> ssl.SSLContext:
    """A verifying client context; ssl.SSLError or OSError for a bad cacert."""
    if cacert:
        return ssl.create_default_context(cafile=cacert)
    context = ssl.create_default_context()
    if not (os.environ.get("SSL_CERT_FILE") or os.environ.get("SSL_CERT_DIR")):
        try:
            import certifi

            context.load_verify_locations(cafile=certifi.where())
        except (ImportError, OSError, ssl.SSLError):
            pass
    return context
