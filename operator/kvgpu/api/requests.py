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

from collections.abc import Mapping
from typing import Any

from kvgpu.api.models import (
    VGPUPoolSpec,
)

# The key catalogue, the value parsers and the pod shape live in their own modules; their public
# names stay importable from here, where callers have always found them.
from kvgpu.api.podshape import *  # noqa: F403
from kvgpu.api.podshape import (
    _annotations,
    _containers,
    _hami_slice_keys,
    pod_template,
)
from kvgpu.api.request_forms import annotation_containers, hami_container
from kvgpu.api.request_keys import *  # noqa: F403
from kvgpu.api.request_keys import (
    _SYNONYMS,
    AMOUNT_ANNOTATIONS,
    EXCLUDE_GPU_TYPE,
    EXCLUDE_GPU_UUID,
    GPU_POLICY,
    GPU_TYPE,
    GPU_UUID,
    GPUMEM,
    HAMI_GPU,
    HAMI_GPUMEM,
    HAMI_NOUSE_TYPE,
    HAMI_NOUSE_UUID,
    HAMI_NUMA_BIND,
    HAMI_SCORING_WEIGHTS,
    HAMI_USE_TYPE,
    HAMI_USE_UUID,
    HAMI_VGPU_MODE,
    NODE_POLICY,
    NUMA_BIND,
    REQUEST_ANNOTATIONS,
    K,
    _is_request_annotation,
    _misspelt,
    misplaced_resource,
)
from kvgpu.api.values import *  # noqa: F403
from kvgpu.api.values import (
    MILLI_HINT,
    RequestError,
    RequestErrors,
    _bool,
    _Errors,
    _policy,
    _text,
    _types,
    _uuids,
    show,
)
from kvgpu.core.requests import ContainerRequest, PodRequest, Policy


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
                r = hami_container(c, pool, shared, errs)
                if r is not None:
                    requests.append(r)
    else:
        requests = annotation_containers(ann, inits, apps, pool, shared, errs)
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
