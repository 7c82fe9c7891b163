"""Admission: which requests generate, which wait, and which are refused.

State and decisions only; patches/admission.py wires this into mlx_lm.server.

Stock mlx_lm.server takes every request into its batch at once: a request
beyond the batch's slots waits inside ``BatchGenerator`` (its
``_unprocessed_sequences``) with no bound and no time limit, and nobody can
tell it from one that generates. Here a request waits *before* stock sees
it, in a line of our own, until a slot is free; so

- ``running`` counts the requests stock has (at most one per slot: stock's
  ``max(--decode-concurrency, --prompt-concurrency)`` for a batchable model,
  else one) and ``queued`` the ones in our line;
- a request that would make the line longer than ``MLX_HOTFIX_MAX_QUEUE`` is
  refused at once, and one still in line after ``MLX_HOTFIX_QUEUE_TIMEOUT``
  leaves it refused: neither was ever given to stock, so neither can start
  later for a client that is gone;
- the line is first come, first served, as stock's own queue is.

The watchdog's probe (header ``X-MLX-Watchdog-Probe: 1``, one token) is
never refused and never waits in the line: it goes to stock at once, where
it waits at most for a slot to free, so a server that is busy and shedding
never looks wedged. It takes a slot while stock has it, and is left out of
the counts.

Refusals and deadline stops are counted (heartbeat, watchdog metrics) and
said on stderr at most once a minute, as one line.
"""

import collections
import math
import threading
import time

from . import log

QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
DEADLINE = "deadline"
REASONS = (QUEUE_FULL, QUEUE_TIMEOUT)
BUSY_TYPE = "server_busy"  # the error type of a refusal: the watchdog's probe reads it

SUMMARY_EVERY_S = 60.0  # at most one stderr line per this long
GATHER_S = 1.0  # after a quiet spell, the first line waits this long to count a burst
POLL_S = 0.25  # a waiting request looks this often whether the server still serves
_SERVICE_SAMPLES = 16  # Retry-After: the mean service time of the last this many

WAITING, RUNNING, PASSED, DONE = "waiting", "running", "passed", "done"


class Refused(BaseException):
    """Raised in a request thread whose request is refused (never an
    Exception: stock's handlers must not turn it into their own answer)."""

    def __init__(self, reason, retry_after, message):
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after
        self.message = message


class Ticket:
    """One request, from its arrival until its slot is free again."""

    __slots__ = ("arrived", "deadline", "queue_deadline", "probe", "state", "event", "started",
                 "ctx", "cut", "waited")

    def __init__(self, *, request_timeout=None, queue_timeout=None, probe=False, now=None):
        self.arrived = time.monotonic() if now is None else now
        self.deadline = None if request_timeout is None else self.arrived + request_timeout
        # A request still waiting at its own deadline has waited long enough too.
        limits = [t for t in (queue_timeout, request_timeout) if t is not None]
        self.queue_deadline = self.arrived + min(limits) if limits else None
        self.probe = probe
        self.state = None
        self.event = threading.Event()
        self.started = None
        self.ctx = None  # the request's GenerationContext, once stock made it
        self.cut = False  # stopped at its deadline
        self.waited = False  # it waited in the line (its start is a hand-over)


