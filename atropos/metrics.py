"""Prometheus metrics (``prometheus-client``). One set per process; scraped at ``/metrics``.

Host-side metrics are recorded where calls run; pool metrics are read from the pool's own state
at scrape time (a custom collector), so the hot path pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from atropos.slots.pool import SlotPool

LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 600)

# sandbox host
HOST_CALLS = Counter("atropos_host_calls", "Tool calls run by this host", ["tool", "outcome"])
HOST_CALL_SECONDS = Histogram("atropos_host_call_seconds", "Tool call latency inside the host", ["tool"],
                              buckets=LATENCY_BUCKETS)
HOST_LEASES = Counter("atropos_host_leases", "Leases granted by this host")
HOST_RESETS = Counter("atropos_host_resets", "Slot resets by result", ["result"])
HOST_HEALTH_SECONDS = Histogram("atropos_host_health_seconds", "Health probe round trip (exec path)",
                                buckets=LATENCY_BUCKETS)

# ToolServer
API_REQUESTS = Counter("atropos_toolserver_requests", "ToolServer HTTP requests", ["method", "route", "status"])
API_SECONDS = Histogram("atropos_toolserver_request_seconds", "ToolServer request latency", ["route"],
                        buckets=LATENCY_BUCKETS)
SLOT_CALLS = Counter("atropos_slot_api_calls", "Tool calls through the REST slot API", ["tool", "outcome"])
EXTERNAL_CALLS = Counter("atropos_external_tool_calls", "External tool invocations", ["tool", "outcome"])
LEASE_WAIT_SECONDS = Histogram("atropos_pool_lease_wait_seconds", "Time to get a slot", buckets=LATENCY_BUCKETS)


class PoolCollector(Collector):
    """Pool gauges and counters computed from ``pool.status()`` when scraped."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Any]:
        s = self.pool.status()
        slots = GaugeMetricFamily("atropos_pool_slots", "Slots by state", labels=["state"])
        for state in ("free", "leased", "quarantined"):
            slots.add_metric([state], getattr(s, state))
        yield slots
        hosts = GaugeMetricFamily("atropos_pool_hosts", "Hosts by health", labels=["health"])
        hosts.add_metric(["healthy"], sum(1 for h in s.hosts if h.healthy))
        hosts.add_metric(["failing"], sum(1 for h in s.hosts if not h.healthy))
        hosts.add_metric(["starting"], s.starting_hosts)
        yield hosts
        yield GaugeMetricFamily("atropos_pool_waiting", "Trajectories waiting for a slot", value=s.waiting)
        yield GaugeMetricFamily("atropos_pool_calls_per_second", "Calls per second (last 10 s)", value=s.calls_per_s)
        yield CounterMetricFamily("atropos_pool_leases", "Leases granted", value=s.leases_total)
        yield CounterMetricFamily("atropos_pool_calls", "Tool calls sent", value=s.calls_total)
        yield CounterMetricFamily("atropos_pool_lost_hosts", "Hosts declared dead", value=s.lost_hosts)
        for name, help_text in (("scale_ups", "Hosts started by scaling"), ("scale_downs", "Idle hosts stopped"),
                                ("quarantines", "Slots quarantined after a failed reset")):
            value = getattr(s, name, None)
            if value is not None:
                yield CounterMetricFamily(f"atropos_pool_{name}", help_text, value=value)


def register_pool(pool: SlotPool) -> PoolCollector:
    collector = PoolCollector(pool)
    REGISTRY.register(collector)
    return collector


def unregister(collector: Collector) -> None:
    try:
        REGISTRY.unregister(collector)
    except KeyError:
        pass


def exposition() -> tuple[bytes, str]:
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
