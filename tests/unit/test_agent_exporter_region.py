"""The exporter reading a REAL shim region (the shim's own C code through kvgpu.shimcore)."""

from __future__ import annotations

import os

import pytest
from kvgpu.agent.exporter import BoundContainer, BoundDevice, UsageCollector, default_reader, make_registry
from kvgpu.core.inventory import Card, NodeInventory
from prometheus_client import generate_latest

U0 = "GPU-00000000-0000-0000-0000-000000000000"
MIB = 1 << 20


@pytest.fixture
def core():
    from kvgpu import shimcore

    try:
        return shimcore.core()
    except Exception as e:  # no compiler / shim sources here
        pytest.skip(f"shim core unavailable: {e}")


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
