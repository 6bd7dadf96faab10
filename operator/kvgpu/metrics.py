"""Prometheus metrics of the operator (prometheus-client). One registry per process."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
        self.ledger_rebuild = Gauge("kvgpu_ledger_rebuild_seconds", "Duration of the last ledger rebuild.",
                                    registry=r)
        # Per node, not per card: 5 per-card series x 40,000 cards cost the operator ~150 MiB and
        # a 3 s scrape at 5,000 nodes; the node agent exports each card's figures on its node.
        node = ["node"]
        self.slots_used = Gauge("kvgpu_node_slots_used", "Slices on a node's cards.", node, registry=r)
        self.slots_total = Gauge("kvgpu_node_slots_total", "Slice capacity of a node's cards.", node, registry=r)
        self.memory_used = Gauge("kvgpu_node_memory_allocated_mib", "Memory allocated on a node's cards, MiB.",
                                 node, registry=r)
        self.memory_total = Gauge("kvgpu_node_memory_mib", "Virtual memory of a node's cards, MiB.", node,
                                  registry=r)
        self.cores_used = Gauge("kvgpu_node_cores_allocated_percent",
                                "Cores allocated on a node's cards, percent of one card's SMs (800 = 8 cards).",
                                node, registry=r)
        self.pending = Gauge("kvgpu_pending_pods", "kvgpu pods waiting for capacity.", registry=r)
