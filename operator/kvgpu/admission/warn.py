"""The admission warnings (kubectl prints them as ``Warning: ...``), as pure functions: what is
not wrong enough to refuse but gives a pod no GPU. For a pod CREATE, ``kvgpu.io/`` annotations
kvgpu does not read (misspellings of request keys are refused instead, by
:mod:`kvgpu.admission.validate`); for a workload, GPU request annotations on its own metadata,
which never reach its pods, and unknown keys on its pod template.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvgpu.admission.validate import _annotations, _mapping
from kvgpu.api import requests as api_requests
from kvgpu.api.requests import pod_template


def _unknown_key_warnings(ann: Mapping[str, Any], where: str = "") -> list[str]:
    return [f"{where}annotation {k} is not a kvgpu key and gives the pod no GPU; kvgpu reads "
            f"{api_requests.GPU}, {api_requests.GPUMEM}, {api_requests.GPUCORES}, ... (docs/api.md)"
            for k in api_requests.unknown_annotations(ann)]


def pod_warnings(operation: str, pod: Mapping[str, Any], subresource: str | None = None) -> list[str]:
    """Admission warnings (kubectl prints them as ``Warning: ...``) for a pod CREATE: ``kvgpu.io/``
    annotations kvgpu does not read (misspellings of request keys are refused instead)."""
    if operation != "CREATE" or subresource or not isinstance(pod, Mapping):
        return []
    return _unknown_key_warnings(_annotations(pod))


#: Where each workload kind keeps its pod template's metadata, for messages.
_TEMPLATE_PATH = {"CronJob": "spec.jobTemplate.spec.template", "PodTemplate": "template"}


def _misplaced(obj: Mapping[str, Any]) -> dict[str, str]:
    """Request annotations (or misspellings of them) on a workload's own metadata that its pod
    template does not carry with the same value: key → value."""
    try:
        meta, _ = pod_template(obj)
    except Exception:
        return {}
    template = {str(k): str(v) for k, v in _mapping(meta.get("annotations")).items()}
    return {k: v for k, v in _annotations(obj).items()
            if (api_requests.is_request_key(k) or api_requests.unknown_annotations({k: v}))
            and template.get(k) != v}


def workload_warnings(operation: str, obj: Mapping[str, Any], old_obj: Mapping[str, Any] | None) -> list[str]:
    """Admission warnings for a workload: GPU request annotations on the workload's own
    ``metadata.annotations``, which never reach its pods (new ones only on UPDATE), and unknown
    ``kvgpu.io/`` keys on its pod template (CREATE, or an UPDATE that changes the template)."""
    if not isinstance(obj, Mapping) or operation not in ("CREATE", "UPDATE"):
        return []
    old = old_obj if operation == "UPDATE" and isinstance(old_obj, Mapping) else None
    before = _misplaced(old) if old is not None else {}
    kind = str(obj.get("kind") or "workload")
    path = _TEMPLATE_PATH.get(kind, "spec.template")
    out = [f"{kind} metadata.annotations {k} does not reach the pods, which get no GPU from it; "
           f"put it under {path}.metadata.annotations"
           for k, v in sorted(_misplaced(obj).items()) if before.get(k) != v]
    try:
        meta, spec = pod_template(obj)
        if old is not None and pod_template(old) == (meta, spec):
            return out
    except Exception:
        return out
    return out + _unknown_key_warnings(_mapping(meta.get("annotations")), "pod template: ")
