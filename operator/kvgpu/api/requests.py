"""Read a pod's GPU request: kvgpu annotations or HAMi's container limits → :class:`PodRequest`.

Two forms, one result:

* **annotation form** — ``kvgpu.io/gpu``, ``kvgpu.io/gpumem``, ... on the pod (or on the pod
  template of a Deployment, Job, ...); the request applies to the containers named by
  ``kvgpu.io/containers`` (default: the first app container);
* **HAMi form** — container ``limits`` (or ``requests``) ``nvidia.com/gpu``, ``nvidia.com/gpumem``,
  ``nvidia.com/gpumem-percentage``, ``nvidia.com/gpucores``, ``nvidia.com/priority``, per
  container, init containers included.

The selection and policy annotations (``kvgpu.io/gpu-type`` ... or HAMi's ``nvidia.com/use-gputype``
...) apply to every requesting container in both forms. A pod may not mix the two forms' amount keys.

Defaults come from a pool's :class:`~kvgpu.api.models.RequestDefaults` and
:class:`~kvgpu.api.models.SchedulingPolicy` (HAMi's: 1 card, whole memory, no core limit, low
priority, binpack nodes, spread cards). A request whose memory is the whole card and that names no
cores, on a pool whose default gpucores is 0, gets ``cores=100`` (an exclusive card), as HAMi does.

Memory values: a plain number counts MiB (``3000``); so does a decimal-suffixed one, because the
API server prints resource quantities that way (``3000`` becomes ``3k``); a binary-suffixed
quantity is bytes (``3Gi`` = 3072 MiB, ``3000Mi`` = 3000 MiB) and must be a whole number of MiB.
Quantities are parsed by ``kubernetes.utils.quantity.parse_quantity``.

Every invalid value raises :class:`RequestError` whose message names the key, the value and the
allowed form; :func:`validate_pod` returns all of a pod's errors, :func:`parse_pod` raises
:class:`RequestErrors` (a :class:`RequestError`) carrying all of them.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from kvgpu.api.models import (
    DEFAULT_MIN_SLICE_MIB,
    MAX_CARD_MEMORY_MIB,
    MAX_CARDS,
    UUID_PATTERN,
    PolicyName,
    VGPUPoolSpec,
)
from kvgpu.core import keys
from kvgpu.core.requests import ContainerRequest, PodRequest, Policy

# --------------------------------------------------------------------------- keys

K = keys.GROUP + "/"
GPU = K + "gpu"
GPUMEM = K + "gpumem"
GPUMEM_PERCENTAGE = K + "gpumem-percentage"
GPUCORES = K + "gpucores"
PRIORITY = K + "priority"
CONTAINERS = K + "containers"
GPU_TYPE = K + "gpu-type"
EXCLUDE_GPU_TYPE = K + "exclude-gpu-type"
GPU_UUID = K + "gpu-uuid"
EXCLUDE_GPU_UUID = K + "exclude-gpu-uuid"
NUMA_BIND = K + "numa-bind"
NODE_POLICY = K + "node-policy"
GPU_POLICY = K + "gpu-policy"

HAMI_GPU = "nvidia.com/gpu"
HAMI_GPUMEM = "nvidia.com/gpumem"
HAMI_GPUMEM_PERCENTAGE = "nvidia.com/gpumem-percentage"
HAMI_GPUCORES = "nvidia.com/gpucores"
HAMI_PRIORITY = "nvidia.com/priority"
HAMI_USE_TYPE = "nvidia.com/use-gputype"
HAMI_NOUSE_TYPE = "nvidia.com/nouse-gputype"
HAMI_USE_UUID = "nvidia.com/use-gpuuuid"
HAMI_NOUSE_UUID = "nvidia.com/nouse-gpuuuid"
HAMI_NUMA_BIND = "nvidia.com/numa-bind"
HAMI_NODE_POLICY = "hami.io/node-scheduler-policy"
HAMI_GPU_POLICY = "hami.io/gpu-scheduler-policy"
HAMI_VGPU_MODE = "nvidia.com/vgpu-mode"
HAMI_SCORING_WEIGHTS = "hami.io/device-scoring-weights"

# Allowed forms, used in messages and in docs/api.md.
FORM_CARDS = f"use a whole number of cards from 1 to {MAX_CARDS}"
FORM_MEMORY = "use MiB like 3000 or a quantity like 3Gi"
FORM_PERCENT = "use a whole number from 1 to 100 (percent of the card's memory)"
FORM_HAMI_PERCENT = "use a whole number from 0 to 100 (percent of the card's memory; 0 = unset)"
FORM_CORES = "use a whole number from 0 to 100 (percent of the card's SMs; 100 = an exclusive card)"
FORM_PRIORITY = "use 0 (high) or 1 (low)"
FORM_POLICY = "use binpack or spread"
FORM_BOOL = "use true or false"
FORM_TYPES = "use a comma list of model substrings like A100,H200"
FORM_UUIDS = "use a comma list of card UUIDs like GPU-8f6c2a4e-..."
FORM_CONTAINERS = "use a comma list of the pod's container names"


@dataclass(frozen=True, slots=True)
class KeyDoc:
    """One request key, for docs/api.md."""

    key: str
    where: str  # "annotation" or "container limit"
    form: str
    meaning: str


ANNOTATION_KEYS: tuple[KeyDoc, ...] = (
    KeyDoc(
        GPU, "annotation", f"integer 1-{MAX_CARDS} (default 1)", "physical cards per container, each sliced"
    ),
    KeyDoc(
        GPUMEM,
        "annotation",
        "MiB (`3000`) or a quantity (`3Gi`, `3000Mi`); 0 = whole card",
        "memory per card",
    ),
    KeyDoc(
        GPUMEM_PERCENTAGE, "annotation", "integer 1-100", "memory as percent of each card (not with gpumem)"
    ),
    KeyDoc(GPUCORES, "annotation", "integer 0-100", "percent of the card's SMs; 100 = exclusive card"),
    KeyDoc(PRIORITY, "annotation", "`0` high, `1` low (default)", "task priority between co-located slices"),
    KeyDoc(
        CONTAINERS,
        "annotation",
        "comma list of container names",
        "containers that get slices (default: the first app container); init containers allowed",
    ),
    KeyDoc(GPU_TYPE, "annotation", "comma list", "card model must contain one item (case-insensitive)"),
    KeyDoc(EXCLUDE_GPU_TYPE, "annotation", "comma list", "card model must contain no item"),
    KeyDoc(GPU_UUID, "annotation", "comma list of `GPU-…`", "only these cards"),
    KeyDoc(EXCLUDE_GPU_UUID, "annotation", "comma list of `GPU-…`", "never these cards"),
    KeyDoc(NUMA_BIND, "annotation", "`true` / `false`", "all cards of a container on one NUMA node"),
    KeyDoc(NODE_POLICY, "annotation", "`binpack` / `spread`", "node placement, overrides the pool"),
    KeyDoc(GPU_POLICY, "annotation", "`binpack` / `spread`", "card placement, overrides the pool"),
)

HAMI_KEYS: tuple[KeyDoc, ...] = (
    KeyDoc(HAMI_GPU, "container limit", f"integer 0-{MAX_CARDS}", "cards (0 = this container asks for none)"),
    KeyDoc(
        HAMI_GPUMEM,
        "container limit",
        "MiB (`3000`, shown as `3k`) or a binary quantity (`3Gi`)",
        "memory per card",
    ),
    KeyDoc(
        HAMI_GPUMEM_PERCENTAGE,
        "container limit",
        "integer 0-100 (0 = unset)",
        "memory as percent of each card",
    ),
    KeyDoc(
        HAMI_GPUCORES,
        "container limit",
        "integer 0-100",
        "percent of the card's SMs (HAMi clamps >100; we reject)",
    ),
    KeyDoc(HAMI_PRIORITY, "container limit", "`0` / `1`", "task priority"),
    KeyDoc(HAMI_USE_TYPE, "annotation", "comma list", f"same as `{GPU_TYPE}`"),
    KeyDoc(HAMI_NOUSE_TYPE, "annotation", "comma list", f"same as `{EXCLUDE_GPU_TYPE}`"),
    KeyDoc(HAMI_USE_UUID, "annotation", "comma list", f"same as `{GPU_UUID}`"),
    KeyDoc(HAMI_NOUSE_UUID, "annotation", "comma list", f"same as `{EXCLUDE_GPU_UUID}`"),
    KeyDoc(HAMI_NUMA_BIND, "annotation", "`true` / `false`", f"same as `{NUMA_BIND}`"),
    KeyDoc(HAMI_NODE_POLICY, "annotation", "`binpack` / `spread`", f"same as `{NODE_POLICY}`"),
    KeyDoc(
        HAMI_GPU_POLICY,
        "annotation",
        "`binpack` / `spread`",
        f"same as `{GPU_POLICY}` (HAMi's topology-aware, mutex and numa are rejected)",
    ),
    KeyDoc(HAMI_VGPU_MODE, "annotation", "`hami-core`", "other modes are rejected"),
    KeyDoc(HAMI_SCORING_WEIGHTS, "annotation", "—", "not supported: rejected"),
)

AMOUNT_ANNOTATIONS = (GPU, GPUMEM, GPUMEM_PERCENTAGE, GPUCORES, PRIORITY, CONTAINERS)
REQUEST_ANNOTATIONS = tuple(k.key for k in ANNOTATION_KEYS)
HAMI_RESOURCES = (HAMI_GPU, HAMI_GPUMEM, HAMI_GPUMEM_PERCENTAGE, HAMI_GPUCORES, HAMI_PRIORITY)

# (kvgpu key, HAMi key) pairs that mean the same; both may be set only to the same value.
_SYNONYMS = (
    (GPU_TYPE, HAMI_USE_TYPE),
    (EXCLUDE_GPU_TYPE, HAMI_NOUSE_TYPE),
    (GPU_UUID, HAMI_USE_UUID),
    (EXCLUDE_GPU_UUID, HAMI_NOUSE_UUID),
    (NUMA_BIND, HAMI_NUMA_BIND),
    (NODE_POLICY, HAMI_NODE_POLICY),
    (GPU_POLICY, HAMI_GPU_POLICY),
)


def _operator_annotations() -> frozenset[str]:
    """Every ``kvgpu.io/...`` annotation name defined in :mod:`kvgpu.core.keys` (operator-owned)."""
    return frozenset(v for v in vars(keys).values() if isinstance(v, str) and v.startswith(K))


_OPERATOR_KEYS = _operator_annotations()
_UUID = re.compile(UUID_PATTERN)
_INT = re.compile(r"^[0-9]{1,12}$")
# Kubernetes' quantity grammar in plain ASCII (no spaces, underscores or non-ASCII digits, which
# Python's number parsing would otherwise let through): digits, an optional fraction, then an
# exponent or one suffix.
_MEMORY_SHAPE = re.compile(r"\A[+-]?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|[munkMGTPE])?\Z")
_TRUE = frozenset({"1", "t", "T", "true", "TRUE", "True"})
_FALSE = frozenset({"0", "f", "F", "false", "FALSE", "False"})
_VALUE_SHOWN = 80
#: Said wherever a milli-suffixed memory value may be the cause: the annotation form sees
#: ``3000m`` itself, a container limit reaches admission as the API server's canonical ``3``.
MILLI_HINT = "m is milli, not MiB: 3000m is 3"


#: How requests are read, for docs/api.md (Markdown).
DOC_MARKDOWN = f"""\
A pod asks for slices in one of two forms; both give the same per-container request.

