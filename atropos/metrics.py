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

import asyncio
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from atropos.slots.pool import SlotPool
    from atropos.slots.pool_status import PoolStatus
    from atropos.slots.shards import ShardedPool, ShardedStatus

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

def _pool_families(rows: Sequence[tuple[tuple[str, ...], PoolStatus]], by: tuple[str, ...] = ()) -> Iterator[Any]:
    """The pool metric families of one or more pools' statuses; ``by``: the label names that tell
    the rows apart (``("shard",)`` for a sharded pool's shards, none for one pool)."""
    slots = GaugeMetricFamily("atropos_pool_slots", "Slots by state", labels=[*by, "state"])
    hosts = GaugeMetricFamily("atropos_pool_hosts", "Hosts by health", labels=[*by, "health"])
    # Per host: alert on one host flapping, which the aggregate above averages away.
    up = GaugeMetricFamily("atropos_pool_host_up", "1 if the host passes its health probe", labels=[*by, "host"])
    probe = GaugeMetricFamily("atropos_pool_host_probe_seconds", "Last health probe round trip",
                              labels=[*by, "host"])
    waiting = GaugeMetricFamily("atropos_pool_waiting", "Trajectories waiting for a slot", labels=[*by])
    rate = GaugeMetricFamily("atropos_pool_calls_per_second", "Calls per second (last 10 s)", labels=[*by])
    counters = [CounterMetricFamily(f"atropos_pool_{name}", doc, labels=[*by]) for name, doc in _POOL_COUNTERS]
    for key, s in rows:
        for state in ("free", "leased", "quarantined"):
            slots.add_metric([*key, state], getattr(s, state))
        hosts.add_metric([*key, "healthy"], sum(1 for h in s.hosts if h.healthy))
        hosts.add_metric([*key, "failing"], sum(1 for h in s.hosts if not h.healthy))
        hosts.add_metric([*key, "starting"], s.starting_hosts)
        for h in s.hosts:
            up.add_metric([*key, h.id], 1.0 if h.healthy else 0.0)
            if h.health_ms is not None:
                probe.add_metric([*key, h.id], h.health_ms / 1000)
        waiting.add_metric([*key], s.waiting)
        rate.add_metric([*key], s.calls_per_s)
        for family, (name, _) in zip(counters, _POOL_COUNTERS, strict=True):
            family.add_metric([*key], getattr(s, _COUNTER_FIELDS.get(name, name)))
    yield from (slots, hosts, up, probe, waiting, rate, *counters)


# (metric name after atropos_pool_, help); the PoolStatus field is the same name unless _COUNTER_FIELDS says
_POOL_COUNTERS = (
    ("leases", "Leases granted"),
    ("calls", "Tool calls sent"),
    ("lost_hosts", "Hosts declared dead"),
    ("scale_ups", "Hosts started by scaling"),
    ("scale_downs", "Idle hosts stopped"),
    ("quarantines", "Slots quarantined after a failed reset"),
)
_COUNTER_FIELDS = {"leases": "leases_total", "calls": "calls_total"}


class PoolCollector(Collector):
    """Pool gauges and counters computed from ``pool.status()`` when scraped."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Any]:
        yield from _pool_families([((), self.pool.status())])


class ShardedPoolCollector(Collector):
    """A sharded pool's metrics (atropos/slots/shards.py): every shard's pool metrics under a ``shard``
    label (the same names as one pool's, so a dashboard sums them), the shards alive and dead, the
    requests queued in the front, and the double leases the shards' audits saw.

    A shard's status is a round trip to its process, and ``collect`` is synchronous: scraped from
    another thread (prometheus_client's ``start_http_server``), it asks the pool's event loop for a
    fresh ``status()``; scraped on that loop itself, which it must not block, it shows the status the
    pool last answered (``sharded_exposition`` awaits a fresh one first)."""

    def __init__(self, pool: ShardedPool, loop: asyncio.AbstractEventLoop, timeout_s: float = 10.0) -> None:
        self.pool = pool
        self.loop = loop
        self.timeout_s = timeout_s

    def _status(self) -> ShardedStatus | None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop or self.loop.is_closed():
            return self.pool.last_status
        try:
            return asyncio.run_coroutine_threadsafe(self.pool.status(), self.loop).result(self.timeout_s)
        except Exception:  # a scrape never fails for a slow or stopping pool: it shows the last status
            return self.pool.last_status

    def collect(self) -> Iterator[Any]:
        s = self._status()
        shards = GaugeMetricFamily("atropos_pool_shards", "Shard processes by state", labels=["state"])
        live = sum(1 for shard in self.pool.shards if shard.dead is None)
        shards.add_metric(["live"], live)
        shards.add_metric(["dead"], len(self.pool.shards) - live)
        yield shards
        yield GaugeMetricFamily("atropos_pool_front_waiting", "Lease requests queued in the sharded pool's front "
                                "(no shard had a slot not held)", value=self.pool.waiting_in_front())
        if s is None:
            return
        yield CounterMetricFamily("atropos_pool_double_leased", "Double leases the shards' audits saw (0 unless a "
                                  "bug)", value=s.double_leased)
        index = {shard.pool_id: shard.pool_id.rsplit(".s", 1)[-1] for shard in s.shards}
        yield from _pool_families([((index[shard.pool_id],), shard) for shard in s.shards], by=("shard",))


def pool_registry(pool: SlotPool) -> CollectorRegistry:
    """A registry of one pool's collector, owned by the app that serves it (see the module doc)."""
    registry = CollectorRegistry()
    registry.register(PoolCollector(pool))
    return registry


def sharded_registry(pool: ShardedPool, loop: asyncio.AbstractEventLoop | None = None) -> CollectorRegistry:
    """A registry of a sharded pool's collector; ``loop``: the one the pool runs on (default: the
    running loop), which a scrape from another thread asks for the shards' status."""
    registry = CollectorRegistry()
    registry.register(ShardedPoolCollector(pool, loop or asyncio.get_running_loop()))
    return registry


async def sharded_exposition(pool: ShardedPool, registry: CollectorRegistry) -> tuple[bytes, str]:
    """The process-wide metrics and a sharded pool's (``registry`` from ``sharded_registry``), for a
    ``/metrics`` route on the pool's own loop: the shards' status is fetched fresh first."""
    await pool.status()
    return exposition(registry)


def exposition(*extra: CollectorRegistry) -> tuple[bytes, str]:
    """The process-wide metrics, then those of ``extra`` registries (names never overlap)."""
    return b"".join(generate_latest(r) for r in (REGISTRY, *extra)), CONTENT_TYPE_LATEST
