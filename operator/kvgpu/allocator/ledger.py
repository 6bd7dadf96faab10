"""The allocation ledger: nodes → cards → reservations. Pure, deterministic, no I/O, no asyncio.

Capacity of a card (from its inventory and the pool's slicing): ``splitCount`` slots (1 in an
``exclusive``-mode pool), ``memory_mib x memoryScaling`` virtual MiB (rounded down), ``100 x
coreScaling`` cores (percent of SMs). The fit rules are listed in :mod:`kvgpu.allocator.fit`.

**Pods, containers, init containers.** The app containers of a pod run together, so they are
placed one after the other on one evolving copy of the node: each needs ``cards`` *distinct*
cards, but two containers of a pod may share a card (each takes a slot). Init containers run
alone and before the app containers, so each is placed against the node *without* this pod. The
pod's footprint on a card is, per dimension, ``max(largest init container on the card, sum of
the app containers on the card)``: slots ``max(#app slices, 1 if any init slice)``, memory and
cores likewise, exclusive if any of them is. An init container therefore prefers a card whose
footprint already covers it (it then costs nothing), then the GPU policy's order. The same rule
applies when a pod's containers are reserved under several keys (one VGPUClaim per container):
footprints are collapsed per pod UID.

**Placement is greedy**: containers in order (app containers, then init containers), each
taking the best cards by the GPU policy. ``filter`` uses the very same procedure, so a node is
feasible exactly when :meth:`Ledger.allocate` succeeds on it.

**Concurrency.** The operator is single-threaded asyncio and the ledger has no locks. A bind
is ``allocate`` + ``reserve`` (or :meth:`Ledger.bind`, which does both) and must run without an
``await`` in between, so no other bind can see the node half-updated; API calls (VGPUClaims,
Binding) happen afterwards, and on failure the caller ``release``s the key. Binds on one node
are serialised by the event loop, not by a node lock.

**Durability.** The ledger holds only what callers reserve. The VGPUClaims are the durable
record; :meth:`Ledger.rebuild` recreates the ledger from them at start-up, and
``rebuild(...).snapshot() == live.snapshot()`` holds (property-tested).
"""


from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvgpu.allocator import fit as F
from kvgpu.allocator.node import _Node, _Pod
from kvgpu.allocator.placement import _check, _needs, decide, explain
from kvgpu.allocator.placement import _place as _place  # tests call it directly
from kvgpu.allocator.usage import (
    AllocationError,
    CardUsage,
    Footprint,
    LedgerSnapshot,
    NodeUsage,
    PoolUsage,
    footprint,
)
from kvgpu.core.inventory import NodeInventory
from kvgpu.core.requests import (
    PodAllocation,
    PodRequest,
    Policy,
)

__all__ = [
    "AllocationError",
    "CardUsage",
    "Footprint",
    "Ledger",
    "LedgerSnapshot",
    "NodeUsage",
    "PoolUsage",
    "explain",
    "footprint",
]


