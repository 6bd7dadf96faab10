"""The extender's HTTP server (aiohttp), served by the operator process.

Routes (prefix ``/scheduler``): ``POST filter``, ``POST prioritize``, ``POST bind``;
``GET /healthz``; ``GET /readyz`` (200 once the ledger is rebuilt); ``GET /metrics``.
Until the ledger is rebuilt from the claims, filter answers with an error so kube-scheduler
retries instead of placing pods against an empty ledger.

Threads: :class:`ExtenderThread` serves the application on an event loop of its own, so that
filter and prioritize — which sit in kube-scheduler's serial scheduling cycle, one pod after
another — are answered at once instead of waiting in the operator's loop behind binds, watch
events and writes (at 70 % busy that wait was most of the cycle). They only read the ledger,
under ``OperatorState.lock``; bind (ledger writes and API calls) and Events are handed to the
operator's loop (``main_loop``). The interpreter's switch interval is lowered so the serving
thread gets the GIL within half a millisecond.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Coroutine
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgpu import kube
from kvgpu.api.requests import RequestError, parse_pod
from kvgpu.extender.binder import Binder
from kvgpu.extender.protocol import ProtocolError, filter_result, parse_args, parse_binding, priority_json
from kvgpu.metrics import OperatorMetrics
from kvgpu.reconcile.state import OperatorState

log = structlog.get_logger("kvgpu.extender")
MAX_BODY = 64 * 1024 * 1024
NOT_READY = "kvgpu operator not ready: starting (ledger not rebuilt yet) or a standby replica"


class Extender:
    def __init__(self, state: OperatorState, api: Any, metrics: OperatorMetrics,
                 main_loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.state = state
        self.api = api
        self.metrics = metrics
        # where binds and Events run (the operator's loop, which owns the API client); None:
        # the loop serving the request (tests, single-threaded use)
        self.main_loop = main_loop
        self.binder = Binder(state, api, metrics)
        # last reasons per pod uid, for Events (posted when they change) and `kubectl vgpu why`
        self.last_reasons: dict[str, str] = {}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.add_routes([
            web.post("/scheduler/filter", self.filter),
            web.post("/scheduler/prioritize", self.prioritize),
            web.post("/scheduler/bind", self.bind),
            web.get("/healthz", self.healthz),
            web.get("/readyz", self.readyz),
            web.get("/metrics", self.metrics_endpoint),
        ])
        return app

    def _on_main(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
        """Run ``coro`` on the operator's loop; a future of its result in the current loop."""
        loop = self.main_loop
        if loop is None or loop is asyncio.get_running_loop():
            return asyncio.ensure_future(coro)
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    async def _json(self, request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as e:
            raise ProtocolError(f"request body is not JSON: {e}") from e

    async def filter(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        try:
            args = parse_args(await self._json(request))
        except ProtocolError as e:
            return web.json_response({"error": str(e)})
        try:
            if not self.state.ready:
                return web.json_response(filter_result(args, [], {}, NOT_READY))
            try:
                req = parse_pod(args.pod, self.state.default_pool_spec())
            except RequestError as e:
                failed = dict.fromkeys(args.node_names, f"invalid GPU request: {e}")
                return web.json_response(filter_result(args, [], failed))
            if req is None:  # not ours: every node passes
                return web.json_response(filter_result(args, list(args.node_names), {}))
            with self.state.lock:
                feasible, reasons = self.state.ledger.filter(req, args.node_names)
            meta = args.pod["metadata"]
            uid = str(meta.get("uid", ""))
            if feasible:
                self.binder.remember(uid, req)
            else:
                self.state.pending[uid] = (str(meta.get("namespace")), str(meta.get("name")))
                self.metrics.pending.set(len(self.state.pending))
                self._on_main(self._explain(args.pod, reasons))  # the answer need not wait for it
            return web.json_response(filter_result(args, feasible, reasons))
        except Exception as e:  # never crash the scheduler's request: report it
            log.exception("filter failed")
            return web.json_response(filter_result(args, [], {}, f"kvgpu filter failed: {e!r}"))
        finally:
            self.metrics.extender_latency.labels(verb="filter").observe(time.perf_counter() - t0)

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

    async def prioritize(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        try:
            args = parse_args(await self._json(request))
            # filter parsed this pod's request a moment ago (a pod's request cannot change)
            req = self.binder.hint(str(args.pod["metadata"].get("uid", ""))) or parse_pod(
                args.pod, self.state.default_pool_spec())
            if req is None or not self.state.ready:
                return web.json_response([{"host": n, "score": 0} for n in args.node_names])
            with self.state.lock:
                scores = self.state.ledger.score(req, args.node_names)
            return web.Response(body=priority_json(scores), content_type="application/json")
        except (ProtocolError, RequestError) as e:
            return web.json_response({"error": str(e)}, status=400)
        finally:
            self.metrics.extender_latency.labels(verb="prioritize").observe(time.perf_counter() - t0)

    async def bind(self, request: web.Request) -> web.Response:
        try:
            args = parse_binding(await self._json(request))
        except ProtocolError as e:
            return web.json_response({"error": str(e)})
        if not self.state.ready:
            return web.json_response({"error": NOT_READY})
        err = await self._on_main(self.binder.bind(args))
        if not err:
            self.metrics.binds.inc()
            self.last_reasons.pop(args.pod_uid, None)
        return web.json_response({"error": err} if err else {})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(self, request: web.Request) -> web.Response:
        return web.Response(text="ready" if self.state.ready else "rebuilding", status=200 if self.state.ready else 503)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


class ExtenderThread:
    """Serve an :class:`Extender` on ``host:port`` (0: a free port) from a thread with its own
    event loop (uvloop when installed). :meth:`start` returns the port once listening."""

    SWITCH_INTERVAL_S = 0.0005

    def __init__(self, extender: Extender, host: str, port: int) -> None:
        self.extender = extender
        self.host, self.port = host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvgpu-extender", daemon=True)

    def start(self, timeout_s: float = 30.0) -> int:
        sys.setswitchinterval(self.SWITCH_INTERVAL_S)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            raise RuntimeError(f"the extender server did not start: {self._error!r}")
        return self.port

    def _run(self) -> None:
        try:
            import uvloop

            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._runner.cleanup() if self._runner else asyncio.sleep(0))
        loop.close()

    async def _serve(self) -> None:
        self._runner = web.AppRunner(self.extender.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.port = int(sock.getsockname()[1])

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
