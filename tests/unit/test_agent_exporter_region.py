"""The exporter reading a REAL shim region (the shim's own C code through kvgpu.shimcore)."""

from __future__ import annotations

import os

from kvgpu.agent.exporter import BoundContainer, BoundDevice, UsageCollector, default_reader, make_registry
from kvgpu.core.inventory import Card, NodeInventory
from prometheus_client import generate_latest

U0 = "GPU-00000000-0000-0000-0000-000000000000"
MIB = 1 << 20


def own_start_time() -> int:
    stat = open("/proc/self/stat").read()
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22 (starttime)


def sample(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + "{"))
    return float(line.split()[-1])


def test_usage_from_a_real_region(core, tmp_path):
    ffi, lib = core.ffi, core.lib
    claim = f"v1;claim=team/nb-main;priority=0;dev={U0},3000,30"
    region_dir = tmp_path / "pod-uid-1" / "main"
    region_dir.mkdir(parents=True)
    cfg = ffi.new("struct vgpu_config *")
    assert lib.vgpu_claim_parse(claim.encode(), cfg) == 0
    h = ffi.new("struct vgpu_region_handle *")
    assert lib.vgpu_region_open(h, str(region_dir / "vgpu.region").encode(), cfg) == 0
    try:
        assert lib.vgpu_region_join(h, os.getpid(), own_start_time()) >= 0
        assert lib.vgpu_region_reserve(h, 0, 1024 * MIB) == 0

        container = BoundContainer(
            "team", "nb", "pod-uid-1", "main", "team/nb-main", 0, (BoundDevice(U0, 3000, 30),), True
        )
        inv = NodeInventory("n", (Card(U0, 0, "NVIDIA H200", 143771, 132),), "simulated")
        col = UsageCollector(
            "n", lambda: [container], lambda: inv, reader=default_reader(), region_root=str(tmp_path)
        )
        text = generate_latest(make_registry(col)).decode()
        assert sample(text, "kvgpu_container_memory_used_bytes") == 1024 * MIB
        assert sample(text, "kvgpu_container_enforced_limit_bytes") == 3000 * MIB
        assert sample(text, "kvgpu_container_memory_limit_bytes") == 3000 * MIB
        assert sample(text, "kvgpu_container_processes") == 1
        assert sample(text, "kvgpu_container_region_active") == 1
        # A container without a region yet: limit exported, usage 0, region inactive.
        other = BoundContainer(
            "team", "nb2", "pod-uid-2", "main", "team/nb2-main", 0, (BoundDevice(U0, 500, 0),), False
        )
        col2 = UsageCollector(
            "n", lambda: [other], lambda: inv, reader=default_reader(), region_root=str(tmp_path)
        )
        text = generate_latest(make_registry(col2)).decode()
        assert sample(text, "kvgpu_container_memory_limit_bytes") == 500 * MIB
        assert sample(text, "kvgpu_container_region_active") == 0
    finally:
        lib.vgpu_region_leave(h)
        lib.vgpu_region_close(h)


async def test_agent_fills_host_pid_into_the_region(core, tmp_path):
    from kvgpu import shimcore
    from kvgpu.agent.enforcement import (
        Attribution,
        EnforcementMonitor,
        GpuProcess,
        proc_start_time,
        set_region_host_pid,
    )

    ffi, lib = core.ffi, core.lib
    claim = f"v1;claim=team/nb-main;priority=0;dev={U0},3000,30"
    region_dir = tmp_path / "pod-uid-1" / "main"
    region_dir.mkdir(parents=True)
    region = region_dir / "vgpu.region"
    cfg = ffi.new("struct vgpu_config *")
    assert lib.vgpu_claim_parse(claim.encode(), cfg) == 0
    h = ffi.new("struct vgpu_region_handle *")
    assert lib.vgpu_region_open(h, str(region).encode(), cfg) == 0
    me, start = os.getpid(), own_start_time()
    assert proc_start_time(me) == start
    try:
        assert lib.vgpu_region_join(h, me, start) >= 0
        # Wrong start time (PID reuse): refused.
        assert not set_region_host_pid(region, me, 777, start + 1)
        # The monitor sees NVML host PID 4242 = our container PID `me`, attached: writes it once.
        container = BoundContainer(
            "team", "nb", "pod-uid-1", "main", "team/nb-main", 0, (BoundDevice(U0, 3000, 30),), True, "c" * 64
        )

        def writer(c, inner, host):
            return set_region_host_pid(tmp_path / c.pod_uid / c.container / "vgpu.region", inner, host, start)

        reader = default_reader()
        mon = EnforcementMonitor(
            processes=lambda: [GpuProcess(U0, 4242, 1 << 20)],
            containers=lambda: [container],
            read_region=lambda uid, name: reader(tmp_path / uid / name),
            attribute_fn=lambda pid: Attribution("pod-uid-1", "c" * 64, me),
            host_pid_writer=writer,
        )
        (v,) = await mon.check()
        assert v.state == "enforced" and mon.host_pids_written == 1
        (dev,) = shimcore.read_region(region).devices
        assert [(p.pid, p.host_pid) for p in dev.processes] == [(me, 4242)]
        await mon.check()
        assert mon.host_pids_written == 1  # already there: no second write
    finally:
        lib.vgpu_region_leave(h)
        lib.vgpu_region_close(h)


