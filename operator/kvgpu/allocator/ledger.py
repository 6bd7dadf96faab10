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
from dataclasses import dataclass
from typing import Any

from kvgpu.allocator import fit as F
from kvgpu.allocator.fit import CardState, Need, need
from kvgpu.core.inventory import NodeInventory
from kvgpu.core.requests import (
    ContainerAllocation,
    DeviceGrant,
    PodAllocation,
    PodRequest,
    Policy,
)


class AllocationError(RuntimeError):
    """A pod does not fit (any more) on a node, or a reservation conflicts with the ledger.
    The message is written for a person."""


# A pod's footprint on one card: (slots, MiB, cores, exclusive 0|1).
Footprint = tuple[int, int, int, int]


def footprint(containers: Iterable[ContainerAllocation]) -> dict[str, Footprint]:
    """Collapse a pod's container grants into its per-card footprint (see the module doc)."""
    app: dict[str, list[int]] = {}
    init: dict[str, list[int]] = {}
    for ca in containers:
        for g in ca.devices:
            ex = 1 if g.cores >= 100 else 0
            if ca.init:
                f = init.setdefault(g.uuid, [1, 0, 0, 0])
                f[1] = max(f[1], g.memory_mib)
                f[2] = max(f[2], g.cores)
                f[3] |= ex
            else:
                f = app.setdefault(g.uuid, [0, 0, 0, 0])
                f[0] += 1
                f[1] += g.memory_mib
                f[2] += g.cores
                f[3] |= ex
    out: dict[str, Footprint] = {}
    for uuid in sorted(app.keys() | init.keys()):
        a = app.get(uuid, [0, 0, 0, 0])
        i = init.get(uuid, [0, 0, 0, 0])
        out[uuid] = (max(a[0], i[0]), max(a[1], i[1]), max(a[2], i[2]), a[3] | i[3])
    return out


@dataclass(frozen=True, slots=True)
class CardUsage:
    """One card's capacity and use. Memory in (virtual) MiB, cores in percent of SMs."""

    uuid: str
    index: int
    model: str
    pool: str  # "" when no VGPUPool covers the card
    mode: str
    usable: bool
    reason: str  # why the card takes no slices ("" when usable)
    slots_used: int
    slots_total: int
    memory_used_mib: int
    memory_total_mib: int
    cores_used: int
    cores_total: int
    pods: int  # pods with a slice on the card
    exclusive: bool  # held by a slice with cores 100

    def to_json(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "index": self.index,
            "model": self.model,
            "pool": self.pool,
            "usable": self.usable,
            "reason": self.reason,
            "slots": [self.slots_used, self.slots_total],
            "memoryMiB": [self.memory_used_mib, self.memory_total_mib],
            "cores": [self.cores_used, self.cores_total],
            "pods": self.pods,
            "exclusive": self.exclusive,
        }


@dataclass(frozen=True, slots=True)
class NodeUsage:
    """A node's cards and totals over its *usable* cards (for the node annotation, the
    VGPUPool status and ``kubectl vgpu nodes``)."""

    node: str
    cards: tuple[CardUsage, ...]
    slots_used: int
    slots_total: int
    memory_used_mib: int
    memory_total_mib: int
    cores_used: int
    cores_total: int

    def to_json(self) -> dict[str, Any]:
        """Compact JSON form (``[used, total]`` pairs), e.g. for the ``kvgpu.io/allocation``
        node annotation: about 200 bytes per card."""
        return {
            "version": 1,
            "node": self.node,
            "slots": [self.slots_used, self.slots_total],
            "memoryMiB": [self.memory_used_mib, self.memory_total_mib],
            "cores": [self.cores_used, self.cores_total],
            "cards": [c.to_json() for c in self.cards],
        }


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """Totals over the usable cards a pool covers (for ``VGPUPool.status``)."""

    pool: str
    nodes: int
    cards: int
    slots_used: int
    slots_total: int
    memory_used_mib: int
    memory_total_mib: int
    cores_used: int
    cores_total: int


@dataclass(frozen=True, slots=True)
class LedgerSnapshot:
    """Everything that defines a ledger's state; compare with ``==``.

    ``nodes``: sorted ``(node, inventory, ((uuid, slots, MiB, cores, exclusive pods, pods), ...))``;
    ``reservations``: sorted ``(key, PodAllocation)``.
    """

    nodes: tuple[tuple[str, NodeInventory, tuple[tuple[str, int, int, int, int, int], ...]], ...]
    reservations: tuple[tuple[str, PodAllocation], ...]


