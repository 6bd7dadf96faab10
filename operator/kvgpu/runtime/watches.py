"""The watch handlers of the main process: Nodes (inventory, HAMi's extended resources) and
VGPUClaims (a claim deleted or Released frees its reservation, unless its pod still holds it; a
claim mirrored from a DRA ResourceClaim is recorded when it appears and freed when it goes)."""

from __future__ import annotations

import asyncio
from typing import Any

from kvgpu import kube
from kvgpu.allocator.usage import AllocationError
from kvgpu.core import keys
from kvgpu.reconcile import advertise
from kvgpu.reconcile.state import allocation_from_claim, is_mirror
from kvgpu.runtime.base import RuntimeBase, log


class WatchHandlers(RuntimeBase):
    """``on_node`` and ``on_claim``, the handlers of the ListWatch streams."""

    def on_node(self, etype: str, node: dict[str, Any]) -> None:
        name = node["metadata"]["name"]
        if etype == "DELETED":
            self.stale_allocation_nodes.discard(name)
            if name in self.state.nodes:
                self.state.remove_node(name)
                self.claims_on_lost_node(name)
            return
        if keys.NODE_ALLOCATION in ((node.get("metadata") or {}).get("annotations") or {}):
            self.stale_allocation_nodes.add(name)
        else:
            self.stale_allocation_nodes.discard(name)
        if self.state.set_node(node):
            self.nudge_pending("node inventory changed")
        self._advertise(name, node)

    def _advertise(self, name: str, node: dict[str, Any]) -> None:
        """Give a GPU node HAMi's extended resources (:mod:`kvgpu.reconcile.advertise`) when
        its status lacks them or shows other amounts (a pool changed, a kubelet reset them)."""
        if not self.active or self.api is None or name not in self.state.ledger:
            return
        patch = advertise.status_patch(node, advertise.advertised(self.state.ledger.node_usage(name)))
        if patch is not None:
            task = asyncio.create_task(self._patch_node_status(name, patch), name=f"kvgpu-advertise-{name}")
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)

    async def _patch_node_status(self, name: str, patch: dict[str, Any]) -> None:
        try:
            await kube.patch_node_status(self.api, name, patch)
        except Exception as e:  # the next node event tries again
            log.warning("could not advertise the node's GPU resources", node=name, error=str(e)[:200])

    def on_claim(self, etype: str, claim: dict[str, Any]) -> None:
        """A claim deleted, or Released/Failed (its pod ended: the claim-phase worker wrote it),
        frees its reservation — if the ledger holds exactly what the claim records (a newer
        claim under the same name, from a later bind, is not freed by an old one's event)."""
        if not self.active:
            return  # a standby rebuilds from the claims when it takes over
        if is_mirror(claim):
            self._on_mirror(etype, claim)
            return
        if etype != "DELETED" and (claim.get("status") or {}).get("phase") not in ("Released", "Failed"):
            return
        try:
            key, alloc = allocation_from_claim(claim)
        except (KeyError, ValueError, TypeError):
            return
        uid = str((claim.get("metadata") or {}).get("uid") or "")
        holder = self.state.claim_uids.get(key)
        if uid and holder and uid != holder:
            return  # an older object under this name (a bind's failed attempt, a restored claim)
        held = self.state.ledger.reservation(key)
        if held is not None and held == alloc:
            if self.api is not None:  # the pod may still run: look before freeing its cards
                task = asyncio.create_task(self._release_unless_pod_runs(etype, key, claim),
                                           name=f"kvgpu-release-{key}")
                self._checks.add(task)
                task.add_done_callback(self._checks.discard)
                return
            self.state.release_key(key)
            self.nudge_pending(f"claim {key} {'deleted' if etype == 'DELETED' else 'released'}")

    def _on_mirror(self, etype: str, claim: dict[str, Any]) -> None:
        """A claim mirrored from a DRA ResourceClaim (kvgpu.reconcile.draworker): kube-scheduler
        allocated its slice, so the ledger records it as it is (``force``: a dra card takes no
        extender slice) while the mirror lives, and frees it when the mirror is deleted. Its key
        and holder (``resourceclaim:<UID>``) are its own: it never joins or frees a pod's
        extender reservations."""
        try:
            key, alloc = allocation_from_claim(claim)
        except (KeyError, ValueError, TypeError):
            return
        uid = str((claim.get("metadata") or {}).get("uid") or "")
        held = self.state.ledger.reservation(key)
        if etype == "DELETED" or (claim.get("status") or {}).get("phase") in ("Released", "Failed"):
            holder = self.state.claim_uids.get(key)
            if held == alloc and not (uid and holder and uid != holder):
                self.state.release_key(key)
            return
        if held is None:
            try:
                self.state.reserve(key, alloc, force=True)
            except AllocationError as e:
                log.warning("mirrored claim not recorded in the ledger", claim=key, error=str(e))
                return
            if uid:
                self.state.record_claim_uid(key, uid)

    async def _release_unless_pod_runs(self, etype: str, key: str, claim: dict[str, Any]) -> None:
        """Free a claim's cards only once its pod no longer holds them. A claim deleted or set
        Released by someone else while its pod still runs on the claim's node (an admin, a
        controller with wide rights) is put back instead, and its cards stay reserved: a user
        action must never let kvgpu promise the same memory twice."""
        meta, spec = claim.get("metadata") or {}, claim.get("spec") or {}
        ns, pod_name = str(meta.get("namespace") or ""), str(spec.get("podName") or "")
        try:
            pod = await kube.get_pod(self.api, ns, pod_name) if pod_name else None
        except Exception as e:  # cannot tell: free it, as before (the sweep re-reserves a live claim)
            log.warning("could not read the claim's pod; freeing its cards", claim=key, error=str(e)[:200])
            pod = None
        try:
            _, alloc = allocation_from_claim(claim)
        except (KeyError, ValueError, TypeError):
            return
        if self.state.ledger.reservation(key) != alloc:
            return  # changed meanwhile (a newer bind, an earlier release)
        if pod is not None and pod_holds(pod, spec):
            log.warning("claim of a running pod was removed by someone else; restoring it", claim=key,
                        change=etype, pod=f"{ns}/{pod_name}")
            try:
                await self._restore_claim(etype, key, claim, pod)
            except Exception as e:
                log.warning("restoring the claim failed; its cards stay reserved", claim=key, error=str(e)[:200])
            return
        self.state.release_key(key)
        self.nudge_pending(f"claim {key} {'deleted' if etype == 'DELETED' else 'released'}")

    async def _restore_claim(self, etype: str, key: str, claim: dict[str, Any], pod: dict[str, Any]) -> None:
        """Create the claim again (a Released claim stays Released, so one set Released is deleted
        first; its own DELETED event is then not taken for a release). It needs no phase: a claim
        without one holds its cards (Bound)."""
        meta, spec, pmeta = claim["metadata"], claim["spec"], pod["metadata"]
        if etype != "DELETED":
            self.state.record_claim_uid(key, "restoring")  # the old object's DELETED event frees nothing
            await kube.delete_claim(self.api, meta["namespace"], meta["name"])
        body = {"apiVersion": f"{keys.GROUP}/{keys.VERSION}", "kind": "VGPUClaim",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                             "labels": {"kvgpu.io/pod-uid": pmeta["uid"],
                                        "kvgpu.io/node": keys.label_value(str(spec["node"]))},
                             "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pmeta["name"],
                                                  "uid": pmeta["uid"], "controller": False,
                                                  "blockOwnerDeletion": False}]},
                "spec": spec}
        uid = await kube.create_claim(self.api, meta["namespace"], body)
        if uid:
            self.state.record_claim_uid(key, uid)

    def claims_on_lost_node(self, node: str) -> None:
        """A node disappeared: its pods are gone with it (pod GC); the sweep releases claims."""
        self.nudge_pending(f"node {node} removed")


