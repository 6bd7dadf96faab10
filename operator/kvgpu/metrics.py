"""Prometheus metrics of the operator (prometheus-client). One registry per process.

Base units: seconds, bytes, cores in percent of one card's SMs. HAMi's scheduler view per card
is rendered by each node's agent (:mod:`kvgpu.agent.hamiview`) from the allocation annotation the
operator writes; the operator exports HAMi's namespace quota families (``hami_resource_quota_used``,
``hami_resource_quota_limit``, legacy ``QuotaUsed``) from its quota book, once
:meth:`OperatorMetrics.export_quotas` is given it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgpu.allocator.quota import QuotaBook

MIB = 1 << 20
#: A quota limit's ``key`` (as the ResourceQuota wrote it) -> HAMi's ``quota_name``: the resource.
_QUOTA_PREFIXES = ("limits.", "requests.")

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class OperatorMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def forget_node(self, name: str) -> None:
        """Drop a node's series (the node is gone)."""
        for g in (self.slots_used, self.slots_total, self.memory_used, self.memory_total, self.cores_used):
            try:
                g.remove(name)
            except KeyError:
                pass

    def __post_init__(self) -> None:
        r = self.registry
        self.extender_latency = Histogram(
            "kvgpu_extender_request_seconds", "Extender request latency by verb (filter, prioritize, bind).",
            ["verb"], registry=r, buckets=_LATENCY_BUCKETS)
        self.bind_failures = Counter("kvgpu_bind_failures_total", "Binds that failed, by reason.", ["reason"],
                                     registry=r)
        self.binds = Counter("kvgpu_binds_total", "Pods bound by the extender.", registry=r)
        self.extender_connections = Counter(
            "kvgpu_extender_connections_total",
            "TLS connections to the extender port whose handshake completed (each costs the operator "
            "a handshake with a client-certificate check).", registry=r)
        self.extender_http2_connections = Counter(
            "kvgpu_extender_http2_connections_total",
            "Extender connections that chose HTTP/2 (every call a stream of the connection).", registry=r)
        self.ledger_rebuild = Gauge("kvgpu_ledger_rebuild_seconds", "Duration of the last ledger rebuild.",
                                    registry=r)
        # Per node, not per card: 5 per-card series x 40,000 cards cost the operator ~150 MiB and
        # a 3 s scrape at 5,000 nodes; the node agent exports each card's figures on its node.
        node = ["node"]
        self.slots_used = Gauge("kvgpu_node_slots_used", "Slices on a node's cards.", node, registry=r)
        self.slots_total = Gauge("kvgpu_node_slots_total", "Slice capacity of a node's cards.", node, registry=r)
        self.memory_used = Gauge("kvgpu_node_memory_allocated_bytes", "Memory allocated on a node's cards, bytes.",
                                 node, registry=r)
        self.memory_total = Gauge("kvgpu_node_memory_bytes", "Virtual memory of a node's cards, bytes.", node,
                                  registry=r)
        self.cores_used = Gauge("kvgpu_node_cores_allocated_percent",
                                "Cores allocated on a node's cards, percent of one card's SMs (800 = 8 cards).",
                                node, registry=r)
        self.pending = Gauge("kvgpu_pending_pods", "kvgpu pods waiting for capacity.", registry=r)

    def export_quotas(self, book: Callable[[], QuotaBook]) -> None:
        """Export HAMi's quota families from ``book()`` on every scrape (call once)."""
        self.registry.register(QuotaCollector(book))


class QuotaCollector(Collector):
    """HAMi's ``hami_resource_quota_used{namespace, quota_name, limit}``,
    ``hami_resource_quota_limit{namespace, quota_name}`` and legacy
    ``QuotaUsed{quotanamespace, quotaName, limit}``: per ResourceQuota limit on GPU memory or
    cores, the namespace's usage in HAMi's unit (MiB; percent-of-card units). VGPUQuota limits
    (kvgpu's own object) and the cards/slices dimensions, which HAMi has not, are left out."""

    def __init__(self, book: Callable[[], QuotaBook]) -> None:
        self.book = book

    def collect(self) -> Iterator[Any]:
        used = GaugeMetricFamily("hami_resource_quota_used", "resourcequota usage for a certain device",
                                 labels=["namespace", "quota_name", "limit"])
        limit = GaugeMetricFamily("hami_resource_quota_limit", "resourcequota limit for a certain device",
                                  labels=["namespace", "quota_name"])
        legacy = GaugeMetricFamily("QuotaUsed", "resourcequota usage for a certain device",
                                   labels=["quotanamespace", "quotaName", "limit"])
        b = self.book()
        for ns in b.namespaces():
            u = b.used(ns)
            for q in b.quotas(ns):
                if q.kind != "ResourceQuota":
                    continue
                for lim in q.limits:
                    name = next((lim.key[len(p):] for p in _QUOTA_PREFIXES if lim.key.startswith(p)), lim.key)
                    if lim.dimension not in ("memory", "cores"):
                        continue
                    used.add_metric([ns, name, str(lim.hard)], u.get(lim.dimension))
                    limit.add_metric([ns, name], lim.hard)
                    legacy.add_metric([ns, name, str(lim.hard)], u.get(lim.dimension))
        yield from (used, limit, legacy)
