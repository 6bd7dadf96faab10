"""Registration against a fake NodeApi: patched only on change, slicing from pools, health."""

from __future__ import annotations

import asyncio

import pytest
from agent_helpers import FakeApi, pool
from kvgpu.agent.discovery import DiscoveryError, SimulatedDiscovery
from kvgpu.agent.health import HealthState, Observation
from kvgpu.agent.registration import Registrar, pool_slicing
from kvgpu.core import keys
from kvgpu.core.inventory import NodeInventory

SIM = """
nodes:
  - name: gpu-0
    cards:
      - {model: "NVIDIA H200", memoryMiB: 143771, smCount: 132, count: 2}
"""


@pytest.fixture
def sim(tmp_path):
    p = tmp_path / "sim.yaml"
    p.write_text(SIM)
    return str(p)


async def test_patch_only_on_change(sim):
    api = FakeApi(labels={"pool": "a"})
    r = Registrar("gpu-0", api, SimulatedDiscovery("gpu-0", sim))
    inv, patched = await r.refresh()
    assert patched and len(api.patches) == 1
    assert api.node["metadata"]["labels"][keys.NODE_LABEL_GPU] == "true"
    assert NodeInventory.loads(api.node["metadata"]["annotations"][keys.NODE_INVENTORY]) == inv
    assert all(c.slicing is None for c in inv.cards)  # no pool yet
    assert api.events[0][0] == "GPUInventoryChanged"
    # Nothing changed: no patch, also for a fresh agent process (compares with the Node, not a cache).
    assert (await r.refresh())[1] is False
    r2 = Registrar("gpu-0", api, SimulatedDiscovery("gpu-0", sim))
    assert (await r2.refresh())[1] is False
    assert len(api.patches) == 1
    # A pool appears: slicing changes -> one patch.
    api.pools = [pool("p1", split=4, match={"pool": "a"})]
    inv, patched = await r.refresh()
    assert patched and {c.slicing.split_count for c in inv.cards} == {4}
    assert len(api.patches) == 2
    # Someone deletes the annotation: repaired.
    del api.node["metadata"]["annotations"][keys.NODE_INVENTORY]
    assert (await r.refresh())[1] is True


async def test_health_is_published_and_discovery_failure_keeps_cards(sim):
    api = FakeApi()
    disc = SimulatedDiscovery("gpu-0", sim)
    state = HealthState([], recovery_s=0)
    r = Registrar("gpu-0", api, disc, health=state)
    inv, _ = await r.refresh()
    u1 = inv.cards[1].uuid
    state.observe(Observation("xid", u1, xid=79), now=1)
    inv, patched = await r.refresh()
    assert patched and not inv.cards[1].healthy and inv.cards[1].reason.startswith("XID 79")

    class Broken:
        def discover(self):
            raise DiscoveryError("NVML query of card 1 failed: GPU is lost")

    r.discovery = Broken()
    inv2, patched = await r.refresh()
    assert not patched and inv2 == inv  # last good cards, current health
    with pytest.raises(DiscoveryError):
        await Registrar("gpu-0", api, Broken()).refresh()


def test_pool_slicing_most_specific_and_invalid_pool(sim):
    inv = SimulatedDiscovery("gpu-0", sim).discover()
    c0, c1 = inv.cards
    pools = [
        pool("wide", split=10),
        pool("one", split=3, uuids=[c1.uuid]),
        {"metadata": {"name": "broken"}, "spec": {"splitCount": "many"}},
    ]
    s = pool_slicing(pools, {}, inv.cards)
    assert s[c0.uuid].pool == "wide" and s[c1.uuid].pool == "one" and s[c1.uuid].split_count == 3
    s = pool_slicing([pool("x", match={"zone": "b"})], {"zone": "a"}, inv.cards)
    assert s == {c0.uuid: None, c1.uuid: None}


async def test_run_loop_kick(sim):
    api = FakeApi()
    r = Registrar("gpu-0", api, SimulatedDiscovery("gpu-0", sim))
    seen: list = []

    async def on_inv(inv):
        seen.append(inv)

    task = asyncio.create_task(r.run(interval_s=3600, on_inventory=on_inv))
    for _ in range(100):
        if seen:
            break
        await asyncio.sleep(0.01)
    api.pools = [pool("p", split=2)]
    r.kick()
    for _ in range(100):
        if len(seen) >= 2:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert len(seen) >= 2 and seen[-1].cards[0].slicing.split_count == 2
