"""The extender's HTTP server (aiohttp), served by the operator process.

Routes (prefix ``/scheduler``): ``POST filter``, ``POST prioritize``, ``POST bind``;
``GET /healthz``; ``GET /readyz`` (200 once the ledger is rebuilt); ``GET /metrics``.
:meth:`Extender.app` serves them all; the runtime serves it over mutual TLS with
:func:`kvgpu.extender.tls.require_client` (only kube-scheduler's certificate is answered) unless
``--extender-insecure``, and the scheduler verbs over HTTP/2 on the same port as well
(:meth:`Extender.answer`, :mod:`kvgpu.extender.http2`: the client identity is checked once per
connection there). :meth:`Extender.probe_app` serves only the read-only ``/healthz``,
``/readyz`` and ``/metrics`` (plain HTTP, ``--metrics-address``: kubelet probes, Prometheus).
Filter answers only the best node for a GPU pod unless ``--node-choice scheduler`` or the pod
states soft preferences (:mod:`kvgpu.extender.choice`); kube-scheduler then calls neither its
score plugins nor prioritize. Until the ledger is rebuilt from the claims, filter answers with
an error so kube-scheduler retries instead of placing pods against an empty ledger.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgpu import kube
from kvgpu.api.requests import RequestError, parse_pod
from kvgpu.core import keys
from kvgpu.extender.binder import Binder
from kvgpu.extender.choice import NodeChoice, best_node, scheduler_preferences
from kvgpu.extender.preemption import Preemption
from kvgpu.extender.protocol import (
    ProtocolError,
    error_result,
    filter_result,
    parse_args,
    parse_binding,
    priority_json,
)
from kvgpu.extender.tls import require_client
from kvgpu.metrics import OperatorMetrics
from kvgpu.reconcile.state import OperatorState

log = structlog.get_logger("kvgpu.extender")
MAX_BODY = 64 * 1024 * 1024
JSON = "application/json"
NOT_READY = "kvgpu operator not ready: starting (ledger not rebuilt yet) or a standby replica"
#: A scheduler verb: the request body in, (HTTP status, a JSON-able answer or its bytes) out.
Verb = Callable[[bytes], Awaitable[tuple[int, Any]]]


def _encode(out: Any) -> bytes:
    """A verb's answer as the response body (bytes pass through, anything else as JSON)."""
    return out if isinstance(out, bytes) else json.dumps(out).encode()


