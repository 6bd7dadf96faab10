"""GPU preemption: which lower-priority pods to evict so a pending pod fits. Pure, no I/O.

kube-scheduler's own preemption cannot do this for kvgpu (it only proposes victims its in-tree
filters need, and GPU memory and cores are not node resources; docs/decisions.md), so the
operator decides with the ledger's own fit rules: a what-if on a copy of one node's state.

The rules (:func:`choose`):

- only pods of **strictly lower** priority than the pending pod are victims; pods of unknown
  priority (not listed), the preemptor's own hold and other preemptors' holds are never victims;
- pods already terminating count as gone: when the pod fits once they have left, nothing is
  evicted (:attr:`NoPlan.wait`);
- a node is a candidate only when the pod fits there once *every* pod of lower priority is gone;
- on a candidate node the victim set is the **smallest** one that makes room; among sets of that
  size, the one whose highest priority is lowest, then whose priorities sum lowest, then by
  name. Sets are searched exactly up to ``max_checks`` fit checks per node; beyond that the set
  is kube-scheduler's greedy one (all lower-priority pods removed, then each put back, most
  important first, while the pod still fits): minimal, not always minimum;
- a set that takes more pods from a :class:`Budget` (a PodDisruptionBudget's
  ``disruptionsAllowed``) than it allows is never chosen; kvgpu does not evict around a PDB;
- across nodes: fewest victims, then lowest highest priority, lowest sum, then the given node
  order. (kube-scheduler ranks lowest highest-priority before fewest victims; kvgpu evicts as
  few workloads as it can, a GPU job being costly to restart.)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvgpu.allocator.ledger import AllocationError, Ledger
from kvgpu.core.inventory import NodeInventory
from kvgpu.core.requests import PodAllocation, PodRequest

#: pod UIDs of preemptors' holds in the ledger start with this (never victims)
HOLD_PREFIX = "kvgpu-hold:"


@dataclass(frozen=True, slots=True)
class Holder:
    """A pod holding GPU reservations, as the preemption sees it."""

    uid: str
    namespace: str
    name: str
    priority: int
    terminating: bool = False

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class Budget:
    """A PodDisruptionBudget: at most ``allowed`` of the pods ``pods`` (UIDs) may be evicted."""

    name: str  # namespace/name
    pods: frozenset[str]
    allowed: int


@dataclass(frozen=True, slots=True)
class Plan:
    """Evict ``victims`` on ``node``; the pod then fits with ``allocation``."""

    node: str
    victims: tuple[Holder, ...]
    allocation: PodAllocation

    def rank(self) -> tuple[int, int, int]:
        p = [v.priority for v in self.victims]
        return (len(p), max(p, default=0), sum(p))


@dataclass(frozen=True, slots=True)
class NoPlan:
    """No eviction. ``reason`` is for a person; ``wait``: the pod fits once pods that are
    already terminating have gone (nothing to evict)."""

    reason: str
    wait: bool = False


def choose(
    pod: PodRequest,
    priority: int,
    inventories: Mapping[str, NodeInventory],
    reservations: Iterable[PodAllocation],
    holders: Mapping[str, Holder],
    budgets: Iterable[Budget] = (),
    *,
    nodes: Iterable[str] | None = None,
    max_checks: int = 400,
) -> Plan | NoPlan:
    """The node and victims for ``pod`` (priority ``priority``), by the rules in the module doc.

    ``inventories``: each node's inventory with its cards' slicing, as the ledger has it;
    ``reservations``: the ledger's reservations (any node); ``holders``: pod UID → holder for
    the pods whose priority is known; ``nodes``: the nodes to consider, in order of preference
    (default: every node of ``inventories``, sorted)."""
    order = list(sorted(inventories) if nodes is None else nodes)
    by_node: dict[str, dict[str, list[PodAllocation]]] = {}
    wanted = set(order)
    for a in reservations:
        if a.node in wanted:
            by_node.setdefault(a.node, {}).setdefault(a.pod_uid, []).append(a)
    budgets = tuple(budgets)
    best: tuple[tuple[int, int, int, int], Plan] | None = None
    why: list[str] = []
    for i, name in enumerate(order):
        inv = inventories.get(name)
        if inv is None:
            continue
        got = node_plan(pod, priority, inv, by_node.get(name, {}), holders, budgets, max_checks)
        if isinstance(got, NoPlan):
            if got.wait:
                return NoPlan(f"fits on {name} once its terminating pods have gone", wait=True)
            why.append(f"{name}: {got.reason}")
            continue
        key = (*got.rank(), i)
        if best is None or key < best[0]:
            best = (key, got)
    if best is not None:
        return best[1]
    if not why:
        return NoPlan("no GPU node to consider")
    text = "; ".join(why[:8]) + (f"; and {len(why) - 8} more nodes" if len(why) > 8 else "")
    return NoPlan(text)


def node_plan(
    pod: PodRequest,
    priority: int,
    inv: NodeInventory,
    pods: Mapping[str, list[PodAllocation]],
    holders: Mapping[str, Holder],
    budgets: tuple[Budget, ...] = (),
    max_checks: int = 400,
) -> Plan | NoPlan:
    """:func:`choose` on one node; ``pods``: pod UID → its reservations on the node."""
    gone = {u for u in pods if (h := holders.get(u)) is not None and h.terminating}
    lower = sorted(
        (h for u in pods if u not in gone and not u.startswith(HOLD_PREFIX)
         and (h := holders.get(u)) is not None and h.priority < priority),
        key=lambda h: (h.priority, h.namespace, h.name, h.uid))

    def fits(removed: Iterable[Holder]) -> PodAllocation | None:
        return fits_without(pod, inv, pods, gone | {h.uid for h in removed})

    if fits(()) is not None:
        return NoPlan("fits once its terminating pods have gone", wait=True)
    if not lower:
        return NoPlan(f"no pod of lower priority (< {priority}) holds GPU slices here")
    if fits(lower) is None:
        return NoPlan(f"would not fit even with all {len(lower)} pods of lower priority gone")

    def allowed(victims: Iterable[Holder]) -> bool:
        uids = {v.uid for v in victims}
        return all(len(b.pods & uids) <= b.allowed for b in budgets)

    checks = 0
    for k in range(1, len(lower) + 1):
        found: list[tuple[tuple[int, int, tuple[str, ...]], tuple[Holder, ...], PodAllocation]] = []
        for combo in itertools.combinations(lower, k):
            if not allowed(combo):
                continue
            checks += 1
            if checks > max_checks:
                return _greedy(inv.node, lower, fits, allowed, budgets)
            a = fits(combo)
            if a is not None:
                ps = [v.priority for v in combo]
                found.append(((max(ps), sum(ps), tuple(v.ref for v in combo)), combo, a))
        if found:
            _, combo, a = min(found, key=lambda f: f[0])
            return Plan(inv.node, combo, a)
    return _blocked(lower, budgets)


def fits_without(pod: PodRequest, inv: NodeInventory, pods: Mapping[str, list[PodAllocation]],
                 removed: Iterable[str]) -> PodAllocation | None:
    """Where ``pod`` goes on the node of ``inv`` (reservations ``pods``: UID → allocations) once
    the pods ``removed`` (UIDs) are gone, or None when it still does not fit."""
    out = set(removed)
    keep = {f"{u}#{k}": a for u, allocs in pods.items() if u not in out for k, a in enumerate(allocs)}
    try:
        return Ledger.rebuild([inv], keep).allocate(pod, inv.node)
    except AllocationError:
        return None


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A ``metav1.LabelSelector`` (``matchLabels``, ``matchExpressions`` with In, NotIn, Exists,
    DoesNotExist) against ``labels``. As for a PodDisruptionBudget of ``policy/v1``: None matches
    nothing, ``{}`` every pod; an unknown operator matches nothing."""
    if selector is None:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e.get("key"), e.get("operator"), set(e.get("values") or [])
        have = key in labels
        if op == "In":
            ok = have and labels[key] in values
        elif op == "NotIn":
            ok = not have or labels[key] not in values
        elif op == "Exists":
            ok = have
        elif op == "DoesNotExist":
            ok = not have
        else:
            ok = False
        if not ok:
            return False
    return True


def _greedy(node: str, lower: list[Holder], fits: Callable[[Iterable[Holder]], PodAllocation | None],
            allowed: Callable[[Iterable[Holder]], bool], budgets: tuple[Budget, ...]) -> Plan | NoPlan:
    """kube-scheduler's reprieve: all lower pods out, then each put back (pods a budget covers
    first, then the others; most important first in each) while the pod still fits."""
    covered = {u for b in budgets for u in b.pods}
    victims = list(lower)
    order = sorted(lower, key=lambda h: (h.uid not in covered, -h.priority, h.namespace, h.name))
    for h in order:
        rest = [v for v in victims if v.uid != h.uid]
        if fits(rest) is not None:
            victims = rest
    if not allowed(victims):
        return _blocked(lower, budgets)
    a = fits(victims)
    assert a is not None
    victims.sort(key=lambda h: (h.priority, h.namespace, h.name))
    return Plan(node, tuple(victims), a)


def _blocked(lower: list[Holder], budgets: tuple[Budget, ...]) -> NoPlan:
    uids = {h.uid for h in lower}
    names = sorted({b.name for b in budgets if b.pods & uids})
    return NoPlan("every set of pods whose eviction would make room breaks a PodDisruptionBudget ("
                  + ", ".join(names) + ")")
