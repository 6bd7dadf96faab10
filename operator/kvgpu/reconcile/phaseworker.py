"""The claim-phase worker: a process of the leading operator that makes each kvgpu pod's
VGPUClaims follow the pod (:mod:`kvgpu.reconcile.phases`) and removes orphaned claims; it also
runs the DRA claim mirror (:mod:`kvgpu.reconcile.draworker`: a VGPUClaim per ResourceClaim of
driver ``gpu.kvgpu.io``).

Why a process of its own: these are many of the operator's writes (Released when a pod ends,
claims of deleted pods deleted, the GPUSlicesBound Event with ``--bind-events``) and its busiest watch (every
kvgpu pod update), and none of it needs the ledger. A bound or running pod costs no write here:
its claims were created holding their cards and stay without a phase until the pod ends
(:mod:`kvgpu.reconcile.phases`). In the operator's asyncio thread they delayed the extender's
filter and prioritize answers, which sit in kube-scheduler's serial scheduling cycle; here they
run on another core. The operator learns what it must free from the claims themselves: a claim
deleted or Released releases its reservation (``Runtime.on_claim``).

Started when the operator leads (never on a standby), ended with it (``PR_SET_PDEATHSIG``); if it
dies the operator stops, so the kubelet restarts the container with both.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from dataclasses import dataclass
from typing import Any

import structlog

from kvgpu import kube, procs
from kvgpu.core import keys
from kvgpu.reconcile.draworker import DraMirror
from kvgpu.reconcile.phases import TERMINAL, actions, pod_claims, slices_message
from kvgpu.watch import ListWatch, periodically

log = structlog.get_logger("kvgpu.phases")

#: pods remembered as having had their GPUSlicesBound Event (bounded; cleared when full)
MAX_EVENTED = 100_000


@dataclass(frozen=True)
class PhaseWorkerConfig:
    kubeconfig: str | None = None  # None: in-cluster service account
    orphan_grace_s: float = 30.0  # a claim younger than this may belong to a bind in flight
    sweep_interval_s: float = 15.0
    bind_events: bool = False  # a GPUSlicesBound Event per pod when it is first seen bound
    dra_mirror: bool = True  # mirror ResourceClaims of driver gpu.kvgpu.io (kvgpu.reconcile.draworker)


def pod_projection(pod: dict[str, Any]) -> dict[str, Any]:
    """What a missed deletion needs and what the sweep reads: identity, claims, and the node and
    phase :func:`~kvgpu.reconcile.phases.actions` derives the claims' phase from."""
    meta = pod.get("metadata") or {}
    out: dict[str, Any] = {k: meta.get(k) for k in ("name", "namespace", "uid")}
    claims = (meta.get("annotations") or {}).get(keys.POD_CLAIMS)
    if claims:
        out["annotations"] = {keys.POD_CLAIMS: claims}
    node = (pod.get("spec") or {}).get("nodeName")
    phase = (pod.get("status") or {}).get("phase")
    return {"metadata": out, **({"spec": {"nodeName": node}} if node else {}),
            **({"status": {"phase": phase}} if phase else {})}


def _ts(s: str) -> float:
    try:
        return datetime.datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()
    except ValueError:
        return 0.0