- **Annotation form**: `{GPU}`, `{GPUMEM}`, `{GPUMEM_PERCENTAGE}`, `{GPUCORES}`, `{PRIORITY}` on the pod
  (for a Deployment, Job, ... on `spec.template.metadata`). The request applies to each container
  named in `{CONTAINERS}` (init containers allowed), by default to the first app container. Any
  `kvgpu.io/` request annotation, even a selection one alone, makes the pod a GPU pod (1 card by default).
- **HAMi form**: container `limits` (or `requests`) `{HAMI_GPU}`, `{HAMI_GPUMEM}`, `{HAMI_GPUMEM_PERCENTAGE}`,
  `{HAMI_GPUCORES}`, `{HAMI_PRIORITY}`, per container, init containers included. `{HAMI_GPU}: 0` alone
  means no GPU for that container.

The selection and policy annotations (`{GPU_TYPE}` ... or HAMi's spelling) apply to every requesting
container in both forms. Mixing the amount annotations with `nvidia.com/*` limits is refused; so is
setting a kvgpu key and its HAMi synonym to different values. A `kvgpu.io/` key (prefix in any case)
that is a case variant or a misspelling of a request key (`kvgpu.io/GPUMEM`, `kvgpu.io/gpu-count`,
`kvgpu.io/gpumemory`) is refused naming the right key; so is a HAMi container resource written as a
pod annotation (`nvidia.com/gpumem`). Other `kvgpu.io/` keys are the operator's (allocation records)
or unknown: admitted with a warning.

**Defaults** come from the pool: before a node is chosen, the pool named `default`, else the only
pool, else HAMi's defaults (1 card, whole memory, no core limit, priority 1, binpack nodes, spread
cards). The card count is the exception for the annotation form: the mutating webhook, which knows
no pool, gives each container with slices the limit `{HAMI_GPU}: <cards>` (so that the kubelet
calls the device plugin), `{GPU}` or else 1; a `{HAMI_GPU}` limit there is the card count, and must
equal `{GPU}` when both are set.
A request that ends up with the whole card's memory and names no cores gets `gpucores: 100`
(an exclusive card) when the pool's default gpucores is 0, as in HAMi. `gpumem-percentage: 100` is the
whole card.

