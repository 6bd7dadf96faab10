"""Discovery: the simulated backend, and the NVML backend against a fake pynvml."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from kvgpu.agent.discovery import DiscoveryError, NvmlDiscovery, SimulatedDiscovery
from kvgpu.core.inventory import NodeInventory, simulated_uuid

SIM = """
nodes:
  - name: gpu-0
    cards:
      - {model: "NVIDIA H200", memoryMiB: 143771, smCount: 132, numa: 0, count: 2}
      - {model: "NVIDIA L4", memoryMiB: 23034, smCount: 58, numa: 1}
  - name: gpu-1
    cards: []
"""


def test_simulated_discovery(tmp_path):
    p = tmp_path / "sim.yaml"
    p.write_text(SIM)
    inv = SimulatedDiscovery("gpu-0", str(p)).discover()
    assert inv.source == "simulated" and inv.node == "gpu-0"
    assert [c.index for c in inv.cards] == [0, 1, 2]
    assert [c.model for c in inv.cards] == ["NVIDIA H200", "NVIDIA H200", "NVIDIA L4"]
    assert inv.cards[2].sm_count == 58 and inv.cards[2].numa == 1
    assert inv.cards[0].uuid == simulated_uuid("gpu-0", 0)
    # Stable across runs and round-trips through the annotation format.
    again = SimulatedDiscovery("gpu-0", str(p)).discover()
    assert again.dumps() == inv.dumps()
    assert NodeInventory.loads(inv.dumps()) == inv
    assert SimulatedDiscovery("gpu-1", str(p)).discover().cards == ()


def test_simulated_json_and_errors(tmp_path):
    p = tmp_path / "sim.json"
    p.write_text(json.dumps({"nodes": [{"name": "n", "cards": [{"count": 1}]}]}))
    assert len(SimulatedDiscovery("n", str(p)).discover().cards) == 1
    with pytest.raises(DiscoveryError, match="no node named"):
        SimulatedDiscovery("other", str(p)).discover()
    with pytest.raises(DiscoveryError):
        SimulatedDiscovery("n", str(tmp_path / "missing.yaml")).discover()
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [{cards: []}]")  # no name
    with pytest.raises(DiscoveryError, match="malformed"):
        SimulatedDiscovery("n", str(bad)).discover()


class FakeNvml:
    """Just the pynvml calls discovery makes."""

    def __init__(self, cards, attributes_supported=True):
        self.cards = cards
        self.attributes_supported = attributes_supported
        self.inits = 0

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        pass

    def nvmlSystemGetDriverVersion(self):
        return "580.159.04"

    def nvmlSystemGetCudaDriverVersion(self):
        return 13000

    def nvmlDeviceGetCount(self):
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.cards[i]

    def nvmlDeviceGetUUID(self, h):
        return h["uuid"].encode()

    def nvmlDeviceGetName(self, h):
        return h["name"]

    def nvmlDeviceGetIndex(self, h):
        return self.cards.index(h)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=h["mib"] << 20, used=0, free=h["mib"] << 20)

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=b"00000000:19:00.0")

    def nvmlDeviceGetNumaNodeId(self, h):
        if h.get("numa") is None:
            raise RuntimeError("Not Supported")
        return h["numa"]

    def nvmlDeviceGetMigMode(self, h):
        if "mig" not in h:
            raise RuntimeError("Not Supported")
        return [h["mig"], h["mig"]]

    def nvmlDeviceGetAttributes(self, h):
        if not self.attributes_supported:
            raise RuntimeError("Not Supported")
        return SimpleNamespace(multiprocessorCount=h["sms"])


H200 = {"uuid": "GPU-11111111-2222-3333-4444-555555555555", "name": "NVIDIA H200", "mib": 143771, "sms": 132}


def test_nvml_discovery_fields():
    cards = [dict(H200, numa=0, mig=0), dict(H200, uuid="GPU-b", numa=None, mig=1)]
    fake = FakeNvml(cards)
    d = NvmlDiscovery("gpu-0", nvml=fake, cuda_sm=lambda: {}, sysfs="/nonexistent")
    inv = d.discover()
    assert inv.source == "nvml" and inv.driver == "580.159.04" and inv.cuda == "13.0"
    a, b = inv.cards
    assert (a.uuid, a.index, a.model, a.memory_mib, a.sm_count, a.numa, a.mig_mode) == (
        H200["uuid"],
        0,
        "NVIDIA H200",
        143771,
        132,
        0,
        False,
    )
    assert b.numa is None and b.mig_mode is True
    assert d.details[0].sm_source == "nvml"
    d.discover()
    assert fake.inits == 1  # NVML initialised once per process


def test_nvml_sm_fallbacks():
    fake = FakeNvml([dict(H200, numa=0)], attributes_supported=False)
    d = NvmlDiscovery("n", nvml=fake, cuda_sm=lambda: {H200["uuid"]: 132})
    assert d.discover().cards[0].sm_count == 132 and d.details[0].sm_source == "cuda"
    d2 = NvmlDiscovery("n", nvml=FakeNvml([dict(H200, numa=0)], False), cuda_sm=lambda: {})
    assert d2.discover().cards[0].sm_count == 132 and d2.details[0].sm_source == "table"


def test_nvml_init_failure():
    class Broken(FakeNvml):
        def nvmlInit(self):
            raise RuntimeError("NVML Shared Library Not Found")

    with pytest.raises(DiscoveryError, match="NVML init failed"):
        NvmlDiscovery("n", nvml=Broken([])).discover()