class PhaseWorker:
    def __init__(self, cfg: PhaseWorkerConfig, api: Any) -> None:
        self.cfg = cfg
        self.api = api
        self._phase: dict[str, str] = {}  # "ns/claim" -> phase written (or found at start)
        self._evented: set[str] = set()  # pod UIDs whose GPUSlicesBound Event was posted
        self._owner: dict[str, str] = {}  # "ns/claim" -> its spec.podUID, once read
        self.pods = ListWatch(api, "/api/v1/pods", self.on_pod, project=pod_projection,
                              label_selector=f"{keys.POD_MANAGED_LABEL}=true", name="pods")

    async def run(self) -> None:
        # Phases as recorded, so the first list of pods costs no write for claims already there,
        # and pods whose claims exist already had their Event (from an earlier run).
        for c in await kube.list_all(self.api, "vgpuclaims"):
            phase = (c.get("status") or {}).get("phase")
            if phase:
                self._phase[f"{c['metadata']['namespace']}/{c['metadata']['name']}"] = str(phase)
            if phase not in ("Released", "Failed"):
                self._evented.add(str((c.get("spec") or {}).get("podUID", "")))
        tasks = [asyncio.create_task(self.pods.run(), name="kvgpu-phases-pods"),
                 asyncio.create_task(self._sweep_loop(), name="kvgpu-phases-sweep")]
        if self.cfg.dra_mirror:
            tasks.append(asyncio.create_task(DraMirror(self.api, self.cfg.sweep_interval_s).run(),
                                             name="kvgpu-dra-mirror"))
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def _owns(self, ns: str, claim: str, uid: str) -> bool:
        """True when claim ``ns/claim`` exists and records pod ``uid`` (``spec.podUID``): a pod's
        ``kvgpu.io/claims`` may name another pod's claim (written by someone with rights on
        ``pods/status`` before admission guarded it); only the claim itself says whose it is."""
        key = f"{ns}/{claim}"
        if self._owner.get(key) == uid:
            return True
        c = await kube.get_claim(self.api, ns, claim)
        if c is None:
            return False
        if str((c.get("spec") or {}).get("podUID", "")) == uid:
            if len(self._owner) >= MAX_EVENTED:
                self._owner.clear()
            self._owner[key] = uid  # spec is immutable: asked once per claim
            return True
        log.warning("pod names a claim of another pod: left alone", claim=f"{ns}/{claim}", pod_uid=uid,
                    claim_pod_uid=(c.get("spec") or {}).get("podUID"))
        return False

    async def on_pod(self, etype: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        ns = meta["namespace"]
        uid = str(meta.get("uid", ""))
        if etype == "DELETED":
            # Leaving the label-filtered watch (the label removed) or missing from a relist is
            # not being deleted: ask the API server.
            live = await kube.get_pod(self.api, ns, str(meta.get("name", "")))
            if live is not None and str((live.get("metadata") or {}).get("uid", "")) == uid:
                log.warning("pod left the watch but still exists: its claims are kept",
                            pod=f"{ns}/{meta.get('name')}")
                etype, pod = "MODIFIED", pod_projection(live)
                meta = pod["metadata"]
        for a in actions(etype, pod):
            key = f"{ns}/{a.claim}"
            if a.delete:
                if await self._owns(ns, a.claim, uid):
                    await kube.delete_claim(self.api, ns, a.claim)
                self._phase.pop(key, None)
                self._owner.pop(key, None)
                continue
            if self._phase.get(key) in (a.phase, "Released", "Failed"):
                continue
            if not await self._owns(ns, a.claim, uid):
                continue
            if await kube.patch_claim_status(self.api, ns, a.claim, {"phase": a.phase, "message": a.message}):
                self._phase[key] = a.phase
        if etype == "DELETED" or (pod.get("status") or {}).get("phase") in TERMINAL:
            self._evented.discard(uid)
            if etype == "DELETED":  # an ended pod's later updates must not write Released again
                for c in pod_claims(pod):
                    self._phase.pop(f"{ns}/{c}", None)
                    self._owner.pop(f"{ns}/{c}", None)
            return
        bound = bool((pod.get("spec") or {}).get("nodeName")) and bool(pod_claims(pod))
        if bound and self.cfg.bind_events and uid not in self._evented:
            if len(self._evented) >= MAX_EVENTED:
                self._evented.clear()
            self._evented.add(uid)
            await kube.post_event(self.api, {"apiVersion": "v1", "kind": "Pod", "metadata": meta},
                                  reason="GPUSlicesBound", message=slices_message(pod))

    async def _sweep_loop(self) -> None:
        await periodically(self.pods.synced, self.sweep, self.cfg.sweep_interval_s, "orphan sweep")

    async def sweep(self) -> None:
        """Delete claims whose pod is gone (or is another pod now) after ``orphan_grace_s``; the
        operator frees them in the ledger when it sees them deleted."""
        pods = self.pods.known()
        now = time.time()
        claims = await kube.list_all(self.api, "vgpuclaims")
        for c in claims:
            meta, spec = c["metadata"], c.get("spec") or {}
            if (c.get("status") or {}).get("phase") in ("Released", "Failed"):
                continue
            if spec.get("resourceClaim"):
                continue  # a ResourceClaim's mirror: the DRA mirror keeps it (draworker)
            if str(spec.get("podUID", "")) in pods:
                continue
            if now - _ts(meta.get("creationTimestamp", "")) < self.cfg.orphan_grace_s:
                continue  # a bind in flight may not have bound the pod yet
            # Re-check the pod directly (the watch is label-filtered; the pod may be new).
            live = await kube.get_pod(self.api, meta["namespace"], spec.get("podName", ""))
            if live is not None and live["metadata"]["uid"] == spec.get("podUID"):
                continue
            log.info("removing orphaned claim", claim=f"{meta['namespace']}/{meta['name']}")
            if await kube.delete_claim(self.api, meta["namespace"], meta["name"]):
                await kube.post_event(self.api, c, reason="OrphanRemoved",
                                      message="the pod this claim belonged to no longer exists")


async def _main(cfg: PhaseWorkerConfig) -> None:
    api = await kube.connect(cfg.kubeconfig)
    try:
        await PhaseWorker(cfg, api).run()
    finally:
        await api.close()


def _process(cfg: PhaseWorkerConfig) -> None:
    from kvgpu.logs import configure_logging

    configure_logging()
    procs.run_child(_main(cfg))


def start(cfg: PhaseWorkerConfig) -> Any:
    """Start the worker process; returns it (``multiprocessing`` process object)."""
    return procs.spawn(_process, (cfg,), "kvgpu-phases")

