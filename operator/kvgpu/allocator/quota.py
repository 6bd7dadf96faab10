"""Namespace quotas on GPU slices: the arithmetic. Pure, deterministic, no I/O, no asyncio.

Four dimensions, each summed over a namespace's live reservations (VGPUClaims not Released):

- ``memory``, MiB: the MiB granted on each card, summed over the pod's cards (HAMi's way:
  ``gpu: 2, gpumem: 2048`` uses 4096);
- ``cores``, percent-of-card units: the cores granted on each card, summed over its cards
  (``gpu: 2, gpucores: 30`` uses 60; a whole card's SMs are 100);
- ``cards``: distinct physical cards;
- ``slices``: (container, card) grants, one per container per card (what the node's
  ``nvidia.com/gpu`` counts, cards × splitCount).

**A pod's usage** follows Kubernetes' rule for a pod's effective request: per dimension,
``max(the largest init container, the sum of the app containers)`` (init containers run alone,
before the app containers; restartable sidecars are app containers). At bind it is computed
from the grants (:func:`pod_usage`: a ``gpumem-percentage`` or whole-card request counts the MiB
it got on its card); before the cards are chosen :func:`request_floor` gives a lower bound from
the request alone, so an early refusal (the extender's filter) is never wrong.

**Quotas.** A :class:`Quota` is one object (a ResourceQuota's GPU keys, or a VGPUQuota) with
one :class:`Limit` per key it sets; every quota of a namespace is enforced on its own, as the
API server does with several ResourceQuotas. A pod is refused when, for some limit, it asks for
a positive amount and ``used + requested > hard`` (a pod asking nothing of a dimension is never
refused for it, even where usage is above a lowered limit).

**The book.** :class:`QuotaBook` holds the quotas and, per pod UID, the usage of what the pod
holds in the ledger; its callers (``OperatorState``) update a pod's usage on every reserve and
release, in the same synchronous step, so a check and the reservation that follows it run with
no ``await`` in between (the binder's rule for the ledger, :mod:`kvgpu.allocator.ledger`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from kvgpu.allocator.ledger import AllocationError
from kvgpu.core.requests import ContainerAllocation, ContainerRequest

#: The dimensions, in the order messages and tables use.
DIMENSIONS = ("memory", "cores", "cards", "slices")
#: Each dimension's unit, for messages.
UNITS = {"memory": "MiB", "cores": "percent-of-card units", "cards": "cards", "slices": "slices"}


class QuotaExceeded(AllocationError):
    """A pod would take its namespace past a quota. The message names the quota, the key, and
    the used, requested and hard amounts."""


@dataclass(frozen=True, slots=True)
class Amounts:
    """GPU amounts of a pod or a namespace: ``memory`` MiB, ``cores`` percent-of-card units,
    ``cards`` physical cards, ``slices`` (container, card) grants. All ≥ 0 for real usage."""

    memory: int = 0
    cores: int = 0
    cards: int = 0
    slices: int = 0

    def __add__(self, other: Amounts) -> Amounts:
        return Amounts(self.memory + other.memory, self.cores + other.cores, self.cards + other.cards,
                       self.slices + other.slices)

    def __sub__(self, other: Amounts) -> Amounts:
        return Amounts(self.memory - other.memory, self.cores - other.cores, self.cards - other.cards,
                       self.slices - other.slices)

    def get(self, dimension: str) -> int:
        """The amount of one dimension (``memory``, ``cores``, ``cards`` or ``slices``); raises
        ``KeyError`` for another name."""
        if dimension not in DIMENSIONS:
            raise KeyError(dimension)
        return int(getattr(self, dimension))

    def pairwise_max(self, other: Amounts) -> Amounts:
        return Amounts(*(max(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)))

    def is_zero(self) -> bool:
        return not (self.memory or self.cores or self.cards or self.slices)

    def to_json(self) -> dict[str, int]:
        return {d: self.get(d) for d in DIMENSIONS}


ZERO = Amounts()


def pod_usage(containers: Iterable[ContainerAllocation]) -> Amounts:
    """What a pod holding these grants uses (see the module doc): per dimension the larger of
    its largest init container and the sum of its app containers; ``cards`` of the app
    containers counts each physical card once."""
    app_cards: set[str] = set()
    mem = cores = slices = 0
    init = ZERO
    for ca in containers:
        if ca.init:
            init = init.pairwise_max(Amounts(
                sum(d.memory_mib for d in ca.devices), sum(d.cores for d in ca.devices),
                len({d.uuid for d in ca.devices}), len(ca.devices)))
            continue
        mem += sum(d.memory_mib for d in ca.devices)
        cores += sum(d.cores for d in ca.devices)
        slices += len(ca.devices)
        app_cards.update(d.uuid for d in ca.devices)
    return Amounts(mem, cores, len(app_cards), slices).pairwise_max(init)


def request_floor(containers: Iterable[ContainerRequest]) -> Amounts:
    """A lower bound of :func:`pod_usage` from the request alone (before cards are chosen):
    memory counts only absolute ``gpumem`` (a percentage or a whole card is 0 here), cards the
    largest container's card count (the containers may share cards)."""
    mem = cores = slices = cards = 0
    init = ZERO
    for c in containers:
        m = c.memory_mib * c.cards if c.memory_percent is None and c.memory_mib > 0 else 0
        one = Amounts(m, c.cores * c.cards, c.cards, c.cards)
        if c.init:
            init = init.pairwise_max(one)
            continue
        mem += one.memory
        cores += one.cores
        slices += one.slices
        cards = max(cards, c.cards)
    return Amounts(mem, cores, cards, slices).pairwise_max(init)