async def test_container_sm_utilisation_measured_and_never_written_to_the_region(core, tmp_path):
    """The metric comes from NVML; the agent leaves the region alone (a value or a write there
    would be a figure the tenant could forge, or a signal of when the agent checks)."""
    from kvgpu.agent.enforcement import Attribution, EnforcementMonitor, GpuProcess

    ffi, lib = core.ffi, core.lib
    region_dir = tmp_path / "pod-uid-1" / "main"
    region_dir.mkdir(parents=True)
    region = region_dir / "vgpu.region"
    cfg = ffi.new("struct vgpu_config *")
    assert lib.vgpu_claim_parse(f"v1;claim=team/nb-main;priority=0;dev={U0},3000,30".encode(), cfg) == 0
    h = ffi.new("struct vgpu_region_handle *")
    assert lib.vgpu_region_open(h, str(region).encode(), cfg) == 0
    try:
        assert lib.vgpu_region_join(h, os.getpid(), own_start_time()) >= 0
        before = region.read_bytes()
        container = BoundContainer(
            "team", "nb", "pod-uid-1", "main", "team/nb-main", 0, (BoundDevice(U0, 3000, 30),), True, "c" * 64
        )
        reader = default_reader()
        mon = EnforcementMonitor(
            processes=lambda: [GpuProcess(U0, 4242, 1 << 20), GpuProcess(U0, 4243, 1 << 20)],
            containers=lambda: [container],
            read_region=lambda uid, name: reader(tmp_path / uid / name),
            attribute_fn=lambda pid: Attribution("pod-uid-1", "c" * 64, os.getpid() if pid == 4242 else 99),
            utilization=lambda: {(U0, 4242): 18.0, (U0, 4243): 7.0, (U0, 1): 50.0},
        )
        await mon.check()
        assert mon.container_util == {("pod-uid-1", "main", U0): 25.0}
        assert region.read_bytes() == before
        inv = NodeInventory("n", (Card(U0, 0, "NVIDIA H200", 143771, 132),), "nvml")
        col = UsageCollector(
            "n",
            lambda: [container],
            lambda: inv,
            reader=reader,
            region_root=str(tmp_path),
            processes=lambda: mon.snapshot,
            utilization=lambda: mon.container_util,
        )
        text = generate_latest(make_registry(col)).decode()
        assert sample(text, "kvgpu_container_sm_utilization_percent") == 25
    finally:
        lib.vgpu_region_leave(h)
        lib.vgpu_region_close(h)


def test_process_utilization_keeps_last_timestamp():
    from types import SimpleNamespace

    from kvgpu.agent.enforcement import ProcessUtilization

    calls = []

    class Nv:
        def nvmlDeviceGetHandleByUUID(self, u):
            return u

        def nvmlDeviceGetProcessUtilization(self, h, ts):
            calls.append(ts)
            if ts:
                raise RuntimeError("Not Found")  # no new samples
            return [
                SimpleNamespace(pid=5, timeStamp=100, smUtil=10),
                SimpleNamespace(pid=5, timeStamp=200, smUtil=30),
            ]

    pu = ProcessUtilization(Nv())
    assert pu([U0]) == {(U0, 5): 30.0}
    assert pu([U0]) == {}
    assert calls == [0, 200]
