"""The agent's ResourceSlice publisher against the real kube-apiserver (and the controller
manager's garbage collector): created with the Node as owner, not rewritten while unchanged,
replaced with the next pool generation when a card changes, deleted when no dra card is left
and with its Node."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import pytest
from kvgpu.agent.drapublish import SlicePublisher
from kvgpu.core.inventory import Card, NodeInventory, SimulatedCardSpec, SimulatedNode, Slicing
from kvgpu.devcluster import Cluster
from kvgpu.devcluster.fakenodes import create_nodes
from kvgpu.dra.slices import slice_name

pytestmark = pytest.mark.cluster


def _slice(cluster: Cluster, node: str) -> dict | None:
    p = cluster.kubectl("get", "resourceslice", slice_name(node), "-o", "json", check=False)
    return json.loads(p.stdout) if p.returncode == 0 else None


async def _gone(cluster: Cluster, node: str, limit_s: float = 60) -> bool:
    for _ in range(int(limit_s * 2)):
        if _slice(cluster, node) is None:
            return True
        await asyncio.sleep(0.5)
    return False


async def test_publisher_follows_the_inventory(cluster: Cluster, namespace: str) -> None:
    node = f"dra-{namespace}"
    dra = Slicing("p", split_count=4, allocation="dra")
    cards = tuple(Card(f"GPU-{i}-{namespace}", i, "NVIDIA H200", 143771, 132, 0, slicing=dra) for i in range(2))
    inv = NodeInventory(node, cards)
    pools = [{"metadata": {"name": "p"}, "spec": {"defaults": {"gpumem": 3000, "gpucores": 30},
                                                  "minSliceMemory": 512}}]
    async with cluster.api() as api:
        await create_nodes(api, [SimulatedNode(node, (SimulatedCardSpec(count=2),))], with_inventory=False)
        try:
            pub = SlicePublisher(node, api)
            assert await pub.sync(inv, pools)
            s = _slice(cluster, node)
            assert s is not None
            n = json.loads(cluster.kubectl("get", "node", node, "-o", "json").stdout)
            (owner,) = s["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["name"], owner["uid"]) == ("Node", node, n["metadata"]["uid"])
            assert [d["name"] for d in s["spec"]["devices"]] == ["gpu-0", "gpu-1"]
            assert s["spec"]["pool"]["generation"] == 1
            assert s["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]["default"] == "3000Mi"
            rv = s["metadata"]["resourceVersion"]

            assert not await SlicePublisher(node, api).sync(inv, pools)  # unchanged, also for a new agent
            assert _slice(cluster, node)["metadata"]["resourceVersion"] == rv  # type: ignore[index]

            sick = NodeInventory(node, (cards[0], replace(cards[1], healthy=False, reason="XID 79")))
            assert await pub.sync(sick, pools)
            s = _slice(cluster, node)
            assert s is not None and [d["name"] for d in s["spec"]["devices"]] == ["gpu-0"]
            assert s["spec"]["pool"]["generation"] == 2

            extender = NodeInventory(node, tuple(replace(c, slicing=Slicing("p")) for c in cards))
            assert await pub.sync(extender, pools)
            assert _slice(cluster, node) is None
            assert not await pub.sync(extender, pools)

            assert await pub.sync(inv, pools)  # and back; deleting the Node deletes its slice
        finally:
            cluster.kubectl("delete", "node", node, "--ignore-not-found")
        assert await _gone(cluster, node), "the garbage collector left the slice of a deleted Node"
        cluster.kubectl("delete", "resourceslice", slice_name(node), "--ignore-not-found")


async def test_a_deleted_slice_is_noticed_and_published_again(cluster: Cluster, namespace: str) -> None:
    """What a starting kubelet does (it deletes its node's ResourceSlices): the publisher's watch
    asks for a sync, which creates the slice again."""
    node = f"draw-{namespace}"
    inv = NodeInventory(node, (Card(f"GPU-w-{namespace}", 0, "NVIDIA H200", 143771, 132, 0,
                                    slicing=Slicing("p", allocation="dra")),))
    async with cluster.api() as api:
        await create_nodes(api, [SimulatedNode(node, (SimulatedCardSpec(count=1),))], with_inventory=False)
        pub = SlicePublisher(node, api)
        kicked = asyncio.Event()
        watch = asyncio.create_task(pub.watch(api, kicked.set))
        try:
            assert await pub.sync(inv, [])
            await asyncio.sleep(1.0)
            kicked.clear()  # our own write (and the initial list) may kick once; from now on only a deletion
            cluster.kubectl("delete", "resourceslice", slice_name(node))
            await asyncio.wait_for(kicked.wait(), 30)
            assert await pub.sync(inv, [])
            assert _slice(cluster, node) is not None
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            cluster.kubectl("delete", "node", node, "--ignore-not-found")
            cluster.kubectl("delete", "resourceslice", slice_name(node), "--ignore-not-found")


async def test_a_mig_node_gets_its_counter_slice_with_one_generation(cluster: Cluster, namespace: str) -> None:
    """A node with a MIG card in a dra pool has two slices (devices, counters) written with one
    generation; when the MIG card leaves the pool the counter slice is deleted and the device
    slice written again with the next generation."""
    from kvgpu.core.inventory import parse_simulated
    from kvgpu.dra.slices import counter_slice_name

    node = f"dram-{namespace}"
    (sim,) = parse_simulated({"nodes": [{"name": node, "cards": [
        {"model": "NVIDIA H200"}, {"model": "NVIDIA H200", "migInstances": [{"profile": "1g.18gb", "count": 7}]}]}]})
    plain = sim.inventory()
    inv = plain.with_slicing({c.uuid: Slicing("p", allocation="dra") for c in plain.cards})
    async with cluster.api() as api:
        await create_nodes(api, [SimulatedNode(node, (SimulatedCardSpec(count=2),))], with_inventory=False)
        try:
            pub = SlicePublisher(node, api)
            assert await pub.sync(inv, [])
            dev, cnt = _slice(cluster, node), _get(cluster, counter_slice_name(node))
            assert dev is not None and cnt is not None
            assert {dev["spec"]["pool"]["generation"], cnt["spec"]["pool"]["generation"]} == {1}
            assert dev["spec"]["pool"]["resourceSliceCount"] == 2
            assert not await SlicePublisher(node, api).sync(inv, [])   # a new agent: nothing to write

            no_mig = inv.with_slicing({c.uuid: (Slicing("p", allocation="dra") if not c.mig_mode else None)
                                       for c in inv.cards})
            assert await pub.sync(no_mig, [])
            assert _get(cluster, counter_slice_name(node)) is None
            dev = _slice(cluster, node)
            assert dev is not None and dev["spec"]["pool"] == {"name": node, "generation": 2, "resourceSliceCount": 1}
            assert [d["name"] for d in dev["spec"]["devices"]] == ["gpu-0"]
        finally:
            cluster.kubectl("delete", "node", node, "--ignore-not-found")
            cluster.kubectl("delete", "resourceslice", slice_name(node), counter_slice_name(node), "--ignore-not-found")


def _get(cluster: Cluster, name: str) -> dict[str, Any] | None:
    p = cluster.kubectl("get", "resourceslice", name, "-o", "json", check=False)
    return json.loads(p.stdout) if p.returncode == 0 else None
