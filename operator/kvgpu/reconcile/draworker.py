"""The DRA claim mirror: keeps one VGPUClaim per ResourceClaim allocated for ``gpu.kvgpu.io``
(:mod:`kvgpu.reconcile.dramirror` says what it holds). Runs in the claim-phase worker process
(leader only), beside the pods' claim phases: both are claim bookkeeping without the ledger.

Sources: a list-and-watch of ResourceClaims (``resource.k8s.io/v1``, all namespaces) and of
the driver's ResourceSlices (``spec.driver=gpu.kvgpu.io``: a result names a device, the slice
gives its card). Each ResourceClaim event creates, replaces (the spec is immutable: delete, then
create) or deletes its mirror; a sweep every ``sweep_interval_s`` deletes mirrors whose
ResourceClaim is gone or no longer allocated and writes those still missing (a device not seen
yet). Restart-safe: the mirrors are listed at start and compared, names are deterministic, a
create that meets an existing mirror checks it. The main process reserves a mirror's slice in
the ledger when it sees the VGPUClaim and frees it when the VGPUClaim goes
(``Runtime.on_claim``). A cluster without ``resource.k8s.io/v1`` is served as one without claims.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from kubernetes_asyncio.client.exceptions import ApiException

from kvgpu import kube
from kvgpu.dra.slices import DRIVER
from kvgpu.reconcile.dramirror import (
    Card,
    MirrorPending,
    mirror,
    slice_cards,
    spec_of,
    wants_mirror,
)
from kvgpu.watch import ListWatch, periodically

log = structlog.get_logger("kvgpu.phases")

RESOURCE_API = "/apis/resource.k8s.io/v1"
MISSING_RETRY_S = 60.0


def _claim_projection(rc: dict[str, Any]) -> dict[str, Any]:
    """What the mirror and its sweep read of a ResourceClaim: identity, allocation, consumers."""
    meta, st = rc.get("metadata") or {}, rc.get("status") or {}
    keep = {k: meta[k] for k in ("name", "namespace", "uid", "deletionTimestamp") if k in meta}
    return {"metadata": keep, "status": {k: st[k] for k in ("allocation", "reservedFor") if k in st}}


def _slice_projection(rs: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": (rs.get("metadata") or {}).get("name")}, "spec": rs.get("spec") or {}}


class DraMirror:
    """Mirrors ResourceClaims into VGPUClaims; :meth:`run` never returns (cancel it)."""

    def __init__(self, api: Any, sweep_interval_s: float = 15.0) -> None:
        self.api = api
        self.sweep_interval_s = sweep_interval_s
        self._mirrors: dict[str, dict[str, Any]] = {}  # ResourceClaim UID -> its mirror (as written)
        self._cards: dict[str, dict[tuple[str, str], Card]] = {}  # slice UID -> its devices
        self.claims = ListWatch(api, f"{RESOURCE_API}/resourceclaims", self.on_claim, project=_claim_projection,
                                name="resourceclaims", missing_retry_s=MISSING_RETRY_S)
        self.slices = ListWatch(api, f"{RESOURCE_API}/resourceslices", self.on_slice, project=_slice_projection,
                                field_selector=f"spec.driver={DRIVER}", name="resourceslices",
                                missing_retry_s=MISSING_RETRY_S)

    async def check_device_class(self) -> bool:
        """Whether the DeviceClass :data:`~kvgpu.dra.slices.DRIVER` exists; logs a warning when
        not (ResourceClaims cannot name it: the chart's ``dra.deviceClass``). A failed read counts
        as present (logged)."""
        try:
            found = await kube.get_path(self.api, f"{RESOURCE_API}/deviceclasses/{DRIVER}") is not None
        except Exception as e:
            log.warning("could not read the DeviceClass", name=DRIVER, error=str(e)[:200])
            return True
        if not found:
            log.warning("DeviceClass missing: ResourceClaims of dra pools cannot name it "
                        "(install it: the chart's dra.deviceClass, docs/dra.md)", name=DRIVER)
        return found

    async def run(self) -> None:
        await self.check_device_class()
        for c in await kube.list_all(self.api, "vgpuclaims"):
            rc = (c.get("spec") or {}).get("resourceClaim")
            if rc:
                self._mirrors[str(rc["uid"])] = c
        tasks = [asyncio.create_task(self.slices.run(), name="kvgpu-dra-slices")]
        await self.slices.synced.wait()  # devices first: a claim's first event can then be mirrored
        tasks += [asyncio.create_task(self.claims.run(), name="kvgpu-dra-claims"),
                  asyncio.create_task(self._sweep_loop(), name="kvgpu-dra-sweep")]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    def on_slice(self, etype: str, rs: dict[str, Any]) -> None:
        uid = str((rs.get("metadata") or {}).get("uid") or (rs.get("metadata") or {}).get("name"))
        if etype == "DELETED":
            self._cards.pop(uid, None)
        else:
            self._cards[uid] = slice_cards(rs)

    def cards(self) -> dict[tuple[str, str], Card]:
        """Every device of the driver's slices, ``(pool, device) -> Card``."""
        return {k: v for devs in self._cards.values() for k, v in devs.items()}

    async def on_claim(self, etype: str, rc: dict[str, Any]) -> None:
        """Make the mirror of ``rc`` what it should be. Raises (so the watch retries later) when
        it cannot be written yet."""
        uid = str(rc["metadata"]["uid"])
        if etype == "DELETED" or not wants_mirror(rc):
            await self._remove(uid)
            return
        meta = rc["metadata"]
        who = (rc.get("status") or {}).get("reservedFor") or []
        pod_name = next(str(r["name"]) for r in who if r.get("resource") == "pods")
        pod = await kube.get_pod(self.api, meta["namespace"], pod_name)
        if pod is None:
            raise MirrorPending(f"pod {meta['namespace']}/{pod_name} not found")
        body = mirror(rc, pod, self.cards())
        have = self._mirrors.get(uid)
        if have is not None and spec_of(have) == spec_of(body):
            return
        if have is not None:  # the consumer or the allocation changed: the spec is immutable
            await self._remove(uid)
        await self._create(uid, body)

    async def _create(self, uid: str, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        try:
            await kube.create_claim(self.api, meta["namespace"], body)
        except ApiException as e:
            if e.status != 409:
                raise
            live = await kube.get_claim(self.api, meta["namespace"], meta["name"])
            if live is None or spec_of(live) != spec_of(body):
                raise MirrorPending(f"VGPUClaim {meta['namespace']}/{meta['name']} differs: replaced") from e
            body = live  # written by an earlier run
        else:
            log.info("mirrored ResourceClaim", claim=f"{meta['namespace']}/{meta['name']}",
                     node=body["spec"]["node"], devices=len(body["spec"]["devices"]))
        self._mirrors[uid] = body

    async def _remove(self, uid: str) -> None:
        have = self._mirrors.pop(uid, None)
        if have is None:
            return
        meta = have["metadata"]
        if await kube.delete_claim(self.api, meta["namespace"], meta["name"]):
            log.info("removed the mirror of a ResourceClaim", claim=f"{meta['namespace']}/{meta['name']}")

    async def _sweep_loop(self) -> None:
        await periodically(self.claims.synced, self.sweep, self.sweep_interval_s, "DRA mirror sweep")

    async def sweep(self) -> None:
        """Delete mirrors whose ResourceClaim is gone or holds no cards of ours; write the
        missing ones (only while the claims' watch is current)."""
        if not self.claims.current():
            return
        known = {str(p["metadata"]["uid"]): p for p in self.claims.known().values()}
        for uid in list(self._mirrors):
            rc = known.get(uid)
            if rc is None or not wants_mirror(rc):
                await self._remove(uid)
        for uid, rc in known.items():
            if uid not in self._mirrors and wants_mirror(rc):
                try:
                    await self.on_claim("MODIFIED", rc)
                except (MirrorPending, ValueError) as e:
                    log.info("ResourceClaim not mirrored yet", claim=f"{rc['metadata']['namespace']}/"
                             f"{rc['metadata']['name']}", why=str(e)[:200])
