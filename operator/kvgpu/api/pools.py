"""Which VGPUPool covers a card, and how that card is sliced. Pure functions, no I/O.

A pool covers a card when its ``nodeSelector`` matches the node's labels and its ``devices``
filter matches the card. When several pools cover one card the most specific wins:

1. a pool filtering by UUID beats one filtering by index, which beats one filtering by model,
   which beats one with no device filter;
2. then the pool whose node selector has more requirements (matchLabels entries plus
   matchExpressions) wins.

Pools equally specific on the same card are in *conflict*: the one whose name sorts first wins (so
the answer is deterministic), and the reconciler shows the conflict as the ``Conflict`` condition
of every pool involved.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvgpu.api.models import (
    COND_CONFLICT,
    COND_READY,
    DEFAULT_MIN_SLICE_MIB,
    Condition,
    ConditionStatus,
    DeviceFilter,
    Mode,
    NodeSelector,
    SelectorOperator,
    VGPUPool,
    VGPUPoolSpec,
)
from kvgpu.core.inventory import Card, Slicing

#: Name of the pool whose defaults apply to requests before a node is chosen (see
#: :func:`defaults_pool`).
DEFAULT_POOL = "default"
#: Most clients one MPS server takes (Volta and later): an mps card's slots.
MPS_MAX_CLIENTS = 48

PoolLike = VGPUPool | Mapping[str, Any]


def as_pool(obj: PoolLike) -> VGPUPool:
    """A :class:`VGPUPool` from the model or from an API object dict (pydantic errors pass through)."""
    return obj if isinstance(obj, VGPUPool) else VGPUPool.model_validate(obj)


def node_matches(selector: NodeSelector, labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics; an empty selector matches every node."""
    for k, v in selector.match_labels.items():
        if labels.get(k) != v:
            return False
    for req in selector.match_expressions:
        present = req.key in labels
        if req.operator is SelectorOperator.IN and not (present and labels[req.key] in req.values):
            return False
        if req.operator is SelectorOperator.NOT_IN and present and labels[req.key] in req.values:
            return False
        if req.operator is SelectorOperator.EXISTS and not present:
            return False
        if req.operator is SelectorOperator.DOES_NOT_EXIST and present:
            return False
    return True


def card_matches(devices: DeviceFilter, card: Card) -> bool:
    """Each non-empty list must match: model by case-insensitive substring, UUID and index exactly."""
    if devices.models and not any(m.lower() in card.model.lower() for m in devices.models):
        return False
    if devices.uuids and card.uuid not in devices.uuids:
        return False
    return not (devices.indexes and card.index not in devices.indexes)


def specificity(spec: VGPUPoolSpec) -> tuple[int, int, int, int]:
    """Sort key: larger is more specific (see the module docstring)."""
    d = spec.devices
    return (int(bool(d.uuids)), int(bool(d.indexes)), int(bool(d.models)), spec.node_selector.terms)


@dataclass(frozen=True, slots=True)
class Coverage:
    """The pool that covers a card (``None``: no pool does) and the equally specific losers."""

    pool: VGPUPool | None
    conflicts: tuple[str, ...] = ()


def covering_pool(pools: Iterable[PoolLike], node_labels: Mapping[str, str], card: Card) -> Coverage:
    """The winning pool for ``card`` on a node with ``node_labels``, with the names it tied with."""
    matching = [
        p
        for p in map(as_pool, pools)
        if node_matches(p.spec.node_selector, node_labels) and card_matches(p.spec.devices, card)
    ]
    if not matching:
        return Coverage(None)
    best = max(specificity(p.spec) for p in matching)
    top = sorted((p for p in matching if specificity(p.spec) == best), key=lambda p: p.name)
    return Coverage(top[0], tuple(p.name for p in top[1:]))


def slicing_of(pool: VGPUPool) -> Slicing:
    """The :class:`Slicing` a pool gives its cards; exclusive mode means one slice per card, mps
    mode at most :data:`MPS_MAX_CLIENTS`."""
    s = pool.spec
    split = 1 if s.mode is Mode.EXCLUSIVE else s.split_count
    if s.mode is Mode.MPS:
        split = min(split, MPS_MAX_CLIENTS)  # what one MPS server serves on Volta and later
    return Slicing(
        pool=pool.name,
        split_count=split,
        memory_scaling=s.memory_scaling,
        core_scaling=s.core_scaling,
        mode=s.mode.value,
        allocation=s.allocation.value,
    )


def effective_slicing(
    pools: Iterable[PoolLike], node_labels: Mapping[str, str], card: Card
) -> Slicing | None:
    """How ``card`` is sliced, or ``None`` when no pool covers it (such a card takes no slices)."""
    cov = covering_pool(pools, node_labels, card)
    return slicing_of(cov.pool) if cov.pool is not None else None


