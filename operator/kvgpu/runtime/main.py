"""The operator's main process: :class:`Runtime` (start-up, the extender's server, rebuild,
clean-up) and :func:`run`. See :mod:`kvgpu.runtime` for the order of start-up."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import kopf
from aiohttp import web

from kvgpu import kube
from kvgpu.core import keys
from kvgpu.extender import http2, tls
from kvgpu.extender.server import MAX_BODY, Extender
from kvgpu.reconcile import handlers
from kvgpu.runtime.background import Background
from kvgpu.runtime.base import OperatorConfig, RuntimeBase, log
from kvgpu.runtime.children import Children
from kvgpu.runtime.lease import Lease
from kvgpu.runtime.watches import WatchHandlers, _claim_projection, _node_projection
from kvgpu.watch import ListWatch


class Runtime(Lease, Children, WatchHandlers, Background, RuntimeBase):
    """One operator process: the state, its watches, the extender and the background tasks."""

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
            ssl_ctx = tls.server_context(cert, key, ca, on_handshake=self.metrics.extender_connections.inc)
            self._tls_reloader = tls.Reloader(ssl_ctx, cert, key, ca)
            allowed = self.cfg.extender_allowed_clients
        else:
            log.warning("extender serves plain HTTP without client authentication (--extender-insecure): "
                        "any pod that reaches the port can bind GPU pods")
        self._runner = web.AppRunner(self.extender.app(allowed), access_log=None)
        await self._runner.setup()
        site: web.TCPSite
        if ssl_ctx is None:
            site = web.TCPSite(self._runner, self.cfg.extender_host, self.cfg.extender_port)
        else:  # HTTP/2 by ALPN beside HTTP/1.1: kube-scheduler's calls share one connection
            http2.offer_h2(ssl_ctx)
            site = http2.ALPNSite(self._runner, self.cfg.extender_host, self.cfg.extender_port, ssl_context=ssl_ctx,
                                  handle=self.extender.answer, allowed=allowed, max_body=MAX_BODY,
                                  on_http2=self.metrics.extender_http2_connections.inc)
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
        self.state.mark_ready()
        self.metrics.ledger_rebuild.set(time.perf_counter() - t0)


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
    if os.environ.get("POD_NAME"):
        # Kopf's identity (POD_ID): the pod's name (manifests: POD_NAME). Its default, user@host,
        # needs a passwd entry for the uid, which an image run with another runAsUser lacks.
        os.environ.setdefault("POD_ID", os.environ["POD_NAME"])
    registry, settings, rt = build(cfg)
    await kopf.operator(
        registry=registry, settings=settings, clusterwide=True,
        standalone=cfg.standalone, priority=cfg.priority,
        peering_name=None if cfg.standalone else cfg.peering_name,
        stop_flag=stop_flag, ready_flag=ready_flag, memo=kopf.Memo(runtime=rt),
    )