**Memory values**: a plain number counts MiB (`3000`); so does a number with a decimal suffix, because
the API server prints resource quantities that way (a limit of `3000` reads back as `3k`); a binary
suffix means bytes (`3Gi` = 3072 MiB, `3000Mi` = 3000 MiB) and must come to a whole number of MiB.
At most {MAX_CARD_MEMORY_MIB} MiB (1 TiB) per card, and at least the smallest `spec.minSliceMemory`
of the pools (default {DEFAULT_MIN_SLICE_MIB}; 0 = the whole card always passes). A `m` suffix is
milli (`3000m` is 3): refused; a container limit of `3000m` reaches admission as `3` and is refused
by the minimum. Quantities are parsed by the Kubernetes client
library (`kubernetes.utils.quantity.parse_quantity`).

**Sidecars** (init containers with `restartPolicy: Always`) are counted as app containers.
"""


# --------------------------------------------------------------------------- errors


class RequestError(ValueError):
    """An invalid GPU request. ``str(err)`` is the message for the user.

    Message form: ``<key>[ of container "<c>"]: "<value>" <problem>; <allowed form>``.
    """

    def __init__(self, key: str, value: Any, problem: str, allowed: str, container: str | None = None):
        self.key = key
        self.value = value
        self.problem = problem
        self.allowed = allowed
        self.container = container
        where = f' of container "{container}"' if container else ""
        super().__init__(f"{key}{where}: {show(value)} {problem}; {allowed}")


class RequestErrors(RequestError):
    """All errors of one pod; ``errors`` lists them, ``str()`` puts one per line."""

    def __init__(self, errors: Sequence[RequestError]):
        if not errors:
            raise ValueError("RequestErrors needs at least one error")
        first = errors[0]
        super().__init__(first.key, first.value, first.problem, first.allowed, first.container)
        self.errors = tuple(errors)
        self.args = ("\n".join(str(e) for e in self.errors),)

    def __str__(self) -> str:
        return str(self.args[0])


def show(value: Any) -> str:
    """A value quoted for a message: JSON string form, shortened past 80 characters."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if len(text) > _VALUE_SHOWN:
        text = text[: _VALUE_SHOWN - 1] + "…"
    return json.dumps(text, ensure_ascii=False)


class _Errors:
    def __init__(self) -> None:
        self.items: list[RequestError] = []

    def add(self, key: str, value: Any, problem: str, allowed: str, container: str | None = None) -> None:
        self.items.append(RequestError(key, value, problem, allowed, container))


# --------------------------------------------------------------------------- value parsers


def _text(v: Any) -> str | None:
    """Annotation and quantity values are strings; YAML integers are tolerated."""
    if isinstance(v, str):
        return v.strip()
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    return None


