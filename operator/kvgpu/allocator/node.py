"""A node as the ledger holds it (:class:`_Node`: its cards and the O(1) pre-filter
aggregates) and a pod's reservations (:class:`_Pod`). Its verdict on a pod is
:func:`kvgpu.allocator.placement.decide`. Pure, no I/O."""

from __future__ import annotations

from typing import Any

from kvgpu.allocator import fit as F
from kvgpu.allocator.fit import CardState, Need
from kvgpu.allocator.usage import Footprint
from kvgpu.core.inventory import NodeInventory
from kvgpu.core.requests import (
    ContainerAllocation,
    PodAllocation,
)


def _cards(k: int) -> str:
    return "1 card" if k == 1 else f"{k} cards"


def _unusable_phrase(code: int, k: int) -> str:
    """``k`` cards unusable for ``code``, for a reason: ``2 unhealthy``, ``2 cards in DRA pools``."""
    if code == F.DRA:
        return f"{_cards(k)} in {'a DRA pool' if k == 1 else 'DRA pools'} (kube-scheduler allocates them)"
    return f"{k} {F.PHRASES[code]}"


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
        self.unusable = ", ".join(_unusable_phrase(code, k) for code, k in sorted(counts.items()))
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
            return f"{self.have} usable < {n.cards} requested" + (f" ({self.unusable})" if self.unusable else "")
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
