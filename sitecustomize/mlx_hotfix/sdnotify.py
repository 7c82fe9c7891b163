"""A tiny sd_notify(3) client: READY=1, STATUS=..., WATCHDOG=1, STOPPING=1.

Stdlib only and cheap to import: the module imports nothing but ``os`` and
``sys`` at import time, and ``socket`` only when ``NOTIFY_SOCKET`` is set and
the first message is sent. Under launchd, or when run by hand, NOTIFY_SOCKET
is unset and every call is a no-op that returns False.

How the shim uses it (``mlx_hotfix/heartbeat.py``, and only when
NOTIFY_SOCKET is set)::

    n = SdNotifier.from_environ()   # one per process, made on first need
    n.status("loading the model")   # while the model loads; the keeper pings
    n.ready("serving")              # the loop's first pass, once listening
    n.watchdog_ping()               # every loop pass (rate-limited inside)
    n.status(why); n.stopping()     # just before the shim exits 70

A manual check: ``python sdnotify.py READY=1``.

Nothing here ever raises: a failed send returns False.
"""

import os
import sys

__all__ = ["SdNotifier"]


def _monotonic():
    # os.times().elapsed is times(2)'s return value: clock ticks since a fixed
    # point in the past (boot on Linux), so it is monotonic where systemd runs.
    # Its resolution (1/CLK_TCK, usually 10 ms) is plenty for a rate limit
    # measured in seconds, and it spares this module an import.
    return os.times().elapsed


class SdNotifier:
    """Send sd_notify datagrams to the socket named by NOTIFY_SOCKET.

    environ: the environment to read (default os.environ): NOTIFY_SOCKET,
        WATCHDOG_USEC, WATCHDOG_PID.
    clock: a monotonic clock in seconds, for the watchdog rate limit
        (injectable for tests).
    min_interval: at most one WATCHDOG=1 per this many seconds. Default: half
        the watchdog timeout when the watchdog is enabled for this process
        (sd_watchdog_enabled(3) recommends pinging every half interval),
        else 1 second.
    """

    def __init__(self, environ=None, clock=None, min_interval=None):
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        if address is not None and address[0] not in "/@":
            # sd_notify only accepts absolute paths and abstract names ("@x").
            # (vsock: addresses are not supported here.)
            address = None
        self.address = address
        self._sockaddr = None
        if address is not None:
            self._sockaddr = "\0" + address[1:] if address[0] == "@" else address
        self.watchdog_usec = None
        self.watchdog_enabled = False
        usec = env.get("WATCHDOG_USEC")
        if usec:
            try:
                value = int(usec)
            except ValueError:
                value = 0
            pid = env.get("WATCHDOG_PID")
            pid_ok = not pid or pid == str(os.getpid())
            if value > 0 and pid_ok:
                self.watchdog_usec = value
                self.watchdog_enabled = True
        if min_interval is None:
            if self.watchdog_enabled:
                min_interval = self.watchdog_usec / 1e6 / 2
            else:
                min_interval = 1.0
        self.min_interval = float(min_interval)
        self._clock = clock if clock is not None else _monotonic
        self._last_ping = None
        self._sock = None

    @classmethod
    def from_environ(cls, environ=None, **kwargs):
        """Same as SdNotifier(environ, ...): reads os.environ by default."""
        return cls(environ, **kwargs)

    @property
    def enabled(self):
        """True when NOTIFY_SOCKET names a socket to send to."""
        return self._sockaddr is not None

    def notify(self, message):
        """Send one datagram. True if it was sent; False if disabled or on any error."""
        if self._sockaddr is None:
            return False
        try:
            data = message.encode("utf-8") if isinstance(message, str) else bytes(message)
        except Exception:  # noqa: BLE001 - nothing here ever raises
            return False
        # One retry with a fresh socket: a cached socket can go bad (e.g. the
        # manager re-executed), and sendto() re-resolves the address each time.
        for _attempt in (0, 1):
            try:
                sock = self._sock
                if sock is None:
                    import socket

                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    # Never block the caller (the generation loop) on a full
                    # receive queue: a dropped ping is better than a stall.
                    sock.setblocking(False)
                    self._sock = sock
                sock.sendto(data, self._sockaddr)
                return True
            except Exception:  # noqa: BLE001 - nothing here ever raises
                self._close()
        return False

    def ready(self, status=None):
        """READY=1 (plus STATUS= when given): start-up is complete."""
        if status:
            return self.notify("READY=1\nSTATUS=" + _one_line(status))
        return self.notify("READY=1")

    def status(self, text):
        """STATUS=<text>: free-form status shown by `systemctl status`."""
        return self.notify("STATUS=" + _one_line(text))

    def watchdog_ping(self):
        """WATCHDOG=1, at most once per min_interval seconds.

        Returns True only when a datagram was sent now; False when disabled,
        rate-limited, or on error. A failed send does not consume the interval,
        so the next call retries.
        """
        if self._sockaddr is None:
            return False
        try:
            now = self._clock()
        except Exception:  # noqa: BLE001 - nothing here ever raises
            now = None
        if now is not None and self._last_ping is not None:
            if now - self._last_ping < self.min_interval:
                return False
        sent = self.notify("WATCHDOG=1")
        if sent and now is not None:
            self._last_ping = now
        return sent

    def stopping(self, status=None):
        """STOPPING=1 (plus STATUS= when given): the service is shutting down."""
        if status:
            return self.notify("STOPPING=1\nSTATUS=" + _one_line(status))
        return self.notify("STOPPING=1")

    def close(self):
        self._close()

    def _close(self):
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except Exception:  # noqa: BLE001 - nothing here ever raises
                pass

    def __repr__(self):
        return "SdNotifier(address=%r, watchdog_usec=%r, min_interval=%r)" % (
            self.address,
            self.watchdog_usec,
            self.min_interval,
        )


def _one_line(text):
    # Each sd_notify assignment is one line; a newline would start a new one.
    return str(text).replace("\r", " ").replace("\n", " ")


if __name__ == "__main__":  # pragma: no cover - manual check: python sdnotify.py READY=1
    print(SdNotifier().notify("\n".join(sys.argv[1:]) or "READY=1"))
