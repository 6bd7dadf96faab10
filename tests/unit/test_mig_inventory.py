"""MIG in the inventory: the simulated H200 in MIG mode, the NVML path against a simulated pynvml
(no MIG card can be used here: the lent H200's MIG settings must not change), and the
annotation's compatibility with agents that know no MIG instances."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from kvgpu.agent.discovery import NvmlDiscovery, SimulatedDiscovery, read_mig_minors
from kvgpu.core.inventory import NodeInventory, mig_cap_minor, parse_simulated
from kvgpu.core.migprofiles import H200_141GB, profile_from_name
from test_agent_discovery import H200, FakeNvml

SIM = """
nodes:
  - name: gpu-0
    cards:
      - {model: "NVIDIA H200", count: 1}
      - model: "NVIDIA H200"
        migInstances: [{profile: 1g.18gb, count: 7}]
      - model: "NVIDIA H200"
        migInstances: [{profile: 3g.71gb}, {profile: 2g.35gb}, {profile: 1g.18gb, count: 2}]
"""


def test_simulated_h200_in_mig_mode(tmp_path):
    p = tmp_path / "sim.yaml"
    p.write_text(SIM)
    inv = SimulatedDiscovery("gpu-0", str(p)).discover()
    whole, seven, mixed = inv.cards
    assert not whole.mig_mode and whole.mig_instances == ()
    assert seven.mig_mode and [m.profile for m in seven.mig_instances] == ["1g.18gb"] * 7
    assert {(m.memory_mib, m.sm_count) for m in seven.mig_instances} == {(16384, 16)}
    assert [m.profile for m in mixed.mig_instances] == ["3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"]
    assert [(m.memory_mib, m.sm_count) for m in mixed.mig_instances][:2] == [(67328, 60), (33280, 32)]
    uuids = [m.uuid for c in inv.cards for m in c.mig_instances]
    assert len(set(uuids)) == 11 and all(u.startswith("MIG-") for u in uuids)
    first = seven.mig_instances[0]
    assert (first.gi, first.ci) == (1, 0)
    assert (first.gi_cap_minor, first.ci_cap_minor) == (mig_cap_minor(1, 1), mig_cap_minor(1, 1, 0))
    again = SimulatedDiscovery("gpu-0", str(p)).discover()
    assert again.dumps() == inv.dumps()  # stable
    assert NodeInventory.loads(inv.dumps()) == inv  # the annotation carries the instances


def test_h200_profiles_fill_the_card_exactly():
    """Each profile's max count fits the 7 compute / 8 memory slices; the SMs add up to at most 132."""
    for p in H200_141GB.profiles:
        assert p.max_count * p.compute_slices <= 7 and p.max_count * p.memory_slices <= 8, p
        assert p.max_count * p.sm_count <= 132 and p.max_count * p.memory_mib <= 143771, p
    assert H200_141GB.profile("7g.141gb").sm_count == 132
    assert profile_from_name("NVIDIA H200 MIG 1g.18gb") == "1g.18gb"
    assert profile_from_name("NVIDIA H200") == ""


def test_cap_minors_follow_the_driver_table():
    # config 1, monitor 2, gpu0/gi0/access 3, gpu0/gi0/ci0..7 4..11, gpu0/gi1/access 12
    assert mig_cap_minor(0, 0) == 3 and mig_cap_minor(0, 0, 7) == 11 and mig_cap_minor(0, 1) == 12
    assert mig_cap_minor(1, 0) == 3 + 135


@pytest.mark.parametrize(
    ("cards", "match"),
    [
        ([{"migInstances": [{"profile": "1g.18gb", "count": 8}]}], "8/7 compute"),
        ([{"migInstances": [{"profile": "4g.71gb"}, {"profile": "3g.71gb"}, {"profile": "1g.18gb"}]}], "memory slices"),
        ([{"migInstances": [{"profile": "1g.10gb"}]}], "not one of the NVIDIA H200's: 1g.18gb, 1g.35gb"),
        ([{"migInstances": [{"profile": "1g.18gb", "count": 0}]}], r"count of 1g.18gb must be an integer ≥ 1"),
        ([{"migInstances": "1g.18gb"}], "must be a list of"),
        ([{"model": "NVIDIA L4", "migInstances": [{"profile": "1g.18gb"}]}], "no MIG profile table"),
    ],
)
def test_simulated_mig_errors_name_the_key(cards, match):
    with pytest.raises(ValueError, match=match):
        parse_simulated({"nodes": [{"name": "n", "cards": cards}]})