class _Node:
    __slots__ = (
        "by_uuid",
        "cards",
        "have",
        "inventory",
        "klass",
        "layout",
        "max_free_cores",
        "max_free_mem",
        "max_free_pct",
        "model_names",
        "models",
        "n_full_mem",
        "n_held",
        "n_idle",
        "n_open",
        "n_usable",
        "name",
        "over_note",
        "unusable",
        "used_pct",
        "util",
        "verdicts",
    )

    def __init__(self, inv: NodeInventory) -> None:
        self.name = inv.node
        self.inventory = inv
        self.cards = tuple(sorted((CardState(c) for c in inv.cards), key=lambda c: (c.index, c.uuid)))
        self.by_uuid = {c.uuid: c for c in self.cards}
        usable = [c for c in self.cards if c.unusable is None]
        self.n_usable = len(usable)
        self.have = _cards(self.n_usable)  # "8 cards", for reasons
        self.models = tuple(sorted({c.model_l for c in usable}))
        self.model_names = ", ".join(sorted({c.model for c in usable}))
        counts: dict[int, int] = {}
        for c in self.cards:
            if c.unusable is not None:
                counts[c.unusable] = counts.get(c.unusable, 0) + 1
        self.unusable = ", ".join(f"{k} {F.PHRASES[code]}" for code, k in sorted(counts.items()))
        # Everything a verdict reads except the cards' UUIDs: nodes with the same layout and
        # the same usage answer every request that names no UUID alike (see Ledger.filter).
        # None when UUIDs repeat (a malformed inventory): placement keys cards by UUID there.
        self.layout: tuple[Any, ...] | None = tuple(
            (c.index, c.model, c.numa, c.pool, c.mode, c.unusable, c.excl_mode, c.slots_total, c.mem_total,
             c.cores_total) for c in self.cards) if len(self.by_uuid) == len(self.cards) else None
        self.refresh()

    def refresh(self) -> None:
        """Recompute the O(1) pre-filter aggregates (O(cards))."""
        n_open = n_idle = n_full = n_held = 0
        over: dict[str, int] = {}
        mfm = mfc = -1
        mfp = -1.0
        su = st = mu = mt = cu = ct = 0
        for c in self.cards:
            if c.unusable is not None:
                continue
            su += c.slots
            st += c.slots_total
            mu += c.mem
            mt += c.mem_total
            cu += c.cores
            ct += c.cores_total
            if c.slots > c.slots_total or c.mem > c.mem_total or c.cores > c.cores_total:
                over[c.pool] = over.get(c.pool, 0) + 1
            if c.excl:
                n_held += 1
                continue
            if c.slots >= c.slots_total:
                continue
            n_open += 1
            if c.pods == 0:
                n_idle += 1
            if c.mem == 0:
                n_full += 1
            free = c.mem_total - c.mem
            if free > mfm:
                mfm = free
            # A percent request p fits iff floor(total*p/100) <= free iff p < (free+1)*100/total.
            p = (free + 1) * 100 / c.mem_total
            if p > mfp:
                mfp = p
            fc = c.cores_total - c.cores
            if fc > mfc:
                mfc = fc
        self.n_open, self.n_idle, self.n_full_mem, self.n_held = n_open, n_idle, n_full, n_held
        # A refusal on a node with cards over their pool's shape says so (FailedScheduling).
        self.over_note = "".join(
            f"; {k} {'card' if k == 1 else 'cards'} over the current shape of VGPUPool {p} "
            "(Overcommitted: no new slices there until enough pods end)" for p, k in sorted(over.items()))
        self.max_free_mem, self.max_free_pct, self.max_free_cores = mfm, mfp, mfc
        parts = [su / st if st else 0.0, mu / mt if mt else 0.0]
        if ct:
            parts.append(cu / ct)
        self.util = sum(parts) / len(parts)
        self.used_pct = min(100, max(0, round(100 * self.util)))
        # Filter verdicts by request shape, valid until the node's usage changes again.
        self.verdicts: dict[int, str | None] = {}
        self.klass = -1  # number of (layout, usage) in Ledger._classes, looked up when filter needs it

    def prefilter(self, n: Need) -> str | None:
        """Necessary conditions from the aggregates, O(1): None, or why the node cannot fit."""
        if self.n_usable < n.cards:
            if self.n_usable == 0:
                total = len(self.cards)
                if total == 0:
                    return "no GPU card"
                return f"no usable card ({self.unusable})"
            return f"{self.have} usable < {n.cards} requested"
        if n.types and not any(t in m for m in self.models for t in n.types):
            return f"no card of type {' or '.join(n.req.types)} (cards here: {self.model_names})"
        have = self.have
        if n.exclusive and self.n_idle < n.cards:
            return f"{have}, {self.n_idle} idle < {n.cards} needed for an exclusive request (cores 100)"
        if n.whole and self.n_full_mem < n.cards:
            return (
                f"{have}, {self.n_full_mem} with all memory free < {n.cards} needed for a whole-card request"
            )
        if self.n_open < n.cards:
            held = f" ({self.n_held} held exclusively)" if self.n_held else ""
            return f"{have}, {self.n_open} with a free slot{held} < {n.cards} needed"
        if n.mem_abs > self.max_free_mem:
            return f"{have}, most free memory {max(0, self.max_free_mem)} MiB < {n.mem_abs} MiB"
        if n.pct and n.pct > self.max_free_pct:
            most = max(0, int(self.max_free_pct) - 1) if self.max_free_pct > 0 else 0
            return f"{have}, most free memory about {most} % < {n.pct} %"
        if n.cores > self.max_free_cores:
            return f"{have}, most free cores {max(0, self.max_free_cores)} % < {n.cores} %"
        return None

    def decide(self, needs: list[Need], pod: PodRequest, fast: bool) -> PodAllocation | str | None:
        """The pod's placement on this node, or why it does not fit. With ``fast`` a
        single-container pod that fits gives ``None`` (feasible, cards not chosen)."""
        got = self._decide(needs, pod, fast)
        return got + self.over_note if isinstance(got, str) else got

    def _decide(self, needs: list[Need], pod: PodRequest, fast: bool) -> PodAllocation | str | None:
        many = len(needs) > 1
        for n in needs:
            why = self.prefilter(n)
            if why is not None:
                return f"container {n.req.container!r}: {why}" if many else why
        if fast:
            if len(needs) == 1:
                return _scan(self, needs[0])  # exactly _place's verdict and reason
            if _surely_fits(self, needs):
                return None
        return _place(self, pod, needs)