def node_slicing(
    pools: Iterable[PoolLike], node_labels: Mapping[str, str], cards: Iterable[Card]
) -> dict[str, Slicing | None]:
    """``{card uuid: Slicing | None}`` for one node, ready for ``NodeInventory.with_slicing``."""
    models = [as_pool(p) for p in pools]
    return {c.uuid: effective_slicing(models, node_labels, c) for c in cards}


def conflicts(
    pools: Iterable[PoolLike], nodes: Iterable[tuple[Mapping[str, str], Iterable[Card]]]
) -> dict[str, frozenset[str]]:
    """For each pool name, the pools it ties with on at least one card of ``nodes``.

    ``nodes`` yields ``(labels, cards)`` per node. Pools without a conflict are absent.
    """
    models = [as_pool(p) for p in pools]
    out: dict[str, set[str]] = {}
    for labels, cards in nodes:
        for card in cards:
            cov = covering_pool(models, labels, card)
            if cov.pool is None or not cov.conflicts:
                continue
            group = {cov.pool.name, *cov.conflicts}
            for name in group:
                out.setdefault(name, set()).update(group - {name})
    return {k: frozenset(v) for k, v in out.items()}


def defaults_pool(pools: Iterable[PoolLike]) -> VGPUPoolSpec:
    """The pool spec whose request defaults apply at admission, before a node is chosen.

    The pool named ``default`` if there is one; else the only pool if there is exactly one; else
    the built-in spec (HAMi's defaults).
    """
    models = [as_pool(p) for p in pools]
    for p in models:
        if p.name == DEFAULT_POOL:
            return p.spec
    if len(models) == 1:
        return models[0].spec
    return VGPUPoolSpec()


#: Most pool names a Conflict message lists before "and N more" (keeps the status small).
MAX_NAMES_IN_MESSAGE = 10


def pool_conditions(
    *,
    cards: int,
    healthy_cards: int,
    conflicts_with: Iterable[str],
    generation: int | None,
    now: str,
    previous: Iterable[Condition] = (),
) -> list[Condition]:
    """The ``Ready`` and ``Conflict`` conditions of a pool's status.

    ``cards``/``healthy_cards``: covered cards (all / healthy); ``conflicts_with``: names of the
    pools it ties with (see :func:`conflicts`); ``now``: RFC 3339 time for transitions. A
    condition whose status did not change keeps its ``lastTransitionTime`` from ``previous``.
    """
    others = sorted(set(conflicts_with))
    if cards == 0:
        ready = (ConditionStatus.FALSE, "NoCardsCovered", "no card of any node matches the pool")
    elif healthy_cards == 0:
        ready = (ConditionStatus.FALSE, "NoHealthyCards", f"all {cards} covered cards are unhealthy")
    else:
        ready = (
            ConditionStatus.TRUE,
            "CardsCovered",
            f"{healthy_cards} of {cards} covered cards are healthy",
        )
    if others:
        shown = ", ".join(others[:MAX_NAMES_IN_MESSAGE])
        more = len(others) - MAX_NAMES_IN_MESSAGE
        shown += f" and {more} more" if more > 0 else ""
        conflict = (
            ConditionStatus.TRUE,
            "EquallySpecificPools",
            f"equally specific pools cover some of the same cards: {shown}; the name that sorts first "
            "wins. Narrow a nodeSelector or device filter to resolve it",
        )
    else:
        conflict = (ConditionStatus.FALSE, "NoConflict", "no other pool is equally specific on any card")
    before = {c.type: c for c in previous}
    out = []
    for ctype, (status, reason, message) in ((COND_READY, ready), (COND_CONFLICT, conflict)):
        old = before.get(ctype)
        since = old.last_transition_time if old is not None and old.status == status else now
        out.append(
            Condition(
                type=ctype,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=since,
                observed_generation=generation,
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class SliceMinimum:
    """The smallest slice admission allows: ``mib`` per card (0 = none), from pool ``pool``
    (``None``: no pool exists, kvgpu's default)."""

    mib: int = DEFAULT_MIN_SLICE_MIB
    pool: str | None = None

    @property
    def source(self) -> str:
        """Where the minimum comes from, for a refusal message."""
        if self.pool is None:
            return "kvgpu's default; no VGPUPool sets spec.minSliceMemory"
        return f'spec.minSliceMemory of VGPUPool "{self.pool}", the smallest of the pools'


def slice_minimum(pools: Iterable[PoolLike]) -> SliceMinimum:
    """The smallest ``minSliceMemory`` of ``pools`` and the pool with it (the name sorting first
    on a tie). A pod could land on any pool's cards, so admission refuses only what is below
    every pool's minimum. Pools that do not validate are skipped; none: kvgpu's default."""
    found: list[tuple[int, str]] = []
    for obj in pools:
        try:
            p = as_pool(obj)
        except ValueError:
            continue
        found.append((p.spec.min_slice_memory, str(p.metadata.get("name") or "")))
    if not found:
        return SliceMinimum()
    mib, name = min(found)
    return SliceMinimum(mib, name)
