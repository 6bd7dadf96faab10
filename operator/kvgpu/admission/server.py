"""The admission webhook server: AdmissionReview v1 over HTTPS, in worker processes.

Three webhooks, each at ``/<id>`` (the ids of :mod:`kvgpu.admission.handlers`, which
:mod:`kvgpu.admission.config` points the configurations at): mutate pods, validate pods,
validate workload pod templates. The decisions are :func:`kvgpu.admission.handlers.review`
(pure); this module is the HTTP and process adapter.

Why worker processes: every GPU pod is admitted twice (mutate, validate), and serving that in
the operator's single asyncio thread — TLS, HTTP, JSON — cost about a quarter of the operator's
CPU during bursts, on the same core as the scheduler extender that bind latency depends on.
The workers need no API access for the decisions (the review carries the object; each lists
the VGPUPools only for their minimum slice, :class:`PoolView`), so ``--webhook-workers N``
processes share the port through ``SO_REUSEPORT`` (the kernel spreads connections over them);
each dies with the operator (``PR_SET_PDEATHSIG``). They run on every replica, leader or not;
with the shipped manifests the webhook Service sends calls to ready replicas only, i.e. the
leader (docs/operations.md: GPU pods are refused for the seconds a takeover lasts).

Errors: a body that is not an AdmissionReview gets HTTP 400; an exception inside a decision
refuses the object with a message (``failurePolicy: Fail`` semantics: never admit unchecked).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import socket
import ssl
import time
from collections.abc import Collection
from multiprocessing.process import BaseProcess
from typing import Any

from aiohttp import web

from kvgpu import procs
from kvgpu.admission.handlers import MUTATE_ID, VALIDATE_ID, VALIDATE_WORKLOADS_ID, review
from kvgpu.api.pools import SliceMinimum, slice_minimum

log = logging.getLogger("kvgpu.admission")
MAX_REVIEW_BYTES = 8 * 1024 * 1024
#: How long a worker waits before it tries again to reach the API, or to list VGPUPools while
#: their CRD is missing (a change of a pool applies as soon as the watch delivers it).
POOL_RETRY_S = 5.0


def response_body(request: dict[str, Any], allowed: bool, *, patch: list[dict[str, Any]] | None = None,
                  message: str = "", code: int = 400, warnings: list[str] | None = None) -> dict[str, Any]:
    """An AdmissionReview v1 answer to ``request`` (the review's ``request`` field)."""
    resp: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": allowed}
    if warnings:
        resp["warnings"] = list(warnings)
    if patch:
        resp["patchType"] = "JSONPatch"
        resp["patch"] = base64.b64encode(json.dumps(patch, separators=(",", ":")).encode()).decode()
    if not allowed:
        resp["status"] = {"code": code, "message": message}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp}


class PoolView:
    """The smallest slice the cluster's VGPUPools allow, kept current by a watch of them
    (:meth:`watch`); kvgpu's default until the first list succeeds."""

    def __init__(self) -> None:
        self.minimum = SliceMinimum()
        self._pools: dict[str, dict[str, Any]] = {}  # UID -> pool object

    def on_event(self, etype: str, obj: dict[str, Any]) -> None:
        """One event of the VGPUPool stream (``ADDED``/``MODIFIED``/``DELETED`` and the pool):
        the pool kept or dropped, the minimum taken again."""
        uid = str((obj.get("metadata") or {}).get("uid", ""))
        if etype == "DELETED":
            self._pools.pop(uid, None)
        else:
            self._pools[uid] = obj
        self.minimum = slice_minimum(self._pools.values())

    async def watch(self, kubeconfig: str | None, retry_s: float = POOL_RETRY_S) -> None:
        """List and watch the pools forever (``kubeconfig`` None: in-cluster): one request per
        change and one watch a few minutes, where a list every few seconds cost every worker a
        request per interval. Until the API answers (down, no RBAC, no CRD yet) the last answer
        stays; a failing stream is logged and retried by :class:`kvgpu.watch.ListWatch`."""
        from kvgpu import kube
        from kvgpu.core import keys
        from kvgpu.watch import ListWatch

        failing = False
        while True:
            try:
                api = await kube.connect(kubeconfig)
                break
            except Exception as e:  # no kubeconfig or service account yet: the default stays
                if not failing:
                    log.warning("kvgpu admission: cannot reach the API for VGPUPools, minimum slice stays "
                                "%d MiB: %s", self.minimum.mib, e)
                failing = True
                await asyncio.sleep(retry_s)
        stream = ListWatch(api, f"/apis/{keys.GROUP}/{keys.VERSION}/vgpupools", self.on_event,
                           name="vgpupools", missing_retry_s=retry_s)
        await stream.run()