class _Pod:
    __slots__ = ("fp", "keys", "node", "uid")

    def __init__(self, uid: str, node: str) -> None:
        self.uid = uid
        self.node = node
        self.keys: dict[str, PodAllocation] = {}
        self.fp: dict[str, Footprint] = {}

    def containers(self) -> list[ContainerAllocation]:
        return [ca for k in sorted(self.keys) for ca in self.keys[k].containers]


_Pick = tuple[CardState, int, int]  # card, MiB, cores


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
                        got = node.decide(needs, pod, True)
                        why = got if isinstance(got, str) else None
                        if shared is not None:
                            shared[k] = why
                    verdicts[shape] = why
            else:
                got = node.decide(needs, pod, True)
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
        placed = st.decide(needs, pod, False)
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

    def usage(self) -> dict[str, NodeUsage]:
        """Every node's usage, by name (sorted)."""
        return {name: self.node_usage(name) for name in self.nodes()}

    def pool_usage(self) -> dict[str, PoolUsage]:
        """Totals per pool over usable cards, by pool name (sorted)."""
        acc: dict[str, list[Any]] = {}
        for name in self.nodes():
            for c in self._nodes[name].cards:
                if c.unusable is not None:
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
                if c.pods and c.unusable is not None:
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


# ---------------------------------------------------------------------- helpers


def _place(node: _Node, pod: PodRequest, needs: list[Need]) -> PodAllocation | str:
    """Greedy placement of the whole pod; the allocation, or why it does not fit."""
    policy = Policy(pod.gpu_policy)
    extra: dict[str, list[int]] = {}  # this pod's app slices so far, per card
    grants: dict[int, tuple[_Pick, ...]] = {}
    many = len(needs) > 1
    for i, n in enumerate(needs):
        if n.req.init:
            continue
        picks = _pick(node, n, policy, extra, None)
        if isinstance(picks, str):
            return f"container {n.req.container!r}: {picks}" if many else picks
        grants[i] = picks
        for c, mem, cores in picks:
            e = extra.setdefault(c.uuid, [0, 0, 0, 0, 0])
            e[0] += 1
            e[1] += mem
            e[2] += cores
            e[3] = 1 if (e[3] or cores >= 100) else 0
            e[4] = 1
    # Collapsed footprint so far (app sums; init maxima are folded in as they are placed).
    cover: dict[str, list[int]] = {u: [e[0], e[1], e[2], e[3]] for u, e in extra.items()}
    for i, n in enumerate(needs):
        if not n.req.init:
            continue
        picks = _pick(node, n, policy, None, cover)
        if isinstance(picks, str):
            return f"container {n.req.container!r}: {picks}" if many else picks
        grants[i] = picks
        for c, mem, cores in picks:
            f = cover.setdefault(c.uuid, [0, 0, 0, 0])
            f[0] = max(f[0], 1)
            f[1] = max(f[1], mem)
            f[2] = max(f[2], cores)
            f[3] = 1 if (f[3] or cores >= 100) else 0
    return PodAllocation(
        pod_uid=pod.uid,
        node=node.name,
        containers=tuple(
            ContainerAllocation(
                container=n.req.container,
                devices=tuple(
                    DeviceGrant(c.uuid, c.index, c.model, mem, cores, c.mode) for c, mem, cores in grants[i]
                ),
                priority=n.req.priority,
                init=n.req.init,
            )
            for i, n in enumerate(needs)
        ),
    )


