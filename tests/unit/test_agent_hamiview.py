"""HAMi's scheduler and monitor views from the agent: a REAL shim region (the shim's C code),
the node's allocation counted from the pods bound to it as the operator's ledger counts the
claims, NVML faked (no GPU here)."""

from __future__ import annotations

import pytest
from exportedmetrics import INV, MIB, NODE, U0, U1, FakeNvml, agent_collector, agent_registry, open_region, scrape
from hypothesis import given, settings
from hypothesis import strategies as st
from kvgpu.agent.hamiview import node_allocation, scheduler_card_families
from kvgpu.agent.usage import BoundContainer, BoundDevice
from kvgpu.core.requests import ContainerAllocation, DeviceGrant, PodAllocation
from kvgpu.reconcile.state import OperatorState


def one(samples, name, **labels):
    hits = [v for lv, v in samples.get(name, []) if labels.items() <= lv.items()]
    assert len(hits) == 1, (name, labels, samples.get(name))
    return hits[0]


def test_monitor_view_reads_the_region(core, tmp_path):
    h = open_region(core, tmp_path, 1024)
    try:
        s = scrape(agent_registry(agent_collector(tmp_path)))
    finally:
        core.lib.vgpu_region_leave(h)
        core.lib.vgpu_region_close(h)
    ctr = {"podnamespace": "team", "podname": "nb", "ctrname": "main", "vdeviceid": "0", "deviceuuid": U0}
    assert one(s, "vGPU_device_memory_usage_in_bytes", **ctr) == 1024 * MIB
    assert one(s, "vGPU_device_memory_limit_in_bytes", **ctr) == 3000 * MIB
    new = {"namespace": "team", "pod": "nb", "container": "main", "vdevice_index": "0", "device_uuid": U0}
    assert one(s, "hami_vgpu_memory_used_bytes", **new) == 1024 * MIB
    assert one(s, "hami_container_device_memory_bytes", **new) == 1024 * MIB
    assert one(s, "Device_utilization_desc_of_container", **ctr) == 0
    for absent in ("Device_last_kernel_of_container", "Device_memory_desc_of_container",
                   "hami_container_last_kernel_elapsed_seconds", "hami_vgpu_memory_context_bytes"):
        assert absent not in s, f"{absent}: kvgpu has no such figure, it must not be exported"


def test_scheduler_view_per_card_and_per_container(tmp_path):
    s = scrape(agent_registry(agent_collector(tmp_path)))
    card = {"nodeid": NODE, "deviceuuid": U0, "deviceidx": "0", "devicetype": "NVIDIA-NVIDIA H200"}
    assert one(s, "GPUDeviceMemoryLimit", **card) == 143771 * MIB
    assert one(s, "GPUDeviceMemoryAllocated", devicecores="100", **card) == 3000 * MIB
    assert one(s, "GPUDeviceCoreAllocated", **card) == 30
    assert one(s, "GPUDeviceCoreLimit", **card) == 100
    assert one(s, "GPUDeviceSharedNum", **card) == 1
    assert one(s, "GPUDeviceSharedNum", deviceuuid=U1) == 0
    assert one(s, "nodeGPUOverview", devicememorylimit="143771", **card) == 3000 * MIB
    assert one(s, "nodeGPUMemoryPercentage", nodeid=NODE, deviceuuid=U0) == pytest.approx(3000 / 143771)
    assert one(s, "hami_gpu_memory_allocated_bytes", node=NODE, device_uuid=U0, device_cores="100") == 3000 * MIB
    assert one(s, "hami_node_gpu_memory_allocated_ratio", device_uuid=U0, device_type="NVIDIA-NVIDIA H200") \
        == pytest.approx(3000 / 143771)
    # Container index as HAMi counts it: init containers first ("setup"), then "side", "main".
    alloc = {"namespace": "team", "node": NODE, "pod": "nb", "container_index": "2", "device_uuid": U0}
    assert one(s, "hami_vgpu_memory_allocated_bytes", **alloc) == 3000 * MIB
    assert one(s, "hami_vgpu_core_allocated_ratio", **alloc) == 30
    assert one(s, "vGPUMemoryAllocated", podnamespace="team", nodename=NODE, containeridx="2") == 3000 * MIB