def parse_memory_mib(key: str, raw: Any, container: str | None = None) -> int:
    """Memory per card in MiB from ``3000``, ``3k`` (both MiB counts), ``3Gi`` or ``3000Mi`` (bytes).

    Returns 0..1048576 (0 = the whole card). Raises :class:`RequestError`.
    """
    text = _text(raw)
    if text is None or text == "" or not _MEMORY_SHAPE.match(text):
        raise RequestError(key, raw, "is not a memory quantity", FORM_MEMORY, container)
    if text[-1] in "munµ":
        raise RequestError(key, raw, f"uses the suffix {text[-1]}, a fraction of a unit ({MILLI_HINT})",
                           FORM_MEMORY, container)
    try:
        q = parse_quantity(text)
    except (ValueError, ArithmeticError, TypeError):
        raise RequestError(key, raw, "is not a memory quantity", FORM_MEMORY, container) from None
    if not isinstance(q, Decimal) or not q.is_finite():
        raise RequestError(key, raw, "is not a memory quantity", FORM_MEMORY, container)
    binary = text.endswith("i")
    mib = q / (1 << 20) if binary else q
    if mib < 0:
        raise RequestError(key, raw, "is negative", FORM_MEMORY, container)
    if mib > MAX_CARD_MEMORY_MIB:
        how = "bytes" if binary else "MiB (plain and decimal-suffixed numbers count MiB)"
        raise RequestError(
            key,
            raw,
            f"is more than {MAX_CARD_MEMORY_MIB} MiB (1 TiB) per card, counted in {how}",
            FORM_MEMORY,
            container,
        )
    if mib != mib.to_integral_value():
        raise RequestError(key, raw, "is not a whole number of MiB", FORM_MEMORY, container)
    return int(mib)


def _annotation_int(key: str, raw: Any, lo: int, hi: int, allowed: str) -> int:
    text = _text(raw)
    if text is None or not _INT.match(text):
        raise RequestError(key, raw, "is not a whole number", allowed)
    n = int(text)
    if not lo <= n <= hi:
        raise RequestError(key, raw, "is out of range", allowed)
    return n


def _resource_int(key: str, raw: Any, lo: int, hi: int, allowed: str, container: str) -> int:
    """A container resource value (a Kubernetes quantity) that must be a whole number."""
    text = _text(raw)
    q: Any = None
    if text:
        try:
            q = parse_quantity(text)
        except (ValueError, ArithmeticError, TypeError):
            q = None
    if not isinstance(q, Decimal) or not q.is_finite() or q != q.to_integral_value():
        raise RequestError(key, raw, "is not a whole number", allowed, container)
    if not lo <= q <= hi:
        raise RequestError(key, raw, "is out of range", allowed, container)
    return int(q)


def _bool(key: str, raw: Any) -> bool:
    text = _text(raw) if not isinstance(raw, bool) else ("true" if raw else "false")
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise RequestError(key, raw, "is not a boolean", FORM_BOOL)


def _policy(key: str, raw: Any) -> Policy:
    text = _text(raw)
    if text is not None and text.lower() in (p.value for p in PolicyName):
        return Policy(text.lower())
    raise RequestError(key, raw, "is not a policy kvgpu knows", FORM_POLICY)


def _list(raw: Any) -> tuple[str, ...] | None:
    text = _text(raw)
    if text is None:
        return None
    return tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))


def _types(key: str, raw: Any) -> tuple[str, ...]:
    items = _list(raw)
    if items is None:
        raise RequestError(key, raw, "is not a comma list", FORM_TYPES)
    for it in items:
        if len(it) > 128:
            raise RequestError(key, raw, "has an item longer than 128 characters", FORM_TYPES)
    return items


def _uuids(key: str, raw: Any) -> tuple[str, ...]:
    items = _list(raw)
    if items is None:
        raise RequestError(key, raw, "is not a comma list", FORM_UUIDS)
    for it in items:
        if not _UUID.match(it):
            raise RequestError(key, raw, f"has {show(it)}, which is not a card UUID", FORM_UUIDS)
    return items


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


def card_resources_to_add(obj: Mapping[str, Any]) -> dict[str, int]:
    """The ``nvidia.com/gpu`` limits a pod in the annotation form still lacks: container name →
    cards, for every container that gets slices and names no ``nvidia.com/gpu`` (in limits or
    requests). The kubelet calls the device plugin only for resources a container requests, so
    the mutating webhook adds these. Empty for the HAMi form (its containers name their own
    resources), a pod without a request and one whose request has errors. HAMi's defaults
    apply (no pool is known at admission): without ``kvgpu.io/gpu`` a container gets 1 card.
    """
    try:
        req = _parse(obj, None)
        _, spec = pod_template(obj)
    except RequestError:
        return {}
    if req is None:
        return {}
    inits, apps = _containers(spec, _Errors())
    by_name = {c.name: c for c in inits + apps}
    if any(k != HAMI_GPU for c in by_name.values() for k in _hami_slice_keys(c)):
        return {}  # the HAMi form
    return {r.container: r.cards for r in req.containers if HAMI_GPU not in by_name[r.container].resources}


#: Another name for :func:`wants_slices`.
requests_slices = wants_slices


def _is_request_annotation(key: str) -> bool:
    """A kvgpu request key, a ``kvgpu.io/`` key (prefix in any case) that looks like a misspelt
    one, or a HAMi container resource written as an annotation (:func:`misplaced_resource`).

    Other ``kvgpu.io/`` keys belong to the operator (allocation annotations, Kopf's progress and
    diff-base annotations) or are unknown (:func:`unknown_annotations`: a warning, not a request).
    """
    return key in REQUEST_ANNOTATIONS or _misspelt(key) is not None or misplaced_resource(key) is not None


#: Public name of :func:`_is_request_annotation` (admission's workload warnings use it).
is_request_key = _is_request_annotation


