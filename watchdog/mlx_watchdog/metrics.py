"""Prometheus metrics, all labelled by instance, in a private registry."""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest, start_http_server

from . import defaults
from .judge import STATES
from .probe import ProbeResult
from .throughput import COUNTERS, ThroughputReading

NO_DEATH = "none"  # the cause label of a restart that follows no death (a hang, planned)
STATE_LABEL = "state"  # mlx_watchdog_state{state="healthy"}: the rules and dashboard query it
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# heartbeat counter (throughput.COUNTERS) -> the reason label of mlx_watchdog_rejected_total
_REJECTED = {"rejected_queue_full": "queue_full", "rejected_queue_timeout": "queue_timeout"}


class Metrics:
    def __init__(self, registry: Optional[CollectorRegistry] = None):
        self.registry = registry or CollectorRegistry()
        self.probe_latency = Histogram(
            "mlx_watchdog_probe_latency_seconds",
            "How long each probe took, failed ones included.",
            ["instance"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.up = Gauge(
            "mlx_watchdog_up",
            "1 if the last probe got a completion token, else 0.",
            ["instance"],
            registry=self.registry,
        )
        self.restarts = Counter(
            "mlx_watchdog_restarts",
            "Restarts attempted; the reason label is the judge's cause "
            "(dead-thread, heartbeat-stale, stalled, exited ...), the cause label the "
            "death's class (docs/operator.md, Death classes; none: the server had not died).",
            # "reason", though it holds a cause: dashboards already query it.
            ["instance", "reason", "cause"],
            registry=self.registry,
        )
        self.needs_attention = Gauge(
            "mlx_watchdog_needs_attention",
            "1 while the instance needs attention: it died of a class a restart cannot "
            "fix (a configuration error) on 3 starts in a row; restarts go on at the "
            "backoff cap. `mlx-watchdog status` names the class and the remedy.",
            ["instance"],
            registry=self.registry,
        )
        # One series per state, 1 for the current one and 0 for the others,
        # labelled `state` (STATE_LABEL). Not a prometheus_client Enum: that
        # names its label after the metric (mlx_watchdog_state="healthy"),
        # which no rule or panel written as state="..." ever matched.
        self.state = Gauge(
            "mlx_watchdog_state",
            "The judge's verdict on the instance: 1 for the current state, 0 for the others.",
            ["instance", STATE_LABEL],
            registry=self.registry,
        )
        self.shim_loaded = Gauge(
            "mlx_watchdog_shim_loaded",
            "1 once the hotfix shim's heartbeat was seen; 0 when a heartbeat file is "
            "configured and none appeared by the end of the boot grace (the shim is not "
            "loaded: no exit on death, no stall detection).",
            ["instance"],
            registry=self.registry,
        )

        # From the shim's heartbeat counters (throughput.py): totals that
        # survive server restarts, so rate() gives tokens per second.
        helps = {
            "prefill_tokens": "Prompt tokens processed (prefill), from the shim's heartbeat.",
            "decode_tokens": "Tokens generated (decode), from the shim's heartbeat.",
            "requests": "Requests the server finished (completed or failed), from the heartbeat.",
            "cancelled_requests": "Requests cancelled (client gone), from the shim's heartbeat.",
            "deadline_stops": "Requests stopped at their deadline (MLX_HOTFIX_REQUEST_TIMEOUT "
                              "or X-Request-Timeout), from the shim's heartbeat.",
        }
        self.server_counters = {
            name: Counter(f"mlx_watchdog_{name}", helps[name], ["instance"], registry=self.registry)
            for name in COUNTERS.values() if name in helps
        }
        self.rejected = Counter(
            "mlx_watchdog_rejected",
            "Requests the shim refused with 503 busy, by reason: queue_full "
            "(MLX_HOTFIX_MAX_QUEUE) or queue_timeout (MLX_HOTFIX_QUEUE_TIMEOUT); "
            "from the heartbeat.",
            ["instance", "reason"],
            registry=self.registry,
        )
        self.queued = Gauge(
            "mlx_watchdog_queued",
            "Requests waiting for a slot, from the shim's heartbeat (admission part).",
            ["instance"],
            registry=self.registry,
        )
        self.running = Gauge(
            "mlx_watchdog_running",
            "Requests generating (holding a slot), from the shim's heartbeat (admission part).",
            ["instance"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "mlx_watchdog_in_flight",
            "Requests the server is working on, from the shim's heartbeat.",
            ["instance"],
            registry=self.registry,
        )
        self.crash_reports = Counter(
            "mlx_watchdog_crash_reports",
            "Crash reports that appeared in the instance's report folder.",
            ["instance"],
            registry=self.registry,
        )

        # The memory guard (memory_guard.py), when the instance has a limit.
        self.memory_bytes = Gauge(
            "mlx_watchdog_memory_bytes",
            "The server's memory by kind: measure (what the guard judges: phys_footprint, "
            "else the RSS of the process tree, never less than mlx_active), phys_footprint, "
            "tree_rss, and the heartbeat's rss, mlx_active, mlx_cache, mlx_peak, "
            "prompt_cache_bytes.",
            ["instance", "kind"],
            registry=self.registry,
        )
        self._memory_kinds: "dict[str, set]" = {}
        self.memory_limit_bytes = Gauge(
            "mlx_watchdog_memory_limit_bytes",
            "The memory guard's limit (memory_limit / --memory-limit); the soft line is 85% "
            "of it, the hard line 95%.",
            ["instance"],
            registry=self.registry,
        )
        self.memory_soft = Gauge(
            "mlx_watchdog_memory_soft",
            "1 while the measure is over the soft line (85% of the limit): the server was "
            "asked to trim and its /health answers 503 memory.",
            ["instance"],
            registry=self.registry,
        )
        self.reboot_required_gauge = Gauge(
            "mlx_watchdog_reboot_required",
            "1 when the machine's wired memory did not come back within a minute of a "
            "server's end (macOS): a reboot is required; restarts are held meanwhile.",
            ["instance"],
            registry=self.registry,
        )

    def add_instance(self, instance: str, causes: "tuple[str, ...]" = ()) -> None:
        """Create an instance's counters at zero, so increase() sees their first step."""
        for counter in self.server_counters.values():
            counter.labels(instance)
        for reason in _REJECTED.values():
            self.rejected.labels(instance, reason)
        self.crash_reports.labels(instance)
        for cause in causes:
            self.restarts.labels(instance, cause, NO_DEATH)
        self.needs_attention.labels(instance).set(0)

    def observe_throughput(self, instance: str, reading: ThroughputReading) -> None:
        for name, increment in reading.increments.items():
            if name in _REJECTED:
                self.rejected.labels(instance, _REJECTED[name]).inc(increment)
            else:
                self.server_counters[name].labels(instance).inc(increment)
        for gauge, value in ((self.in_flight, reading.in_flight), (self.queued, reading.queued),
                             (self.running, reading.running)):
            if value is not None:
                gauge.labels(instance).set(value)

    def reports_written(self, instance: str, count: int) -> None:
        if count:
            self.crash_reports.labels(instance).inc(count)

    def observe(self, instance: str, probe: Optional[ProbeResult], state: str) -> None:
        if probe is not None:
            self.probe_latency.labels(instance).observe(probe.latency_s)
            self.up.labels(instance).set(1 if probe.ok else 0)
        for name in STATES:
            self.state.labels(instance, name).set(1 if name == state else 0)

    def shim(self, instance: str, loaded: bool) -> None:
        self.shim_loaded.labels(instance).set(1 if loaded else 0)

    def restarted(self, instance: str, cause: str, death: str = "") -> None:
        """A restart: cause, the judge's (the reason label); death, the class
        of the death it follows (the cause label; none: there was none)."""
        self.restarts.labels(instance, cause, death or NO_DEATH).inc()

    def attention(self, instance: str, cause: Optional[str]) -> None:
        """The instance needs attention for cause (None: it does not any more)."""
        self.needs_attention.labels(instance).set(1 if cause else 0)

    def memory_limit(self, instance: str, limit_bytes: int) -> None:
        self.memory_limit_bytes.labels(instance).set(limit_bytes)
        self.memory_soft.labels(instance).set(0)
        self.reboot_required_gauge.labels(instance).set(0)

    def memory(self, instance: str, parts: "dict[str, int]", *, soft: bool) -> None:
        # A kind not measured this time (no heartbeat yet, a new server) is
        # dropped, not left at its last value.
        kinds = self._memory_kinds.setdefault(instance, set())
        for kind in kinds - set(parts):
            self.memory_bytes.remove(instance, kind)
        kinds.clear()
        for kind, value in parts.items():
            self.memory_bytes.labels(instance, kind).set(value)
            kinds.add(kind)
        self.memory_soft.labels(instance).set(1 if soft else 0)

    def reboot_required(self, instance: str, required: bool) -> None:
        self.reboot_required_gauge.labels(instance).set(1 if required else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = defaults.METRICS_HOST):
        """Serve /metrics on host:port from a daemon thread; returns the server."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
