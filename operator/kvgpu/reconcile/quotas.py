"""Namespace quotas, the operator's side: ResourceQuotas and VGPUQuotas into the quota book
(:class:`kvgpu.allocator.quota.QuotaBook` in :class:`OperatorState`), and the VGPUQuotas' status.

* :meth:`QuotaSync.load` lists both kinds when the ledger is rebuilt (start-up, winning the
  Lease), before the extender answers: a bind never runs against a book without its quotas;
* :meth:`QuotaSync.on_resource_quota` / :meth:`QuotaSync.on_vgpu_quota` are the handlers of
  their list-and-watch streams (:class:`kvgpu.watch.ListWatch`, run by the runtime); a quota that
  changed nudges the pending pods (a raised or deleted quota may let them fit);
* :meth:`QuotaSync.flush` (the runtime's flush, leader only) writes ``status.hard`` and
  ``status.used`` of the VGPUQuotas of namespaces whose usage or quotas changed, when they
  differ from what the object shows. ResourceQuotas' status belongs to kube-controller-manager.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog
from kubernetes_asyncio.client.exceptions import ApiException

from kvgpu import kube
from kvgpu.allocator.quota import DIMENSIONS
from kvgpu.api.quotas import RESOURCE_QUOTA, VGPU_QUOTA, from_resource_quota, from_vgpu_quota, vgpu_quota_status
from kvgpu.reconcile.state import OperatorState

log = structlog.get_logger("kvgpu.quota")


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


class QuotaSync:
    """Keeps ``state.quotas`` in step with the cluster's quota objects; see the module doc."""

    def __init__(self, state: OperatorState, nudge: Callable[[str], None] | None = None) -> None:
        self.state = state
        self.nudge = nudge
        # (namespace, name) -> (generation, status) of each VGPUQuota as last seen
        self._seen: dict[tuple[str, str], tuple[int | None, dict[str, Any]]] = {}
        self._problems: dict[tuple[str, str, str], str] = {}  # logged once per object and text

    # ----- watch handlers (synchronous: they only touch memory) ---------------------------------
    def on_resource_quota(self, etype: str, obj: dict[str, Any]) -> None:
        ns, name = _key(obj)
        book = self.state.quotas
        if etype == "DELETED":
            changed = book.remove_quota(RESOURCE_QUOTA, ns, name)
        else:
            quota, problems = from_resource_quota(obj)
            self._report(RESOURCE_QUOTA, ns, name, "; ".join(problems))
            changed = book.set_quota(quota) if quota is not None else book.remove_quota(RESOURCE_QUOTA, ns, name)
        if changed:
            self._changed(f"ResourceQuota {ns}/{name}")

    def on_vgpu_quota(self, etype: str, obj: dict[str, Any]) -> None:
        ns, name = _key(obj)
        book = self.state.quotas
        if etype == "DELETED":
            self._seen.pop((ns, name), None)
            changed = book.remove_quota(VGPU_QUOTA, ns, name)
        else:
            meta = obj.get("metadata") or {}
            self._seen[(ns, name)] = (meta.get("generation"), dict(obj.get("status") or {}))
            try:
                changed = book.set_quota(from_vgpu_quota(obj))
                self._report(VGPU_QUOTA, ns, name, "")
            except ValueError as e:  # the CRD's schema refuses these first; keep nothing of it
                self._report(VGPU_QUOTA, ns, name, str(e)[:500])
                changed = book.remove_quota(VGPU_QUOTA, ns, name)
            book.dirty.add(ns)  # its status may be stale (a new object, a changed spec)
        if changed:
            self._changed(f"VGPUQuota {ns}/{name}")

    def _changed(self, what: str) -> None:
        log.info("quota changed", quota=what)
        if self.nudge is not None:
            self.nudge(f"{what} changed")

    def _report(self, kind: str, ns: str, name: str, problem: str) -> None:
        k = (kind, ns, name)
        if problem and self._problems.get(k) != problem:
            log.warning("quota value ignored", quota=f"{kind} {ns}/{name}", problem=problem)
        if problem:
            self._problems[k] = problem
        else:
            self._problems.pop(k, None)

    # ----- I/O ----------------------------------------------------------------------------------
    async def load(self, api: Any) -> None:
        """List every ResourceQuota and VGPUQuota into the book, dropping quotas no longer there.
        A cluster without the VGPUQuota CRD (404) has none; other API errors propagate (the
        operator must not answer binds without the quotas)."""

        async def vgpu_quotas() -> list[dict[str, Any]]:
            try:
                return await kube.list_all(api, "vgpuquotas")
            except ApiException as e:
                if e.status != 404:
                    raise
                log.warning("the VGPUQuota CRD is not installed: only ResourceQuotas apply")
                return []

        rqs, vqs = await asyncio.gather(kube.list_all(api, "resourcequotas"), vgpu_quotas())
        listed = {(RESOURCE_QUOTA, *_key(o)) for o in rqs} | {(VGPU_QUOTA, *_key(o)) for o in vqs}
        book = self.state.quotas
        for ns in book.namespaces():
            for q in book.quotas(ns):
                if (q.kind, q.namespace, q.name) not in listed:
                    book.remove_quota(q.kind, q.namespace, q.name)
        for o in rqs:
            self.on_resource_quota("ADDED", o)
        for o in vqs:
            self.on_vgpu_quota("ADDED", o)

    async def flush(self, api: Any) -> None:
        """Write the status of the VGPUQuotas of changed namespaces where it differs from the
        object's (a namespace stays to be written when a write fails)."""
        book = self.state.quotas
        dirty, book.dirty = book.dirty, set()
        todo = sorted(dirty)
        for i, ns in enumerate(todo):
            for q in book.quotas(ns):
                seen = self._seen.get((ns, q.name))
                if q.kind != VGPU_QUOTA or seen is None:
                    continue
                generation, shown = seen
                status = vgpu_quota_status(q, book.used(ns), generation)
                if shown == status:
                    continue
                # a merge patch: dimensions no longer limited are removed with null
                patch = {**status, "hard": {d: status["hard"].get(d) for d in DIMENSIONS}}
                try:
                    if await kube.patch_vgpuquota_status(api, ns, q.name, patch):
                        self._seen[(ns, q.name)] = (generation, status)
                except BaseException:
                    book.dirty.update(todo[i:])
                    raise