def _cards(k: int) -> str:
    return "1 card" if k == 1 else f"{k} cards"


def _needs(pod: PodRequest) -> list[Need]:
    if not pod.containers:
        raise ValueError(f"pod {pod.key} requests no GPU slice")
    names = [c.container for c in pod.containers]
    if len(set(names)) != len(names):
        raise ValueError(f"pod {pod.key}: container names repeat")
    Policy(pod.node_policy)
    Policy(pod.gpu_policy)
    return [need(c) for c in pod.containers]


def _surely_fits(node: _Node, needs: list[Need]) -> bool:
    """Cheap sufficient test that :func:`_place` succeeds (no ordering, no grants built).

    One container: :func:`_enough` is exact. Several: every init container is placed against
    the node without this pod, so :func:`_enough` is exact for each. For the app containers
    (none with ``numa_bind``): if at least ``sum(cards)`` cards each fit every app container
    on their own, the greedy placement cannot fail, since container *k* always finds enough
    cards not touched by containers 1..k-1. Otherwise: unknown (False)."""
    if len(needs) == 1:
        return _enough(node, needs[0])
    apps = [n for n in needs if not n.req.init]
    for n in needs:
        if n.req.init and not _enough(node, n):
            return False
    if not apps:
        return True
    if any(n.req.numa_bind for n in apps):
        return False
    want = sum(n.cards for n in apps)
    k = 0
    for c in node.cards:
        for n in apps:
            if F.selectable(c, n) is not None or type(F.fit(c, n, None)) is not tuple:
                break
        else:
            k += 1
            if k >= want:
                return True
    return False


def _enough(node: _Node, n: Need) -> bool:
    """Single-container fast path: are there ``n.cards`` fitting cards (on one NUMA node when
    ``numa_bind``)? Equivalent to :func:`_pick` succeeding, without ordering."""
    return _scan(node, n) is None


def _scan(node: _Node, n: Need) -> str | None:
    """One pass over the cards for one container placed alone: None as soon as enough cards
    fit, else the same reason :func:`_pick` gives (without scoring any card)."""
    want = n.cards
    fails: list[tuple[int, CardState, list[int] | None]] = []
    selectable, fit = F.selectable, F.fit
    if not n.req.numa_bind:
        k = 0
        for c in node.cards:
            code = selectable(c, n)
            if code is None:
                r = fit(c, n, None)
                if type(r) is tuple:
                    k += 1
                    if k >= want:
                        return None
                    continue
                code = r  # type: ignore[assignment]
            fails.append((code, c, None))  # type: ignore[arg-type]
        return _why(node, n, k, fails, None)
    per: dict[int | None, int] = {}
    for c in node.cards:
        code = selectable(c, n)
        if code is None:
            r = fit(c, n, None)
            if type(r) is tuple:
                k = per.get(c.numa, 0) + 1
                if k >= want:
                    return None
                per[c.numa] = k
                continue
            code = r  # type: ignore[assignment]
        fails.append((code, c, None))  # type: ignore[arg-type]
    return _why(node, n, sum(per.values()), fails, max(per.values(), default=0))


