"""Bind: pick the cards on the node kube-scheduler chose, record them, then bind the pod.

Order (each step idempotent, so kube-scheduler may retry a bind at any point):

1. read the pod; refuse if its UID differs (a new pod with the same name) or if it is already
   bound elsewhere; a pod already bound to this node with its claims present is a success;
2. ``allocate`` + ``reserve`` in the ledger, one key per container claim, with no ``await``
   in between (this is what makes concurrent binds on one node safe without a node lock);
   a retry that finds this pod's reservations on the same node reuses them;
3. create one VGPUClaim per sliced container (deterministic name; an existing claim of the
   same pod UID is accepted, one of another pod is an error);
4. write the allocation annotations the container's env and claim file read (downward API);
5. create the Binding; then mark the claims Bound.

Any failure releases the ledger keys, deletes the claims this attempt created and clears the
annotations, so nothing stays reserved; the error goes back to kube-scheduler, which retries.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import structlog
from kubernetes_asyncio.client.exceptions import ApiException

from kvgpu import kube
from kvgpu.allocator.ledger import AllocationError
from kvgpu.api.models import VGPUClaim
from kvgpu.api.requests import RequestError, parse_pod
from kvgpu.core import keys
from kvgpu.core.claimstr import ClaimDevice, ClaimString
from kvgpu.core.requests import PodAllocation, PodRequest
from kvgpu.extender.protocol import BindingArgs
from kvgpu.reconcile.state import OperatorState, claim_key

log = structlog.get_logger("kvgpu.bind")


def claim_name(pod_name: str, container: str, pod_uid: str) -> str:
    """Deterministic VGPUClaim name for (pod, container): ``<pod>-<container>-<uid[:5]>``,
    shortened with a hash when longer than 253 characters."""
    name = f"{pod_name}-{container}-{pod_uid[:5]}".lower()
    if len(name) <= 253:
        return name
    h = hashlib.sha256(f"{pod_name}/{container}/{pod_uid}".encode()).hexdigest()[:10]
    return f"{pod_name[:230]}-{h}".lower()


def claim_body(pod: dict[str, Any], alloc: PodAllocation, container: str, pool: str = "") -> dict[str, Any]:
    """The VGPUClaim for one container of ``alloc`` (built through the model, so the printer
    columns' summary fields are filled)."""
    meta = pod["metadata"]
    ca = next(c for c in alloc.containers if c.container == container)
    claim = VGPUClaim.model_validate({
        "metadata": {
            "name": claim_name(meta["name"], container, meta["uid"]),
            "namespace": meta["namespace"],
            "labels": {"kvgpu.io/pod-uid": meta["uid"], "kvgpu.io/node": alloc.node[:63]},
            "ownerReferences": [{
                "apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"],
                "controller": False, "blockOwnerDeletion": False,
            }],
        },
        "spec": {
            "podName": meta["name"],
            "podUID": meta["uid"],
            "container": container,
            "init": ca.init,
            "node": alloc.node,
            "pool": pool,
            "priority": ca.priority,
            "devices": [
                {"uuid": d.uuid, "index": d.index, "model": d.model, "memory": d.memory_mib, "cores": d.cores}
                for d in ca.devices
            ],
        },
    })
    body = claim.to_body()
    body.pop("status", None)
    return body


def allocation_annotations(namespace: str, pod: dict[str, Any], alloc: PodAllocation) -> dict[str, str]:
    meta = pod["metadata"]
    ann: dict[str, str] = {keys.POD_NODE: alloc.node}
    names = []
    for ca in alloc.containers:
        name = claim_name(meta["name"], ca.container, meta["uid"])
        names.append(name)
        cs = ClaimString(
            f"{namespace}/{name}",
            ca.priority,
            tuple(ClaimDevice(d.uuid, d.memory_mib, d.cores) for d in ca.devices),
        )
        ann[keys.claim_annotation(ca.container)] = cs.encode()
        ann[keys.devices_annotation(ca.container)] = ",".join(d.uuid for d in ca.devices)
    ann[keys.POD_CLAIMS] = ",".join(names)
    return ann


class BindError(RuntimeError):
    """A bind that failed; the message goes back to kube-scheduler and into a pod Event."""


