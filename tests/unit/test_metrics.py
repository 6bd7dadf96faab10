"""The operator's allocation metrics are per node, and a node's series can be dropped."""

from __future__ import annotations

from kvgpu.metrics import OperatorMetrics
from prometheus_client import generate_latest


def test_node_series_are_per_node_and_forgotten_with_the_node() -> None:
    m = OperatorMetrics()
    for name in ("n1", "n2"):
        m.slots_used.labels(name).set(3)
        m.memory_total.labels(name).set(8 * 81559)
    text = generate_latest(m.registry).decode()
    assert 'kvgpu_node_slots_used{node="n1"} 3.0' in text
    assert "uuid=" not in text, "allocation series must not be per card"
    m.forget_node("n1")
    m.forget_node("n-unknown")  # no error for a node without series
    text = generate_latest(m.registry).decode()
    assert 'node="n1"' not in text and 'kvgpu_node_slots_used{node="n2"} 3.0' in text


def test_node_memory_in_bytes_and_hami_quota_families() -> None:
    from exportedmetrics import MIB, operator_metrics, scrape

    s = scrape(operator_metrics().registry)
    assert s["kvgpu_node_memory_allocated_bytes"] == [({"node": "gpu-0"}, 3000 * MIB)]
    # HAMi's unit for a quota's memory is MiB; only GPU memory/cores of a ResourceQuota, named by resource.
    assert s["QuotaUsed"] == [({"quotanamespace": "team", "quotaName": "nvidia.com/gpumem", "limit": "8000"}, 3000)]
    assert s["hami_resource_quota_used"] == [
        ({"namespace": "team", "quota_name": "nvidia.com/gpumem", "limit": "8000"}, 3000)]
    assert s["hami_resource_quota_limit"] == [({"namespace": "team", "quota_name": "nvidia.com/gpumem"}, 8000)]


def test_the_runtime_exports_its_own_quota_book() -> None:
    from kvgpu.allocator.quota import Amounts, Limit, Quota
    from kvgpu.runtime import OperatorConfig, Runtime

    rt = Runtime(OperatorConfig())
    rt.state.quotas.set_quota(Quota("ResourceQuota", "ns1", "q", (Limit("cores", "limits.nvidia.com/gpucores", 50),)))
    rt.state.quotas.set_pod("u", "ns1", Amounts(cores=20))
    text = generate_latest(rt.metrics.registry).decode()
    assert 'hami_resource_quota_used{limit="50",namespace="ns1",quota_name="nvidia.com/gpucores"} 20.0' in text
