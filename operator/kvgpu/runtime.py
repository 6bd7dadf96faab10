"""The operator process. One asyncio loop runs Kopf (VGPUPool reconciler), the list-and-watch
streams of Nodes and VGPUClaims (:mod:`kvgpu.watch`), the extender's HTTP server and background
tasks, sharing one :class:`OperatorState`. Child processes it starts and watches: the admission
webhook workers (:mod:`kvgpu.admission.server`) and, while it leads, the claim-phase worker
(:mod:`kvgpu.reconcile.phaseworker`).

Start-up order: list nodes, pools and claims → rebuild the ledger → only then does the extender
answer filter/bind (before that it tells kube-scheduler to retry) → the watches keep the state
live. Background tasks write node allocation annotations and VGPUPool status when they change,
re-reserve claims the ledger lacks, and requeue pending pods when capacity frees.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kopf
import structlog
from aiohttp import web
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from kvgpu import faults, kube
from kvgpu.core import keys
from kvgpu.extender import tls
from kvgpu.extender.choice import NodeChoice
from kvgpu.extender.server import Extender
from kvgpu.extender.tls import DEFAULT_ALLOWED_CLIENTS
from kvgpu.metrics import OperatorMetrics
from kvgpu.reconcile import advertise, handlers, poolstatus
from kvgpu.reconcile.state import OperatorState, allocation_from_claim
from kvgpu.watch import ListWatch

log = structlog.get_logger("kvgpu.operator")


@dataclass
class OperatorConfig:
    """How to run the operator. Ports 0 = pick a free one (dev/tests)."""

    kubeconfig: str | None = None  # None: in-cluster service account
    extender_host: str = "127.0.0.1"
    extender_port: int = 8888
    # Mutual TLS on the extender port (kvgpu.extender.tls): serving cert/key, the CA that signs
    # the clients' certificates, and the identities (CN or DNS/URI SAN) answered. All three
    # files are required unless extender_insecure (plain HTTP, no client check: dev/bench only).
    extender_cert: str | None = None
    extender_key: str | None = None
    extender_client_ca: str | None = None
    extender_allowed_clients: tuple[str, ...] = DEFAULT_ALLOWED_CLIENTS
    extender_insecure: bool = False
    # Plain HTTP port for /healthz, /readyz and /metrics only (kubelet probes, Prometheus).
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: not served (0: any free port)
    webhook_port: int | None = None  # None: no admission webhooks served
    webhook_host: str = "127.0.0.1"
    webhook_cert: str | None = None
    webhook_key: str | None = None
    webhook_ca: str | None = None  # PEM bundle the API server uses to trust the webhook
    webhook_workers: int = 2  # processes serving admission (kvgpu.admission.server)
    dev_webhook_configurations: bool = False  # create the webhook configurations pointing at us
    exclude_namespaces: tuple[str, ...] = ()
    operator_usernames: tuple[str, ...] = ()
    standalone: bool = True
    priority: int = 0
    peering_name: str = "kvgpu"
    sweep_interval_s: float = 15.0
    flush_interval_s: float = 0.5
    pool_status_interval_s: float = 5.0  # allocation totals in VGPUPool status, at most this often
    orphan_grace_s: float = 30.0
    bind_events: bool = True  # a GPUSlicesBound Event per pod (posted by the claim-phase worker)
    node_choice: NodeChoice = NodeChoice.EXTENDER  # who picks a GPU pod's node (kvgpu.extender.choice)
    ready_file: str | None = None  # written with the extender URL once ready
    # Leader election on a Lease: every replica watches (a warm standby), only the leader
    # answers the extender, reports ready and writes. Losing the lease ends the process.
    leader_elect: bool = False
    lease_namespace: str = "kvgpu-system"
    lease_name: str = "kvgpu-operator"
    identity: str = ""  # default: host name + PID
    lease_duration_s: int = 15


@dataclass
class Runtime:
    cfg: OperatorConfig
    state: OperatorState = field(default_factory=OperatorState)
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    api: Any = None
    extender: Extender | None = None
    extender_port: int = 0
    metrics_port: int = 0  # the plain probe/metrics port, once listening (0: none)
    pools_dirty: bool = True  # a pool or the leadership changed: write pool status at the next flush
    _pool_usage_dirty: bool = False  # allocations changed: pool status within pool_status_interval_s
    _pool_status_due: float = 0.0  # time.monotonic() before which allocation-only changes wait
    _runner: web.AppRunner | None = None
    _probe_runner: web.AppRunner | None = None
    _tls_reloader: tls.Reloader | None = None
    _webhook_procs: list[Any] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _checks: set[asyncio.Task[None]] = field(default_factory=set)  # releases waiting on a pod read
    _nudge: asyncio.Event = field(default_factory=asyncio.Event)
    _written_nodes: dict[str, str] = field(default_factory=dict)
    _written_pools: dict[str, dict[str, Any]] = field(default_factory=dict)
    _phase_worker: Any = None  # the claim-phase worker process while leading
    _topology: dict[str, tuple[int, int, frozenset[str]]] | None = None
    _clash: dict[str, dict[str, set[str]]] = field(default_factory=dict)  # pool -> tied pool -> nodes
    ready_event: asyncio.Event = field(default_factory=asyncio.Event)
    active: bool = True  # False on a standby replica (leader election)
    watches: dict[str, ListWatch] = field(default_factory=dict)
    fault_log: faults.FaultLog = field(default_factory=lambda: faults.FaultLog(log))
    quota_sync: Any = None  # kvgpu.reconcile.quotas.QuotaSync, made on first use (quotas())

    # ----- start / stop ------------------------------------------------------------------------
    async def startup(self) -> None:
        self.api = await kube.connect(self.cfg.kubeconfig)
        self.active = not self.cfg.leader_elect
        if self.active:
            await self.rebuild()
        self.extender = Extender(self.state, self.api, self.metrics, self.cfg.node_choice)
        self.extender.preemption.nudge = self.nudge_pending  # a GPU hold ended: retry pending pods
        await self.start_extender()
        if self.cfg.webhook_port:
            await self.start_webhooks()
        if self.cfg.dev_webhook_configurations and self.cfg.webhook_port:
            await self.apply_dev_webhooks()
        claims_path = f"/apis/{keys.GROUP}/{keys.VERSION}/vgpuclaims"
        self.watches = {
            "nodes": ListWatch(self.api, "/api/v1/nodes", self.on_node, project=_node_projection),
            "vgpuclaims": ListWatch(self.api, claims_path, self.on_claim, project=_claim_projection),
            "resourcequotas": ListWatch(self.api, "/api/v1/resourcequotas", self.quotas().on_resource_quota),
            "vgpuquotas": ListWatch(self.api, f"/apis/{keys.GROUP}/{keys.VERSION}/vgpuquotas",
                                    self.quotas().on_vgpu_quota),
        }
        self._tasks = [
            *(asyncio.create_task(w.run(), name=f"kvgpu-watch-{n}") for n, w in self.watches.items()),
            asyncio.create_task(self._loop(self.flush, self.cfg.flush_interval_s), name="kvgpu-flush"),
            asyncio.create_task(self._loop(self.sweep, self.cfg.sweep_interval_s), name="kvgpu-sweep"),
            asyncio.create_task(self._requeue_loop(), name="kvgpu-requeue"),
        ]
        if self._tls_reloader is not None:
            self._tasks.append(asyncio.create_task(self._tls_reloader.run(), name="kvgpu-extender-tls-reload"))
        self._tasks.append(asyncio.create_task(self._watch_children(), name="kvgpu-children-watchdog"))
        if self.active:
            self._became_ready()
        else:
            self._tasks.append(asyncio.create_task(self._elect(), name="kvgpu-election"))
            log.info("standby: waiting for the lease", lease=f"{self.cfg.lease_namespace}/{self.cfg.lease_name}")

    @property
    def extender_url(self) -> str:
        scheme = "http" if self.cfg.extender_insecure else "https"
        return f"{scheme}://{self.cfg.extender_host}:{self.extender_port}/scheduler"

    async def start_extender(self) -> None:
        """The extender's server: HTTPS with client certificates (or plain HTTP when
        ``extender_insecure``), and the plain probe/metrics port when configured."""
        assert self.extender is not None
        ssl_ctx = None
        allowed: tuple[str, ...] | None = None
        if not self.cfg.extender_insecure:
            cert, key, ca = self.cfg.extender_cert, self.cfg.extender_key, self.cfg.extender_client_ca
            if not (cert and key and ca):
                raise ValueError("the extender needs --extender-cert, --extender-key and --extender-client-ca "
                                 "(mutual TLS), or --extender-insecure (plain HTTP, dev only)")
            ssl_ctx = tls.server_context(cert, key, ca)
            self._tls_reloader = tls.Reloader(ssl_ctx, cert, key, ca)
            allowed = self.cfg.extender_allowed_clients
        else:
            log.warning("extender serves plain HTTP without client authentication (--extender-insecure): "
                        "any pod that reaches the port can bind GPU pods")
        self._runner = web.AppRunner(self.extender.app(allowed), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.extender_host, self.cfg.extender_port, ssl_context=ssl_ctx)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.extender_port = int(sock.getsockname()[1])
        if self.cfg.metrics_port is not None:
            self._probe_runner = web.AppRunner(self.extender.probe_app(), access_log=None)
            await self._probe_runner.setup()
            probe = web.TCPSite(self._probe_runner, self.cfg.metrics_host, self.cfg.metrics_port)
            await probe.start()
            self.metrics_port = int(probe._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    def _became_ready(self) -> None:
        from kvgpu.reconcile import phaseworker

        self._phase_worker = phaseworker.start(phaseworker.PhaseWorkerConfig(
            kubeconfig=self.cfg.kubeconfig, orphan_grace_s=self.cfg.orphan_grace_s,
            sweep_interval_s=self.cfg.sweep_interval_s, bind_events=self.cfg.bind_events))
        self.ready_event.set()
        if self.cfg.ready_file:
            Path(self.cfg.ready_file).write_text(f"{self.extender_url}\n")
        log.info("operator ready", extender=self.extender_url, metrics_port=self.metrics_port or None,
                 nodes=len(self.state.nodes), claims=len(self.state.ledger.reservations()))

    async def _elect(self) -> None:
        """Run for the Lease (kubernetes_asyncio.leaderelection). On winning: rebuild the ledger
        from the claims, then serve. On losing it: stop the process (a fresh start is the only
        safe way back to standby; the kubelet restarts it)."""
        import socket

        from kubernetes_asyncio.leaderelection import electionconfig, leaderelection
        from kubernetes_asyncio.leaderelection.resourcelock.leaselock import LeaseLock

        identity = self.cfg.identity or f"{socket.gethostname()}-{os.getpid()}"
        lock = LeaseLock(self.cfg.lease_name, self.cfg.lease_namespace, identity, self.api)
        d = int(self.cfg.lease_duration_s)  # the lock stores it as an integer string
        cfg = electionconfig.Config(lock, lease_duration=d, renew_deadline=d * 2 / 3, retry_period=d / 7,
                                    onstarted_leading=self._lead, onstopped_leading=self._lost)
        try:
            await leaderelection.LeaderElection(cfg).run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("leader election failed: stopping")
            os.kill(os.getpid(), signal.SIGTERM)

    async def _lead(self) -> None:
        log.info("won the lease: rebuilding the ledger", identity=self.cfg.identity or os.getpid())
        await self.rebuild()
        self.active = True
        self.pools_dirty = True
        self._became_ready()
        await asyncio.Event().wait()  # lead until cancelled (lease lost)

    async def _lost(self) -> None:
        was = self.active
        self.active = False
        self.state.ready = False
        if was:
            log.error("lost the lease: stopping so a fresh process can stand by")
            os.kill(os.getpid(), signal.SIGTERM)

    async def cleanup(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.extender is not None:
            self.extender.preemption.stop()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        from kvgpu import procs

        children = self._children()
        if children:
            await asyncio.to_thread(procs.stop, children)
        for runner in (self._runner, self._probe_runner):
            if runner is not None:
                await runner.cleanup()
        if self.api is not None:
            await self.api.close()

    async def rebuild(self) -> None:
        t0 = time.perf_counter()
        nodes, pools, claims = await asyncio.gather(
            kube.list_all(self.api, "nodes"), kube.list_all(self.api, "vgpupools"),
            kube.list_all(self.api, "vgpuclaims"))
        problems = self.state.rebuild(nodes, pools, claims)
        for p in problems + self.state.ledger.problems():
            log.warning("rebuild problem", problem=p)
        await self.quotas().load(self.api)  # the namespaces' quotas, before any bind is answered
        self.state.ready = True
        self.metrics.ledger_rebuild.set(time.perf_counter() - t0)

    def quotas(self) -> Any:
        """The namespace-quota adapter (:class:`kvgpu.reconcile.quotas.QuotaSync`)."""
        if self.quota_sync is None:
            from kvgpu.reconcile.quotas import QuotaSync

            self.quota_sync = QuotaSync(self.state, self.nudge_pending)
        return self.quota_sync

    async def start_webhooks(self) -> None:
        """Start the admission worker processes and a watchdog that stops the operator if one
        dies (the pod is then restarted: admission must not silently lose capacity)."""
        from kvgpu.admission.server import start_workers

        if not (self.cfg.webhook_cert and self.cfg.webhook_key):
            raise ValueError("the webhooks need --webhook-cert and --webhook-key")
        listen = self.cfg.webhook_host if self.cfg.dev_webhook_configurations else "0.0.0.0"
        assert self.cfg.webhook_port is not None
        # Started from this (the main) thread on purpose: the kernel's parent-death signal
        # follows the thread that started a child, and executor threads may come and go. The
        # loop waits the second or two the workers take to listen; it serves nothing else yet.
        self._webhook_procs = start_workers(
            max(1, self.cfg.webhook_workers), listen, self.cfg.webhook_port,
            self.cfg.webhook_cert, self.cfg.webhook_key, self.cfg.operator_usernames)
        log.info("admission webhooks serving", port=self.cfg.webhook_port, workers=len(self._webhook_procs))

    def _children(self) -> list[Any]:
        """The child processes started so far (admission workers, the claim-phase worker)."""
        return [*self._webhook_procs, *([self._phase_worker] if self._phase_worker is not None else [])]

    async def _watch_children(self) -> None:
        """Stop the operator when a child process dies (admission worker, claim-phase worker):
        the kubelet restarts it with them, instead of it running on without them."""
        while True:
            await asyncio.sleep(1.0)
            dead = [p for p in self._children() if not p.is_alive()]
            if dead:
                log.error("a child process died: stopping", child=dead[0].name, exitcode=dead[0].exitcode)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    async def apply_dev_webhooks(self) -> None:
        """The webhook configurations pointing at this process, and the VGPUClaim policy
        (:func:`kvgpu.admission.config.claim_policy`: only the operator writes claims)."""
        from kvgpu.admission.config import claim_policy, webhook_configurations

        ca = Path(self.cfg.webhook_ca or "").read_bytes()  # noqa: ASYNC240 (once, at start-up)
        mutating, validating = webhook_configurations(
            url_base=f"https://{self.cfg.webhook_host}:{self.cfg.webhook_port}", service=None, ca_bundle=ca,
            exclude_namespaces=list(self.cfg.exclude_namespaces))
        policy, binding = claim_policy(list(self.cfg.operator_usernames))
        adm = client.AdmissionregistrationV1Api(self.api)
        for body, create, replace_, read in (
            (mutating, adm.create_mutating_webhook_configuration, adm.replace_mutating_webhook_configuration,
             adm.read_mutating_webhook_configuration),
            (validating, adm.create_validating_webhook_configuration,
             adm.replace_validating_webhook_configuration, adm.read_validating_webhook_configuration),
            (policy, adm.create_validating_admission_policy, adm.replace_validating_admission_policy,
             adm.read_validating_admission_policy),
            (binding, adm.create_validating_admission_policy_binding,
             adm.replace_validating_admission_policy_binding, adm.read_validating_admission_policy_binding),
        ):
            name = body["metadata"]["name"]
            try:
                await create(body)
            except ApiException as e:
                if e.status != 409:
                    raise
                old = await read(name)
                body["metadata"]["resourceVersion"] = old.metadata.resource_version
                await replace_(name, body)

    # ----- nodes, pods and claims (watch handlers) ----------------------------------------------
    def on_node(self, etype: str, node: dict[str, Any]) -> None:
        name = node["metadata"]["name"]
        if etype == "DELETED":
            if name in self.state.nodes:
                self.state.remove_node(name)
                self.claims_on_lost_node(name)
            return
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
        first; its own DELETED event is then not taken for a release) and set its phase."""
        meta, spec, pmeta = claim["metadata"], claim["spec"], pod["metadata"]
        if etype != "DELETED":
            self.state.claim_uids[key] = "restoring"  # the old object's DELETED event frees nothing
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
            self.state.claim_uids[key] = uid
        phase = "Running" if (pod.get("status") or {}).get("phase") == "Running" else "Bound"
        await kube.patch_claim_status(self.api, meta["namespace"], meta["name"], {"phase": phase})

    def claims_on_lost_node(self, node: str) -> None:
        """A node disappeared: its pods are gone with it (pod GC); the sweep releases claims."""
        self.nudge_pending(f"node {node} removed")

    # ----- background --------------------------------------------------------------------------
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
        """Write changed node allocation annotations and VGPUPool status."""
        dirty, self.state.dirty_nodes = self.state.dirty_nodes, set()
        todo = sorted(dirty)
        for i, name in enumerate(todo):
            if name not in self.state.nodes:
                self.metrics.forget_node(name)
            if name not in self.state.ledger:
                continue
            # The pool totals are summed from the live ledger, which may have changed during
            # the awaits below even where this node's text ends up as already written.
            self._pool_usage_dirty = True
            usage = self.state.ledger.node_usage(name)
            text = json.dumps(usage.to_json(), sort_keys=True, separators=(",", ":"))
            cards = usage.cards
            self.metrics.slots_used.labels(name).set(sum(c.slots_used for c in cards))
            self.metrics.slots_total.labels(name).set(sum(c.slots_total for c in cards))
            self.metrics.memory_used.labels(name).set(sum(c.memory_used_mib for c in cards))
            self.metrics.memory_total.labels(name).set(sum(c.memory_total_mib for c in cards))
            self.metrics.cores_used.labels(name).set(sum(c.cores_used for c in cards))
            if self._written_nodes.get(name) == text:
                continue
            try:
                await kube.patch_node_annotations(self.api, name, {keys.NODE_ALLOCATION: text})
            except ApiException as e:
                if e.status is None or e.status >= 500 or e.status == 429:
                    self.state.dirty_nodes.update(todo[i:])
                    raise
                # Refused for this node alone (gone: 404; 403, 422): the others and the pool
                # status are still written; the node is tried again when it changes.
                log.warning("node allocation annotation not written", node=name, status=e.status,
                            reason=e.reason)
                continue
            except BaseException:
                # Not written (API server away): this node and the rest stay dirty for the next
                # round; dropping them left annotations stale until the node changed again.
                self.state.dirty_nodes.update(todo[i:])
                raise
            self._written_nodes[name] = text
        self.metrics.pending.set(len(self.state.pending))
        # Pool status sums every node and reservation: written at once when a pool, an
        # inventory or the leadership changed, at most every pool_status_interval_s for
        # allocations alone (a burst would otherwise recompute it every flush, in the loop
        # that answers kube-scheduler).
        now = time.monotonic()
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

    def _pool_topology(self) -> dict[str, tuple[int, int, frozenset[str]]]:
        """Per pool: (covered cards, healthy covered cards, pools it conflicts with). Recomputed
        only when nodes' inventories or pools change, not on every allocation."""
        from kvgpu.api.pools import conflicts

        if self._topology is not None and not self.state.topology_dirty:
            return self._topology
        self.state.topology_dirty = False
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
        self.state.conflict_notes = {n: poolstatus.conflict_note(n, self._clash) for n in where}
        return self._topology

    async def write_pool_status(self) -> None:
        """VGPUPool status: aggregate counts (bounded size at any cluster size) and conditions."""
        import datetime

        from kvgpu.api.models import VGPUPoolStatus
        from kvgpu.api.pools import pool_conditions

        usage = self.state.ledger.pool_usage()
        topo = self._pool_topology()
        over = poolstatus.excess(self.state.ledger.usage().values())
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
                    self.state.claim_uids[key] = str(uid)
                try:
                    self.state.reserve(key, alloc)
                except Exception as e:  # over-committed: force it, the claims are the truth
                    log.warning("claim does not fit the ledger; forcing", claim=key, error=str(e))
                    self.state.reserve(key, alloc, force=True)

    def nudge_pending(self, why: str) -> None:
        if self.state.pending:
            self._nudge.set()

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
                        self.state.pending.pop(uid, None)
                except Exception as e:
                    if (why := faults.expected(e)) is None:
                        log.exception("requeue failed", pod=f"{ns}/{name}")
                    else:
                        self.fault_log.fault("requeue", "requeue of pending pods failed", why)


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