# Stems of the words people use for the request keys (``gpu-count``, ``gpu_mem``, ``memory``,
# ``vgpu-cores``, ...), longest first where one contains another, each with its concept; "" = a
# word that carries no meaning here (units, "use"). "gpu" and "count" both name the card count.
_STEMS: tuple[tuple[str, str], ...] = tuple(sorted((
    ("percentage", "pct"), ("percent", "pct"), ("pct", "pct"),
    ("memory", "mem"), ("vram", "mem"), ("mem", "mem"),
    ("cores", "core"), ("core", "core"), ("compute", "core"), ("utilization", "core"), ("util", "core"),
    ("priority", "prio"), ("prio", "prio"),
    ("containers", "ctr"), ("container", "ctr"),
    ("types", "type"), ("type", "type"), ("models", "type"), ("model", "type"),
    ("uuids", "uuid"), ("uuid", "uuid"),
    ("exclude", "not"), ("excluded", "not"), ("except", "not"), ("nouse", "not"), ("avoid", "not"),
    ("numa", "numa"), ("bind", "bind"),
    ("policy", "policy"), ("scheduler", "policy"), ("scheduling", "policy"), ("sched", "policy"),
    ("strategy", "policy"), ("node", "node"),
    ("number", "count"), ("count", "count"), ("cards", "count"), ("card", "count"), ("num", "count"),
    ("gpus", "count"), ("vgpus", "count"), ("vgpu", "gpu"), ("gpu", "gpu"),
    ("use", ""), ("mib", ""), ("size", ""), ("limit", ""), ("request", ""), ("amount", ""), ("per", ""),
), key=lambda s: -len(s[0])))
_CARD_WORDS = frozenset({"gpu", "count"})

# The concept sets each request key answers to (card words and meaningless words left out).
_KEY_CONCEPTS: tuple[tuple[str, tuple[frozenset[str], ...]], ...] = (
    (GPU, (frozenset(),)),
    (GPUMEM, (frozenset({"mem"}),)),
    (GPUMEM_PERCENTAGE, (frozenset({"mem", "pct"}), frozenset({"pct"}))),
    (GPUCORES, (frozenset({"core"}), frozenset({"core", "pct"}))),
    (PRIORITY, (frozenset({"prio"}),)),
    (CONTAINERS, (frozenset({"ctr"}),)),
    (GPU_TYPE, (frozenset({"type"}),)),
    (EXCLUDE_GPU_TYPE, (frozenset({"not", "type"}),)),
    (GPU_UUID, (frozenset({"uuid"}),)),
    (EXCLUDE_GPU_UUID, (frozenset({"not", "uuid"}),)),
    (NUMA_BIND, (frozenset({"numa"}), frozenset({"numa", "bind"}))),
    (NODE_POLICY, (frozenset({"node", "policy"}),)),
    (GPU_POLICY, (frozenset({"policy"}),)),
)
_NORMALISED = {re.sub(r"[^a-z0-9]", "", k.removeprefix(K)): k for k in REQUEST_ANNOTATIONS}


def _concepts(name: str) -> frozenset[str] | None:
    """The concepts of a key's name part (``gpu-count`` → {gpu, count}), from :data:`_STEMS`;
    ``None`` when some letters fit no stem (a trailing plural ``s`` aside)."""
    text = re.sub(r"[^a-z0-9]", "", name.lower())
    found: set[str] = set()
    rest = ""
    i = 0
    while i < len(text):
        stem = next((s for s in _STEMS if text.startswith(s[0], i)), None)
        if stem is None:
            rest += text[i]
            i += 1
            continue
        found.add(stem[1])
        i += len(stem[0])
    if rest not in ("", "s") or not found - {""}:
        return None
    return frozenset(found - {""})


def suggest_key(name: str) -> str | None:
    """The request key that an annotation name part (after ``kvgpu.io/``) most likely means.

    In order: the same letters in another case or with other separators (``GPUMEM``,
    ``gpu_mem``); the same concepts (``gpu-count``, ``gpus``, ``gpu_num`` → ``kvgpu.io/gpu``,
    ``gpu-memory`` → ``kvgpu.io/gpumem``, ``vgpu-cores`` → ``kvgpu.io/gpucores``); a close
    spelling of a key's letters (``priorty``, difflib ratio ≥ 0.8). ``None``: no request key.
    """
    flat = re.sub(r"[^a-z0-9]", "", name.lower())
    if flat in _NORMALISED:
        return _NORMALISED[flat]
    concepts = _concepts(name)
    if concepts is not None:
        meaning = concepts - _CARD_WORDS
        if meaning or concepts & _CARD_WORDS:
            for key, sets in _KEY_CONCEPTS:
                if meaning in sets:
                    return key
    close = difflib.get_close_matches(flat, list(_NORMALISED), n=1, cutoff=0.8)
    return _NORMALISED[close[0]] if close else None


def _ours(key: str) -> bool:
    """A ``kvgpu.io/`` key, the prefix in any case (annotation prefixes are DNS names, and the
    API server accepts them in upper case too)."""
    return key.lower().startswith(K)


def _operator_key(key: str) -> bool:
    return key in _OPERATOR_KEYS or keys.is_allocation_annotation(key)


@functools.lru_cache(maxsize=4096)
def _misspelt(key: str) -> str | None:
    """The request key that ``key`` is probably a typo or a case variant of, if any."""
    if not _ours(key) or key in REQUEST_ANNOTATIONS or _operator_key(key):
        return None
    return suggest_key(key[len(K):])


def misplaced_resource(key: str) -> str | None:
    """The HAMi container resource that annotation ``key`` names (``nvidia.com/gpumem`` in any
    case), written on the pod instead of as a container limit; else ``None``."""
    low = key.lower()
    return low if low in HAMI_RESOURCES else None


