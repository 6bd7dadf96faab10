"""A node name of any valid length takes kvgpu pods: the claim's ``kvgpu.io/node`` label is a
valid label value even when the name is 253 characters long with ``-``/``.`` at position 63
(the truncated name was an invalid label, so the claim could not be created and the bind
retried forever)."""

from __future__ import annotations

import asyncio
import json

from kvgpu.core.inventory import SimulatedCardSpec, SimulatedNode
from kvgpu.devcluster.fakenodes import create_nodes

from tests.cluster.conftest import GpuEnv


def test_a_pod_lands_on_a_node_with_a_long_name(gpu: GpuEnv) -> None:
    name = f"{'x' * 62}.{gpu.ns}.{'y' * 60}.example"
    assert len(name) <= 253
    sim = SimulatedNode(name, (SimulatedCardSpec(count=1),), labels=(("kvgpu.io/test", gpu.ns),))

    async def mk() -> None:
        async with gpu.cluster.api() as api:
            await create_nodes(api, [sim])

    asyncio.run(mk())
    gpu.node_names.append(name)  # deleted by the fixture
    gpu.create(gpu.pod("long", {"kvgpu.io/gpumem": "1000"}))
    pod = gpu.wait_bound("long")
    assert pod["spec"]["nodeName"] == name
    [claim] = gpu.claims()
    assert claim["spec"]["node"] == name
    label = claim["metadata"]["labels"]["kvgpu.io/node"]
    assert len(label) <= 63 and label[-1].isalnum(), label
    listed = json.loads(gpu.cluster.kubectl("get", "vgpuclaims", "-n", gpu.ns, "-l", f"kvgpu.io/node={label}",
                                            "-o", "json").stdout)["items"]
    assert [c["metadata"]["name"] for c in listed] == [claim["metadata"]["name"]]