def build(cfg: OperatorConfig) -> tuple[kopf.OperatorRegistry, kopf.OperatorSettings, Runtime]:
    """The registry, settings and runtime of one operator process."""
    rt = Runtime(cfg)
    registry = kopf.OperatorRegistry()
    settings = kopf.OperatorSettings()

    @kopf.on.startup(registry=registry)
    async def _startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        await rt.startup()

    @kopf.on.cleanup(registry=registry)
    async def _cleanup(**_: Any) -> None:
        await rt.cleanup()

    @kopf.on.login(registry=registry)
    def _login(**kw: Any) -> Any:
        if cfg.kubeconfig:
            return kopf.login_with_kubeconfig(**kw)
        return kopf.login_with_service_account(**kw)

    handlers.register(registry, rt)
    settings.posting.level = 30  # warnings and errors become Events; decisions post their own
    settings.persistence.finalizer = "kvgpu.io/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvgpu.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kvgpu.io")
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 30
    return registry, settings, rt


async def run(cfg: OperatorConfig, stop_flag: Any = None, ready_flag: Any = None) -> None:
    """Run the operator until ``stop_flag`` (an asyncio/threading Event or Future) is set."""
    if cfg.kubeconfig:
        os.environ["KUBECONFIG"] = cfg.kubeconfig  # Kopf's kubeconfig login reads it from here
    registry, settings, rt = build(cfg)
    await kopf.operator(
        registry=registry, settings=settings, clusterwide=True,
        standalone=cfg.standalone, priority=cfg.priority,
        peering_name=None if cfg.standalone else cfg.peering_name,
        stop_flag=stop_flag, ready_flag=ready_flag, memo=kopf.Memo(runtime=rt),
    )