def test_one_scrape_counts_cards_and_containers_from_one_snapshot(tmp_path):
    """The pods bound here change while a scrape runs (the scrape is the exporter's thread, the
    pod cache the agent's loop): a pod deleted between the per-container series and the card
    series showed its grant in vGPUMemoryAllocated beside GPUDeviceSharedNum 0. The card series
    are counted from the containers the scrape read once."""
    c = agent_collector(tmp_path)
    snapshots = [list(c.containers()), []]  # the pod, then gone
    c.containers = lambda: snapshots.pop(0) if len(snapshots) > 1 else snapshots[0]
    s = scrape(agent_registry(c))
    assert one(s, "vGPUMemoryAllocated", podnamespace="team", nodename=NODE, containeridx="2") == 3000 * MIB
    assert one(s, "GPUDeviceSharedNum", deviceuuid=U0) == 1
    assert one(s, "GPUDeviceMemoryAllocated", deviceuuid=U0) == 3000 * MIB


def test_no_inventory_no_card_series():
    assert node_allocation(None, []) is None
    assert all(f.samples == [] for f in scheduler_card_families(NODE, node_allocation(None, [])))


def test_no_allocation_no_card_series():
    fams = {f.name: f for f in scheduler_card_families(NODE, None)}
    assert fams["GPUDeviceMemoryLimit"].samples == [] and fams["hami_gpu_shared_count"].samples == []
    bad = {f.name: f for f in scheduler_card_families(NODE, {"cards": [{"uuid": U0, "memoryMiB": "x"}]})}
    assert bad["nodeGPUMemoryPercentage"].samples == [], "no ratio of a card without a memory total"


def test_host_series_from_nvml_and_left_out_where_nvml_refuses(tmp_path):
    nv = FakeNvml({U0: (1500 * MIB, 40, 12), U1: (None, None, None)})
    s = scrape(agent_registry(agent_collector(tmp_path, nv)))
    assert one(s, "HostGPUMemoryUsage", nodeid=NODE, deviceuuid=U0) == 1500 * MIB
    assert one(s, "HostCoreUtilization", nodeid=NODE, deviceuuid=U0) == 40
    assert one(s, "hami_host_gpu_utilization_ratio", node=NODE, device_uuid=U0) == 40
    assert one(s, "hami_host_gpu_memory_controller_utilization_ratio", device_uuid=U0) == 12
    assert [lv for lv, _ in s["HostGPUMemoryUsage"] if lv["deviceuuid"] == U1] == []


def _bound(pod: str, container: str, devices: list[tuple[str, int, int]], *, init: bool = False,
           region_dir: str = "") -> BoundContainer:
    return BoundContainer("team", pod, f"uid-{pod}", container, f"team/{pod}-{container}", 1,
                          tuple(BoundDevice(u, m, c) for u, m, c in devices), init=init, region_dir=region_dir)


def test_the_agents_count_is_the_ledgers():
    """An init container's slice overlaps its app containers' (max, not sum), an exclusive slice
    marks its card, a DRA claim shared by two pods is one slice; pods of one node."""
    bound = [
        _bound("a", "setup", [(U0, 8000, 50)], init=True),
        _bound("a", "main", [(U0, 3000, 30)]),
        _bound("a", "side", [(U0, 2000, 10)]),
        _bound("b", "main", [(U1, 143771, 100)]),
        _bound("c", "main", [(U0, 1000, 10)], region_dir="/claims/x"),
        _bound("d", "main", [(U0, 1000, 10)], region_dir="/claims/x"),
    ]
    got = node_allocation(INV, bound)
    assert got is not None
    c0, c1 = got["cards"]
    assert (c0["slots"], c0["memoryMiB"], c0["cores"], c0["pods"]) == ([3, 10], [9000, 143771], [60, 100], 2)
    assert c1["exclusive"] and c1["memoryMiB"] == [143771, 143771] and c1["slots"] == [1, 10]


CARD_UUIDS = [c.uuid for c in INV.cards]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["main", "side", "setup"]),
                          st.lists(st.tuples(st.sampled_from(CARD_UUIDS), st.integers(1, 20000),
                                             st.integers(0, 100)), min_size=1, max_size=2,
                                   unique_by=lambda d: d[0])),
                max_size=12, unique_by=lambda t: (t[0], t[1])))
def test_the_agent_counts_what_the_operator_counts(containers):
    """For any containers bound here, the agent's per-card figures equal the operator's ledger
    rebuilt from the same slices' claims (overcommitted or not)."""
    bound = [_bound(f"p{pod}", name, devs, init=name == "setup") for pod, name, devs in containers]
    state = OperatorState()
    state.ledger.set_node(INV)
    index = {c.uuid: c for c in INV.cards}
    for b in bound:
        grants = tuple(DeviceGrant(d.uuid, index[d.uuid].index, index[d.uuid].model, d.memory_mib, d.cores)
                       for d in b.devices)
        state.ledger.reserve(b.claim, PodAllocation(b.pod_uid, NODE, (ContainerAllocation(
            b.container, grants, b.priority, b.init),)), force=True)
    assert node_allocation(INV, bound) == state.ledger.node_usage(NODE).to_json()
