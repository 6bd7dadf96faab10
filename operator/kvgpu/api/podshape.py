"""Where a pod's request is written: the pod or a workload's pod template
(:func:`pod_template`), its containers and their HAMi resources, its annotations, and whether
it asks for slices at all (:func:`wants_slices`). Pure, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from kvgpu.api.request_keys import (
    HAMI_GPU,
    HAMI_RESOURCES,
    _is_request_annotation,
)
from kvgpu.api.values import (
    RequestError,
    _Errors,
    _text,
)

# --------------------------------------------------------------------------- pod shape


_TEMPLATE_KINDS = {
    "Deployment",
    "ReplicaSet",
    "StatefulSet",
    "DaemonSet",
    "Job",
    "ReplicationController",
    "PodTemplate",
}


def pod_template(obj: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return ``(metadata, spec)`` of the pod an object describes.

    Works for a Pod and for the pod template of Deployment, ReplicaSet, StatefulSet, DaemonSet,
    Job, CronJob, ReplicationController and PodTemplate. The returned metadata takes namespace
    and name from the object itself when the template has none. Raises :class:`RequestError`
    (key ``spec``) when the object has no pod spec.
    """
    if not isinstance(obj, Mapping):
        raise RequestError("spec", obj, "is not an object", "give a Pod or a workload with a pod template")
    kind = obj.get("kind", "Pod")
    meta = _map(obj.get("metadata"))
    tmpl: Any
    if kind == "Pod":
        tmpl = obj
    elif kind == "CronJob":
        tmpl = _dig(obj, "spec", "jobTemplate", "spec", "template")
    elif kind == "PodTemplate":
        tmpl = obj.get("template")
    elif kind in _TEMPLATE_KINDS:
        tmpl = _dig(obj, "spec", "template")
    else:
        raise RequestError(
            "kind", kind, "has no pod template", "give a Pod or a workload with a pod template"
        )
    spec = tmpl.get("spec") if isinstance(tmpl, Mapping) else None
    if not isinstance(spec, Mapping):
        raise RequestError("spec", spec, "is not a pod spec", "give a Pod or a workload with a pod template")
    out_meta = dict(_map(tmpl.get("metadata")))
    for k in ("namespace", "name", "uid"):
        if k not in out_meta and k in meta:
            out_meta[k] = meta[k]
    return out_meta, dict(spec)


def _map(x: Any) -> Mapping[str, Any]:
    return x if isinstance(x, Mapping) else {}


def _dig(obj: Any, *path: str) -> Any:
    for p in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(p)
    return obj


@dataclass(frozen=True, slots=True)
class _Container:
    name: str
    init: bool  # an init container that is not a restartable sidecar
    resources: dict[str, Any]  # requests overlaid by limits


def _containers(spec: Mapping[str, Any], errs: _Errors) -> tuple[list[_Container], list[_Container]]:
    """(init containers, app containers). Sidecars (init with restartPolicy Always) count as app."""
    inits: list[_Container] = []
    apps: list[_Container] = []
    for field, is_init in (("initContainers", True), ("containers", False)):
        items = spec.get(field) or []
        if not isinstance(items, list):
            errs.add(f"spec.{field}", items, "is not a list", "give a pod spec")
            continue
        for c in items:
            if not isinstance(c, Mapping) or not isinstance(c.get("name"), str):
                errs.add(f"spec.{field}", c, "has an entry without a name", "give a pod spec")
                continue
            res = _map(c.get("resources"))
            merged: dict[str, Any] = {}
            for part in ("requests", "limits"):  # limits win, as in HAMi
                merged.update(_map(res.get(part)))
            sidecar = is_init and c.get("restartPolicy") == "Always"
            cont = _Container(c["name"], is_init and not sidecar, merged)
            (inits if is_init else apps).append(cont)
    return inits, apps


def _hami_slice_keys(c: _Container) -> list[str]:
    """The HAMi resource keys a container names; ``nvidia.com/gpu`` of 0 alone counts as none."""
    found = [k for k in HAMI_RESOURCES if k in c.resources]
    if found == [HAMI_GPU] and _is_zero(c.resources[HAMI_GPU]):
        return []
    return found


def _is_zero(v: Any) -> bool:
    text = _text(v)
    if not text:
        return False
    try:
        return bool(parse_quantity(text) == 0)
    except (ValueError, ArithmeticError, TypeError):
        return False


def _annotations(meta: Mapping[str, Any], errs: _Errors) -> dict[str, Any]:
    ann = meta.get("annotations")
    if ann is None:
        return {}
    if not isinstance(ann, Mapping):
        errs.add("metadata.annotations", ann, "is not a map", "give string keys and values")
        return {}
    return {str(k): v for k, v in ann.items()}


def wants_slices(obj: Mapping[str, Any]) -> bool:
    """True when a pod (or a workload's pod template) asks kvgpu for GPU slices.

    That is: it carries a kvgpu request annotation (any key of :data:`ANNOTATION_KEYS`, or a
    ``kvgpu.io/`` key that looks like a misspelt one, which :func:`validate_pod` then rejects; other
    ``kvgpu.io/`` keys are the operator's and do not count), or a container names a
    HAMi resource (``nvidia.com/gpu`` other than 0, ``gpumem``, ``gpumem-percentage``,
    ``gpucores``, ``priority``). Never raises; malformed objects count as not asking.
    """
    try:
        meta, spec = pod_template(obj)
    except RequestError:
        return False
    errs = _Errors()
    ann = _annotations(meta, errs)
    if any(_is_request_annotation(k) for k in ann):
        return True
    inits, apps = _containers(spec, errs)
    return any(_hami_slice_keys(c) for c in inits + apps)


#: Another name for :func:`wants_slices`.
requests_slices = wants_slices
