"""The usage exporter with a fake region reader: limits before CUDA, usage after, HAMi names."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from kvgpu.agent.exporter import (
    DeviceUsage,
    UsageCollector,
    adapt_region,
    containers_of_pod,
    gc_regions,
    make_registry,
    pending_device_sets,
)
from kvgpu.agent.pods import PodCache
from kvgpu.core import keys
from kvgpu.core.inventory import Card, NodeInventory, Slicing
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

U0 = "GPU-00000000-0000-0000-0000-000000000000"
U1 = "GPU-11111111-1111-1111-1111-111111111111"
INV = NodeInventory(
    "gpu-0",
    (
        Card(U0, 0, "NVIDIA H200", 143771, 132, 0, slicing=Slicing("default", 10)),
        Card(U1, 1, "NVIDIA H200", 143771, 132, 1, healthy=False, reason="XID 79"),
    ),
    "simulated",
)


def pod(name="nb", uid="uid-1", containers=("main", "side"), claims=None, statuses=(), phase="Pending"):
    claims = (
        claims
        if claims is not None
        else {
            "main": f"v1;claim=team/nb-main;priority=0;dev={U0},3000,30;dev={U1},2000,0",
        }
    )
    return {
        "metadata": {
            "name": name,
            "namespace": "team",
            "uid": uid,
            "annotations": {keys.claim_annotation(c): t for c, t in claims.items()},
        },
        "spec": {"nodeName": "gpu-0", "containers": [{"name": c} for c in containers]},
        "status": {
            "phase": phase,
            "containerStatuses": [{"name": s, "containerID": "containerd://x"} for s in statuses],
        },
    }


def scrape(collector) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(make_registry(collector)).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples, name, **labels):
    hits = [v for (n, lv), v in samples.items() if n == name and set(labels.items()) <= lv]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def test_containers_of_pod():
    (c,) = containers_of_pod(pod())
    assert (c.namespace, c.pod, c.pod_uid, c.container, c.claim, c.priority) == (
        "team",
        "nb",
        "uid-1",
        "main",
        "team/nb-main",
        0,
    )
    assert [(d.uuid, d.memory_mib, d.cores) for d in c.devices] == [(U0, 3000, 30), (U1, 2000, 0)]
    assert not c.started
    assert containers_of_pod(pod(phase="Succeeded")) == []
    assert containers_of_pod(pod(claims={"main": "garbage"})) == []
    assert containers_of_pod(pod(statuses=("main",)))[0].started
    assert pending_device_sets(containers_of_pod(pod())) == [[U0, U1]]
    assert pending_device_sets(containers_of_pod(pod(statuses=("main",)))) == []


def test_limits_appear_before_cuda_then_usage(tmp_path):
    regions: dict[Path, list[DeviceUsage]] = {}
    measured: dict[tuple[str, str, str], float] = {}
    reads: list[Path] = []

    def reader(path):
        reads.append(path)
        return regions.get(path)

    pods = [pod()]
    col = UsageCollector(
        "gpu-0",
        lambda: [c for p in pods for c in containers_of_pod(p)],
        lambda: INV,
        reader=reader,
        region_root=str(tmp_path),
        utilization=lambda: measured,
    )
    s = scrape(col)
    lab = {"namespace": "team", "pod": "nb", "container": "main", "device_uuid": U0}
    # Bound, no CUDA yet: the limit is there, usage 0, region inactive.
    assert value(s, "kvgpu_container_memory_limit_bytes", **lab) == 3000 * 2**20
    assert value(s, "kvgpu_container_core_limit_percent", **lab) == 30
    assert value(s, "kvgpu_container_memory_used_bytes", **lab) == 0
    assert value(s, "kvgpu_container_region_active", container="main") == 0
    assert value(s, "kvgpu_container_memory_limit_bytes", device_uuid=U1, device_index="1") == 2000 * 2**20
    assert reads == [tmp_path / "uid-1" / "main"]
    # The shim starts: usage from the region.
    regions[tmp_path / "uid-1" / "main"] = [DeviceUsage(U0, 3000, 1024.5, (10, 11))]
    measured[("uid-1", "main", U0)] = 27.0  # the agent's NVML samples
    s = scrape(col)
    assert value(s, "kvgpu_container_memory_used_bytes", **lab) == 1024.5 * 2**20
    assert value(s, "kvgpu_container_sm_utilization_percent", **lab) == 27
    assert value(s, "kvgpu_container_processes", **lab) == 2
    assert value(s, "kvgpu_container_enforced_limit_bytes", **lab) == 3000 * 2**20
    assert value(s, "kvgpu_container_region_active", container="main") == 1
    # HAMi-compatible names, with the real device position.
    assert value(s, "hami_vgpu_memory_used_bytes", device_uuid=U0, vdevice_index="0") == 1024.5 * 2**20
    assert value(s, "hami_vgpu_memory_limit_bytes", device_uuid=U1, vdevice_index="1") == 2000 * 2**20
    # Cards.
    assert value(s, "kvgpu_card_healthy", device_uuid=U1) == 0
    assert value(s, "kvgpu_card_slices", device_uuid=U0) == 10
    assert value(s, "kvgpu_card_slices", device_uuid=U1) == 0
    # Pod gone: its series go.
    pods.clear()
    s = scrape(col)
    assert not [k for k in s if k[0] == "kvgpu_container_memory_limit_bytes"]


def test_reader_errors_do_not_break_scrape(tmp_path):
    def reader(path):
        raise ValueError("bad magic")

    col = UsageCollector(
        "gpu-0",
        lambda: containers_of_pod(pod()),
        lambda: INV,
        reader=reader,
        region_root=str(tmp_path),
        hami_compat=False,
    )
    s = scrape(col)
    assert value(s, "kvgpu_region_read_errors_total") == 1
    assert value(s, "kvgpu_container_memory_limit_bytes", device_uuid=U0) == 3000 * 2**20
    assert not [k for k in s if k[0].startswith("hami_")]


def test_adapt_region_shapes():
    obj = SimpleNamespace(devices=[SimpleNamespace(uuid=U0, limit_mib=100, used_mib=5, pids=[1], sm_util=3)])
    assert adapt_region(obj) == [DeviceUsage(U0, 100, 5.0, (1,))]
    dicts = [{"uuid": U1, "limit_bytes": 2 * 2**20, "used_bytes": 2**20}]
    assert adapt_region(dicts) == [DeviceUsage(U1, 2, 1.0, ())]
    assert adapt_region(None) == []


def test_gc_regions(tmp_path):
    for uid in ("live", "gone-old", "gone-new"):
        (tmp_path / uid / "main").mkdir(parents=True)
    os.utime(tmp_path / "gone-old", (0, 0))
    removed = gc_regions(tmp_path, {"live"}, min_age_s=60)
    assert [p.name for p in removed] == ["gone-old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gone-new", "live"]


def test_pod_cache_hints():
    pc = PodCache("gpu-0")
    pc.set_pod(pod())
    pc.set_pod(
        pod(
            name="other",
            uid="uid-2",
            claims={"main": f"v1;claim=team/o;priority=1;dev={U1},100,0"},
            statuses=("main",),
        )
    )
    assert pc.hints(2) == [[U0, U1]] and pc.hints(1) == []
    assert {c.pod for c in pc.containers()} == {"nb", "other"}
    pc.delete_pod(pod())
    assert pc.live_uids() == {"uid-2"}