class Ledger:
    """Nodes, cards and reservations. See the module docstring for the rules.

    Reservation keys are free-form strings (the extender uses the VGPUClaim's
    ``<namespace>/<name>``, or the pod UID when one key covers the whole pod).

    Pool defaults and per-pod overrides of the policies are resolved by the request parser:
    the ledger uses ``PodRequest.node_policy`` / ``gpu_policy`` as given.

    ``cache`` (default on): :meth:`filter` remembers, per node, its verdict for each request
    shape (the containers' requests and the GPU policy) until that node's usage or inventory
    changes, so a burst of identical pods costs one dictionary lookup per unchanged node. A
    shape not seen before is decided once per distinct node state (the cards' layout and usage,
    UUIDs aside) unless it names UUIDs: many empty nodes of one kind answer alike. The answers
    are the same with and without it (property-tested).
    """

    _SHAPES_MAX = 4096  # distinct shapes remembered; beyond it the memo starts afresh
    _CLASSES_MAX = 20_000  # node states numbered (~1 KB each); beyond it the memo starts afresh

    def __init__(self, *, cache: bool = True) -> None:
        self._nodes: dict[str, _Node] = {}
        self._keys: dict[str, PodAllocation] = {}
        self._pods: dict[str, _Pod] = {}
        self._cache = cache
        self._shapes: dict[tuple[Any, ...], int] = {}
        # (layout, usage) of nodes -> class number, and per shape the verdict of each class:
        # a shape seen for the first time costs one decision per distinct node state, not per
        # node (a burst of pods of many sizes onto mostly empty nodes).
        self._classes: dict[tuple[Any, ...], int] = {}
        self._class_verdicts: dict[int, dict[int, str | None]] = {}
        self._rejected: dict[str, str] = {}  # rebuild: key -> why it could not be recorded

    # ------------------------------------------------------------------ nodes

    def set_node(self, inventory: NodeInventory) -> None:
        """Add or replace a node's inventory (cards with their ``slicing``). Reservations that
        name the node are re-applied; grants on cards the inventory no longer has are kept as
        reservations but count on no card (see :meth:`problems`). An inventory equal to the
        current one changes nothing."""
        old = self._nodes.get(inventory.node)
        if old is not None and old.inventory == inventory:
            return
        node = _Node(inventory)
        self._nodes[inventory.node] = node
        for pod in self._pods.values():
            if pod.node == inventory.node:
                self._apply(node, {}, pod.fp)
        node.refresh()

    def remove_node(self, name: str) -> None:
        """Forget a node's cards (idempotent). Its reservations stay until released."""
        self._nodes.pop(name, None)

    def __contains__(self, name: object) -> bool:
        """Whether ``name`` is a known node (O(1); :meth:`nodes` sorts)."""
        return name in self._nodes

    def nodes(self) -> list[str]:
        """Names of the known nodes, sorted."""
        return sorted(self._nodes)

    # ------------------------------------------------------------------ decisions

    def filter(self, pod: PodRequest, nodes: Iterable[str] | None = None) -> tuple[list[str], dict[str, str]]:
        """Every node of ``nodes`` (default: all known, sorted) where :meth:`allocate` would
        succeed, in the given order, and for each other node a reason for a person, e.g.
        ``"8 cards, most free memory 2048 MiB < 3000 MiB"`` (no node name, so kube-scheduler can
        group equal reasons; :func:`explain` makes one line for an Event). O(1) per node that
        fails the aggregate pre-checks, O(cards) otherwise; see ``cache``. Raises ``ValueError``
        for an invalid request."""
        needs = _needs(pod)
        feasible: list[str] = []
        reasons: dict[str, str] = {}
        shape = -1
        by_class: dict[int, str | None] | None = None
        if self._cache:
            key = (Policy(pod.gpu_policy), pod.containers)
            if len(self._classes) >= self._CLASSES_MAX:  # grows with usage changes, not shapes
                self._forget_verdicts()
            shape = self._shapes.get(key, -1)
            if shape < 0:
                if len(self._shapes) >= self._SHAPES_MAX:
                    self._forget_verdicts()
                shape = self._shapes[key] = len(self._shapes)
            if not any(n.uuids or n.exclude_uuids for n in needs):
                by_class = self._class_verdicts.setdefault(shape, {})
        classes = self._classes
        for name in self.nodes() if nodes is None else nodes:
            node = self._nodes.get(name)
            if node is None:
                reasons[name] = "no kvgpu inventory for this node (is the agent running there?)"
                continue
            if shape >= 0:
                verdicts = node.verdicts
                if shape in verdicts:
                    why = verdicts[shape]
                else:
                    shared = by_class if node.layout is not None else None
                    k = -1
                    if shared is not None:
                        k = node.klass
                        if k < 0:
                            state = (node.layout, tuple(c.usage() for c in node.cards))
                            k = node.klass = classes.setdefault(state, len(classes))
                    if shared is not None and k in shared:
                        why = shared[k]
                    else:
                        got = decide(node, needs, pod, True)
                        why = got if isinstance(got, str) else None
                        if shared is not None:
                            shared[k] = why
                    verdicts[shape] = why
            else:
                got = decide(node, needs, pod, True)
                why = got if isinstance(got, str) else None
            if why is None:
                feasible.append(name)
            else:
                reasons[name] = why
        return feasible, reasons

    def _forget_verdicts(self) -> None:
        self._shapes.clear()
        self._classes.clear()
        self._class_verdicts.clear()
        for n in self._nodes.values():
            n.verdicts.clear()
            n.klass = -1

    def score(self, pod: PodRequest, nodes: Iterable[str]) -> dict[str, int]:
        """Node scores 0..100 by the pod's ``node_policy`` from the nodes' current use (mean of
        the slots, memory and cores fractions over usable cards): ``binpack`` scores full
        nodes high, ``spread`` empty ones. Unknown nodes score 0. (kube-scheduler's extender
        scores are 0..10: the extender divides by 10.)"""
        get = self._nodes.get
        if Policy(pod.node_policy) == Policy.BINPACK:
            return {name: n.used_pct if (n := get(name)) else 0 for name in nodes}
        return {name: 100 - n.used_pct if (n := get(name)) else 0 for name in nodes}

    def rank(self, pod: PodRequest, nodes: Iterable[str]) -> dict[str, float]:
        """:meth:`score` unrounded, 0.0..1.0 (higher is better), for picking one node: a small
        slice moves a node's rank even where it leaves the whole-percent score unchanged."""
        get = self._nodes.get
        if Policy(pod.node_policy) == Policy.BINPACK:
            return {name: n.util if (n := get(name)) else -1.0 for name in nodes}
        return {name: 1.0 - n.util if (n := get(name)) else -1.0 for name in nodes}

    def card_codes(self, pod: PodRequest, node: str) -> dict[str, tuple[int | None, ...]]:
        """Per container of ``pod``, placed alone on ``node`` as it is now: each card's first
        failing rule (a reason code of :mod:`kvgpu.allocator.fit`, cards in index order) or None
        where the container fits. For explanations (``kubectl vgpu simulate``), not decisions.
        Raises ``KeyError`` for an unknown node, ``ValueError`` for an invalid request."""
        st = self._nodes[node]
        out: dict[str, tuple[int | None, ...]] = {}
        for n in _needs(pod):
            codes: list[int | None] = []
            for c in st.cards:
                code = F.selectable(c, n)
                if code is None:
                    r = F.fit(c, n, None)
                    code = r if isinstance(r, int) else None
                codes.append(code)
            out[n.req.container] = tuple(codes)
        return out

    def allocate(self, pod: PodRequest, node: str) -> PodAllocation:
        """Pick the cards for every container of ``pod`` on ``node`` (by the pod's
        ``gpu_policy``) without reserving them. Raises :class:`AllocationError` with the
        reason when it does not fit, ``ValueError`` for an invalid request."""
        needs = _needs(pod)
        st = self._nodes.get(node)
        if st is None:
            raise AllocationError(f"{node}: no kvgpu inventory for this node")
        placed = decide(st, needs, pod, False)
        if not isinstance(placed, PodAllocation):
            raise AllocationError(f"{pod.key} does not fit on {node}: {placed}")
        return placed

    def bind(self, pod: PodRequest, node: str, key: str | None = None) -> PodAllocation:
        """``allocate`` + ``reserve`` under ``key`` (default: the pod UID), atomically.
        Idempotent: when ``key`` already holds this pod's allocation on ``node``, returns it.
        Raises :class:`AllocationError` (does not fit; key held by another pod or node)."""
        key = pod.uid if key is None else key
        held = self._keys.get(key)
        if held is not None:
            if held.pod_uid == pod.uid and held.node == node:
                return held
            raise AllocationError(
                f"reservation {key!r} is held by pod {held.pod_uid} on {held.node}, "
                f"not pod {pod.uid} on {node}"
            )
        alloc = self.allocate(pod, node)
        self.reserve(key, alloc)
        return alloc

    # ------------------------------------------------------------------ reservations

    def reserve(self, key: str, allocation: PodAllocation, *, force: bool = False) -> None:
        """Record ``allocation`` under ``key``. The same key with an equal allocation is a no-op;
        with a different one, :class:`AllocationError`. Several keys may share a pod UID (one
        per container); they must name the same node and distinct containers.

        Without ``force`` the ledger checks the grants still fit (cards known and usable,
        capacity, exclusivity) and raises :class:`AllocationError` otherwise, leaving the ledger
        unchanged. ``force=True`` (used by :meth:`rebuild`: the claims are the truth) records
        it regardless; over-commitment then shows in :meth:`problems`."""
        old = self._keys.get(key)
        if old is not None:
            if old == allocation:
                return
            raise AllocationError(f"reservation {key!r} already holds a different allocation")
        pod = self._pods.get(allocation.pod_uid)
        if pod is not None and pod.node != allocation.node:
            raise AllocationError(
                f"pod {allocation.pod_uid} is reserved on {pod.node}, not {allocation.node}"
            )
        names = [ca.container for ca in (pod.containers() if pod else [])]
        for ca in allocation.containers:
            if ca.container in names:
                raise AllocationError(
                    f"container {ca.container!r} of pod {allocation.pod_uid} is reserved twice"
                )
            names.append(ca.container)
            uuids = [g.uuid for g in ca.devices]
            if len(set(uuids)) != len(uuids):
                raise AllocationError(f"container {ca.container!r} is granted one card twice")
        new_pod = pod or _Pod(allocation.pod_uid, allocation.node)
        new_fp = footprint([*new_pod.containers(), *allocation.containers])
        node = self._nodes.get(allocation.node)
        if not force:
            if node is None:
                raise AllocationError(f"{allocation.node}: no kvgpu inventory for this node")
            _check(node, new_pod.fp, new_fp)
        if node is not None:
            self._apply(node, new_pod.fp, new_fp)
            node.refresh()
        new_pod.fp = new_fp
        new_pod.keys[key] = allocation
        self._pods[allocation.pod_uid] = new_pod
        self._keys[key] = allocation

    def release(self, key_or_uid: str) -> list[str]:
        """Release a reservation key, or every key of a pod UID. Idempotent; returns the keys
        released (empty when nothing was held)."""
        if key_or_uid in self._keys:
            keys = [key_or_uid]
            pod = self._pods[self._keys[key_or_uid].pod_uid]
        elif key_or_uid in self._pods:
            pod = self._pods[key_or_uid]
            keys = sorted(pod.keys)
        else:
            return []
        for k in keys:
            del pod.keys[k]
            del self._keys[k]
        new_fp = footprint(pod.containers())
        node = self._nodes.get(pod.node)
        if node is not None:
            self._apply(node, pod.fp, new_fp)
            node.refresh()
        pod.fp = new_fp
        if not pod.keys:
            del self._pods[pod.uid]
        return keys

    def reservations(self) -> dict[str, PodAllocation]:
        """All reservations, key → allocation (a copy)."""
        return dict(self._keys)

    def reservation(self, key: str) -> PodAllocation | None:
        """The allocation reserved under ``key``, or None."""
        return self._keys.get(key)

    def pod_keys(self, pod_uid: str) -> list[str]:
        """The reservation keys of a pod, sorted (empty when it holds none). O(its keys)."""
        pod = self._pods.get(pod_uid)
        return sorted(pod.keys) if pod else []

    def pod_node(self, pod_uid: str) -> str | None:
        """The node a pod holds reservations on, or None. O(1)."""
        pod = self._pods.get(pod_uid)
        return pod.node if pod else None

    @classmethod
    def rebuild(
        cls, inventories: Iterable[NodeInventory], reservations: Mapping[str, PodAllocation]
    ) -> Ledger:
        """A ledger from node inventories and the reservations recorded in the VGPUClaims
        (key -> allocation), reserved with ``force=True`` in key order. Never raises for
        contradictory input (a pod on two nodes, a container or a card twice): such a key is
        left out and named by :meth:`problems`, so start-up is not blocked by one bad claim."""
        led = cls()
        for inv in inventories:
            led.set_node(inv)
        for key in sorted(reservations):
            try:
                led.reserve(key, reservations[key], force=True)
            except AllocationError as e:
                led._rejected[key] = str(e)
        return led

    # ------------------------------------------------------------------ views

    def snapshot(self) -> LedgerSnapshot:
        """The ledger's state as a comparable value."""
        nodes = tuple(
            (
                name,
                n.inventory,
                tuple((c.uuid, c.slots, c.mem, c.cores, c.excl, c.pods) for c in n.cards),
            )
            for name, n in sorted(self._nodes.items())
        )
        return LedgerSnapshot(nodes, tuple(sorted(self._keys.items())))

    def node_usage(self, name: str) -> NodeUsage:
        """A node's usage. Raises ``KeyError`` for an unknown node."""
        n = self._nodes[name]
        cards = tuple(
            CardUsage(
                uuid=c.uuid,
                index=c.index,
                model=c.model,
                pool=c.pool,
                mode=c.mode,
                usable=c.unusable is None,
                reason="" if c.unusable is None else F.PHRASES[c.unusable],
                slots_used=c.slots,
                slots_total=c.slots_total,
                memory_used_mib=c.mem,
                memory_total_mib=c.mem_total,
                cores_used=c.cores,
                cores_total=c.cores_total,
                pods=c.pods,
                exclusive=c.excl > 0,
                dra=c.unusable == F.DRA,
            )
            for c in n.cards
        )
        u = [c for c in cards if c.usable]
        return NodeUsage(
            node=name,
            cards=cards,
            slots_used=sum(c.slots_used for c in u),
            slots_total=sum(c.slots_total for c in u),
            memory_used_mib=sum(c.memory_used_mib for c in u),
            memory_total_mib=sum(c.memory_total_mib for c in u),
            cores_used=sum(c.cores_used for c in u),
            cores_total=sum(c.cores_total for c in u),
        )

    def usage(self, names: Iterable[str] | None = None) -> dict[str, NodeUsage]:
        """The usage of ``names`` (default: every node), by name, in the order given (sorted by
        default). Raises ``KeyError`` for an unknown node."""
        return {name: self.node_usage(name) for name in (self.nodes() if names is None else names)}

    def over_nodes(self) -> list[str]:
        """The nodes (sorted) with a usable card that holds more slots, memory or cores than it
        has now (a pool shrunk under live claims): the only ones whose :meth:`usage` can show
        an over-full card. O(cards), without building a :class:`NodeUsage` per node."""
        return [name for name in self.nodes() if any(
            c.unusable is None and (c.slots > c.slots_total or c.mem > c.mem_total or c.cores > c.cores_total)
            for c in self._nodes[name].cards)]

    def pool_usage(self) -> dict[str, PoolUsage]:
        """Totals per pool over usable cards, by pool name (sorted)."""
        acc: dict[str, list[Any]] = {}
        for name in self.nodes():
            for c in self._nodes[name].cards:
                if c.unusable is not None and c.unusable != F.DRA:
                    continue
                a = acc.setdefault(c.pool, [set(), 0, 0, 0, 0, 0, 0, 0])
                a[0].add(name)
                a[1] += 1
                a[2] += c.slots
                a[3] += c.slots_total
                a[4] += c.mem
                a[5] += c.mem_total
                a[6] += c.cores
                a[7] += c.cores_total
        return {p: PoolUsage(p, len(a[0]), *a[1:]) for p, a in sorted(acc.items())}

    def problems(self) -> list[str]:
        """What forced reservations left inconsistent, for a person: cards over capacity or
        shared despite an exclusive slice, grants on unknown nodes or cards, reservations
        :meth:`rebuild` left out. Empty when the ledger is consistent."""
        out = [f"reservation {k!r} left out: {why}" for k, why in sorted(self._rejected.items())]
        for name in self.nodes():
            for c in self._nodes[name].cards:
                over = []
                if c.slots > c.slots_total:
                    over.append(f"slots {c.slots}/{c.slots_total}")
                if c.mem > c.mem_total:
                    over.append(f"memory {c.mem}/{c.mem_total} MiB")
                if c.cores > c.cores_total:
                    over.append(f"cores {c.cores}/{c.cores_total} %")
                if c.excl and c.pods > 1:
                    over.append(f"exclusive but shared by {c.pods} pods")
                if c.pods and c.unusable is not None and c.unusable != F.DRA:
                    over.append(f"has slices but is {F.PHRASES[c.unusable]}")
                if over:
                    out.append(f"{name} card {c.index} ({c.uuid}): " + ", ".join(over))
        for uid, pod in sorted(self._pods.items()):
            node = self._nodes.get(pod.node)
            if node is None:
                out.append(f"pod {uid}: reserved on unknown node {pod.node}")
                continue
            missing = sorted(u for u in pod.fp if u not in node.by_uuid)
            if missing:
                out.append(f"pod {uid}: granted cards {', '.join(missing)} that {pod.node} does not have")
        return out

    # ------------------------------------------------------------------ internals

    def _apply(self, node: _Node, old: dict[str, Footprint], new: dict[str, Footprint]) -> None:
        for uuid in old.keys() | new.keys():
            c = node.by_uuid.get(uuid)
            if c is None:
                continue
            o = old.get(uuid)
            n = new.get(uuid)
            if o is not None:
                c.slots -= o[0]
                c.mem -= o[1]
                c.cores -= o[2]
                c.excl -= o[3]
                c.pods -= 1
            if n is not None:
                c.slots += n[0]
                c.mem += n[1]
                c.cores += n[2]
                c.excl += n[3]
                c.pods += 1