def unknown_annotations(annotations: Mapping[str, Any]) -> list[str]:
    """The ``kvgpu.io/`` keys (prefix in any case) of ``annotations`` that kvgpu does not read:
    neither a request key, nor a probable misspelling of one (those are refused), nor one the
    operator writes. Sorted. For an admission warning: they give the pod nothing."""
    return sorted(k for k in annotations if _ours(str(k)) and str(k) not in REQUEST_ANNOTATIONS
                  and not _operator_key(str(k)) and _misspelt(str(k)) is None)


def slice_minimum_errors(obj: Mapping[str, Any], minimum_mib: int, source: str) -> list[RequestError]:
    """Requests of ``obj`` (a pod or workload) for fewer MiB per card than ``minimum_mib``.

    Only memory named in MiB or a quantity counts (0 = the whole card and percentages pass: the
    card is not known yet). ``source`` says where the minimum comes from, for the message.
    Returns one error per offending key (the annotation once, a limit per container); ``[]``
    also when the request has other errors (reported by :func:`validate_pod`).
    """
    if minimum_mib <= 0:
        return []
    try:
        req = _parse(obj, None)
        meta, spec = pod_template(obj)
    except RequestError:
        return []
    if req is None:
        return []
    ann = _annotations(meta, _Errors())
    inits, apps = _containers(spec, _Errors())
    by_name = {c.name: c for c in inits + apps}
    out: dict[tuple[str, str | None], RequestError] = {}
    for r in req.containers:
        if r.memory_percent is not None or r.memory_mib == 0 or r.memory_mib >= minimum_mib:
            continue
        c = by_name[r.container]
        limit = HAMI_GPUMEM in c.resources
        key, raw, where = (HAMI_GPUMEM, c.resources[HAMI_GPUMEM], c.name) if limit else (GPUMEM, ann.get(GPUMEM), None)
        hint = f"; a limit written 3000m reaches kvgpu as 3: {MILLI_HINT}" if limit else ""
        out.setdefault((key, where), RequestError(
            key, raw, f"is {r.memory_mib} MiB, below the minimum slice of {minimum_mib} MiB ({source}{hint})",
            f"use at least {minimum_mib} MiB, like 3000 or 3Gi, or 0 for the whole card", where))
    return list(out.values())


# --------------------------------------------------------------------------- the parser


def validate_pod(obj: Mapping[str, Any], pool: VGPUPoolSpec | None = None) -> list[RequestError]:
    """Every problem of a pod's (or pod template's) GPU request; empty when it is valid."""
    try:
        _parse(obj, pool)
    except RequestErrors as e:
        return list(e.errors)
    except RequestError as e:
        return [e]
    return []


def parse_pod(obj: Mapping[str, Any], pool: VGPUPoolSpec | None = None) -> PodRequest | None:
    """Normalise a pod's GPU request, applying ``pool``'s defaults (HAMi's when ``None``).

    ``obj`` is a Pod dict (as the API server or an admission review gives it) or a workload with
    a pod template. Returns ``None`` when the pod asks for no slices (:func:`wants_slices` false),
    else a :class:`PodRequest` with one :class:`ContainerRequest` per requesting container, init
    containers first, in pod order. Raises :class:`RequestErrors` listing every invalid key.
    """
    return _parse(obj, pool)


def _parse(obj: Mapping[str, Any], pool: VGPUPoolSpec | None) -> PodRequest | None:
    pool = pool or VGPUPoolSpec()
    errs = _Errors()
    try:
        meta, spec = pod_template(obj)
    except RequestError as e:
        raise RequestErrors([e]) from None
    ann = _annotations(meta, errs)
    inits, apps = _containers(spec, errs)
    _fail(errs)

    ours = [k for k in ann if _is_request_annotation(k)]
    hami = {c.name: _hami_slice_keys(c) for c in inits + apps}
    hami = {n: ks for n, ks in hami.items() if ks}
    if not ours and not hami:
        return None
    if not apps:
        errs.add("spec.containers", [], "is empty", "give the pod at least one container")
        _fail(errs)

    for k in ours:
        _key_error(k, ann[k], errs)
    amounts = [k for k in ours if k in AMOUNT_ANNOTATIONS]
    if amounts and hami and all(ks == [HAMI_GPU] for ks in hami.values()):
        # The annotation form with the extended resource the mutating webhook adds (or the user
        # wrote) so that the kubelet calls the device plugin: a card count, checked against the
        # annotations in _annotation_containers.
        hami = {}
    if amounts and hami:
        names = ", ".join(hami)
        errs.add(
            amounts[0],
            ann[amounts[0]],
            f"cannot be combined with nvidia.com/* container limits (set on {names})",
            "use either kvgpu.io/* request annotations or nvidia.com/* container limits",
        )

    shared = _shared(ann, errs)
    node_policy = shared.pop("node_policy", None) or Policy(pool.scheduling.node_policy.value)
    gpu_policy = shared.pop("gpu_policy", None) or Policy(pool.scheduling.gpu_policy.value)

    requests: list[ContainerRequest] = []
    if hami:
        for c in inits + apps:
            if c.name in hami:
                r = _hami_container(c, pool, shared, errs)
                if r is not None:
                    requests.append(r)
    else:
        requests = _annotation_containers(ann, inits, apps, pool, shared, errs)
    _fail(errs)
    return PodRequest(
        namespace=str(meta.get("namespace") or ""),
        name=str(meta.get("name") or meta.get("generateName") or ""),
        uid=str(meta.get("uid") or ""),
        containers=tuple(requests),
        node_policy=node_policy,
        gpu_policy=gpu_policy,
    )


