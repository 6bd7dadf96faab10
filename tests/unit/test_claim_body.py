"""The bind's VGPUClaim body (:func:`kvgpu.extender.binder.claim_body`, built directly for speed)
is the one the model writes: ``VGPUClaim.model_validate(body).to_body()`` gives it back unchanged,
summaries included, for one card, several cards with equal and differing slices, and an init
container."""

from __future__ import annotations

from typing import Any

import pytest
from kvgpu.api.models import VGPUClaim
from kvgpu.core.requests import ContainerAllocation, DeviceGrant, PodAllocation
from kvgpu.extender.binder import claim_body

POD: dict[str, Any] = {"metadata": {"name": "train-0", "namespace": "team",
                                    "uid": "0123abcd-0000-1111-2222-333344445555"}}


def _grant(index: int, memory: int, cores: int) -> DeviceGrant:
    return DeviceGrant(f"GPU-{index:08d}-0000-0000-0000-000000000000", index, "NVIDIA H100 80GB HBM3", memory, cores)


@pytest.mark.parametrize("grants,init,priority", [
    ([(0, 3000, 30)], False, 1),
    ([(1, 16000, 30), (3, 16000, 30)], False, 0),
    ([(2, 8000, 20), (5, 4000, 100), (6, 4000, 20)], True, 1),
])
def test_claim_body_is_what_the_model_writes(grants: list[tuple[int, int, int]], init: bool, priority: int) -> None:
    ca = ContainerAllocation("main", tuple(_grant(*g) for g in grants), priority=priority, init=init)
    body = claim_body(POD, PodAllocation(POD["metadata"]["uid"], "gpu-00001", (ca,)), "main", "default")
    model = VGPUClaim.model_validate(body).to_body()
    model.pop("status", None)
    assert body == model
    assert body["spec"]["gpuSummary"] == ",".join(str(g[0]) for g in grants)
