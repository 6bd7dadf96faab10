"""Builders shared by the allocator tests."""

from __future__ import annotations

from kvgpu.core.inventory import Card, NodeInventory, Slicing, simulated_uuid
from kvgpu.core.requests import ContainerRequest, PodRequest, Policy

DEFAULT = Slicing("default")


def card(
    node: str,
    index: int,
    *,
    model: str = "NVIDIA H200",
    memory_mib: int = 10000,
    numa: int | None = 0,
    healthy: bool = True,
    mig: bool = False,
    slicing: Slicing | None = DEFAULT,
) -> Card:
    return Card(
        uuid=simulated_uuid(node, index),
        index=index,
        model=model,
        memory_mib=memory_mib,
        sm_count=132,
        numa=numa,
        mig_mode=mig,
        healthy=healthy,
        slicing=slicing,
    )


def node(name: str, n: int = 2, **kw) -> NodeInventory:
    """A node with ``n`` identical cards (keyword arguments as for :func:`card`)."""
    return NodeInventory(name, tuple(card(name, i, **kw) for i in range(n)), "simulated")


def node_of(name: str, *cards: dict) -> NodeInventory:
    """A node whose card ``i`` takes ``cards[i]`` as keyword arguments."""
    return NodeInventory(name, tuple(card(name, i, **kw) for i, kw in enumerate(cards)), "simulated")


def pod(
    *containers: ContainerRequest,
    uid: str = "u1",
    name: str = "p",
    node_policy=Policy.BINPACK,
    gpu_policy=Policy.SPREAD,
) -> PodRequest:
    return PodRequest("ns", name, uid, tuple(containers), node_policy, gpu_policy)


def c(name: str = "main", **kw) -> ContainerRequest:
    return ContainerRequest(name, **kw)


def uuid(node_name: str, index: int) -> str:
    return simulated_uuid(node_name, index)
