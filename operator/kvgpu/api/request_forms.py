"""The two forms of a GPU request, one container at a time → :class:`ContainerRequest`: the
annotation form (``kvgpu.io/gpu``, ``gpumem`` ... on the pod, for the containers named by
``kvgpu.io/containers``, and the ``nvidia.com/gpu`` limits that must agree with them) and the
HAMi form (each container's ``nvidia.com/*`` limits), with the pool's defaults applied.

The pod-level parser that picks the form, reads the shared selection and policy annotations and
reports every error is :mod:`kvgpu.api.requests`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgpu.api.models import MAX_CARDS, VGPUPoolSpec
from kvgpu.api.podshape import _Container, _is_zero
from kvgpu.api.request_keys import (
    CONTAINERS,
    FORM_CARDS,
    FORM_CONTAINERS,
    FORM_CORES,
    FORM_HAMI_PERCENT,
    FORM_PERCENT,
    FORM_PRIORITY,
    GPU,
    GPUCORES,
    GPUMEM,
    GPUMEM_PERCENTAGE,
    HAMI_GPU,
    HAMI_GPUCORES,
    HAMI_GPUMEM,
    HAMI_GPUMEM_PERCENTAGE,
    HAMI_PRIORITY,
    PRIORITY,
    K,
)
from kvgpu.api.values import RequestError, _annotation_int, _Errors, _list, _resource_int, parse_memory_mib, show
from kvgpu.core.requests import ContainerRequest


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
    """One container's request: its amounts, the pool's defaults for those it leaves out (and
    HAMi's exclusive-card rule), the pod's shared selection and policy fields."""
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


def annotation_containers(
    ann: Mapping[str, Any],
    inits: list[_Container],
    apps: list[_Container],
    pool: VGPUPoolSpec,
    shared: Mapping[str, Any],
    errs: _Errors,
) -> list[ContainerRequest]:
    """The annotation form: the ``kvgpu.io/*`` amounts, the same for every container named by
    ``kvgpu.io/containers`` (default: the first app container), in pod order; ``[]`` with the
    errors added to ``errs``."""
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


def hami_container(
    c: _Container, pool: VGPUPoolSpec, shared: Mapping[str, Any], errs: _Errors
) -> ContainerRequest | None:
    """The HAMi form: one container's ``nvidia.com/*`` limits (or requests); ``None`` with the
    errors added to ``errs``."""
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
