"""The scale bench's GPU pods in extender mode (:mod:`bench.scale.run`): annotated pods of mixed
sizes, and the same pods without GPUs as the baseline. DRA mode's pods: :mod:`bench.scale.dra`."""

from __future__ import annotations

import random
from typing import Any


def gpu_request(rng: random.Random) -> tuple[dict[str, str], dict[str, str]]:
    """A mixed-size request: (annotations, container limits). Mostly small slices, some halves,
    some HAMi-form, some two-card and a few exclusive cards."""
    r = rng.random()
    if r < 0.45:
        return {"kvgpu.io/gpumem": str(rng.choice((2000, 4000, 8000, 10000))),
                "kvgpu.io/gpucores": str(rng.choice((10, 20, 30)))}, {}
    if r < 0.65:
        return {"kvgpu.io/gpumem-percentage": str(rng.choice((25, 50))), "kvgpu.io/gpucores": "25"}, {}
    if r < 0.80:
        return {}, {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(rng.choice((3000, 6000))),
                    "nvidia.com/gpucores": "20"}
    if r < 0.95:
        return {"kvgpu.io/gpu": "2", "kvgpu.io/gpumem": "16000", "kvgpu.io/gpucores": "30"}, {}
    return {"kvgpu.io/gpucores": "100"}, {}  # a whole card


def pod_body(name: str, *, gpu: bool, rng: random.Random) -> dict[str, Any]:
    ann, limits = gpu_request(rng) if gpu else ({}, {})
    res: dict[str, Any] = {"requests": {"cpu": "10m", "memory": "16Mi"}}
    if limits:
        res["limits"] = limits
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "annotations": ann, "labels": {"kvgpu.io/bench": "scale"}},
        "spec": {"containers": [{"name": "main", "image": "bench", "resources": res}],
                 "terminationGracePeriodSeconds": 0,
                 "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists"}]},
    }

