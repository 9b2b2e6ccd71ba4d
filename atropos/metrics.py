"""Prometheus metrics (``prometheus-client``), scraped at ``/metrics`` of a host and of the ToolServer.

* Counters and histograms recorded on the hot path (host calls, ToolServer requests, slot API and
  external tool calls, lease waits) live in the process-wide default registry: a process counts
  what it did, whichever app did it.
* Pool state (slots, hosts and their health, scaling, quarantines) is read from ``pool.status()``
  at scrape time by a ``PoolCollector``, so the hot path pays nothing for it. Each ToolServer app
  gets its own ``CollectorRegistry`` for its pool's collector: two ToolServers in one process
  (tests, an env embedding one) never collide with "Duplicated timeseries", and each ``/metrics``
  shows its own pool.

Who may scrape: a sandbox host's ``/metrics`` needs the host token like every host route (the host
is internal; its token is the pool's secret and never handed to a scraper). The ToolServer's
``/metrics`` is public by default (``ToolServerSettings.public_metrics``): it carries no secret and
no trajectory or lease ids, only bounded labels (registered tool names, route templates, status
codes, host ids), and Prometheus scrapers are usually configured without credentials. Set
``public_metrics=False`` (``--metrics-need-token``) to require the bearer token there as well.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
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
SLOT_CALLS = Counter("atropos_slot_api_calls", "Tool calls through the REST slot API by outcome (ok, error = the "
                     "tool ran and failed, invalid_arguments, lease_invalid, infrastructure, unknown_tool)",
                     ["tool", "outcome"])
EXTERNAL_CALLS = Counter("atropos_external_tool_calls", "External tool invocations by outcome (ok, failed, "
                         "invalid_arguments, infrastructure, error)", ["tool", "outcome"])
LEASE_WAIT_SECONDS = Histogram("atropos_pool_lease_wait_seconds", "Time to get a slot", buckets=LATENCY_BUCKETS)

# Label value for tool names a client made up: a label per unknown name would let any client grow
# the exposition (and Prometheus' memory) without bound.
UNKNOWN_TOOL = "unknown"

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
        # Per host: alert on one host flapping, which the aggregate above averages away.
        up = GaugeMetricFamily("atropos_pool_host_up", "1 if the host passes its health probe", labels=["host"])
        probe = GaugeMetricFamily("atropos_pool_host_probe_seconds", "Last health probe round trip",
                                  labels=["host"])
        for h in s.hosts:
            up.add_metric([h.id], 1.0 if h.healthy else 0.0)
            if h.health_ms is not None:
                probe.add_metric([h.id], h.health_ms / 1000)
        yield up
        yield probe
        yield GaugeMetricFamily("atropos_pool_waiting", "Trajectories waiting for a slot", value=s.waiting)
        yield GaugeMetricFamily("atropos_pool_calls_per_second", "Calls per second (last 10 s)", value=s.calls_per_s)
        yield CounterMetricFamily("atropos_pool_leases", "Leases granted", value=s.leases_total)
        yield CounterMetricFamily("atropos_pool_calls", "Tool calls sent", value=s.calls_total)
        yield CounterMetricFamily("atropos_pool_lost_hosts", "Hosts declared dead", value=s.lost_hosts)
        yield CounterMetricFamily("atropos_pool_scale_ups", "Hosts started by scaling", value=s.scale_ups)
        yield CounterMetricFamily("atropos_pool_scale_downs", "Idle hosts stopped", value=s.scale_downs)
        yield CounterMetricFamily("atropos_pool_quarantines", "Slots quarantined after a failed reset",
                                  value=s.quarantines)


def pool_registry(pool: SlotPool) -> CollectorRegistry:
    """A registry of one pool's collector, owned by the app that serves it (see the module doc)."""
    registry = CollectorRegistry()
    registry.register(PoolCollector(pool))
    return registry


def exposition(*extra: CollectorRegistry) -> tuple[bytes, str]:
    """The process-wide metrics, then those of ``extra`` registries (names never overlap)."""
    return b"".join(generate_latest(r) for r in (REGISTRY, *extra)), CONTENT_TYPE_LATEST
