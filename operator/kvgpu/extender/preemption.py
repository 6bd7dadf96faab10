"""GPU preemption, the adapter: pods filter rejects → victims evicted, room held for the pod.

kube-scheduler cannot preempt for GPU memory or cores (docs/decisions.md, "GPU preemption in
the operator"), so the extender does it with the ledger's rules:

1. filter found no node for a GPU pod (:meth:`Preemption.rejected`, a sync call that only
   queues); one worker task takes the pods one at a time, each at most every ``retry_s``;
2. a pod with ``preemptionPolicy: Never`` gets an Event saying so and nothing else; otherwise
   its ``spec.priority`` (the API server's Priority admission fills it from the PriorityClass)
   against the priorities of the pods holding slices on the nodes filter was given (read from
   the API, cached by UID; a pod's priority never changes) and the PodDisruptionBudgets of their
   namespaces;
3. :func:`kvgpu.allocator.preempt.choose` (pure, in a thread) picks the node and victims;
4. the room is **held** for the pod (a nomination, in this process): while it lasts, filter
   keeps every pod of no higher priority off the cards the preemptor will take on that node
   (their requests get those cards' UUIDs excluded, so bind respects it too), and answers the
   preemptor only its nominated node when it fits there. Nothing is reserved in the ledger for
   it: the victims keep their reservations until their claims are released (their pods have
   gone), so the preemptor cannot land on a card its victims' processes still use, and no card
   ever reads over-committed;
5. victims are evicted through the Eviction API, one after the other (PodDisruptionBudgets
   apply). A refusal (429) drops the nomination, keeps that pod out of the next plans for
   ``protect_s`` and plans again with what is already evicted counted as leaving (up to three
   plans); kvgpu never deletes around it. Events: ``Preempted`` on each victim, ``GPUPreemption``
   or ``GPUPreemptionNotPossible`` on the preemptor;
6. the nomination is bounded: ``hold_s`` after the victims' reservations are gone (the
   preemptor is requeued when they free, like any pending pod) and at most the victims' grace
   period plus twice ``hold_s`` after the eviction; it ends when the pod is bound. Then pending
   pods are requeued (the ones kept off the cards may fit now).

State is in memory: a restart or a new leader forgets holds (the preemptor then competes for
the freed room like any pod; kube-scheduler's queue tries higher priority first).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import structlog
from kubernetes_asyncio.client.exceptions import ApiException

from kvgpu import kube
from kvgpu.allocator.preempt import HOLD_PREFIX, Budget, Holder, NoPlan, choose, fits_without, selector_matches
from kvgpu.core.requests import PodAllocation, PodRequest
from kvgpu.reconcile.state import OperatorState

log = structlog.get_logger("kvgpu.preemption")

MAX_NODES = 32  # nodes whose pods are read for one plan
ATTEMPTS = 3  # plans per pod and round when evictions are refused


@dataclass
class Nomination:
    uid: str
    ref: str  # namespace/name of the preemptor
    priority: int
    node: str
    hold: PodAllocation  # where the preemptor goes: other pods are kept off these cards
    victims: tuple[Holder, ...]
    deadline: float
    gone_at: float | None = None


@dataclass
class Preemption:
    state: OperatorState
    api: Any
    hold_s: float = 30.0
    retry_s: float = 5.0
    protect_s: float = 30.0
    nudge: Callable[[str], None] | None = None  # requeue pending pods (the runtime's)
    noms: dict[str, Nomination] = field(default_factory=dict)
    _holders: dict[str, Holder] = field(default_factory=dict)
    _labels: dict[str, dict[str, str]] = field(default_factory=dict)
    _grace: dict[str, int] = field(default_factory=dict)
    _tried: dict[str, float] = field(default_factory=dict)
    _said: dict[str, str] = field(default_factory=dict)
    _protected: dict[str, float] = field(default_factory=dict)
    _queue: dict[str, tuple[dict[str, Any], PodRequest, tuple[str, ...]]] = field(default_factory=dict)
    _wake: asyncio.Event | None = None
    _task: asyncio.Task[None] | None = None

    # ----- hooks (sync: called by filter) -------------------------------------------------------
    def filter(self, pod: dict[str, Any], req: PodRequest,
               names: list[str]) -> tuple[PodRequest, list[str], dict[str, str]]:
        """The ledger's filter, with the holds applied: a pod of no higher priority than a
        nominated preemptor gets that preemptor's cards excluded (the request returned, which
        bind then uses); the preemptor itself gets only its nominated node when it fits there."""
        if not self.noms:
            return req, *self.state.ledger.filter(req, names)
        nom = self.noms.get(req.uid)
        if nom is not None:
            feasible, reasons = self.state.ledger.filter(req, names)
            return req, [nom.node] if nom.node in feasible else feasible, reasons
        priority = _priority(pod)
        held = tuple(sorted({d.uuid for n in self.noms.values() if n.priority >= priority
                             for ca in n.hold.containers for d in ca.devices}))
        if held:
            req = replace(req, containers=tuple(
                replace(c, exclude_uuids=(*c.exclude_uuids, *held)) for c in req.containers))
        return req, *self.state.ledger.filter(req, names)

    def rejected(self, pod: dict[str, Any], req: PodRequest, names: Iterable[str]) -> None:
        """Filter found no node for ``pod``: consider preempting for it (queued, not done here)."""
        uid = req.uid
        now = time.monotonic()
        if uid in self.noms or now - self._tried.get(uid, -1e9) < self.retry_s:
            return
        if len(self._tried) > 10_000:
            self._tried.clear()
            self._said.clear()
        self._tried[uid] = now
        self._queue[uid] = (pod, req, tuple(names))
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name="kvgpu-preemption")
        assert self._wake is not None
        self._wake.set()

    # ----- the worker ---------------------------------------------------------------------------
    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            if not self._queue:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=1.0)
            self._expire()
            if not self._queue:
                if not self.noms:
                    return  # started again by the next rejected pod
                continue
            uid = next(iter(self._queue))
            pod, req, names = self._queue.pop(uid)
            try:
                await self._consider(pod, req, names)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("GPU preemption failed", pod=f"{req.namespace}/{req.name}", error=repr(e)[:300])

    async def _consider(self, pod: dict[str, Any], req: PodRequest, names: tuple[str, ...]) -> None:
        spec = pod.get("spec") or {}
        if spec.get("preemptionPolicy") == "Never":
            await self._say(pod, "preemptionPolicy is Never: kvgpu evicts no pod for it; "
                                 "it waits for free GPU capacity")
            return
        priority = _priority(pod)
        for _ in range(ATTEMPTS):
            if req.uid in self.noms or self.state.ledger.pod_node(req.uid) is not None:
                return
            invs = {n: inv for n in names if (inv := self.state.sliced.get(n)) is not None}
            allocs = [*self.state.ledger.reservations().values(), *(n.hold for n in self.noms.values())]
            busy = {a.node for a in allocs if a.node in invs and not a.pod_uid.startswith(HOLD_PREFIX)}
            order = [n for n in names if n in busy][:MAX_NODES]
            if not order:
                await self._say(pod, "no pod holds GPU slices on the nodes it may use: nothing to preempt")
                return
            await self._learn(order, allocs)
            now = time.monotonic()
            holders = {u: h for u, h in self._holders.items() if self._protected.get(u, 0) <= now}
            budgets = await self._budgets([h for h in holders.values() if h.priority < priority])
            got = await asyncio.to_thread(choose, req, priority, invs, allocs, holders, budgets, nodes=order)
            if isinstance(got, NoPlan):
                if not got.wait:
                    await self._say(pod, f"no lower-priority pods whose eviction would make room "
                                         f"(priority {priority}): {got.reason}")
                return
            # The ledger may have changed during the awaits: place the pod again, now.
            node = got.node
            on_node: dict[str, list[PodAllocation]] = {}
            for a in [*self.state.ledger.reservations().values(), *(n.hold for n in self.noms.values())]:
                if a.node == node:
                    on_node.setdefault(a.pod_uid, []).append(a)
            leaving = {u for u in on_node if (h := self._holders.get(u)) is not None and h.terminating}
            alloc = fits_without(req, invs[node], on_node, leaving | {v.uid for v in got.victims})
            if alloc is None or req.uid in self.noms:
                continue
            grace = max((self._grace.get(v.uid, 30) for v in got.victims), default=30)
            nom = Nomination(req.uid, f"{req.namespace}/{req.name}", priority, node,
                             PodAllocation(HOLD_PREFIX + req.uid, node, alloc.containers), got.victims,
                             time.monotonic() + min(grace, 600) + 2 * self.hold_s)
            self.noms[req.uid] = nom
            if await self._evict(pod, priority, nom):
                return
        await self._say(pod, "evictions were refused (PodDisruptionBudget); trying again later")

    async def _evict(self, pod: dict[str, Any], priority: int, nom: Nomination) -> bool:
        """Evict the victims in turn; False (hold dropped) when one is refused."""
        names = ", ".join(f"{v.ref} (priority {v.priority})" for v in nom.victims)
        log.info("GPU preemption", pod=nom.ref, node=nom.node, victims=names)
        for v in nom.victims:
            try:
                await kube.evict_pod(self.api, v.namespace, v.name, v.uid)
            except ApiException as e:
                if e.status in (404, 409):  # gone already (409: another pod under the name now)
                    continue
                self._protected[v.uid] = time.monotonic() + self.protect_s
                why = "a PodDisruptionBudget forbids it" if e.status == 429 else f"HTTP {e.status}"
                log.info("eviction refused", pod=v.ref, preemptor=nom.ref, status=e.status)
                await self._say(pod, f"eviction of {v.ref} on {nom.node} refused ({why}); "
                                     "looking for other pods of lower priority")
                self._drop(nom, f"eviction of {v.ref} refused")
                return False
            self._holders[v.uid] = Holder(v.uid, v.namespace, v.name, v.priority, terminating=True)
            await kube.post_event(self.api, _pod_ref(v.namespace, v.name, v.uid), reason="Preempted",
                                  message=f"preempted by {nom.ref} (priority {priority}) for GPU memory "
                                          f"on node {nom.node}")
        await self._say(pod, f"evicting {names} on node {nom.node}: their GPU capacity is held for this pod",
                        reason="GPUPreemption", warning=False)
        return True

    # ----- reading the cluster ------------------------------------------------------------------
    async def _learn(self, nodes: list[str], allocs: list[PodAllocation]) -> None:
        """Holders for the pods on ``nodes``: read the nodes' pods where one is not known yet."""
        live = {a.pod_uid for a in allocs}
        for u in [u for u in self._holders if u not in live]:
            for d in (self._holders, self._labels, self._grace, self._protected):
                d.pop(u, None)
        want: dict[str, set[str]] = {}
        for a in allocs:
            if a.node in nodes and not a.pod_uid.startswith(HOLD_PREFIX):
                want.setdefault(a.node, set()).add(a.pod_uid)
        for node in nodes:
            if want.get(node, set()) <= self._holders.keys():
                continue
            for p in await kube.list_node_pods(self.api, node):
                meta, spec = p.get("metadata") or {}, p.get("spec") or {}
                uid = str(meta.get("uid") or "")
                if uid not in live:
                    continue
                self._holders[uid] = Holder(uid, str(meta.get("namespace")), str(meta.get("name")),
                                            int(spec.get("priority") or 0), bool(meta.get("deletionTimestamp")))
                self._labels[uid] = dict(meta.get("labels") or {})
                self._grace[uid] = int(spec.get("terminationGracePeriodSeconds") or 30)

    async def _budgets(self, candidates: list[Holder]) -> list[Budget]:
        out: list[Budget] = []
        for ns in sorted({h.namespace for h in candidates}):
            for pdb in await kube.list_pdbs(self.api, ns):
                meta, st = pdb.get("metadata") or {}, pdb.get("status") or {}
                sel = (pdb.get("spec") or {}).get("selector")
                uids = frozenset(h.uid for h in candidates
                                 if h.namespace == ns and selector_matches(sel, self._labels.get(h.uid, {})))
                if not uids:
                    continue
                fresh = int(st.get("observedGeneration") or 0) >= int(meta.get("generation") or 0)
                allowed = int(st.get("disruptionsAllowed") or 0) if fresh else 0
                out.append(Budget(f"{ns}/{meta.get('name')}", uids, allowed))
        return out

    # ----- holds --------------------------------------------------------------------------------
    def _expire(self) -> None:
        now = time.monotonic()
        for nom in list(self.noms.values()):
            if self.state.ledger.pod_node(nom.uid) is not None:  # bound: done
                self.noms.pop(nom.uid, None)
                self._said.pop(nom.uid, None)
                continue
            if nom.gone_at is None and all(self.state.ledger.pod_node(v.uid) is None for v in nom.victims):
                nom.gone_at = now
            if now > nom.deadline or (nom.gone_at is not None and now > nom.gone_at + self.hold_s):
                self._drop(nom, "the hold expired")

    def _drop(self, nom: Nomination, why: str) -> None:
        if self.noms.pop(nom.uid, None) is None:
            return
        log.info("GPU hold released", pod=nom.ref, node=nom.node, why=why)
        if self.nudge is not None:  # pods kept off its cards may fit now
            self.nudge(f"hold of {nom.ref} released")

    async def _say(self, pod: dict[str, Any], message: str, *, reason: str = "GPUPreemptionNotPossible",
                   warning: bool = False) -> None:
        uid = str(pod["metadata"].get("uid", ""))
        if self._said.get(uid) == message:
            return
        self._said[uid] = message
        await kube.post_event(self.api, {"apiVersion": "v1", "kind": "Pod", "metadata": pod["metadata"]},
                              reason=reason, message=message, type_="Warning" if warning else "Normal")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


def _priority(pod: dict[str, Any]) -> int:
    """``spec.priority`` (filled by the API server from the PriorityClass; 0 without one)."""
    return int((pod.get("spec") or {}).get("priority") or 0)


def _pod_ref(namespace: str, name: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": namespace, "name": name, "uid": uid}}
