"""Bind: pick the cards on the node kube-scheduler chose, record them, then bind the pod.

Order (each step idempotent, so kube-scheduler may retry a bind at any point; binds of one
pod run one at a time, a retry of a pod this process already bound elsewhere is refused at once):

0. with the request filter parsed for this pod, ``allocate`` + ``reserve`` on the node before
   any API call, so the next pods' filters see the cards taken (without this, a burst piles
   onto the node prioritize likes best while the first binds wait for the API);
1. without step 0 (no filter hint: a retry, or filter ran in another process), read the pod;
   refuse if its UID differs (a new pod with the same name) or if it is already bound
   elsewhere; a pod already bound to this node with its claims present is a success. With step
   0 the pod is not read (filter had it a moment ago): the Binding's UID precondition and its
   409 for a bound pod catch what the read would, and a claim that already exists makes the
   bind read the pod after all;
2. ``allocate`` + the namespace's quotas (:meth:`OperatorState.check_quota`: the pod's usage
   from the grants, refused with the quota, used, requested and hard amounts) + ``reserve`` in
   the ledger (unless step 0 did, for the same request, with the same check), one key per
   container claim, with no ``await`` in between (this is what makes concurrent binds on one
   node safe without a node lock, and binds of one namespace unable to pass a quota together);
   a retry that finds this pod's reservations on the same node reuses them;
3. create one VGPUClaim per sliced container (deterministic name; an existing claim of the
   same pod UID on this node is accepted, one on another node of the still unbound pod is a
   leftover of a bind cut short and is replaced, one of another pod is an error);
4. create the Binding carrying the allocation annotations the container's env and claim file
   read (downward API): the API server merges them into the pod in the same write that sets
   ``spec.nodeName``; answer. The claims need no further write while the pod holds them: a
   claim without a phase is Bound (the claim-phase worker, :mod:`kvgpu.reconcile.phaseworker`,
   writes Released when the pod ends, and posts the optional GPUSlicesBound Event).

Any failure (API errors and unexpected ones too) releases the ledger keys and deletes the
claims this attempt created, so nothing stays reserved; the error goes back to kube-scheduler,
which retries.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
from kubernetes_asyncio.client.exceptions import ApiException

from kvgpu import faults, kube
from kvgpu.allocator.ledger import AllocationError
from kvgpu.api.requests import RequestError, parse_pod
from kvgpu.core import keys
from kvgpu.core.claimstr import ClaimDevice, ClaimString
from kvgpu.core.requests import PodAllocation, PodRequest
from kvgpu.extender.protocol import BindingArgs
from kvgpu.reconcile.state import OperatorState, allocation_from_claim, claim_key

log = structlog.get_logger("kvgpu.bind")

#: What an API call can raise when the API server is away or the connection breaks mid-call
#: (aiohttp's ServerDisconnectedError and ClientPayloadError are not OSErrors).
API_ERRORS: tuple[type[BaseException], ...] = (ApiException, OSError, aiohttp.ClientError, TimeoutError)


def claim_name(pod_name: str, container: str, pod_uid: str) -> str:
    """Deterministic VGPUClaim name for (pod, container): ``<pod>-<container>-<uid[:5]>``,
    shortened with a hash when longer than 253 characters."""
    name = f"{pod_name}-{container}-{pod_uid[:5]}".lower()
    if len(name) <= 253:
        return name
    h = hashlib.sha256(f"{pod_name}/{container}/{pod_uid}".encode()).hexdigest()[:10]
    return f"{pod_name[:230]}-{h}".lower()


def claim_body(pod: dict[str, Any], alloc: PodAllocation, container: str, pool: str = "") -> dict[str, Any]:
    """The VGPUClaim for one container of ``alloc``, as :class:`~kvgpu.api.models.VGPUClaim`
    writes it (``to_body()``, the printer columns' summary fields filled), built directly: a
    claim per bind, in the process that answers kube-scheduler (the model's validation and dump
    cost ~0.1 ms; the values come from the ledger and a pod the API server accepted, and the
    CRD's schema checks them again). A unit test holds it equal to the model's body."""
    meta = pod["metadata"]
    ca = next(c for c in alloc.containers if c.container == container)
    devices = [{"uuid": d.uuid, "index": d.index, "model": d.model, "memory": d.memory_mib, "cores": d.cores}
               for d in ca.devices]
    return {
        "apiVersion": f"{keys.GROUP}/{keys.VERSION}",
        "kind": "VGPUClaim",
        "metadata": {
            "name": claim_name(meta["name"], container, meta["uid"]),
            "namespace": meta["namespace"],
            "labels": {"kvgpu.io/pod-uid": meta["uid"], "kvgpu.io/node": keys.label_value(alloc.node)},
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
            "devices": devices,
            "gpuSummary": ",".join(str(d["index"]) for d in devices),
            "memorySummary": _summary(f"{d['memory']}Mi" for d in devices),
            "coresSummary": _summary(f"{d['cores']}%" for d in devices),
        },
    }


def _summary(values: Any) -> str:
    """Distinct values in order, comma-separated (the claim's printer-column summaries)."""
    return ",".join(dict.fromkeys(values))


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
            mode="mps" if any(d.mode == "mps" for d in ca.devices) else "hami-core",
        )
        ann[keys.claim_annotation(ca.container)] = cs.encode()
        ann[keys.devices_annotation(ca.container)] = ",".join(d.uuid for d in ca.devices)
    ann[keys.POD_CLAIMS] = ",".join(names)
    return ann


def api_error_text(e: BaseException) -> str:
    """An API call's failure for people (logs, the scheduler's Event on the pod): the API
    server's Status message and reason, never its raw JSON body."""
    if isinstance(e, ApiException):
        return faults.status_message(e)
    return faults.expected(e) or (str(e) or type(e).__name__)[:300]


def bound_cards(alloc: PodAllocation) -> str:
    """The cards of a bind, for its log line: ``main=0:3000MiB/30%,1:3000MiB/30%``."""
    return " ".join(
        f"{ca.container}=" + ",".join(f"{d.index}:{d.memory_mib}MiB/{d.cores}%" for d in ca.devices)
        for ca in alloc.containers)


def claim_keys(req: PodRequest) -> dict[str, str]:
    """Container → the ledger key of its claim (``<namespace>/<claim name>``)."""
    return {c.container: claim_key(req.namespace, claim_name(req.name, c.container, req.uid))
            for c in req.containers}


@dataclass
class _Attempt:
    """One bind attempt of a pod: what it read, what it changed (undone on failure)."""

    args: BindingArgs
    pod: dict[str, Any]  # the live pod, or its name and UID only while ``unread``
    req: PodRequest
    bound_to: str | None  # the node the pod is bound to already (a retried bind)
    unread: bool = False  # the pod was not read (step 0 reserved with filter's request)
    early: PodRequest | None = None  # the request step 0 reserved with
    created: list[str] = field(default_factory=list)  # claims this attempt created
    replaced: list[dict[str, Any]] = field(default_factory=list)  # stale claims it deleted
    ckeys: dict[str, str] = field(init=False)  # container -> ledger key

    def __post_init__(self) -> None:
        self.ckeys = claim_keys(self.req)

    @property
    def who(self) -> str:
        return f"{self.args.pod_namespace}/{self.args.pod_name}"


class BindError(RuntimeError):
    """A bind that failed; the message goes back to kube-scheduler and into a pod Event."""


class Binder:
    #: filter hints kept at most (pods filtered but never bound: chosen elsewhere, deleted)
    MAX_HINTS = 50_000

    def __init__(self, state: OperatorState, api: Any, metrics: Any = None) -> None:
        self.state = state
        self.api = api
        self.metrics = metrics
        # pod UID -> the request filter parsed; bind reserves with it before its first API call
        self._hints: dict[str, PodRequest] = {}
        # pod UID -> [lock, users]: binds of one pod run one at a time (kube-scheduler retries a
        # bind that timed out while the first attempt may still be running here)
        self._locks: dict[str, list[Any]] = {}
        # pod UID -> node, for pods this process bound: a bind retried by kube-scheduler after
        # a timeout (the first attempt finished late) is answered without an API call
        self._bound_to: dict[str, str] = {}

    def remember(self, uid: str, req: PodRequest) -> None:
        """Called by filter for a pod it found room for. The bind that follows reserves the
        cards before reading the pod, so the next pods' filters see them taken at once (with
        a read first, a burst piles onto the node prioritize likes best, and most of those
        binds then fail and retry)."""
        if len(self._hints) >= self.MAX_HINTS:
            self._hints.clear()
        self._hints[uid] = req

    def hint(self, uid: str) -> PodRequest | None:
        """The request filter parsed for pod ``uid`` (prioritize reuses it), if any."""
        return self._hints.get(uid)

    def _reserve_early(self, args: BindingArgs) -> PodRequest | None:
        """Reserve with filter's request when the pod holds nothing yet; returns the request
        used (None: no hint, or a retry that holds reservations). No room: BindError, at once."""
        hint = self._hints.pop(args.pod_uid, None)
        if hint is None or self.state.ledger.pod_node(args.pod_uid) is not None:
            return None
        req = PodRequest(args.pod_namespace, args.pod_name, args.pod_uid, hint.containers, hint.node_policy,
                         hint.gpu_policy)
        self._reserve(req, args.node, claim_keys(req))
        return req

    def _reserve(self, req: PodRequest, node: str, ckeys: dict[str, str]) -> PodAllocation:
        """``allocate`` + the namespace's quotas + ``reserve`` of pod ``req`` on ``node``, one
        ledger key per container claim (``ckeys``: container → key). A plain function on
        purpose: no ``await`` can come between the allocation and its reservation, which is what
        makes concurrent binds on one node, and binds of one namespace against its quotas, safe
        without locks. No room (or over a quota): the pod's reservations are released and
        BindError raised."""
        try:
            alloc = self.state.ledger.allocate(req, node)
            self.state.check_quota(req.namespace, alloc)  # QuotaExceeded (an AllocationError): same step
            for ca in alloc.containers:
                self.state.reserve(ckeys[ca.container], PodAllocation(req.uid, node, (ca,)))
        except (AllocationError, ValueError) as e:
            self.state.release_pod(req.uid)
            raise BindError(str(e)) from e
        return alloc

    async def bind(self, args: BindingArgs) -> str:
        """Run the bind; return "" on success or the error message (nothing left reserved)."""
        t0 = time.perf_counter()
        who = f"{args.pod_namespace}/{args.pod_name}"
        try:
            await self._bind(args)
            return ""
        except BindError as e:
            if self.metrics is not None:
                self.metrics.bind_failures.labels(reason="bind").inc()
            log.info("bind failed", pod=f"{args.pod_namespace}/{args.pod_name}", node=args.node, error=str(e))
            return str(e)
        except (ApiException, OSError, TimeoutError, aiohttp.ClientError) as e:  # the API server is away
            self.state.release_pod(args.pod_uid)
            if self.metrics is not None:
                self.metrics.bind_failures.labels(reason="api").inc()
            why = api_error_text(e)
            log.info("bind failed: API error", pod=who, node=args.node, error=why)
            return f"binding {who} to {args.node} failed: {why}"[:2000]
        except Exception as e:  # a bug or an answer we did not expect: keep nothing, tell the scheduler
            self.state.release_pod(args.pod_uid)
            if self.metrics is not None:
                self.metrics.bind_failures.labels(reason="internal").inc()
            log.exception("bind failed unexpectedly", pod=who, node=args.node)
            return f"kvgpu could not bind {who} to {args.node}: {e!r}"[:2000]
        finally:
            if self.metrics is not None:
                self.metrics.extender_latency.labels(verb="bind").observe(time.perf_counter() - t0)

    async def _bind(self, args: BindingArgs) -> None:
        entry = self._locks.get(args.pod_uid)
        if entry is None:
            entry = self._locks[args.pod_uid] = [asyncio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:
                await self._bind_once(args)
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                self._locks.pop(args.pod_uid, None)

    async def _bind_once(self, args: BindingArgs) -> None:
        done = self._bound_to.get(args.pod_uid)
        if done is not None and done != args.node:
            raise BindError(f"pod {args.pod_namespace}/{args.pod_name} is already bound to {done}")
        early = self._reserve_early(args)
        try:
            await self._bind_pod(args, early)
        except BaseException:
            if early is not None:
                self.state.release_pod(args.pod_uid)
            raise

    async def _read_pod(self, args: BindingArgs) -> tuple[dict[str, Any], str | None]:
        """The live pod and the node it is bound to; BindError when it is gone, is another pod
        now, or is bound to another node."""
        ns, name, node = args.pod_namespace, args.pod_name, args.node
        pod = await kube.get_pod(self.api, ns, name)
        if pod is None:
            raise BindError(f"pod {ns}/{name} no longer exists")
        if pod["metadata"].get("uid") != args.pod_uid:
            raise BindError(f"pod {ns}/{name} has UID {pod['metadata'].get('uid')}, not {args.pod_uid}")
        bound_to = (pod.get("spec") or {}).get("nodeName")
        if bound_to and bound_to != node:
            raise BindError(f"pod {ns}/{name} is already bound to {bound_to}")
        return pod, bound_to

    async def _bind_pod(self, args: BindingArgs, early: PodRequest | None) -> None:
        """Steps 1–4 for one attempt (module docstring); on failure nothing stays reserved and
        the claims this attempt created are deleted again."""
        at = await self._attempt(args, early)
        alloc = self._ledger_step(at)  # step 2, synchronously
        try:
            for ca in alloc.containers:  # step 3
                await self._claim(at, alloc, ca.container)
            if not at.bound_to:  # step 4
                await self._create_binding(at, alloc)
        except (BindError, *API_ERRORS) as e:  # type: ignore[misc]
            await self._undo(at)
            if isinstance(e, BindError):
                raise
            raise BindError(f"binding {at.who} to {args.node} failed: {api_error_text(e)}") from e
        self._bound(at, alloc)

    async def _attempt(self, args: BindingArgs, early: PodRequest | None) -> _Attempt:
        """Step 1: the pod and its request — filter's (``early``, step 0 reserved with it: the
        pod is not read) or parsed from the live pod (BindError when it is not one of ours)."""
        ns, name = args.pod_namespace, args.pod_name
        if early is not None:
            pod: dict[str, Any] = {"metadata": {"name": name, "namespace": ns, "uid": args.pod_uid}}
            return _Attempt(args, pod, early, None, unread=True, early=early)
        pod, bound_to = await self._read_pod(args)
        try:
            parsed = parse_pod(pod, self.state.default_pool_spec())
        except RequestError as e:
            raise BindError(f"invalid GPU request: {e}") from e
        if parsed is None:
            raise BindError(f"pod {ns}/{name} requests no GPU slices; it should not use {keys.SCHEDULER_NAME}")
        if not keys.webhook_admitted(pod):
            raise BindError(f"pod {ns}/{name}: {keys.NOT_ADMITTED}")
        req = PodRequest(ns, name, args.pod_uid, parsed.containers, parsed.node_policy, parsed.gpu_policy)
        return _Attempt(args, pod, req, bound_to)

    def _ledger_step(self, at: _Attempt) -> PodAllocation:
        """Step 2: what this pod holds on the node already (a retry, or step 0 for the same
        request), else a fresh reservation (:meth:`_reserve`)."""
        uid, node = at.args.pod_uid, at.args.node
        reused = self._held(at.ckeys, uid, node)
        if at.early is not None and at.early != at.req:
            reused = None  # the pod's request changed since filter: allocate for the live one
        if reused is not None:
            return reused
        self.state.release_pod(uid)  # a retry towards another node
        return self._reserve(at.req, node, at.ckeys)

    async def _claim(self, at: _Attempt, alloc: PodAllocation, container: str) -> None:
        """Step 3 for one container: create its VGPUClaim, or settle with the one that exists."""
        ns, node = at.args.pod_namespace, at.args.node
        ca = next(c for c in alloc.containers if c.container == container)
        body = claim_body(at.pod, alloc, container, self.state.pool_of(node, ca.devices[0].uuid))
        cname, key = body["metadata"]["name"], at.ckeys[container]
        try:
            self._record_uid(key, await kube.create_claim(self.api, ns, body))
            at.created.append(cname)
            return
        except ApiException as e:
            if e.status != 409:
                raise
        if at.unread:  # the claim exists: this is not a first bind after all; look
            _, at.bound_to = await self._read_pod(at.args)
            at.unread = False
        old = await kube.get_claim(self.api, ns, cname)
        if old is None or old["spec"].get("podUID") != at.args.pod_uid:
            raise BindError(f"claim {cname} exists for another pod (or was just deleted); retry")
        mine = PodAllocation(at.args.pod_uid, node, (ca,))
        try:
            _, theirs = allocation_from_claim(old)
        except (KeyError, ValueError, TypeError):
            theirs = None
        if theirs == mine:  # a retried bind that got the same slices: keep the claim
            self._record_uid(key, old["metadata"].get("uid"))
            return
        if at.bound_to:
            self._hold_existing(at, key, cname, old, theirs)
            return
        # The pod is unbound: the claim was left by an attempt that died or failed half-way
        # (operator killed, connection lost) with other slices or another node, and no other
        # bind of this pod runs: replace it with this attempt's.
        log.info("replacing a stale claim", claim=f"{ns}/{cname}", old_node=old["spec"].get("node"), node=node)
        await kube.delete_claim(self.api, ns, cname)
        at.replaced.append(old)
        self._record_uid(key, await kube.create_claim(self.api, ns, body))
        at.created.append(cname)

    def _hold_existing(self, at: _Attempt, key: str, cname: str, old: dict[str, Any],
                       theirs: PodAllocation | None) -> None:
        """The pod is bound here already, and its annotations were made from this claim (created
        before the Binding that landed): the claim is the record; hold what it says."""
        ns, node = at.args.pod_namespace, at.args.node
        if theirs is None or theirs.node != node:
            raise BindError(f"pod {at.who} is bound to {node} but claim {cname} says otherwise")
        self.state.release_key(key)
        self.state.reserve(key, theirs, force=True)
        self._record_uid(key, old["metadata"].get("uid"))
        log.info("pod already bound here: holding what its claim says", claim=f"{ns}/{cname}")

    async def _create_binding(self, at: _Attempt, alloc: PodAllocation) -> None:
        """Step 4: the Binding, carrying the allocation annotations. The API server merges a
        Binding's annotations into the pod in the write that sets spec.nodeName: one write
        instead of two, no validating-webhook round trip, and a pod is never seen annotated but
        unbound (or bound without its annotations)."""
        ns, name, uid, node = at.args.pod_namespace, at.args.pod_name, at.args.pod_uid, at.args.node
        try:
            await kube.create_binding(self.api, ns, name, uid, node,
                                      annotations=allocation_annotations(ns, at.pod, alloc))
        except API_ERRORS:
            # The Binding may have landed although we saw an error (a timeout under load, a
            # connection cut): if this pod is bound here now, this bind succeeded; releasing its
            # claims would leave a running pod unaccounted.
            if await self._live_node(ns, name, uid) != node:
                raise
            log.info("binding reported an error but the pod is bound here", pod=at.who, node=node)

    async def _undo(self, at: _Attempt) -> None:
        """A failed attempt: delete the claims it created, release the pod's reservations, and
        restore stale claims it replaced if they were right after all."""
        ns = at.args.pod_namespace
        for cname in at.created:
            try:
                await kube.delete_claim(self.api, ns, cname)  # (release_pod below forgets its UID)
            except API_ERRORS:
                # Left behind: a retry replaces it (its slices or node differ, the pod is
                # unbound) or keeps it (the same); the orphan sweep removes it if the pod goes.
                pass
        self.state.release_pod(at.args.pod_uid)
        if at.replaced:
            await self._restore(ns, at.args.pod_name, at.args.pod_uid, at.replaced)

    def _bound(self, at: _Attempt, alloc: PodAllocation) -> None:
        """The pod is bound: answer kube-scheduler. Its claims are complete as created (no phase:
        Bound)."""
        uid, node = at.args.pod_uid, at.args.node
        self.state.forget_pending(uid)
        if len(self._bound_to) >= self.MAX_HINTS:
            self._bound_to.clear()
        self._bound_to[uid] = node
        names = sorted(k.partition("/")[2] for k in at.ckeys.values())
        log.info("bound", pod=at.who, node=node, claims=",".join(names), cards=bound_cards(alloc))

    async def _restore(self, ns: str, name: str, uid: str, olds: list[dict[str, Any]]) -> None:
        """This attempt replaced claims it judged stale (the pod looked unbound) and then failed:
        if the pod is bound now to the node those claims named — the Binding of an attempt cut
        short (operator killed) landed after all — they were right: create them again and hold
        them in the ledger, or the running pod would be unaccounted."""
        bound = await self._live_node(ns, name, uid)
        for old in olds:
            if not bound or old["spec"].get("node") != bound:
                continue
            body = {"apiVersion": old.get("apiVersion"), "kind": old.get("kind"), "spec": old["spec"],
                    "metadata": {k: v for k, v in old["metadata"].items()
                                 if k in ("name", "namespace", "labels", "annotations", "ownerReferences")}}
            key, alloc = allocation_from_claim(old)
            try:
                # The new object's UID: the old object's deletion, still on its way through the
                # claims watch, names the same slices and must not free the restored claim.
                self._record_uid(key, await kube.create_claim(self.api, ns, body))
            except ApiException as e:
                if e.status != 409:
                    log.warning("could not restore a claim", claim=f"{ns}/{old['metadata']['name']}", error=str(e))
                    continue
            self.state.reserve(key, alloc, force=True)
            log.info("restored a claim: the pod was bound by an earlier attempt", claim=key, node=bound)

    def _record_uid(self, key: str, uid: Any) -> None:
        """Remember which claim object holds ``key`` (its UID), so that events of an older object
        under the same name do not free it (Runtime.on_claim)."""
        if isinstance(uid, str) and uid:
            self.state.record_claim_uid(key, uid)

    async def _live_node(self, ns: str, name: str, uid: str) -> str | None:
        """The node pod ``ns/name`` with UID ``uid`` is bound to now; None when it is unbound,
        gone, another pod, or the API server cannot say."""
        try:
            now = await kube.get_pod(self.api, ns, name)
        except API_ERRORS:
            return None
        if now is None or now["metadata"].get("uid") != uid:
            return None
        return (now.get("spec") or {}).get("nodeName") or None

    def _held(self, ckeys: dict[str, str], uid: str, node: str) -> PodAllocation | None:
        """This pod's existing reservations on ``node`` (a retried bind), merged; else None."""
        held = [self.state.ledger.reservation(k) for k in ckeys.values()]
        if not all(h is not None and h.pod_uid == uid and h.node == node for h in held):
            return None
        return PodAllocation(uid, node, tuple(h.containers[0] for h in held if h is not None))