@dataclass(frozen=True, slots=True)
class Limit:
    """One hard limit of a quota: ``dimension`` (``memory``/``cores``/``cards``/``slices``),
    the ``key`` that set it as the user wrote it (``limits.nvidia.com/gpumem``,
    ``spec.hard.memory``), and ``hard`` in the dimension's unit."""

    dimension: str
    key: str
    hard: int


@dataclass(frozen=True, slots=True)
class Quota:
    """A quota object: ``kind`` (``ResourceQuota`` or ``VGPUQuota``), where, and its limits."""

    kind: str
    namespace: str
    name: str
    limits: tuple[Limit, ...]

    @property
    def ref(self) -> str:
        """``ResourceQuota team/gpu``: how messages name it."""
        return f"{self.kind} {self.namespace}/{self.name}"


def refusal(quota: Quota, used: Amounts, want: Amounts) -> str | None:
    """Why ``want`` more on top of ``used`` passes ``quota``, for a person (the first limit
    passed), or None when it fits. No ``%`` in the text: kube-scheduler formats its event
    messages with it."""
    for lim in quota.limits:
        w = want.get(lim.dimension)
        u = used.get(lim.dimension)
        if w > 0 and u + w > lim.hard:
            unit = UNITS[lim.dimension]
            return (f"GPU quota exceeded: {quota.ref} {lim.key}: used {u} + requested {w} > hard {lim.hard} "
                    f"({unit})")
    return None


