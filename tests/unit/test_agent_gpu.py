"""On a GPU machine: NVML discovery agrees with nvidia-smi (skipped where there is no NVML)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from kvgpu.agent.discovery import DiscoveryError, NvmlDiscovery

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def discovered():
    d = NvmlDiscovery("gpu-test")
    try:
        inv = d.discover()
    except DiscoveryError as e:
        pytest.skip(f"no NVML here: {e}")
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no nvidia-smi")
    yield d, inv
    d.shutdown()


def test_discovery_matches_nvidia_smi(discovered):
    _, inv = discovered
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid,index,name,memory.total", "--format=csv,noheader,nounits"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    smi = {}
    for line in out.strip().splitlines():
        uuid, index, name, mem = (x.strip() for x in line.split(","))
        smi[uuid] = (int(index), name, int(mem))
    assert {c.uuid: (c.index, c.model, c.memory_mib) for c in inv.cards} == smi
    assert all(c.sm_count > 0 for c in inv.cards)
    assert inv.driver and inv.cuda


def test_health_probe_passes_on_real_cards(discovered):
    from kvgpu.agent.health import NvmlHealthSource

    d, inv = discovered
    src = NvmlHealthSource(lambda: [c.uuid for c in inv.cards], nvml=d.nvml)
    for c in inv.cards:
        o = src.probe(c.uuid)
        assert o.ok, o.reason
