"""Real exporters with real in-memory state, scraped as Prometheus text: the agent's
:class:`UsageCollector` over a REAL shim region (the shim's C code through ``kvgpu.shimcore``),
pods decoded from claim annotations, this node's allocation per card counted from them and the
inventory (``hamiview.node_allocation``); the operator's :class:`OperatorMetrics` with a real
:class:`QuotaBook`. NVML is faked (:class:`FakeNvml`): no GPU on the test machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvgpu.agent.exporter import UsageCollector, containers_of_pod, default_reader, make_registry
from kvgpu.agent.hamiview import node_allocation, nvml_host_cards
from kvgpu.allocator.quota import Amounts, Limit, Quota, QuotaBook
from kvgpu.core import keys
from kvgpu.core.inventory import Card, NodeInventory, Slicing
from kvgpu.metrics import OperatorMetrics
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

MIB = 1 << 20
U0 = "GPU-00000000-0000-0000-0000-000000000000"
U1 = "GPU-11111111-1111-1111-1111-111111111111"
NODE = "gpu-0"
INV = NodeInventory(
    NODE,
    (
        Card(U0, 0, "NVIDIA H200", 143771, 132, 0, slicing=Slicing("default", 10)),
        Card(U1, 1, "NVIDIA H200", 143771, 132, 1, slicing=Slicing("default", 10)),
    ),
    "simulated",
)
CLAIM = f"v1;claim=team/nb-main;priority=0;dev={U0},3000,30"


class FakeNvml:
    """pynvml's three calls the host series use, for cards ``{uuid: (used bytes, gpu %, mem %)}``
    (a fake: no NVIDIA driver here). ``None`` for a figure raises as NVML's NOT_SUPPORTED does."""

    def __init__(self, cards: dict[str, tuple[int | None, int | None, int | None]]) -> None:
        self.cards = cards

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid not in self.cards:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return uuid

    def nvmlDeviceGetMemoryInfo(self, h: str) -> Any:
        if self.cards[h][0] is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return SimpleNamespace(used=self.cards[h][0])

    def nvmlDeviceGetUtilizationRates(self, h: str) -> Any:
        _, gpu, mem = self.cards[h]
        if gpu is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return SimpleNamespace(gpu=gpu, memory=mem)


def pod(name: str = "nb", uid: str = "pod-uid-1") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "team", "uid": uid,
                     "annotations": {keys.claim_annotation("main"): CLAIM}},
        "spec": {"nodeName": NODE, "initContainers": [{"name": "setup"}],
                 "containers": [{"name": "side"}, {"name": "main"}]},
        "status": {"phase": "Running", "containerStatuses": [{"name": "main", "containerID": "containerd://x"}]},
    }


def agent_collector(region_root: Path, nvml: FakeNvml | None = None) -> UsageCollector:
    """The agent's collector over the pods above; regions under ``region_root``."""
    containers = containers_of_pod(pod())
    nv = nvml if nvml is not None else FakeNvml({U0: (1500 * MIB, 40, 12), U1: (0, 0, 0)})
    return UsageCollector(
        NODE, lambda: containers, lambda: INV, reader=default_reader(), region_root=str(region_root),
        processes=lambda: [], utilization=lambda: {},  # NVML mode: no GPU process running
        allocation=lambda cs: node_allocation(INV, cs),
        host=lambda: nvml_host_cards(nv, [(c.uuid, c.index, c.model) for c in INV.cards]),
    )


def operator_metrics() -> OperatorMetrics:
    """The operator's metrics with a ResourceQuota on GPU memory and one pod's usage."""
    m = OperatorMetrics()
    book = QuotaBook()
    book.set_quota(Quota("ResourceQuota", "team", "gpu", (Limit("memory", "limits.nvidia.com/gpumem", 8000),
                                                           Limit("slices", "requests.nvidia.com/gpu", 4))))
    book.set_pod("pod-uid-1", "team", Amounts(memory=3000, cores=30, cards=1, slices=1))
    m.export_quotas(lambda: book)
    for name, used, total in ((NODE, 3000, 2 * 143771),):
        m.slots_used.labels(name).set(1)
        m.slots_total.labels(name).set(20)
        m.memory_used.labels(name).set(used * MIB)
        m.memory_total.labels(name).set(total * MIB)
        m.cores_used.labels(name).set(30)
    m.pending.set(0)
    return m


def scrape_text(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] from Prometheus text exposition (prometheus_client's parser)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def scrape(*registries: Any) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for r in registries:
        for k, v in scrape_text(generate_latest(r).decode()).items():
            out.setdefault(k, []).extend(v)
    return out


def open_region(core: Any, region_root: Path, used_mib: int) -> Any:
    """Open the shim's real region of ``pod-uid-1/main`` for CLAIM, this process joined, with
    ``used_mib`` reserved on the claim's card. Returns the handle (close with
    ``core.lib.vgpu_region_close``)."""
    ffi, lib = core.ffi, core.lib
    d = region_root / "pod-uid-1" / "main"
    d.mkdir(parents=True, exist_ok=True)
    cfg = ffi.new("struct vgpu_config *")
    assert lib.vgpu_claim_parse(CLAIM.encode(), cfg) == 0
    h = ffi.new("struct vgpu_region_handle *")
    assert lib.vgpu_region_open(h, str(d / "vgpu.region").encode(), cfg) == 0
    stat = open("/proc/self/stat").read()
    assert lib.vgpu_region_join(h, os.getpid(), int(stat.rsplit(")", 1)[1].split()[19])) >= 0
    assert lib.vgpu_region_reserve(h, 0, used_mib * MIB) == 0
    return h


def agent_registry(collector: UsageCollector) -> Any:
    return make_registry(collector)