def _key_error(key: str, value: Any, errs: _Errors) -> None:
    """A misspelt, case-variant or misplaced request key: the message names the right key."""
    resource = misplaced_resource(key)
    if resource is not None:
        ours = K + resource.removeprefix("nvidia.com/")
        instead = f" or the annotation {ours}" if ours in REQUEST_ANNOTATIONS else ""
        errs.add(key, value, "is a container resource, not a pod annotation",
                 f"set it under the container's resources.limits ({resource}: {show(value)}){instead}")
        return
    typo = _misspelt(key)
    if typo is None:
        return
    if key.lower() == typo:
        errs.add(key, value, "is not a kvgpu request annotation (annotation keys are case-sensitive)",
                 f"use {typo}")
    else:
        errs.add(key, value, "is not a kvgpu request annotation", f"did you mean {typo}?")


def _fail(errs: _Errors) -> None:
    if errs.items:
        raise RequestErrors(errs.items)


def _shared(ann: Mapping[str, Any], errs: _Errors) -> dict[str, Any]:
    """Selection and policy annotations (kvgpu or HAMi spelling), keyed by ContainerRequest field."""
    out: dict[str, Any] = {}
    for ours, theirs in _SYNONYMS:
        parsed: dict[str, Any] = {}
        for key in (ours, theirs):
            if key not in ann:
                continue
            try:
                parsed[key] = _shared_value(key, ann[key])
            except RequestError as e:
                errs.items.append(e)
        if len(parsed) == 2 and parsed[ours] != parsed[theirs]:
            errs.add(
                theirs,
                ann[theirs],
                f"disagrees with {ours} ({show(ann[ours])})",
                "set one of them, or both to the same value",
            )
        elif parsed:
            out[_FIELD[ours]] = parsed.get(ours, parsed.get(theirs))
    if HAMI_VGPU_MODE in ann and _text(ann[HAMI_VGPU_MODE]) != "hami-core":
        errs.add(
            HAMI_VGPU_MODE,
            ann[HAMI_VGPU_MODE],
            "is not supported",
            "use hami-core, or choose the mode with the VGPUPool that covers the cards",
        )
    if HAMI_SCORING_WEIGHTS in ann:
        errs.add(
            HAMI_SCORING_WEIGHTS,
            ann[HAMI_SCORING_WEIGHTS],
            "is not supported by kvgpu",
            f"remove it and use {NODE_POLICY} / {GPU_POLICY}",
        )
    return out


_FIELD = {
    GPU_TYPE: "types",
    EXCLUDE_GPU_TYPE: "exclude_types",
    GPU_UUID: "uuids",
    EXCLUDE_GPU_UUID: "exclude_uuids",
    NUMA_BIND: "numa_bind",
    NODE_POLICY: "node_policy",
    GPU_POLICY: "gpu_policy",
}


def _shared_value(key: str, raw: Any) -> Any:
    if key in (GPU_TYPE, EXCLUDE_GPU_TYPE, HAMI_USE_TYPE, HAMI_NOUSE_TYPE):
        return _types(key, raw)
    if key in (GPU_UUID, EXCLUDE_GPU_UUID, HAMI_USE_UUID, HAMI_NOUSE_UUID):
        return _uuids(key, raw)
    if key in (NUMA_BIND, HAMI_NUMA_BIND):
        return _bool(key, raw)
    return _policy(key, raw)


@dataclass(slots=True)
class _Amounts:
    cards: int | None = None
    memory_mib: int | None = None
    memory_percent: int | None = None
    cores: int | None = None
    priority: int | None = None


def _finish(
    name: str, init: bool, a: _Amounts, pool: VGPUPoolSpec, shared: Mapping[str, Any]
) -> ContainerRequest:
    d = pool.defaults
    if a.memory_mib is None and a.memory_percent is None:
        memory_mib, memory_percent = d.gpumem, d.gpumem_percentage
    else:
        memory_mib, memory_percent = a.memory_mib or 0, a.memory_percent
    if memory_percent == 100:
        memory_mib, memory_percent = 0, None  # 100 % of each card = the whole card
    whole = memory_mib == 0 and memory_percent is None
    if a.cores is not None:
        cores = a.cores
    elif whole and d.gpucores == 0:
        cores = 100  # whole memory and no cores named: an exclusive card (HAMi's rule)
    else:
        cores = d.gpucores
    return ContainerRequest(
        container=name,
        cards=a.cards if a.cards is not None else d.gpu,
        memory_mib=memory_mib,
        memory_percent=memory_percent,
        cores=cores,
        priority=a.priority if a.priority is not None else d.priority,
        types=shared.get("types", ()),
        exclude_types=shared.get("exclude_types", ()),
        uuids=shared.get("uuids", ()),
        exclude_uuids=shared.get("exclude_uuids", ()),
        numa_bind=bool(shared.get("numa_bind", False)),
        init=init,
    )