class Gate:
    """The line in front of stock's batch, and the counts."""

    def __init__(self, *, max_queue=None, summary=None, clock=time.monotonic):
        self.max_queue = max_queue
        self.summary = summary
        self._clock = clock
        self._lock = threading.Lock()
        self._line = collections.deque()
        self._running = set()
        self._probes = 0
        self._service = collections.deque(maxlen=_SERVICE_SAMPLES)
        self.slots = lambda: 1  # the patch gives the live count (it may change at a load)
        self.rejected = dict.fromkeys(REASONS, 0)
        self.deadline_stops = 0

    # -- the counts --------------------------------------------------------------

    def counts(self):
        """(queued, running): waiting in the line, and given to stock (probes left out)."""
        return len(self._line), len(self._running)

    def fields(self):
        """The heartbeat record's fields (and /health's)."""
        queued, running = self.counts()
        return {"queued": queued, "running": running,
                "rejected_queue_full": self.rejected[QUEUE_FULL],
                "rejected_queue_timeout": self.rejected[QUEUE_TIMEOUT],
                "deadline_stops": self.deadline_stops}

    # -- a request's way through -------------------------------------------------

    def admit(self, ticket, serving=lambda: True):
        """Return once ticket may go to stock, or raise Refused.

        serving() says whether the server can still serve: a request waiting
        when it stops (a death, SIGTERM) leaves the line at once, uncounted,
        for the server's own answer to that.
        """
        with self._lock:
            if ticket.probe:
                self._probes += 1
                ticket.state = RUNNING
                return
            self._fill_locked()  # the slots may have grown (the model loaded)
            if not self._line and self._occupied_locked() < self._slots():
                self._start_locked(ticket)
                return
            if self.max_queue is not None and len(self._line) >= self.max_queue:
                raise self._refuse_locked(ticket, QUEUE_FULL)
            ticket.state = WAITING
            ticket.waited = True
            self._line.append(ticket)
        while not ticket.event.wait(self._wait_time(ticket)):
            alive = serving()
            with self._lock:
                if ticket.state == RUNNING:
                    return
                if not alive:
                    self._line.remove(ticket)
                    ticket.state = PASSED
                    return
                if ticket.queue_deadline is not None and self._clock() >= ticket.queue_deadline:
                    self._line.remove(ticket)
                    raise self._refuse_locked(ticket, QUEUE_TIMEOUT)

    def release(self, ticket):
        """The request's stream ended, or its handler returned: its slot is free.
        Idempotent."""
        with self._lock:
            if ticket.state != RUNNING:
                return
            ticket.state = DONE
            if ticket.probe:
                self._probes -= 1
            else:
                self._running.discard(ticket)
                self._service.append(self._clock() - ticket.started)
            self._fill_locked()

    def deadline_stop(self):
        with self._lock:
            self.deadline_stops += 1
        if self.summary is not None:
            self.summary.note(DEADLINE)

    # -- inside the lock -------------------------------------------------------------

    def _slots(self):
        try:
            return max(1, int(self.slots()))
        except Exception:  # noqa: BLE001 - a server we cannot read has one slot at least
            return 1

    def _occupied_locked(self):
        return len(self._running) + self._probes

    def _start_locked(self, ticket):
        ticket.state = RUNNING
        ticket.started = self._clock()
        self._running.add(ticket)
        ticket.event.set()

    def _fill_locked(self):
        slots = self._slots()
        while self._line and self._occupied_locked() < slots:
            self._start_locked(self._line.popleft())

    def _wait_time(self, ticket):
        if ticket.queue_deadline is None:
            return POLL_S
        return max(0.0, min(POLL_S, ticket.queue_deadline - self._clock()))

    def _refuse_locked(self, ticket, reason):
        ticket.state = DONE
        self.rejected[reason] += 1
        retry = self._retry_after_locked()
        queued, running = self.counts()
        if reason == QUEUE_FULL:
            why = "%d request%s already wait%s for %s (MLX_HOTFIX_MAX_QUEUE=%d)" % (
                queued, "" if queued == 1 else "s", "s" if queued == 1 else "",
                _slots_text(self._slots()), self.max_queue)
        else:
            why = "no slot came free within %g s of waiting" % (
                ticket.queue_deadline - ticket.arrived)
        if self.summary is not None:
            self.summary.note(reason)
        return Refused(reason, retry, "the server is busy: %s; retry in %d s" % (why, retry))

    def _retry_after_locked(self):
        """Seconds until the requests now waiting (at least one) have had a
        slot, from the recent service rate; at least 1."""
        if self._service:
            service = sum(self._service) / len(self._service)
        elif self._running:  # nothing finished yet: the oldest running is a lower bound
            now = self._clock()
            service = max(now - t.started for t in self._running)
        else:
            service = 1.0
        waiting = max(1, len(self._line))
        return max(1, int(math.ceil(waiting * service / self._slots())))


def _slots_text(slots):
    return "%d slot%s" % (slots, "" if slots == 1 else "s")


class Summary:
    """Refusals and deadline stops, said on stderr at most once a minute.

    The first event after a quiet minute is said GATHER_S later (a burst
    arrives within a moment and reads as one line); later ones wait for the
    minute to pass."""

    def __init__(self, say=log.say, clock=time.monotonic, timer=None):
        self._say = say
        self._clock = clock
        self._timer = timer or _start_timer
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(REASONS + (DEADLINE,), 0)
        self._last_said = None
        self._armed = False

    def note(self, kind):
        with self._lock:
            self._counts[kind] += 1
            if self._armed:
                return
            self._armed = True
            now = self._clock()
            delay = GATHER_S
            if self._last_said is not None:
                delay = max(delay, self._last_said + SUMMARY_EVERY_S - now)
        self._timer(delay, self.flush)

    def flush(self):
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
            self._armed = False
            self._last_said = self._clock()
        text = summary_line(counts)
        if text:
            self._say(text)


def summary_line(counts):
    """'admission: 37 requests refused (queue full), 2 stopped at the deadline
    in the last 60 s', or None when there is nothing to say."""
    parts = []
    for kind, what in ((QUEUE_FULL, "refused (queue full)"),
                       (QUEUE_TIMEOUT, "refused (queue timeout)"),
                       (DEADLINE, "stopped at the deadline")):
        count = counts.get(kind, 0)
        if count:
            noun = "" if parts else (" request" if count == 1 else " requests")
            parts.append("%d%s %s" % (count, noun, what))
    if not parts:
        return None
    return "admission: %s in the last %g s" % (", ".join(parts), SUMMARY_EVERY_S)


def _start_timer(delay, function):
    timer = threading.Timer(delay, function)
    timer.daemon = True
    timer.name = "mlx-hotfix-admission"
    timer.start()


def describe(max_queue, queue_timeout, request_timeout):
    """The status line's settings: 'max queue 2, queue timeout 2 s, request timeout off'."""
    def seconds(value):
        return "off" if value is None else "%g s" % value

    return "max queue %s, queue timeout %s, request timeout %s" % (
        "off" if max_queue is None else max_queue, seconds(queue_timeout),
        seconds(request_timeout))


def parse_timeout_header(raw):
    """X-Request-Timeout's value in seconds; ValueError naming the problem."""
    text = raw.strip()
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise ValueError("X-Request-Timeout: %r is not a number of seconds above 0 "
                         "(it may lower the server's MLX_HOTFIX_REQUEST_TIMEOUT, never raise "
                         "it)" % text[:40])
    return value
