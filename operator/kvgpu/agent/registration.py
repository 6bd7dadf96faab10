"""Publish the node's inventory annotation (``kvgpu.io/inventory``), only when it changed.

One :meth:`Registrar.refresh` = discovery (NVML or simulated) → health applied (healthy/reason
per card) → each card's effective slicing from the VGPUPools that cover it (using the node's
labels) → canonical JSON compared with the annotation **on the Node object** (not an in-process
cache, so a restarted agent does not patch an unchanged inventory, and an annotation edited or
removed by someone else is repaired at the next refresh) → merge-patch only on difference.

If discovery fails after a success (e.g. a card fell off the bus and NVML enumeration errors),
the last good card list is kept with the current health applied, so the broken card is published
as unhealthy instead of the inventory going stale or vanishing.

:meth:`Registrar.run` refreshes every ``interval_s`` and at once after :meth:`Registrar.kick`
(health change, pool change).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from kvgpu import faults
from kvgpu.core import keys
from kvgpu.core.inventory import Card, NodeInventory, Slicing

from .discovery import Discovery, DiscoveryError
from .health import HealthState
from .kube import NodeApi

log = logging.getLogger(__name__)


def _fallback_slicing(pool: Mapping[str, Any], labels: Mapping[str, str], card: Card) -> Slicing | None:
    spec = pool.get("spec") or {}
    sel = (spec.get("nodeSelector") or {}).get("matchLabels") or {}
    if any(labels.get(k) != v for k, v in sel.items()):
        return None
    mode = str(spec.get("mode", "hami-core"))
    return Slicing(
        pool=str((pool.get("metadata") or {}).get("name", "")),
        split_count=1 if mode == "exclusive" else min(int(spec.get("splitCount", 10)), 48 if mode == "mps" else 100),
        memory_scaling=float(spec.get("memoryScaling", 1.0)),
        core_scaling=float(spec.get("coreScaling", 1.0)),
        mode=mode,
        allocation=str(spec.get("allocation", "extender")),
    )


def pool_slicing(
    pools: Iterable[Mapping[str, Any]], labels: Mapping[str, str], cards: Iterable[Card]
) -> dict[str, Slicing | None]:
    """``{card uuid: Slicing | None}`` from VGPUPool API objects (invalid pools are skipped, logged).

    Uses :func:`kvgpu.api.pools.effective_slicing` (most specific pool wins); falls back to a
    matchLabels-only rule if that module is unavailable.
    """
    cards = list(cards)
    try:
        from kvgpu.api.pools import as_pool, effective_slicing
    except ImportError:  # pragma: no cover - only before the api package exists
        plist = list(pools)
        out: dict[str, Slicing | None] = {}
        for c in cards:
            matches = [s for p in plist if (s := _fallback_slicing(p, labels, c)) is not None]
            out[c.uuid] = sorted(matches, key=lambda s: s.pool)[0] if matches else None
        return out
    valid = []
    for p in pools:
        try:
            valid.append(as_pool(p))
        except Exception as e:  # pydantic.ValidationError: the webhook/CRD should have refused it
            log.warning("ignoring invalid VGPUPool %s: %s", (p.get("metadata") or {}).get("name"), e)
    return {c.uuid: effective_slicing(valid, labels, c) for c in cards}


class Registrar:
    """Keeps the node's inventory annotation equal to what this agent sees.

    ``health`` (optional) supplies healthy/reason per card; ``label_node`` also sets the
    ``kvgpu.io/gpu-node=true`` label when missing; ``extra`` (optional, called in a thread each
    refresh) gives more annotations kept equal the same way, e.g. ``kvgpu.io/shim``
    (:mod:`kvgpu.agent.shimcheck`). Counters: ``patches`` (inventory writes), ``refreshes``.
    """

    def __init__(
        self,
        node: str,
        api: NodeApi,
        discovery: Discovery,
        health: HealthState | None = None,
        label_node: bool = True,
        extra: Callable[[], dict[str, str]] | None = None,
    ) -> None:
        self.node = node
        self.extra = extra
        self.api = api
        self.discovery = discovery
        self.health = health
        self.label_node = label_node
        self.inventory: NodeInventory | None = None
        self.last_raw: NodeInventory | None = None
        self.patches = 0
        self.refreshes = 0
        self._lock = asyncio.Lock()
        self._kick = asyncio.Event()
        self.faults = faults.FaultLog(log, every_s=300.0)

    def kick(self) -> None:
        """Ask :meth:`run` to refresh now."""
        self._kick.set()

    async def _discover(self) -> NodeInventory:
        try:
            raw = await asyncio.to_thread(self.discovery.discover)
        except DiscoveryError:
            if self.last_raw is None:
                raise
            log.exception("discovery failed; publishing the last known cards with current health")
            return self.last_raw
        self.last_raw = raw
        return raw

    async def refresh(self) -> tuple[NodeInventory, bool]:
        """Compute the inventory and patch the annotation if it differs. Returns (inventory, patched).

        Raises :class:`~kvgpu.agent.discovery.DiscoveryError` when discovery never succeeded, and
        Kubernetes API errors as they come.
        """
        async with self._lock:
            raw = await self._discover()
            if self.health is not None:
                self.health.set_cards(c.uuid for c in raw.cards)
                raw = self.health.apply(raw)
            node = await self.api.get_node(self.node)
            meta = node.get("metadata") or {}
            labels = dict(meta.get("labels") or {})
            pools = await self.api.list_pools()
            inv = raw.with_slicing(pool_slicing(pools, labels, raw.cards))
            text = inv.dumps()
            have = meta.get("annotations") or {}
            current = have.get(keys.NODE_INVENTORY)
            patched = False
            want_label = self.label_node and labels.get(keys.NODE_LABEL_GPU) != "true"
            extra = await asyncio.to_thread(self.extra) if self.extra is not None else {}
            changes: dict[str, str | None] = {k: v for k, v in extra.items() if have.get(k) != v}
            if current != text:
                changes[keys.NODE_INVENTORY] = text
            if changes or want_label:
                await self.api.patch_node_metadata(
                    self.node, changes, {keys.NODE_LABEL_GPU: "true"} if want_label else None
                )
                patched = current != text
                if patched:
                    self.patches += 1
                    log.info("published inventory of %s: %d cards", self.node, len(inv.cards))
                    first = self.inventory is None and current is None
                    if first or self._cards_changed(current, inv):
                        await self.api.node_event(
                            self.node,
                            "GPUInventoryChanged",
                            f"{len(inv.cards)} card(s): "
                            + ", ".join(f"{c.index}:{c.model}:{c.uuid}" for c in inv.cards)[:900],
                        )
            self.inventory = inv
            self.refreshes += 1
            return inv, patched

    @staticmethod
    def _cards_changed(old_text: str | None, inv: NodeInventory) -> bool:
        if not old_text:
            return True
        try:
            old = NodeInventory.loads(old_text)
        except ValueError:
            return True
        return [c.uuid for c in old.cards] != [c.uuid for c in inv.cards]

    async def run(
        self,
        interval_s: float = 30.0,
        on_inventory: Callable[[NodeInventory], Awaitable[None]] | None = None,
        retry_s: float = 5.0,
    ) -> None:
        """Refresh forever (until cancelled); ``on_inventory`` gets every computed inventory.

        An expected fault (the API server away, this node deleted: 404) is one warning line,
        repeated at most every 5 minutes, and the retries back off from ``retry_s`` to
        ``interval_s``; a kick (the node watch sees the node again) retries at once. Other
        errors keep their traceback."""
        backoff = retry_s
        while True:
            self._kick.clear()
            wait = interval_s
            try:
                inv, _ = await self.refresh()
                if on_inventory is not None:
                    await on_inventory(inv)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                why = faults.expected(e)
                if why is None:
                    log.exception("inventory refresh of %s failed", self.node)
                    wait = min(interval_s, retry_s)
                else:
                    if getattr(e, "status", None) == 404:
                        why = f"node {self.node} or the VGPUPool API is not found (node deleted?): {why}"
                    self.faults.fault("refresh", f"inventory refresh of {self.node} failed; retrying "
                                      f"(back-off up to {max(interval_s, retry_s):.0f} s)", why)
                    wait = min(interval_s, backoff)
                    backoff = min(backoff * 2, max(interval_s, retry_s))
            else:
                backoff = retry_s
                self.faults.ok("refresh", f"inventory refresh of {self.node}")
            try:
                await asyncio.wait_for(self._kick.wait(), wait)
            except TimeoutError:
                pass
