"""Prometheus metrics, all labelled by instance, in a private registry."""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram
from prometheus_client import generate_latest, start_http_server

from . import defaults
from .judge import STATES
from .probe import ProbeResult

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


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
            "Restarts attempted, by cause (wedged, down, exited ...).",
            ["instance", "reason"],
            registry=self.registry,
        )
        self.state = Enum(
            "mlx_watchdog_state",
            "The judge's verdict on the instance.",
            ["instance"],
            states=list(STATES),
            registry=self.registry,
        )

    def observe(self, instance: str, probe: Optional[ProbeResult], state: str) -> None:
        if probe is not None:
            self.probe_latency.labels(instance).observe(probe.latency_s)
            self.up.labels(instance).set(1 if probe.ok else 0)
        self.state.labels(instance).state(state)

    def restarted(self, instance: str, cause: str) -> None:
        self.restarts.labels(instance, cause).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = defaults.METRICS_HOST):
        """Serve /metrics on host:port from a daemon thread; returns the server."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
