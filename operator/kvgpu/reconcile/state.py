"""The operator's in-memory state: the ledger plus what it is built from. Pure (no I/O).

Sources: Node objects (the agent's ``kvgpu.io/inventory`` annotation and the node's labels),
VGPUPools (slicing per card, request defaults) and VGPUClaims (the durable reservations).
Every mutation keeps the ledger consistent with them; the Kopf handlers and the extender call
these methods without awaiting in between, so the single asyncio thread serialises them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvgpu.allocator.ledger import Ledger
from kvgpu.allocator.quota import QuotaBook, pod_usage, request_floor
from kvgpu.api.models import VGPUPool, VGPUPoolSpec
from kvgpu.api.pools import effective_slicing
from kvgpu.core import keys
from kvgpu.core.inventory import NodeInventory
from kvgpu.core.requests import ContainerAllocation, DeviceGrant, PodAllocation, PodRequest


def invalid_reason(e: ValueError) -> str:
    """A model's refusal of an object for people: ``spec.defaults: ...; spec.splitCount: ...``."""
    from pydantic import ValidationError

    if not isinstance(e, ValidationError):
        return str(e)
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if not str(x).startswith("function-"))
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def claim_key(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


#: The prefix of the ledger's pod UID for a claim mirrored from a DRA ResourceClaim: such a slice
#: is the ResourceClaim's (several pods may share one, a pod may have several), so it is
#: reserved apart from any pod's extender reservations, which it can neither join nor free.
RESOURCE_CLAIM_HOLDER = "resourceclaim:"


def is_mirror(claim: dict[str, Any]) -> bool:
    """Whether a VGPUClaim dict is mirrored from a DRA ResourceClaim (``spec.resourceClaim``)."""
    return bool((claim.get("spec") or {}).get("resourceClaim"))


def allocation_from_claim(claim: dict[str, Any]) -> tuple[str, PodAllocation]:
    """``(ledger key, allocation)`` recorded by a VGPUClaim dict; a mirrored claim's allocation
    is held by ``resourceclaim:<its UID>``, not by the pod. Raises ``KeyError``/``ValueError``
    for a malformed claim."""
    meta, spec = claim["metadata"], claim["spec"]
    devices = tuple(
        DeviceGrant(str(d["uuid"]), int(d["index"]), str(d["model"]), int(d["memory"]), int(d["cores"]))
        for d in spec["devices"]
    )
    ca = ContainerAllocation(
        str(spec["container"]), devices, int(spec.get("priority", 1)), bool(spec.get("init", False))
    )
    rc = spec.get("resourceClaim")
    holder = RESOURCE_CLAIM_HOLDER + str(rc["uid"]) if rc else str(spec["podUID"])
    return claim_key(meta["namespace"], meta["name"]), PodAllocation(holder, str(spec["node"]), (ca,))


@dataclass
class NodeRecord:
    name: str
    labels: dict[str, str]
    raw_inventory: str
    inventory: NodeInventory | None
    error: str = ""


@dataclass
class OperatorState:
    ledger: Ledger = field(default_factory=Ledger)
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    pools: dict[str, VGPUPool] = field(default_factory=dict)
    # pending kvgpu pods not yet bound: uid -> (namespace, name)
    pending: dict[str, tuple[str, str]] = field(default_factory=dict)
    # nodes whose allocations changed since the last flush (their metrics are refreshed)
    dirty_nodes: set[str] = field(default_factory=set)
    # each node's inventory with the slicing of its cards, as given to the ledger
    sliced: dict[str, NodeInventory] = field(default_factory=dict)
    topology_dirty: bool = True  # nodes' cards or pools changed: pool coverage must be recomputed
    # ledger key -> UID of the claim object that holds it (set by bind, the rebuild and the
    # drift repair): an event about another object under the same name frees nothing
    claim_uids: dict[str, str] = field(default_factory=dict)
    ready: bool = False
    # node -> what its pods' scheduling failures add when equally specific pools conflict there
    conflict_notes: dict[str, str] = field(default_factory=dict)
    # namespace quotas and each pod's usage, kept in step with the ledger's reservations
    quotas: QuotaBook = field(default_factory=QuotaBook)
    # pools the model refuses (valid for the CRD's schema only): name -> (metadata, why). They
    # slice no cards; the status writer gives them Ready=False, reason InvalidSpec.
    invalid_pools: dict[str, tuple[dict[str, Any], str]] = field(default_factory=dict)

    # ----- pools -------------------------------------------------------------------------------
    def default_pool_spec(self) -> VGPUPoolSpec | None:
        """Request defaults for pods: the pool named ``default``, else the only pool, else HAMi's."""
        if "default" in self.pools:
            return self.pools["default"].spec
        if len(self.pools) == 1:
            return next(iter(self.pools.values())).spec
        return None

    def set_pool(self, body: dict[str, Any]) -> bool:
        """Add or update a pool; re-slice the cards only when its spec changed (a status write
        must not cost a pass over every node). Returns True when the spec changed.

        A pool the model refuses raises ``ValueError`` (the reason, field by field) after it is
        recorded in :attr:`invalid_pools` and taken out of :attr:`pools`: it slices no cards
        until it is fixed, as after a restart; running claims are not touched."""
        try:
            pool = VGPUPool.model_validate(body)
        except ValueError as e:
            name = str((body.get("metadata") or {}).get("name", ""))
            why = invalid_reason(e)
            self.invalid_pools[name] = (dict(body.get("metadata") or {}), why)
            if self.pools.pop(name, None) is not None:
                self.topology_dirty = True
                self._reslice_all()
            raise ValueError(why) from e
        self.invalid_pools.pop(pool.name, None)
        old = self.pools.get(pool.name)
        self.pools[pool.name] = pool
        if old is not None and old.spec == pool.spec:
            return False
        self.topology_dirty = True
        self._reslice_all()
        return True

    def remove_pool(self, name: str) -> None:
        self.invalid_pools.pop(name, None)
        self.topology_dirty = True
        if self.pools.pop(name, None) is not None:
            self._reslice_all()

    # ----- nodes -------------------------------------------------------------------------------
    def set_node(self, body: dict[str, Any]) -> bool:
        """Update from a Node dict. Returns True when the node's GPU view changed."""
        meta = body.get("metadata", {})
        name = meta["name"]
        raw = (meta.get("annotations") or {}).get(keys.NODE_INVENTORY, "")
        labels = dict(meta.get("labels") or {})
        old = self.nodes.get(name)
        if old is not None and old.raw_inventory == raw and old.labels == labels:
            return False
        if not raw:
            self.remove_node(name)
            return old is not None
        try:
            inv = NodeInventory.loads(raw)
            rec = NodeRecord(name, labels, raw, inv)
        except ValueError as e:
            rec = NodeRecord(name, labels, raw, None, f"unreadable inventory annotation: {e}")
        self.nodes[name] = rec
        self._apply_node(rec)
        return True

    def remove_node(self, name: str) -> None:
        self.topology_dirty = True
        self.dirty_nodes.add(name)  # so the flush drops its metrics
        self.nodes.pop(name, None)
        self.sliced.pop(name, None)
        self.ledger.remove_node(name)

    def _apply_node(self, rec: NodeRecord) -> None:
        if rec.inventory is None:
            self.sliced.pop(rec.name, None)
            self.ledger.remove_node(rec.name)
            return
        pools = list(self.pools.values())
        cards = tuple(
            replace(c, slicing=effective_slicing(pools, rec.labels, c)) for c in rec.inventory.cards
        )
        inv = replace(rec.inventory, node=rec.name, cards=cards)
        self.sliced[rec.name] = inv
        self.ledger.set_node(inv)
        self.dirty_nodes.add(rec.name)
        self.topology_dirty = True

    def _reslice_all(self) -> None:
        for rec in self.nodes.values():
            self._apply_node(rec)

    # ----- claims ------------------------------------------------------------------------------
    def rebuild(
        self, nodes: list[dict[str, Any]], pools: list[dict[str, Any]], claims: list[dict[str, Any]]
    ) -> list[str]:
        """Rebuild everything from listed objects (start-up). Returns problems for the log."""
        problems: list[str] = []
        self.nodes.clear()
        self.sliced.clear()
        self.pools.clear()
        self.invalid_pools.clear()
        self.claim_uids.clear()
        self.ledger = Ledger()
        for p in pools:
            try:
                pool = VGPUPool.model_validate(p)
                self.pools[pool.name] = pool
            except ValueError as e:
                name = str((p.get("metadata") or {}).get("name", ""))
                self.invalid_pools[name] = (dict(p.get("metadata") or {}), invalid_reason(e))
                problems.append(f"VGPUPool {name}: {invalid_reason(e)}")
        for n in nodes:
            self.set_node(n)
        reservations: dict[str, PodAllocation] = {}
        for c in claims:
            if (c.get("status") or {}).get("phase") in ("Released", "Failed"):
                continue
            try:
                k, a = allocation_from_claim(c)
                reservations[k] = a
                if uid := (c.get("metadata") or {}).get("uid"):
                    self.claim_uids[k] = str(uid)
            except (KeyError, ValueError, TypeError) as e:
                problems.append(f"VGPUClaim {c.get('metadata', {}).get('name')}: {e!r}")
        self.ledger = Ledger.rebuild(list(self.sliced.values()), reservations)
        self.quotas.clear_pods()
        for key, alloc in sorted(self.ledger.reservations().items()):
            self._track_quota(alloc.pod_uid, key)
        self.dirty_nodes.update(self.nodes)
        return problems

    def ledger_inventory(self, node: str) -> NodeInventory | None:
        """The node's inventory with each card's slicing, exactly as the ledger has it."""
        return self.sliced.get(node)

    def pool_of(self, node: str, uuid: str) -> str:
        """The VGPUPool that slices card ``uuid`` of ``node`` ("" when none does)."""
        inv = self.sliced.get(node)
        card = next((c for c in (inv.cards if inv else ()) if c.uuid == uuid), None)
        return card.slicing.pool if card is not None and card.slicing is not None else ""

    def reserve(self, key: str, allocation: PodAllocation, *, force: bool = False) -> None:
        """Reserve in the ledger (raises ``AllocationError`` unless ``force``)."""
        self.ledger.reserve(key, allocation, force=force)
        self.dirty_nodes.add(allocation.node)
        self._track_quota(allocation.pod_uid, key)

    def release_pod(self, uid: str) -> list[str]:
        """Release every reservation of a pod (idempotent). Returns the released keys."""
        node = self.ledger.pod_node(uid)
        released = self.ledger.release(uid)
        self.quotas.set_pod(uid, "", None)
        for k in released:
            self.claim_uids.pop(k, None)
        if node is not None:
            self.dirty_nodes.add(node)
        return released

    def release_key(self, key: str) -> None:
        self.claim_uids.pop(key, None)
        alloc = self.ledger.reservation(key)
        self.ledger.release(key)
        if alloc is not None:
            self.dirty_nodes.add(alloc.node)
            self._track_quota(alloc.pod_uid, key)

    def record_claim_uid(self, key: str, uid: str) -> None:
        """The claim object holding ledger key ``key`` is the one with ``uid`` now: events of
        another object under the same name free nothing."""
        self.claim_uids[key] = uid

    # ----- readiness and the flush's bookkeeping ----------------------------------------------
    def mark_ready(self) -> None:
        """The ledger is rebuilt from the claims (and the quotas loaded): the extender answers."""
        self.ready = True

    def mark_not_ready(self) -> None:
        """Leadership lost: the extender answers "not ready" again."""
        self.ready = False

    def take_dirty_nodes(self) -> set[str]:
        """The nodes whose allocations changed since the last call, handed over and forgotten."""
        dirty, self.dirty_nodes = self.dirty_nodes, set()
        return dirty

    def take_topology_change(self) -> bool:
        """Whether nodes' cards or pools changed since the last call (pool coverage and conflicts
        must be recomputed); clears the mark."""
        changed, self.topology_dirty = self.topology_dirty, False
        return changed

    def set_conflict_notes(self, notes: dict[str, str]) -> None:
        """Per node, what its pods' scheduling failures add while equally specific pools
        conflict there (replaces the previous notes)."""
        self.conflict_notes = notes

    # ----- pending pods ------------------------------------------------------------------------
    def add_pending(self, uid: str, namespace: str, name: str) -> None:
        """Pod ``uid`` waits for capacity (requeued when some frees)."""
        self.pending[uid] = (namespace, name)

    def forget_pending(self, uid: str) -> None:
        """Pod ``uid`` waits no more (bound, or gone); idempotent."""
        self.pending.pop(uid, None)

    # ----- quotas (kvgpu.allocator.quota) ------------------------------------------------------
    def _track_quota(self, uid: str, key: str) -> None:
        """Record pod ``uid``'s usage from what the ledger holds for it now (O(its keys)). The
        namespace is the reservation key's (``<namespace>/<claim>``)."""
        held = [self.ledger.reservation(k) for k in self.ledger.pod_keys(uid)]
        containers = [ca for a in held if a is not None for ca in a.containers]
        self.quotas.set_pod(uid, key.partition("/")[0], pod_usage(containers) if containers else None)

    def quota_refusal(self, req: PodRequest) -> str | None:
        """Why ``req`` surely passes a quota of its namespace, from the request alone (a lower
        bound of what it would get: :func:`kvgpu.allocator.quota.request_floor`), or None."""
        return self.quotas.check(req.namespace, request_floor(req.containers), req.uid)

    def check_quota(self, namespace: str, allocation: PodAllocation) -> None:
        """Raise :class:`kvgpu.allocator.quota.QuotaExceeded` when the pod holding
        ``allocation`` (besides what it holds already) would pass a quota of ``namespace``. Call
        it between ``ledger.allocate`` and :meth:`reserve` with no ``await`` in between."""
        uid = allocation.pod_uid
        held = [self.ledger.reservation(k) for k in self.ledger.pod_keys(uid)]
        containers = [ca for a in held if a is not None for ca in a.containers]
        self.quotas.require(namespace, pod_usage([*containers, *allocation.containers]), uid)