def pod_holds(pod: dict[str, Any], claim_spec: dict[str, Any]) -> bool:
    """Whether ``pod`` still holds the cards of a claim with ``claim_spec``: the claim's pod (same
    UID), bound to the claim's node, not ended and not being deleted. Pure."""
    meta, st = pod.get("metadata") or {}, pod.get("status") or {}
    return (meta.get("uid") == claim_spec.get("podUID") and not meta.get("deletionTimestamp")
            and (pod.get("spec") or {}).get("nodeName") == claim_spec.get("node")
            and st.get("phase") not in ("Succeeded", "Failed"))


def _node_projection(node: dict[str, Any]) -> dict[str, Any]:
    meta = node.get("metadata") or {}
    return {"metadata": {"name": meta.get("name"), "uid": meta.get("uid")}}


def _claim_projection(claim: dict[str, Any]) -> dict[str, Any]:
    """A claim less its managedFields and conditions: what release and the sweep read."""
    meta = claim.get("metadata") or {}
    phase = (claim.get("status") or {}).get("phase")
    return {
        "apiVersion": claim.get("apiVersion"), "kind": claim.get("kind"),
        "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid", "creationTimestamp")},
        "spec": claim.get("spec") or {},
        **({"status": {"phase": phase}} if phase else {}),
    }