class Binder:
    def __init__(self, state: OperatorState, api: Any, metrics: Any = None) -> None:
        self.state = state
        self.api = api
        self.metrics = metrics

    async def bind(self, args: BindingArgs) -> str:
        """Run the bind; return "" on success or the error message (nothing left reserved)."""
        t0 = time.perf_counter()
        try:
            await self._bind(args)
            return ""
        except BindError as e:
            if self.metrics is not None:
                self.metrics.bind_failures.labels(reason="bind").inc()
            log.info("bind failed", pod=f"{args.pod_namespace}/{args.pod_name}", node=args.node, error=str(e))
            return str(e)
        finally:
            if self.metrics is not None:
                self.metrics.extender_latency.labels(verb="bind").observe(time.perf_counter() - t0)

    async def _bind(self, args: BindingArgs) -> None:
        ns, name, node = args.pod_namespace, args.pod_name, args.node
        pod = await kube.get_pod(self.api, ns, name)
        if pod is None:
            raise BindError(f"pod {ns}/{name} no longer exists")
        meta, spec = pod["metadata"], pod.get("spec", {})
        if meta.get("uid") != args.pod_uid:
            raise BindError(f"pod {ns}/{name} has UID {meta.get('uid')}, not {args.pod_uid}")
        bound_to = spec.get("nodeName")
        if bound_to and bound_to != node:
            raise BindError(f"pod {ns}/{name} is already bound to {bound_to}")
        try:
            req = parse_pod(pod, self.state.default_pool_spec())
        except RequestError as e:
            raise BindError(f"invalid GPU request: {e}") from e
        if req is None:
            raise BindError(f"pod {ns}/{name} requests no GPU slices; it should not use {keys.SCHEDULER_NAME}")
        req = PodRequest(ns, name, args.pod_uid, req.containers, req.node_policy, req.gpu_policy)
        names = {c.container: claim_name(name, c.container, args.pod_uid) for c in req.containers}
        ckeys = {c: claim_key(ns, n) for c, n in names.items()}

        # --- step 2: the ledger, synchronously ------------------------------------------------
        reused = self._held(ckeys, args.pod_uid, node)
        created: list[str] = []
        if reused is None:
            self.state.release_pod(args.pod_uid)  # a retry towards another node
            try:
                alloc = self.state.ledger.allocate(req, node)
                for ca in alloc.containers:
                    self.state.reserve(ckeys[ca.container], PodAllocation(args.pod_uid, node, (ca,)))
            except (AllocationError, ValueError) as e:
                self.state.release_pod(args.pod_uid)
                raise BindError(str(e)) from e
        else:
            alloc = reused
        annotated = False
        try:
            # --- step 3: claims -------------------------------------------------------------
            for ca in alloc.containers:
                body = claim_body(pod, alloc, ca.container, self._pool_of(node, ca.devices[0].uuid))
                try:
                    await kube.create_claim(self.api, ns, body)
                    created.append(body["metadata"]["name"])
                except ApiException as e:
                    if e.status != 409:
                        raise
                    old = await kube.get_claim(self.api, ns, body["metadata"]["name"])
                    if old is None or old["spec"].get("podUID") != args.pod_uid or old["spec"].get("node") != node:
                        raise BindError(f"claim {body['metadata']['name']} exists for another pod or node") from e
            # --- step 4: annotations ----------------------------------------------------------
            if not bound_to:
                await kube.patch_pod_metadata(self.api, ns, name, annotations=allocation_annotations(ns, pod, alloc))
                annotated = True
                # --- step 5: binding ----------------------------------------------------------
                await kube.create_binding(self.api, ns, name, args.pod_uid, node)
        except (ApiException, OSError, BindError) as e:
            for cname in created:
                try:
                    await kube.delete_claim(self.api, ns, cname)
                except (ApiException, OSError):
                    pass  # the orphan sweep removes it
            if annotated:
                try:
                    clear: dict[str, str | None] = dict.fromkeys(allocation_annotations(ns, pod, alloc))
                    await kube.patch_pod_metadata(self.api, ns, name, annotations=clear)
                except (ApiException, OSError):
                    pass
            self.state.release_pod(args.pod_uid)
            if isinstance(e, BindError):
                raise
            reason = getattr(e, "reason", None) or str(e)
            raise BindError(f"binding {ns}/{name} to {node} failed: {reason}") from e
        self.state.pending.pop(args.pod_uid, None)
        for cname in names.values():
            try:
                await kube.patch_claim_status(self.api, ns, cname, {"phase": "Bound", "message": f"bound to {node}"})
            except (ApiException, OSError):
                pass  # the pod reconciler moves the phase on
        devs = "; ".join(
            f"{ca.container}: " + ", ".join(f"GPU {d.index} ({d.memory_mib} MiB, {d.cores}%)" for d in ca.devices)
            for ca in alloc.containers
        )
        await kube.post_event(self.api, {"apiVersion": "v1", "kind": "Pod", "metadata": meta},
                              reason="GPUSlicesBound", message=f"bound to {node}: {devs}")

    def _pool_of(self, node: str, uuid: str) -> str:
        inv = self.state.ledger_inventory(node)
        card = next((c for c in (inv.cards if inv else ()) if c.uuid == uuid), None)
        return card.slicing.pool if card is not None and card.slicing is not None else ""

    def _held(self, ckeys: dict[str, str], uid: str, node: str) -> PodAllocation | None:
        """This pod's existing reservations on ``node`` (a retried bind), merged; else None."""
        held = [self.state.ledger.reservation(k) for k in ckeys.values()]
        if not all(h is not None and h.pod_uid == uid and h.node == node for h in held):
            return None
        return PodAllocation(uid, node, tuple(h.containers[0] for h in held if h is not None))