def make_app(operator_usernames: Collection[str], pools: PoolView | None = None) -> web.Application:
    """The aiohttp application: ``POST /<webhook id>`` for each webhook (other paths: 404).
    ``pools``: where the minimum slice comes from (None: kvgpu's default)."""
    operators = frozenset(operator_usernames)

    async def handle(request: web.Request) -> web.Response:
        webhook = request.path.strip("/")
        try:
            body = json.loads(await request.read())
            req = body["request"]
            if not isinstance(req, dict):
                raise TypeError("request is not an object")
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": f"not an AdmissionReview: {e}"}, status=400)
        try:
            decision = (review(webhook, req, operators, pools.minimum) if pools is not None
                        else review(webhook, req, operators))
        except Exception as e:  # a bug: refuse rather than admit unchecked
            log.exception("kvgpu admission: %s failed", webhook)
            return web.json_response(response_body(req, False, message=f"kvgpu admission failed: {e!r}",
                                                   code=500))
        return web.json_response(response_body(req, decision.allowed, patch=decision.patch,
                                               message=decision.message, code=decision.code,
                                               warnings=decision.warnings))

    # An UPDATE review carries the object and the old one, each up to etcd's 1.5 MiB.
    app = web.Application(client_max_size=MAX_REVIEW_BYTES)
    for webhook in (MUTATE_ID, VALIDATE_ID, VALIDATE_WORKLOADS_ID):
        app.router.add_post(f"/{webhook}", handle)
    return app


def ssl_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certfile, keyfile)
    return ctx


CERT_CHECK_S = 10.0


def _mtimes(*paths: str) -> tuple[float, ...]:
    out = []
    for p in paths:
        try:
            out.append(os.stat(p).st_mtime)
        except OSError:
            out.append(0.0)
    return tuple(out)


async def _reload_certificate(ctx: ssl.SSLContext, certfile: str, keyfile: str) -> None:
    """Load the certificate again when its files change (cert-manager renews the Secret, the
    kubelet swaps the mounted files); new connections get the new one."""
    seen = _mtimes(certfile, keyfile)
    while True:
        await asyncio.sleep(CERT_CHECK_S)
        now = _mtimes(certfile, keyfile)
        if now == seen:
            continue
        try:
            ctx.load_cert_chain(certfile, keyfile)
            seen = now
            log.info("kvgpu admission: serving certificate reloaded from %s", certfile)
        except (OSError, ssl.SSLError) as e:  # mid-rotation: key and certificate not matching yet
            log.warning("kvgpu admission: certificate not reloaded yet: %s", e)


async def serve(host: str, port: int, certfile: str, keyfile: str, operator_usernames: Collection[str],
                *, reuse_port: bool = False, stop: asyncio.Event | None = None,
                app: web.Application | None = None, pools: PoolView | None = None,
                kubeconfig: str | None = None) -> None:
    """Serve until ``stop`` is set (forever when None). With ``pools`` (the same view ``app`` was
    made with, if given) the VGPUPools are watched through ``kubeconfig`` (None: in-cluster)."""
    runner = web.AppRunner(app or make_app(operator_usernames, pools), access_log=None)
    await runner.setup()
    ctx = ssl_context(certfile, keyfile)
    site = web.TCPSite(runner, host, port, ssl_context=ctx, reuse_port=reuse_port)
    await site.start()
    tasks = [asyncio.create_task(_reload_certificate(ctx, certfile, keyfile))]
    if pools is not None:
        tasks.append(asyncio.create_task(pools.watch(kubeconfig)))
    try:
        await (stop or asyncio.Event()).wait()
    finally:
        for t in tasks:
            t.cancel()
        await runner.cleanup()


def _worker(host: str, port: int, certfile: str, keyfile: str, operators: list[str]) -> None:
    from kvgpu.logs import configure_logging

    configure_logging()  # refusals and certificate reloads are logged
    # The operator's kubeconfig, if it has one (``kvgpu.runtime.run`` exports it before the
    # workers start); else the pod's service account, which may list VGPUPools.
    procs.run_child(serve(host, port, certfile, keyfile, operators, reuse_port=True, pools=PoolView(),
                          kubeconfig=os.environ.get("KUBECONFIG") or None))


def start_workers(workers: int, host: str, port: int, certfile: str, keyfile: str,
                  operator_usernames: Collection[str], *, ready_timeout_s: float = 30.0
                  ) -> list[BaseProcess]:
    """Start ``workers`` server processes on ``host:port`` (a fixed port: they share it) and
    wait until the port accepts connections. Raises ``TimeoutError`` (workers stopped) if it
    does not within ``ready_timeout_s``, ``RuntimeError`` if a worker exits first."""
    if port <= 0:
        raise ValueError("webhook workers need a fixed port")
    # Someone else on the port (without SO_REUSEPORT) would make every worker fail to bind while
    # the readiness probe below connects to that someone: find out first.
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        probe.bind((host, port))  # OSError (EADDRINUSE) names the clash
    started = [procs.spawn(_worker, (host, port, certfile, keyfile, sorted(operator_usernames)),
                           "kvgpu-webhook") for _ in range(workers)]
    deadline = time.monotonic() + ready_timeout_s
    while True:
        dead = [p for p in started if not p.is_alive()]
        if dead:
            procs.stop(started)
            raise RuntimeError(f"webhook worker {dead[0].name} exited with {dead[0].exitcode}")
        try:
            with socket.create_connection((host, port), timeout=1):
                return started
        except OSError:
            if time.monotonic() > deadline:
                procs.stop(started)
                raise TimeoutError(
                    f"no webhook worker listened at {host}:{port} after {ready_timeout_s:.0f} s") from None
            time.sleep(0.05)

