"""A minimal stand-in for :mod:`kvgpu.api.requests` until that module lands (then deleted).

Knows only enough for the admission tests: which keys mean "this pod asks for slices", which
containers get them, and a few value checks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kvgpu.core.requests import ContainerRequest, PodRequest

_KEYS = ("kvgpu.io/gpu", "kvgpu.io/gpumem", "kvgpu.io/gpumem-percentage", "kvgpu.io/gpucores")
_HAMI = ("nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpumem-percentage", "nvidia.com/gpucores")


class RequestError(ValueError):
    def __init__(self, messages: list[str]) -> None:
        super().__init__("; ".join(messages))
        self.messages = messages


def _limits(c: Mapping[str, Any]) -> dict[str, Any]:
    r = c.get("resources") or {}
    return {**(r.get("requests") or {}), **(r.get("limits") or {})}


def requests_slices(pod: Mapping[str, Any]) -> bool:
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    if any(k in ann for k in _KEYS):
        return True
    spec = pod.get("spec") or {}
    return any(
        k in _limits(c) for c in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]
        for k in _HAMI
    )


def parse_pod(pod: Mapping[str, Any]) -> PodRequest:
    meta = pod.get("metadata") or {}
    ann = meta.get("annotations") or {}
    spec = pod.get("spec") or {}
    errors: list[str] = []
    mem = ann.get("kvgpu.io/gpumem")
    if mem is not None and not re.fullmatch(r"[0-9]+(Mi|Gi)?", str(mem)):
        errors.append(f"kvgpu.io/gpumem: {mem!r} is not a memory size; use MiB (3000) or a quantity (3Gi, 3000Mi)")
    cores = ann.get("kvgpu.io/gpucores")
    if cores is not None and not (str(cores).isdigit() and 0 <= int(cores) <= 100):
        errors.append(f"kvgpu.io/gpucores: {cores!r} is not an integer 0..100")
    gpu = ann.get("kvgpu.io/gpu")
    if gpu is not None and not (str(gpu).isdigit() and int(gpu) >= 1):
        errors.append(f"kvgpu.io/gpu: {gpu!r} is not an integer >= 1")
    if errors:
        raise RequestError(errors)
    apps = spec.get("containers") or []
    inits = spec.get("initContainers") or []
    out: list[ContainerRequest] = []
    for init, cs in ((True, inits), (False, apps)):
        for c in cs:
            if any(k in _limits(c) for k in _HAMI):
                out.append(ContainerRequest(container=c["name"], init=init))
    if not out and any(k in ann for k in _KEYS):
        names = ann.get("kvgpu.io/containers")
        wanted = [n.strip() for n in names.split(",")] if names else [apps[0]["name"]] if apps else []
        for c in [*inits, *apps]:
            if c.get("name") in wanted:
                out.append(ContainerRequest(container=c["name"], init=c in inits))
    return PodRequest(meta.get("namespace", ""), meta.get("name", ""), meta.get("uid", ""), tuple(out))
