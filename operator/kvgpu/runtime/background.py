"""The main process's background tasks while it leads: flush (VGPUPool status, metrics, the
removal of the node annotation earlier versions wrote), sweep (re-reserve claims the ledger lacks) and the requeue of
pending pods."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from kvgpu import faults, kube
from kvgpu.core import keys
from kvgpu.metrics import MIB
from kvgpu.reconcile import poolstatus
from kvgpu.reconcile.state import allocation_from_claim, is_mirror
from kvgpu.runtime.base import RuntimeBase, log


class Background(RuntimeBase):
    """The loops started by :meth:`kvgpu.runtime.Runtime.startup` and what they write."""

    async def _loop(self, fn: Any, interval: float) -> None:
        while True:
            try:
                if self.active:
                    await fn()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if (why := faults.expected(e)) is None:
                    log.exception("background task failed", task=fn.__name__)
                else:  # the API server away: one line now and then, not a traceback per round
                    self.fault_log.fault(fn.__name__, f"{fn.__name__} failed, retrying", why)
            else:
                self.fault_log.ok(fn.__name__, fn.__name__)
            await asyncio.sleep(interval)

    async def flush(self) -> None:
        """Refresh the per-node metrics of nodes whose allocations changed, write VGPUPool status
        and the VGPUQuotas' usage. Nothing is written per node: a node's use is derived from the
        claims by whoever shows it (the agent's HAMi series, ``kubectl vgpu nodes``)."""
        now = time.monotonic()
        for name in sorted(self.state.take_dirty_nodes()):
            if name not in self.state.nodes:
                self.metrics.forget_node(name)
            if name not in self.state.ledger:
                continue
            self._pool_usage_dirty = True
            cards = self.state.ledger.node_usage(name).cards
            self.metrics.slots_used.labels(name).set(sum(c.slots_used for c in cards))
            self.metrics.slots_total.labels(name).set(sum(c.slots_total for c in cards))
            self.metrics.memory_used.labels(name).set(sum(c.memory_used_mib for c in cards) * MIB)
            self.metrics.memory_total.labels(name).set(sum(c.memory_total_mib for c in cards) * MIB)
            self.metrics.cores_used.labels(name).set(sum(c.cores_used for c in cards))
        await self._drop_stale_allocation_annotations()
        self.metrics.pending.set(len(self.state.pending))
        # Pool status sums every node and reservation: written at once when a pool, an
        # inventory or the leadership changed, at most every pool_status_interval_s for
        # allocations alone (a burst would otherwise recompute it every flush, in the loop
        # that answers kube-scheduler).
        if self.pools_dirty or self.state.topology_dirty or (
                self._pool_usage_dirty and now >= self._pool_status_due):
            self.pools_dirty = self._pool_usage_dirty = False
            self._pool_status_due = now + self.cfg.pool_status_interval_s
            try:
                await self.write_pool_status()
            except BaseException:
                self.pools_dirty = True
                raise
        await self.quotas().flush(self.api)  # VGPUQuota status of namespaces whose usage changed

    async def _drop_stale_allocation_annotations(self) -> None:
        """Remove the ``kvgpu.io/allocation`` annotation that earlier versions wrote on every
        node (a usage summary rewritten during bursts), once per node that still has it, so no
        stale figure stays on the Node."""
        while self.stale_allocation_nodes:
            name = self.stale_allocation_nodes.pop()
            try:
                await kube.patch_node_annotations(self.api, name, {keys.NODE_ALLOCATION: None})
            except ApiException as e:
                if e.status is None or e.status >= 500 or e.status == 429:
                    self.stale_allocation_nodes.add(name)
                    raise
                log.warning("old allocation annotation not removed", node=name, status=e.status,
                            reason=e.reason)
            except BaseException:
                self.stale_allocation_nodes.add(name)  # the API server away: the next round
                raise

    def _pool_topology(self) -> dict[str, tuple[int, int, frozenset[str]]]:
        """Per pool: (covered cards, healthy covered cards, pools it conflicts with). Recomputed
        only when nodes' inventories or pools change, not on every allocation."""
        from kvgpu.api.pools import conflicts

        if not self.state.take_topology_change() and self._topology is not None:
            return self._topology
        counts: dict[str, list[int]] = {}
        for node in self.state.nodes:
            inv = self.state.ledger_inventory(node)
            for c in inv.cards if inv else ():
                if c.slicing is not None:
                    a = counts.setdefault(c.slicing.pool, [0, 0])
                    a[0] += 1
                    a[1] += int(c.healthy)
        pairs = [(r.labels, r.inventory.cards) for r in self.state.nodes.values() if r.inventory is not None]
        clash = conflicts(list(self.state.pools.values()), pairs)
        self._topology = {
            name: (counts.get(name, [0, 0])[0], counts.get(name, [0, 0])[1], clash.get(name, frozenset()))
            for name in self.state.pools
        }
        self._clash = poolstatus.conflict_nodes(self.state.pools.values(), (
            (n, r.labels, r.inventory.cards) for n, r in self.state.nodes.items() if r.inventory is not None))
        where = {n for others in self._clash.values() for ns in others.values() for n in ns}
        self.state.set_conflict_notes({n: poolstatus.conflict_note(n, self._clash) for n in where})
        return self._topology

    async def write_pool_status(self) -> None:
        """VGPUPool status: aggregate counts (bounded size at any cluster size) and conditions."""
        import datetime

        from kvgpu.api.models import VGPUPoolStatus
        from kvgpu.api.pools import pool_conditions

        usage = self.state.ledger.pool_usage()
        topo = self._pool_topology()
        # only the nodes with an over-full card: building every node's usage was O(cards) objects
        over = poolstatus.excess(self.state.ledger.usage(self.state.ledger.over_nodes()).values())
        claims_per_pool: dict[str, int] = {}
        for alloc in self.state.ledger.reservations().values():
            for ca in alloc.containers:
                pool_name = self.state.pool_of(alloc.node, ca.devices[0].uuid) if ca.devices else ""
                if pool_name:
                    claims_per_pool[pool_name] = claims_per_pool.get(pool_name, 0) + 1
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for name, pool in self.state.pools.items():
            u = usage.get(name)
            cards, healthy, clash = topo.get(name, (0, 0, frozenset()))
            prev = pool.status.conditions if pool.status is not None else []
            status = VGPUPoolStatus(
                observed_generation=pool.metadata.get("generation"),
                nodes=u.nodes if u else 0, cards=cards, unhealthy_cards=cards - healthy,
                slots_used=u.slots_used if u else 0, slots_total=u.slots_total if u else 0,
                memory_used_mib=u.memory_used_mib if u else 0, memory_total_mib=u.memory_total_mib if u else 0,
                cores_used=u.cores_used if u else 0, cores_total=u.cores_total if u else 0,
                claims=claims_per_pool.get(name, 0),
                conditions=poolstatus.conditions(
                    name, pool_conditions(cards=cards, healthy_cards=healthy, conflicts_with=clash,
                                          generation=pool.metadata.get("generation"), now=now, previous=prev),
                    clash=self._clash.get(name, {}), over=over.get(name, []),
                    generation=pool.metadata.get("generation"), now=now, previous=prev),
            )
            body = status.model_dump(mode="json", by_alias=True, exclude_none=True)
            compare = {k: v for k, v in body.items() if k != "conditions"}
            compare["conditions"] = [(c["type"], c["status"], c.get("reason"), c.get("message"))
                                     for c in body.get("conditions", [])]
            if self._written_pools.get(name) == compare:
                continue
            await kube.patch_pool_status(self.api, name, body)
            self._written_pools[name] = compare
            if (turned := poolstatus.became_overcommitted(prev, status.conditions)) is not None:
                log.warning("pool shrunk under live claims", pool=name, detail=turned.message)
                await kube.post_event(self.api, pool.to_body(), reason="Overcommitted", message=turned.message,
                                      type_="Warning")
        for name, (meta, why) in list(self.state.invalid_pools.items()):
            await self._write_invalid_pool_status(name, meta, why, now)

    async def _write_invalid_pool_status(self, name: str, meta: dict[str, Any], why: str, now: str) -> None:
        """A pool valid for the CRD's schema but refused by the model: zero counts, Ready False
        with reason InvalidSpec and the model's reason, and a Warning Event when that is new."""
        from kvgpu.api.models import VGPUPoolStatus

        generation = meta.get("generation")
        status = VGPUPoolStatus(observed_generation=generation, conditions=poolstatus.invalid_conditions(
            why, generation=generation, now=now))
        body = status.model_dump(mode="json", by_alias=True, exclude_none=True)
        compare = {"invalid": why, "generation": generation}
        if self._written_pools.get(name) == compare:
            return
        await kube.patch_pool_status(self.api, name, body)
        self._written_pools[name] = compare
        await kube.post_event(self.api, {"apiVersion": f"{keys.GROUP}/{keys.VERSION}", "kind": "VGPUPool",
                                         "metadata": meta}, reason=poolstatus.INVALID_SPEC,
                              message=body["conditions"][0]["message"], type_="Warning")

    async def sweep(self) -> None:
        """Re-reserve live claims the ledger lacks (drift: a reservation lost to a bug or a
        missed event); the claims are the truth. Orphaned claims are the claim-phase worker's."""
        cw = self.watches.get("vgpuclaims")
        if cw is not None and cw.synced.is_set():
            claims = list(cw.known().values())  # the watch's view: no list of the cluster
        else:
            claims = await kube.list_all(self.api, "vgpuclaims")
        for c in claims:
            if (c.get("status") or {}).get("phase") in ("Released", "Failed"):
                continue
            try:
                key, alloc = allocation_from_claim(c)
            except (KeyError, ValueError, TypeError):
                continue
            if self.state.ledger.reservation(key) is None:
                if uid := (c.get("metadata") or {}).get("uid"):
                    self.state.record_claim_uid(key, str(uid))
                if is_mirror(c):  # kube-scheduler's allocation on a dra card: recorded as it is
                    try:
                        self.state.reserve(key, alloc, force=True)
                    except Exception as e:  # contradicts the ledger (a container twice): logged
                        log.warning("mirrored claim not recorded in the ledger", claim=key, error=str(e))
                    continue
                try:
                    self.state.reserve(key, alloc)
                except Exception as e:  # over-committed: force it, the claims are the truth
                    log.warning("claim does not fit the ledger; forcing", claim=key, error=str(e))
                    self.state.reserve(key, alloc, force=True)

    async def _requeue_loop(self) -> None:
        while True:
            await self._nudge.wait()
            await asyncio.sleep(0.05)  # coalesce bursts of releases
            self._nudge.clear()
            if not self.active:
                continue
            stamp = f"{time.time():.3f}"
            for uid, (ns, name) in list(self.state.pending.items()):
                try:
                    await kube.patch_pod_metadata(self.api, ns, name, annotations={keys.POD_REQUEUE: stamp})
                except ApiException as e:
                    if e.status == 404:
                        self.state.forget_pending(uid)
                except Exception as e:
                    if (why := faults.expected(e)) is None:
                        log.exception("requeue failed", pod=f"{ns}/{name}")
                    else:
                        self.fault_log.fault("requeue", "requeue of pending pods failed", why)
