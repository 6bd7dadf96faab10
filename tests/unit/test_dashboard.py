"""Every query of the Grafana dashboard (charts/kvgpu/dashboards/kvgpu.json) against the
metrics really exported: the agent's collector over a REAL shim region and the operator's
metrics with real state (:mod:`exportedmetrics`), scraped as text and parsed by
prometheus_client; PromQL parsed by promql-parser (:mod:`dashboardcheck`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dashboardcheck import Checker, load, queries
from exportedmetrics import agent_collector, agent_registry, open_region, operator_metrics, scrape

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "kvgpu" / "dashboards" / "kvgpu.json"
HAMI_DASHBOARD = Path(__file__).resolve().parent / "data" / "hami-vgpu-dashboard.json"  # see data/README.md


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    from kvgpu import shimcore

    try:
        core = shimcore.core()
    except Exception as e:  # no compiler / shim sources here
        pytest.skip(f"shim core unavailable: {e}")
    root = tmp_path_factory.mktemp("regions")
    h = open_region(core, root, 1024)
    try:
        s = scrape(agent_registry(agent_collector(root)), operator_metrics().registry)
    finally:
        core.lib.vgpu_region_leave(h)
        core.lib.vgpu_region_close(h)
    return Checker(s)


def test_every_dashboard_query_resolves(checker):
    found = list(queries(load(DASHBOARD)))
    assert len(found) >= 15, "the dashboard's panels and variables"
    errors = [f"{where}: {expr}: {e}" for where, expr, legend in found for e in checker.check(expr, legend)]
    assert errors == []


def test_hamis_own_dashboard_resolves_against_kvgpu(checker):
    found = list(queries(load(HAMI_DASHBOARD)))
    assert len(found) >= 15
    errors = [f"{where}: {expr}: {e}" for where, expr, legend in found for e in checker.check(expr, legend)]
    assert errors == []


def test_the_dashboard_covers_allocation_cards_and_pods():
    d = load(DASHBOARD)
    titles = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert titles == ["Cluster allocation", "Per-node cards", "Per-pod usage vs limit"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    assert all(p["datasource"]["uid"] == "${datasource}" for p in d["panels"] if p["type"] != "row")


@pytest.mark.parametrize(
    ("expr", "legend", "error"),
    [
        ("sum(kvgpu_no_such_metric)", "", "metric 'kvgpu_no_such_metric' is not exported"),
        ('hami_gpu_shared_count{nodename=~"$node"}', "", "no label 'nodename'"),
        ("sum by (nodeid) (hami_gpu_memory_limit_bytes)", "", "sum by ['nodeid']: not labels of its input"),
        ("sum by (node) (hami_gpu_memory_limit_bytes)", "{{device_uuid}}", "labels ['device_uuid'] not on the result"),
        ('GPUDeviceSharedNum{devicetype="NVIDIA-A100"}', "", "no series with devicetype='NVIDIA-A100'"),
        ("kvgpu_card_healthy / on (pod) kvgpu_card_slices", "", "on ['pod']: not labels of the left side"),
        ("label_values(kvgpu_card_info, pod)", "", "labels ['pod'] not on the result"),
        ("sum(rate(kvgpu_container_memory_used_bytes[5m]", "", "does not parse"),
    ],
)
def test_a_bad_query_is_caught(checker, expr, legend, error):
    errors = checker.check(expr, legend)
    assert any(error in e for e in errors), errors


def test_a_good_query_passes(checker):
    assert checker.check(
        "hami_host_gpu_memory_used_bytes and on (device_uuid) hami_gpu_memory_limit_bytes", "{{node}}"
    ) == []