@dataclass
class QuotaBook:
    """Quotas by namespace and the usage of what each pod holds. See the module doc."""

    _quotas: dict[str, dict[tuple[str, str], Quota]] = field(default_factory=dict)
    _pods: dict[str, tuple[str, Amounts]] = field(default_factory=dict)  # pod UID -> (namespace, usage)
    _used: dict[str, Amounts] = field(default_factory=dict)
    #: namespaces whose usage or quotas changed since the caller last cleared it (status writes)
    dirty: set[str] = field(default_factory=set)

    # ----- quotas ------------------------------------------------------------------------------
    def set_quota(self, quota: Quota) -> bool:
        """Add or replace a quota (by kind, namespace and name). Returns True when it changed."""
        by_ns = self._quotas.setdefault(quota.namespace, {})
        k = (quota.kind, quota.name)
        if by_ns.get(k) == quota:
            return False
        by_ns[k] = quota
        self.dirty.add(quota.namespace)
        return True

    def remove_quota(self, kind: str, namespace: str, name: str) -> bool:
        """Forget a quota (idempotent). Returns True when one was known."""
        by_ns = self._quotas.get(namespace, {})
        gone = by_ns.pop((kind, name), None) is not None
        if not by_ns:
            self._quotas.pop(namespace, None)
        if gone:
            self.dirty.add(namespace)
        return gone

    def quotas(self, namespace: str) -> list[Quota]:
        """The quotas of a namespace, sorted by kind and name."""
        return [q for _, q in sorted(self._quotas.get(namespace, {}).items())]

    def namespaces(self) -> list[str]:
        """Namespaces with at least one quota, sorted."""
        return sorted(self._quotas)

    # ----- usage -------------------------------------------------------------------------------
    def set_pod(self, uid: str, namespace: str, usage: Amounts | None) -> None:
        """Record what pod ``uid`` of ``namespace`` holds now (None or zero: nothing)."""
        old = self._pods.pop(uid, None)
        if old is not None:
            ons, ou = old
            left = self._used.get(ons, ZERO) - ou
            if left.is_zero():
                self._used.pop(ons, None)
            else:
                self._used[ons] = left
            self.dirty.add(ons)
        if usage is not None and not usage.is_zero():
            self._pods[uid] = (namespace, usage)
            self._used[namespace] = self._used.get(namespace, ZERO) + usage
            self.dirty.add(namespace)

    def clear_pods(self) -> None:
        """Forget every pod's usage (a ledger rebuild follows)."""
        self.dirty.update(self._used)
        self._pods.clear()
        self._used.clear()

    def used(self, namespace: str) -> Amounts:
        """The namespace's usage: the sum of its pods'."""
        return self._used.get(namespace, ZERO)

    def pod(self, uid: str) -> tuple[str, Amounts] | None:
        """(namespace, usage) recorded for a pod, or None."""
        return self._pods.get(uid)

    def pods(self) -> dict[str, tuple[str, Amounts]]:
        """Every pod's (namespace, usage), by UID (a copy)."""
        return dict(self._pods)

    # ----- decisions ---------------------------------------------------------------------------
    def check(self, namespace: str, want: Amounts, uid: str = "") -> str | None:
        """Why a pod ``uid`` of ``namespace`` that would use ``want`` in all passes a quota (the
        first quota by kind and name), or None. What ``uid`` holds already is not counted twice."""
        quotas = self._quotas.get(namespace)
        if not quotas:
            return None
        used = self.used(namespace)
        mine = self._pods.get(uid) if uid else None
        if mine is not None and mine[0] == namespace:
            used = used - mine[1]
        for _, q in sorted(quotas.items()):
            why = refusal(q, used, want)
            if why is not None:
                return why
        return None

    def require(self, namespace: str, want: Amounts, uid: str = "") -> None:
        """:meth:`check`, raising :class:`QuotaExceeded` with the reason instead of returning it."""
        why = self.check(namespace, want, uid)
        if why is not None:
            raise QuotaExceeded(why)


def usage_by_namespace(pods: Iterable[tuple[str, str, ContainerAllocation]]) -> dict[str, Amounts]:
    """Namespace → usage from ``(namespace, pod UID, container grant)`` triples (e.g. read from
    VGPUClaims): grants are grouped per pod, then :func:`pod_usage` per pod is summed."""
    per_pod: dict[tuple[str, str], list[ContainerAllocation]] = {}
    for ns, uid, ca in pods:
        per_pod.setdefault((ns, uid), []).append(ca)
    out: dict[str, Amounts] = {}
    for (ns, _), cas in sorted(per_pod.items()):
        out[ns] = out.get(ns, ZERO) + pod_usage(cas)
    return out


def to_json(quota: Quota, used: Amounts) -> dict[str, Any]:
    """A quota with the namespace's usage, for ``-o json`` and logs."""
    return {"kind": quota.kind, "namespace": quota.namespace, "name": quota.name,
            "limits": [{"key": lim.key, "dimension": lim.dimension, "hard": lim.hard,
                        "used": used.get(lim.dimension)} for lim in quota.limits]}