class Extender:
    def __init__(self, state: OperatorState, api: Any, metrics: OperatorMetrics,
                 node_choice: NodeChoice = NodeChoice.EXTENDER) -> None:
        self.state = state
        self.node_choice = node_choice
        self.api = api
        self.metrics = metrics
        self.binder = Binder(state, api, metrics)
        self.preemption = Preemption(state, api)  # GPU preemption for pods filter rejects
        # last reasons per pod uid, for Events (posted when they change) and `kubectl vgpu why`
        self.last_reasons: dict[str, str] = {}
        self._verbs: dict[str, Verb] = {"/scheduler/filter": self.filter,
                                        "/scheduler/prioritize": self.prioritize,
                                        "/scheduler/bind": self.bind}

    def app(self, allowed_clients: tuple[str, ...] | None = None) -> web.Application:
        """Every route. ``allowed_clients``: answer only TLS clients whose verified certificate
        names one of them (CN or DNS/URI SAN); None: no check (plain HTTP, ``--extender-insecure``)."""
        middlewares = [] if allowed_clients is None else [require_client(allowed_clients)]
        app = web.Application(client_max_size=MAX_BODY, middlewares=middlewares)
        app.add_routes([
            *(web.post(path, self._route(verb)) for path, verb in self._verbs.items()),
            web.get("/healthz", self.healthz),
            web.get("/readyz", self.readyz),
            web.get("/metrics", self.metrics_endpoint),
        ])
        return app

    def probe_app(self) -> web.Application:
        """The read-only routes, for the plain probe/metrics port: no scheduler verb."""
        app = web.Application(client_max_size=1024)
        app.add_routes([
            web.get("/healthz", self.healthz),
            web.get("/readyz", self.readyz),
            web.get("/metrics", self.metrics_endpoint),
        ])
        return app

    @staticmethod
    def _json(body: bytes) -> Any:
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise ProtocolError(f"request body is not JSON: {e}") from e

    async def answer(self, method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        """A scheduler verb (``POST /scheduler/<verb>``) as bytes in and out: the HTTP/2 side
        (:mod:`kvgpu.extender.http2`) calls it; aiohttp's routes call the same verbs."""
        verb = self._verbs.get(path)
        if verb is None or method != "POST":
            return 404, "text/plain", b"not found"
        status, out = await verb(body)
        return status, JSON, _encode(out)

    @staticmethod
    def _route(verb: Verb) -> Callable[[web.Request], Awaitable[web.Response]]:
        """The aiohttp handler of a verb (HTTP/1.1)."""
        async def handler(request: web.Request) -> web.Response:
            status, out = await verb(await request.read())
            return web.Response(body=_encode(out), status=status, content_type=JSON)
        return handler

    async def filter(self, body: bytes) -> tuple[int, Any]:
        t0 = time.perf_counter()
        try:
            args = parse_args(self._json(body))
        except ProtocolError as e:
            return 200, error_result(str(e))
        try:
            if not self.state.ready:
                return 200, filter_result(args, [], {}, NOT_READY)
            try:
                req = parse_pod(args.pod, self.state.default_pool_spec())
            except RequestError as e:
                failed = dict.fromkeys(args.node_names, f"invalid GPU request: {e}")
                return 200, filter_result(args, [], failed)
            if req is None:  # not ours: every node passes
                return 200, filter_result(args, list(args.node_names), {})
            if not keys.webhook_admitted(args.pod):
                return 200, filter_result(args, [], dict.fromkeys(args.node_names, keys.NOT_ADMITTED))
            if (over := self.state.quota_refusal(req)) is not None:  # before preemption: no eviction for it
                return 200, await self._over_quota(args, over)
            req, feasible, reasons = self.preemption.filter(args.pod, req, args.node_names)
            if notes := self.state.conflict_notes:  # pools in conflict: the real cause, on those nodes
                reasons = {n: r + notes.get(n, "") for n, r in reasons.items()}
            meta = args.pod["metadata"]
            uid = str(meta.get("uid", ""))
            if feasible:
                self.binder.remember(uid, req)
                if (len(feasible) > 1 and self.node_choice == NodeChoice.EXTENDER
                        and not scheduler_preferences(args.pod)):
                    feasible = [best_node(self.state.ledger.rank(req, feasible))]
            else:
                self.state.add_pending(uid, str(meta.get("namespace")), str(meta.get("name")))
                self.metrics.pending.set(len(self.state.pending))
                self.preemption.rejected(args.pod, req, args.node_names)
                await self._explain(args.pod, reasons)
            return 200, filter_result(args, feasible, reasons)
        except Exception as e:  # never crash the scheduler's request: report it
            log.exception("filter failed")
            return 200, filter_result(args, [], {}, f"kvgpu filter failed: {e!r}")
        finally:
            self.metrics.extender_latency.labels(verb="filter").observe(time.perf_counter() - t0)

    async def _over_quota(self, args: Any, why: str) -> dict[str, Any]:
        """Filter's answer for a pod that surely passes a namespace quota: every node fails with
        the quota's message (kube-scheduler's FailedScheduling event shows it), the pod waits
        among the pending ones (requeued when usage frees or a quota changes), and one
        ``GPUQuotaExceeded`` Event per new reason. The bind checks again with the real grants."""
        meta = args.pod["metadata"]
        uid = str(meta.get("uid", ""))
        self.state.add_pending(uid, str(meta.get("namespace")), str(meta.get("name")))
        self.metrics.pending.set(len(self.state.pending))
        if self.last_reasons.get(uid) != why:
            self.last_reasons[uid] = why
            await kube.post_event(self.api, {"apiVersion": "v1", "kind": "Pod", "metadata": meta},
                                  reason="GPUQuotaExceeded", message=why, type_="Warning")
        return filter_result(args, [], dict.fromkeys(args.node_names, why))

    async def _explain(self, pod: dict[str, Any], reasons: dict[str, str]) -> None:
        uid = str(pod["metadata"].get("uid", ""))
        shown = sorted(reasons.items())
        text = "; ".join(f"{n}: {r}" for n, r in shown[:8])
        if len(shown) > 8:
            text += f"; and {len(shown) - 8} more nodes"
        msg = f"no node has room for the GPU request: {text}" if shown else "no GPU node is known to kvgpu"
        if self.last_reasons.get(uid) == msg:
            return
        self.last_reasons[uid] = msg
        await kube.post_event(self.api, {"apiVersion": "v1", "kind": "Pod", "metadata": pod["metadata"]},
                              reason="NoGPUCapacity", message=msg, type_="Warning")

    async def prioritize(self, body: bytes) -> tuple[int, Any]:
        t0 = time.perf_counter()
        try:
            args = parse_args(self._json(body))
            # filter parsed this pod's request a moment ago (a pod's request cannot change)
            req = self.binder.hint(str(args.pod["metadata"].get("uid", ""))) or parse_pod(
                args.pod, self.state.default_pool_spec())
            if req is None or not self.state.ready:
                return 200, [{"host": n, "score": 0} for n in args.node_names]
            return 200, priority_json(self.state.ledger.score(req, args.node_names))
        except (ProtocolError, RequestError) as e:
            return 400, error_result(str(e))
        finally:
            self.metrics.extender_latency.labels(verb="prioritize").observe(time.perf_counter() - t0)

    async def bind(self, body: bytes) -> tuple[int, Any]:
        try:
            args = parse_binding(self._json(body))
        except ProtocolError as e:
            return 200, error_result(str(e))
        if not self.state.ready:
            return 200, error_result(NOT_READY)
        err = await self.binder.bind(args)
        if not err:
            self.metrics.binds.inc()
            self.last_reasons.pop(args.pod_uid, None)
        return 200, error_result(err) if err else {}

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(self, request: web.Request) -> web.Response:
        return web.Response(text="ready" if self.state.ready else "rebuilding", status=200 if self.state.ready else 503)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        # Rendering is O(series): per-node gauges at 5,000 nodes take ~0.3 s of CPU. In a thread
        # the loop gets the GIL back every switch interval, so filter answers are not held up
        # for the whole scrape (prometheus_client's metrics are thread-safe).
        body = await asyncio.to_thread(generate_latest, self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