def test_old_annotation_without_instances_still_parses():
    old = {"version": 1, "node": "n", "source": "nvml", "driver": "", "cuda": "",
           "cards": [{"uuid": "GPU-a", "index": 0, "model": "NVIDIA H200", "memoryMiB": 143771,
                      "smCount": 132, "numa": 0, "migMode": True, "healthy": True, "reason": ""}]}
    (c,) = NodeInventory.loads(json.dumps(old)).cards
    assert c.mig_mode and c.mig_instances == ()
    assert "migInstances" not in c.to_json()  # and a card without instances writes none


class MigNvml(FakeNvml):
    """FakeNvml plus the MIG calls: card ``h["migs"]`` lists MIG devices (``None``: empty slot)."""

    def nvmlDeviceGetMinorNumber(self, h):
        return h.get("minor", self.cards.index(h))

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        return len(h["migs"])

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, i):
        if h["migs"][i] is None:
            raise RuntimeError("Not Found")
        return h["migs"][i]

    def nvmlDeviceGetGpuInstanceId(self, mh):
        return mh["gi"]

    def nvmlDeviceGetComputeInstanceId(self, mh):
        return mh["ci"]

    def nvmlDeviceGetAttributes(self, h):
        return SimpleNamespace(multiprocessorCount=h["sms"])


def mig(uuid, gi, profile="1g.18gb", mib=16128, sms=16):
    return {"uuid": uuid, "name": f"NVIDIA H200 MIG {profile}", "mib": mib, "sms": sms, "gi": gi, "ci": 0}


def test_nvml_lists_a_mig_cards_instances(tmp_path):
    minors = tmp_path / "mig-minors"
    minors.write_text("config 1\nmonitor 2\ngpu4/gi7/access 543\ngpu4/gi7/ci0/access 544\n"
                      "gpu4/gi1/access 480\ngpu4/gi1/ci0/access 481\n")
    card = dict(H200, numa=0, mig=1, minor=4,
                migs=[mig("MIG-a", 7), None, mig("MIG-b", 1, "3g.71gb", 66816, 60)])
    fake = MigNvml([dict(H200, uuid="GPU-plain", numa=0, mig=0, migs=[]), card])
    inv = NvmlDiscovery("n", nvml=fake, cuda_sm=lambda: {}, mig_minors=str(minors)).discover()
    plain, parent = inv.cards
    assert plain.mig_instances == ()
    a, b = parent.mig_instances
    assert (a.uuid, a.index, a.profile, a.memory_mib, a.sm_count) == ("MIG-a", 0, "1g.18gb", 16128, 16)
    assert (a.gi, a.ci) == (7, 0)
    assert (a.gi_cap_minor, a.ci_cap_minor) == (543, 544)
    assert (b.index, b.profile, b.sm_count, b.gi_cap_minor, b.ci_cap_minor) == (2, "3g.71gb", 60, 480, 481)


def test_nvml_mig_without_the_minors_table(tmp_path):
    card = dict(H200, numa=0, mig=1, migs=[mig("MIG-a", 7)])
    inv = NvmlDiscovery("n", nvml=MigNvml([card]), cuda_sm=lambda: {}, mig_minors=str(tmp_path / "none")).discover()
    (a,) = inv.cards[0].mig_instances
    assert a.gi_cap_minor is None and a.ci_cap_minor is None
    assert read_mig_minors(str(tmp_path / "none")) == {}


def test_nvml_unreadable_mig_device_is_not_offered(caplog):
    class Broken(MigNvml):
        def nvmlDeviceGetGpuInstanceId(self, mh):
            if mh["uuid"] == "MIG-bad":
                raise RuntimeError("Unknown Error")
            return mh["gi"]

    card = dict(H200, numa=0, mig=1, migs=[mig("MIG-bad", 7), mig("MIG-ok", 8)])
    inv = NvmlDiscovery("n", nvml=Broken([card]), cuda_sm=lambda: {}).discover()
    assert [m.uuid for m in inv.cards[0].mig_instances] == ["MIG-ok"]
    assert "MIG device 0" in caplog.text
    # a card whose MIG devices cannot be counted offers none (the plain FakeNvml has no MIG calls)
    inv = NvmlDiscovery("n", nvml=FakeNvml([dict(H200, numa=0, mig=1)]), cuda_sm=lambda: {}).discover()
    assert inv.cards[0].mig_mode and inv.cards[0].mig_instances == ()