def _pick(
    node: _Node,
    n: Need,
    policy: Policy,
    extra: dict[str, list[int]] | None,
    cover: dict[str, list[int]] | None,
) -> tuple[_Pick, ...] | str:
    """Choose ``n.cards`` distinct cards for one container, or say why not.

    ``extra``: this pod's app slices already placed (app containers); ``cover``: the pod's
    collapsed footprint (init containers, which prefer cards it already covers)."""
    fits: list[tuple[tuple[Any, ...], CardState, int, int]] = []
    fails: list[tuple[int, CardState, list[int] | None]] = []
    for c in node.cards:
        code = F.selectable(c, n)
        ex = extra.get(c.uuid) if extra else None
        if code is None:
            r = F.fit(c, n, ex)
            if type(r) is tuple:
                mem, cores = r
                key: tuple[Any, ...] = F.order_key(policy, F.card_score(c, ex, mem, cores), c)
                if cover is not None:
                    fp = cover.get(c.uuid)
                    covered = fp is not None and fp[1] >= mem and fp[2] >= cores and (fp[3] or cores < 100)
                    key = (0 if covered else 1, *key)
                fits.append((key, c, mem, cores))
                continue
            code = r  # type: ignore[assignment]
        fails.append((code, c, ex))  # type: ignore[arg-type]
    want = n.cards
    if not n.req.numa_bind:
        if len(fits) >= want:
            fits.sort(key=lambda t: t[0])
            return tuple((c, m, k) for _, c, m, k in fits[:want])
        return _why(node, n, len(fits), fails, None)
    groups: dict[int | None, list[tuple[tuple[Any, ...], CardState, int, int]]] = {}
    for t in fits:
        groups.setdefault(t[1].numa, []).append(t)
    best: tuple[Any, ...] | None = None
    chosen = None
    for numa in sorted(groups, key=lambda x: (x is None, x or 0)):
        g = sorted(groups[numa], key=lambda t: t[0])
        if len(g) < want:
            continue
        top = g[:want]
        rank = (tuple(sum(t[0][i] for t in top) for i in range(len(top[0][0]) - 1)),)
        if best is None or rank < best:
            best, chosen = rank, top
    if chosen is not None:
        return tuple((c, m, k) for _, c, m, k in chosen)
    most = max((len(g) for g in groups.values()), default=0)
    return _why(node, n, len(fits), fails, most)


def _why(
    node: _Node,
    n: Need,
    fitting: int,
    fails: list[tuple[int, CardState, list[int] | None]],
    numa_most: int | None,
) -> str:
    counts: dict[int, int] = {}
    most_free = -1
    for code, c, ex in fails:
        counts[code] = counts.get(code, 0) + 1
        if code == F.NO_MEMORY:
            used = c.mem + (ex[1] if ex else 0)
            most_free = max(most_free, c.mem_total - used)
    parts = []
    for code, k in sorted(counts.items()):
        s = f"{k} {F.PHRASES[code]}"
        if code == F.NO_MEMORY:
            s += f" (most free {max(0, most_free)} MiB)"
        parts.append(s)
    if numa_most is not None and fitting >= n.cards:
        parts.append(f"{fitting} fit but at most {numa_most} on one NUMA node")
    fit_txt = f"{fitting} of {len(node.cards)} cards fit"
    return f"needs {n.describe()}: {fit_txt}" + (f"; {', '.join(parts)}" if parts else "")


def explain(reasons: Mapping[str, str], limit: int = 5) -> str:
    """One line for an Event from :meth:`Ledger.filter`'s reasons: ``"node-a: ...; node-b:
    ...; and 12 more nodes"`` (sorted by node name, at most ``limit`` nodes named)."""
    names = sorted(reasons)
    shown = "; ".join(f"{n}: {reasons[n]}" for n in names[:limit])
    rest = len(names) - limit
    return shown + (f"; and {rest} more node{'s' if rest != 1 else ''}" if rest > 0 else "")


def _check(node: _Node, old: dict[str, Footprint], new: dict[str, Footprint]) -> None:
    """Raise :class:`AllocationError` unless replacing ``old`` by ``new`` keeps every card within
    capacity and exclusivity."""
    for uuid in sorted(new):
        c = node.by_uuid.get(uuid)
        if c is None:
            raise AllocationError(f"{node.name}: no card {uuid}")
        if c.unusable is not None:
            raise AllocationError(f"{node.name} card {c.index}: {F.PHRASES[c.unusable]}")
        o = old.get(uuid, (0, 0, 0, 0))
        f = new[uuid]
        others_pods = c.pods - (1 if uuid in old else 0)
        others_excl = c.excl - o[3]
        slots = c.slots - o[0] + f[0]
        mem = c.mem - o[1] + f[1]
        cores = c.cores - o[2] + f[2]
        where = f"{node.name} card {c.index}"
        if slots > c.slots_total:
            raise AllocationError(f"{where}: no free slot ({c.slots_total} slots)")
        if mem > c.mem_total:
            raise AllocationError(f"{where}: memory {mem} MiB > {c.mem_total} MiB")
        if cores > c.cores_total:
            raise AllocationError(f"{where}: cores {cores} % > {c.cores_total} %")
        if others_excl and f:
            raise AllocationError(f"{where}: held exclusively by another pod")
        if (f[3] or c.excl_mode) and others_pods:
            raise AllocationError(f"{where}: an exclusive slice needs the card idle")