def _annotation_containers(
    ann: Mapping[str, Any],
    inits: list[_Container],
    apps: list[_Container],
    pool: VGPUPoolSpec,
    shared: Mapping[str, Any],
    errs: _Errors,
) -> list[ContainerRequest]:
    a = _Amounts()
    n0 = len(errs.items)

    def get(key: str, fn: Any, *args: Any) -> Any:
        if key not in ann:
            return None
        try:
            return fn(key, ann[key], *args)
        except RequestError as e:
            errs.items.append(e)
            return None

    a.cards = get(GPU, _annotation_int, 1, MAX_CARDS, FORM_CARDS)
    a.memory_mib = get(GPUMEM, parse_memory_mib)
    a.memory_percent = get(GPUMEM_PERCENTAGE, _annotation_int, 1, 100, FORM_PERCENT)
    a.cores = get(GPUCORES, _annotation_int, 0, 100, FORM_CORES)
    a.priority = get(PRIORITY, _annotation_int, 0, 1, FORM_PRIORITY)
    if GPUMEM in ann and GPUMEM_PERCENTAGE in ann:
        errs.add(
            GPUMEM_PERCENTAGE,
            ann[GPUMEM_PERCENTAGE],
            f"cannot be used together with {GPUMEM}",
            "set memory one way: MiB/quantity or percent",
        )

    by_name = {c.name: c for c in inits + apps}
    targets: list[_Container] = []
    if CONTAINERS in ann:
        names = _list(ann[CONTAINERS])
        if not names:
            errs.add(
                CONTAINERS, ann[CONTAINERS], "names no container", FORM_CONTAINERS + ": " + _names(by_name)
            )
        for n in names or ():
            if n not in by_name:
                errs.add(
                    CONTAINERS,
                    ann[CONTAINERS],
                    f"names {show(n)}, which is not a container of the pod",
                    FORM_CONTAINERS + ": " + _names(by_name),
                )
            else:
                targets.append(by_name[n])
    else:
        targets = apps[:1]
    if len(errs.items) > n0:
        return []
    order = {c.name: i for i, c in enumerate(inits + apps)}
    targets.sort(key=lambda c: order[c.name])
    a.cards = _card_resource(ann, a.cards, targets, [c for c in inits + apps if c not in targets], errs)
    if len(errs.items) > n0:
        return []
    return [_finish(c.name, c.init, a, pool, shared) for c in targets]


def _card_resource(
    ann: Mapping[str, Any], cards: int | None, targets: list[_Container], others: list[_Container],
    errs: _Errors,
) -> int | None:
    """The annotation form's ``nvidia.com/gpu`` limits (the mutating webhook adds them so that the
    kubelet calls the device plugin; a user may have written them): on a container with slices
    it must be the card count, the same as ``kvgpu.io/gpu`` when that is set; elsewhere it may
    only be 0. Returns the card count (``kvgpu.io/gpu``, else the limits', else ``None``)."""
    first: tuple[str, int] | None = None
    for c in targets:
        if HAMI_GPU not in c.resources:
            continue
        raw = c.resources[HAMI_GPU]
        try:
            n = _resource_int(HAMI_GPU, raw, 1, MAX_CARDS, FORM_CARDS, c.name)
        except RequestError as e:
            errs.items.append(e)
            continue
        if cards is not None and n != cards:
            errs.add(HAMI_GPU, raw, f"disagrees with {GPU} ({show(ann[GPU])})",
                     "set the limit to the same number of cards or remove it (kvgpu adds it)", c.name)
        elif first is not None and n != first[1]:
            errs.add(HAMI_GPU, raw, f'disagrees with the {HAMI_GPU} limit of container "{first[0]}" '
                     f"({first[1]}); every container named by {CONTAINERS} gets the same cards",
                     f"set {GPU} and remove the limits (kvgpu adds them)", c.name)
        elif first is None:
            first = (c.name, n)
    for c in others:
        if HAMI_GPU in c.resources and not _is_zero(c.resources[HAMI_GPU]):
            errs.add(HAMI_GPU, c.resources[HAMI_GPU],
                     f"is set on a container that gets no slices from the {K}* request annotations",
                     f"name the container in {CONTAINERS}, or remove the limit", c.name)
    if cards is None and first is not None:
        return first[1]
    return cards


def _names(by_name: Mapping[str, Any]) -> str:
    return ", ".join(by_name) or "(none)"


def _hami_container(
    c: _Container, pool: VGPUPoolSpec, shared: Mapping[str, Any], errs: _Errors
) -> ContainerRequest | None:
    a = _Amounts()
    r = c.resources
    n0 = len(errs.items)

    def get(key: str, fn: Any, *args: Any) -> Any:
        if key not in r:
            return None
        try:
            return fn(key, r[key], *args)
        except RequestError as e:
            errs.items.append(e)
            return None

    a.cards = get(HAMI_GPU, _resource_int, 0, MAX_CARDS, FORM_CARDS, c.name)
    a.memory_mib = get(HAMI_GPUMEM, parse_memory_mib, c.name)
    pct = get(HAMI_GPUMEM_PERCENTAGE, _resource_int, 0, 100, FORM_HAMI_PERCENT, c.name)
    a.memory_percent = pct or None  # 0 = unset, as in HAMi
    a.cores = get(HAMI_GPUCORES, _resource_int, 0, 100, FORM_CORES, c.name)
    a.priority = get(HAMI_PRIORITY, _resource_int, 0, 1, FORM_PRIORITY, c.name)
    if len(errs.items) > n0:
        return None
    others = [k for k in (HAMI_GPUMEM, HAMI_GPUMEM_PERCENTAGE, HAMI_GPUCORES, HAMI_PRIORITY) if k in r]
    if a.cards == 0:
        errs.add(
            HAMI_GPU, r[HAMI_GPU], f"asks for no card but {', '.join(others)} is set", FORM_CARDS, c.name
        )
        return None
    if a.memory_mib is not None and a.memory_percent is not None:
        errs.add(
            HAMI_GPUMEM_PERCENTAGE,
            r[HAMI_GPUMEM_PERCENTAGE],
            f"cannot be used together with {HAMI_GPUMEM}",
            "set memory one way: MiB/quantity or percent",
            c.name,
        )
        return None
    if others == [HAMI_PRIORITY] and HAMI_GPU not in r:
        errs.add(
            HAMI_PRIORITY,
            r[HAMI_PRIORITY],
            "has no effect without a GPU request",
            f"add {HAMI_GPU} (or gpumem/gpucores), or remove it",
            c.name,
        )
        return None
    return _finish(c.name, c.init, a, pool, shared)
