"""Scale bench: the real control plane, the real kube-scheduler with the kvgpu extender, and
thousands of fake GPU nodes (Node objects only; the bench plays kubelet).

What one run measures, for each burst size and mode, GPU pods and (as the baseline) the same
number of pods that request no GPU, through the default kube-scheduler, on the same nodes:

* ``stream``: the scheduler runs; the bench creates the pods as fast as it can (64 in flight).
  Throughput = pods / (first create sent → last pod seen Bound). Includes admission.
* ``queued``: the scheduler is stopped, the pods are created, then the scheduler is started.
  Throughput = pods / (first Bound → last Bound): pure scheduling + extender + bind.

Per pod: create → Bound → Running (the bench patches pod status to Running once it sees the pod
bound, as a kubelet would; a GPU pod's claims need no write for it). Extender latency per
verb from the operator's ``kvgpu_extender_request_seconds`` histogram (delta over the burst),
and from direct probes of ``/scheduler/filter`` and ``/scheduler/prioritize`` with the node
list kube-scheduler would send. Operator CPU and RSS from ``/proc/<pid>``. Requeue: a pending
pod that fits nowhere, time from freeing the capacity (delete of the pod holding it) to Bound.

What a pod costs the API server, for GPU pods and the no-GPU baseline of the same run: the
requests it served during the burst per pod, by verb and resource (``apiserver_request_total``,
watches left out; the bench's own creates and status patches, as a kubelet's, included), the
admission webhook calls per pod by webhook, and kube-apiserver's CPU time per pod.

With ``--dra``, a second phase on the same nodes and cards (:mod:`bench.scale.dra`): the pool
moves to ``allocation: dra``, each node gets its ResourceSlice, and the same bursts run with pods
that each get one ResourceClaim from a template (3000 MiB, 30 %), allocated by the default
kube-scheduler's DRA plugin, each next to a no-GPU baseline burst of its own.

Usage (from the repository root)::

    .venv/bin/python bench/scale/run.py --nodes 1000 --bursts 500,2000
    .venv/bin/python bench/scale/run.py --nodes 1000 --bursts 500,2000 --dra
    .venv/bin/python bench/scale/run.py --nodes 5000 --bursts 2000 --requeue-trials 0

Results are merged into ``bench/results/scale.json`` (keyed by node count);
``bench/scale/report.py`` renders the table and plot into ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import ssl
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "operator"))
sys.path.insert(0, str(REPO))

from kubernetes_asyncio import client  # noqa: E402
from kvgpu.core import keys  # noqa: E402
from kvgpu.core.inventory import SimulatedCardSpec, SimulatedNode  # noqa: E402
from kvgpu.devcluster import Cluster  # noqa: E402
from kvgpu.devcluster.fakenodes import node_manifest  # noqa: E402
from kvgpu.devcluster.system import KvgpuSystem  # noqa: E402
from kvgpu.dra.slices import device_classes  # noqa: E402
from kvgpu.kube import read_checked  # noqa: E402

from bench.scale import dra, kubeio  # noqa: E402
from bench.scale.probes import (  # noqa: E402
    ProcSampler,
    api_requests,
    apiserver_cpu_ms_per_pod,
    cpu_ms_per_pod,
    histogram_quantiles,
    load_average,
    new_connections,
    pct,
    per_pod_requests,
    scrape_histogram,
    webhook_workers,
)
from bench.scale.requeue import requeue  # noqa: E402
from bench.scale.results import code_version, machine, merge_results, public_args  # noqa: E402
from bench.scale.workload import pod_body  # noqa: E402

RESULTS = REPO / "bench" / "results" / "scale.json"
CARD = SimulatedCardSpec(model="NVIDIA H100 80GB HBM3", memory_mib=81559, sm_count=132, numa=0, count=8)
KVGPU_SCHED = "kube-scheduler-kvgpu-scheduler"
DEFAULT_SCHED = "kube-scheduler-default-scheduler"
SPLIT_COUNT = 10  # the pool's splitCount: slices (extender) or shares (DRA) per card


def log(msg: str) -> None:
    print(f"[{datetime.now(UTC).strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- the bench
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="kvgpu-scale-"))
        self.cluster = Cluster(self.run_dir,
                               open_scheduler_pprof=bool(args.scheduler_profile or args.scheduler_trace))
        self.system = KvgpuSystem(self.cluster, operator_args=(f"--node-choice={args.node_choice}",))
        self.result: dict[str, Any] = {}
        self.node_bodies: list[dict[str, Any]] = []
        self.slices: list[dict[str, Any]] = []
        self.t_start = time.monotonic()

    # --- setup -------------------------------------------------------------------------------
    def start(self) -> None:
        t0 = time.monotonic()
        self.cluster.start()
        self.system.start()
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": "default"},
            "spec": {"nodeSelector": {"matchLabels": {keys.NODE_LABEL_GPU: "true"}}, "splitCount": SPLIT_COUNT}}))
        log(f"control plane + operator up in {time.monotonic() - t0:.1f} s ({self.run_dir})")

    def stop(self) -> None:
        self.system.stop()
        self.cluster.stop()
        if not self.args.run_dir and not self.args.keep:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    @property
    def ext_port(self) -> int:
        """The extender (mutual TLS, as in production: the bench calls it with kube-scheduler's
        client certificate, :meth:`KvgpuSystem.client_ssl`)."""
        return self.system.extender_port

    @property
    def metrics_port(self) -> int:
        """The operator's plain /metrics port (the extender port answers only client certificates)."""
        return self.system.metrics_port

    async def make_nodes(self, api: client.ApiClient) -> dict[str, Any]:
        n = self.args.nodes
        bodies = [node_manifest(SimulatedNode(f"gpu-{i:05d}", (CARD,)), pods="250") for i in range(n)]
        # One small tainted node for the requeue trials (bursts cannot land there).
        rq = node_manifest(SimulatedNode("requeue-0", (SimulatedCardSpec(memory_mib=10000, count=1),),
                                         labels=(("kvgpu.io/bench", "requeue"),)))
        rq["spec"]["taints"] = [{"key": "kvgpu.io/bench", "value": "requeue", "effect": "NoSchedule"}]
        bodies.append(rq)
        self.node_bodies = bodies
        cards = sum(len(json.loads(b["metadata"]["annotations"][keys.NODE_INVENTORY])["cards"]) for b in bodies)
        co = client.CustomObjectsApi(api)

        async def all_known() -> None:
            """Until the operator's pool status counts every card: its ledger has every node."""
            while True:
                pool = await co.get_cluster_custom_object(keys.GROUP, keys.VERSION, "vgpupools", "default")
                if ((pool.get("status") or {}).get("cards") or 0) >= cards:
                    return
                await asyncio.sleep(0.5)

        sampler = ProcSampler(self.system.operator.pid)  # type: ignore[union-attr]
        with sampler:
            t0 = time.monotonic()
            res = await kubeio.bounded(bodies, lambda b: kubeio.create_node(api, b), 64)
            created = time.monotonic() - t0
            errors = [r for r in res if isinstance(r, Exception)]
            if errors:
                raise RuntimeError(f"{len(errors)} node creations failed, e.g. {errors[0]!r}")
            log(f"{len(bodies)} nodes created in {created:.1f} s ({len(bodies) / created:.0f}/s)")
            await asyncio.wait_for(all_known(), timeout=max(300, n * 0.2))
            synced = time.monotonic() - t0
        log(f"the operator's pool status counted every node's cards {synced:.1f} s after the first create")
        return {"nodes": n, "cards_per_node": CARD.count, "create_s": round(created, 2),
                "create_per_s": round(len(bodies) / created, 1), "operator_synced_s": round(synced, 2),
                "operator_during_sync": sampler.summary()}

    # --- one burst ---------------------------------------------------------------------------
    async def burst(self, api: client.ApiClient, size: int, *, kind: str, mode: str,
                    phase: str = "extender") -> dict[str, Any]:
        """One burst of ``size`` pods of ``kind`` (``baseline``: no GPU; ``gpu``: extender mode;
        ``dra``: one claim each from the seed's ResourceClaimTemplate) in ``mode`` (``stream`` or
        ``queued``); ``phase`` names the cards' allocation while it runs (``extender``/``dra``).
        Returns the burst's record (shape: the keys of ``out`` below)."""
        gpu = kind == "gpu"
        ns = f"b-{kind}-{mode}-{size}-{self.rng.randrange(16**6):06x}"
        await kubeio.bounded([ns], lambda n: client.CoreV1Api(api).create_namespace(
            {"metadata": {"name": n}}, _preload_content=False), 1)
        if kind == "dra":
            await dra.create_template(api, ns)
            bodies = [dra.pod_body(f"p{i:05d}") for i in range(size)]
        else:
            bodies = [pod_body(f"p{i:05d}", gpu=gpu, rng=self.rng) for i in range(size)]
        t_sent: dict[str, float] = {}
        t_bound: dict[str, float] = {}
        t_running: dict[str, float] = {}
        done = asyncio.Event()
        kubelet: list[asyncio.Task[Any]] = []
        sem = asyncio.Semaphore(32)

        async def play_kubelet(name: str) -> None:
            async with sem:
                try:
                    await kubeio.mark_running(api, ns, name)
                except Exception:
                    pass

        def finished() -> bool:
            return len(t_bound) >= size and len(t_running) >= size

        def on_pod(etype: str, obj: dict[str, Any], t: float) -> None:
            name = obj["metadata"]["name"]
            if obj.get("spec", {}).get("nodeName") and name not in t_bound:
                t_bound[name] = t
                kubelet.append(asyncio.create_task(play_kubelet(name)))
            if (obj.get("status") or {}).get("phase") == "Running" and name not in t_running:
                t_running[name] = t
            if finished():
                done.set()

        watches = [kubeio.Watch(api, "pods", ns, on_pod).start()]
        for w in watches:
            await w.synced.wait()
        sched = KVGPU_SCHED if gpu else DEFAULT_SCHED

        async def create(b: dict[str, Any]) -> None:
            t_sent[b["metadata"]["name"]] = time.monotonic()
            await kubeio.create_pod(api, ns, b)

        hist0 = scrape_histogram(self.metrics_port)
        req0 = await api_requests(api)
        sampler = ProcSampler(self.pids())
        load0 = load_average()
        t_sched_start = t_drain = None
        pprof = None
        if self.args.apiserver_profile:
            pprof = asyncio.create_task(self.apiserver_profile(api, f"apiserver-{kind}-{mode}-{size}.pprof"))
        sched_tasks: list[asyncio.Task[None]] = []
        sched_debug = self.scheduler_debug_asked(kind, mode, size)
        if mode != "queued":  # queued: once the scheduler starts, below
            sched_tasks = [asyncio.create_task(self.scheduler_debug(sched, *d)) for d in sched_debug]
        with sampler:
            if mode == "queued":
                self.cluster.stop_component(sched)
            t0 = time.monotonic()
            res = await kubeio.bounded(bodies, create, 64)
            t_created = time.monotonic()
            errors = [r for r in res if isinstance(r, Exception)]
            if mode == "queued":
                t_drain = sampler.mark()
                t_sched_start = time.monotonic()
                await asyncio.to_thread(self._start_scheduler, gpu)
                short = sched.replace("kube-scheduler-", "scheduler-")
                sampler.add(short, self.cluster.components[sched].pid)
                sched_tasks = [asyncio.create_task(self.scheduler_debug(sched, *d)) for d in sched_debug]
            try:
                await asyncio.wait_for(done.wait(), timeout=self.args.burst_timeout)
                timed_out = False
            except TimeoutError:
                timed_out = True
            t_end = time.monotonic()
            await asyncio.gather(*kubelet, return_exceptions=True)
        for w in watches:
            await w.stop()
        for task in (pprof, *sched_tasks):
            if task is not None:
                await task
        hist1 = scrape_histogram(self.metrics_port)
        req1 = await api_requests(api)

        bound = sorted(t_bound.values())
        lat_bound = [t_bound[n] - t_sent[n] for n in t_bound if n in t_sent]
        lat_run = [t_running[n] - t_sent[n] for n in t_running if n in t_sent]
        out: dict[str, Any] = {
            "kind": kind, "mode": mode, "pods": size, "phase": phase, "create_errors": len(errors),
            "create_s": round(t_created - t0, 2), "bound": len(bound), "timed_out": timed_out,
        }
        if errors:
            out["create_error_example"] = repr(errors[0])[:300]
        if bound:
            if mode == "stream":
                span = bound[-1] - t0
            else:
                span = bound[-1] - bound[0]
                out["scheduler_start_to_first_bound_s"] = round(bound[0] - (t_sched_start or t0), 2)
            out["span_s"] = round(span, 2)
            out["bound_per_s"] = round(len(bound) / span, 1) if span > 0 else None
            ends = sorted(t_running.values())
            if ends:
                ref = t0 if mode == "stream" else bound[0]
                out["running_per_s"] = round(len(ends) / (ends[-1] - ref), 1)
                out["running"] = len(ends)
            out["create_to_bound_ms"] = {"p50": round(pct(lat_bound, 0.5) * 1000),
                                         "p99": round(pct(lat_bound, 0.99) * 1000)}
            out["create_to_running_ms"] = {"p50": round(pct(lat_run, 0.5) * 1000),
                                           "p99": round(pct(lat_run, 0.99) * 1000)}
            ref = t0 if mode == "stream" else bound[0]
            out["bound_curve_s"] = [round(b - ref, 3) for b in bound[:: max(1, len(bound) // 200)]]
        if gpu:
            out["extender"] = histogram_quantiles(hist0, hist1)
            out["extender_connections_per_pod"] = round(new_connections(hist0, hist1) / size, 3)
        if kind == "dra":
            out["dra_allocations"] = dra.check_allocations(await dra.list_claims(api, ns), self.slices)
        out["operator"] = sampler.summary()
        out["cpu_seconds_by_process"] = sampler.cpu_by_process()
        out["api_requests_per_pod"] = per_pod_requests(req0, req1, size)
        out["api_requests_per_pod_total"] = round(sum(out["api_requests_per_pod"].values()), 2)
        out["webhook_calls_per_pod"] = per_pod_requests(req0, req1, size, webhooks=True)
        out["apiserver_cpu_ms_per_pod"] = apiserver_cpu_ms_per_pod(out["cpu_seconds_by_process"], size)
        out["cpu_ms_per_pod_all"] = cpu_ms_per_pod(out["cpu_seconds_by_process"], size)
        if t_drain is not None:  # queued: what placing the created pods cost, creation left out
            out["drain_cpu_ms_per_pod"] = cpu_ms_per_pod(sampler.cpu_by_process(since=t_drain), size, each=True)
        out["load_average_1m"] = [load0, load_average()]
        out["wall_s"] = round(t_end - t0, 2)
        log(f"{kind:8s} {phase:8s} {mode:6s} {size:5d} pods: bound {len(bound)}/{size}"
            f" {out.get('bound_per_s')} pods/s, running {out.get('running_per_s')} pods/s,"
            f" create {out['create_s']} s, errors {len(errors)}, operator {out['operator']}"
            + (f", extender {out['extender']}, {out['extender_connections_per_pod']} new extender"
               " connections per pod" if gpu else "")
            + (f", claims {out['dra_allocations']}" if kind == "dra" else "")
            + f", cpu {out['cpu_seconds_by_process']}"
            + f", API requests per pod {out['api_requests_per_pod']}"
            + f", webhook calls per pod {out['webhook_calls_per_pod']}"
            + f", kube-apiserver CPU {out['apiserver_cpu_ms_per_pod']} ms per pod")
        await self.cleanup_namespace(api, ns, kind)
        return out

    async def apiserver_profile(self, api: client.ApiClient, name: str) -> None:
        """A CPU profile of kube-apiserver (Go pprof, ``/debug/pprof/profile``) over the first
        ``--apiserver-profile`` seconds of the burst, saved in the run directory; read it with
        ``bench/scale/pprof_summary.py <files>`` (share per activity) or ``go tool pprof -top <file>``."""
        secs = int(self.args.apiserver_profile)
        resp = await api.call_api("/debug/pprof/profile", "GET", query_params=[("seconds", secs)],
                                  auth_settings=["BearerToken"], _preload_content=False,
                                  _request_timeout=secs + 60)
        try:
            (self.run_dir / name).write_bytes(await resp.read())
        finally:
            resp.release()
        log(f"kube-apiserver CPU profile: {self.run_dir / name}")

    def scheduler_debug_asked(self, kind: str, mode: str, size: int) -> list[tuple[str, str, int]]:
        """What ``--scheduler-profile`` / ``--scheduler-trace`` ask of this burst (GPU bursts
        only): ``(pprof endpoint, file name, seconds)`` each."""
        if kind != "gpu":
            return []
        stem = f"scheduler-{kind}-{mode}-{size}"
        asked = [("profile", f"{stem}.pprof", self.args.scheduler_profile),
                 ("trace", f"{stem}.trace", self.args.scheduler_trace)]
        return [a for a in asked if a[2]]

    async def scheduler_debug(self, component: str, endpoint: str, name: str, secs: int) -> None:
        """A Go CPU profile (``profile``: where its CPU goes) or execution trace (``trace``: where
        its goroutines wait, e.g. the scheduling cycle on the extender's answer) of the kvgpu
        kube-scheduler over ``secs`` seconds of its work in the burst, saved in the run
        directory; read it with ``go tool pprof -top`` or ``go tool trace``. Its serving
        certificate is self-signed: not verified."""
        url = f"https://127.0.0.1:{self.cluster.components[component].port}/debug/pprof/{endpoint}?seconds={secs}"
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE

        def fetch() -> bytes:
            with urllib.request.urlopen(url, timeout=secs + 60, context=ctx) as r:
                return bytes(r.read())

        (self.run_dir / name).write_bytes(await asyncio.to_thread(fetch))
        log(f"kube-scheduler {endpoint}: {self.run_dir / name}")

    def pids(self) -> dict[str, int]:
        """The processes whose CPU a burst accounts: control plane, operator, this bench."""
        out = {"operator": self.system.operator.pid, "bench": os.getpid()}  # type: ignore[union-attr]
        for i, child in enumerate(webhook_workers(out["operator"])):
            out[f"webhook-{i}"] = child
        for name, comp in self.cluster.components.items():
            out[name.replace("kube-scheduler-", "scheduler-")] = comp.pid
        return out

    def _start_scheduler(self, gpu: bool) -> None:
        if gpu:
            self.system.start_scheduler()
        else:
            self.cluster.start_scheduler("default-scheduler")

    async def cleanup_namespace(self, api: client.ApiClient, ns: str, kind: str) -> None:
        """Delete the burst's pods and namespace; for GPU bursts (``kind`` ``gpu``, ``dra``) wait
        until its claims (VGPUClaims, ResourceClaims) are gone, so the next burst starts from a
        quiet operator and kube-controller-manager."""
        t0 = time.monotonic()
        await asyncio.to_thread(self.cluster.kubectl, "delete", "pods", "--all", "-n", ns, "--grace-period=0",
                                "--force", "--wait=false", check=False, timeout=300)
        if kind != "baseline":
            while time.monotonic() - t0 < 180:
                left = len(await dra.list_claims(api, ns) if kind == "dra"
                           else (await kubeio.list_raw(api, "vgpuclaims", ns)).get("items") or [])
                if not left:
                    break
                await asyncio.sleep(1.0)
        await asyncio.to_thread(self.cluster.kubectl, "delete", "namespace", ns, "--wait=false", check=False)
        await asyncio.sleep(self.args.settle)
        log(f"cleaned {ns} in {time.monotonic() - t0:.1f} s")

    # --- direct extender probes ----------------------------------------------------------------
    async def probe_extender(self, api: client.ApiClient, n_calls: int = 200) -> dict[str, Any]:
        """Call filter and prioritize directly, sequentially, with the node list kube-scheduler
        sends (it scores at most max(100, 10 %) of the nodes at this size; we send that many)."""
        import aiohttp

        names = [f"gpu-{i:05d}" for i in range(self.args.nodes)]
        k = max(100, self.args.nodes // 10)
        out: dict[str, Any] = {"node_names_per_call": k}
        uid = "00000000-0000-0000-0000-000000000001"
        pod = {"metadata": {"name": "probe", "namespace": "default", "uid": uid,
                            "annotations": {"kvgpu.io/gpumem": "8000", "kvgpu.io/gpucores": "20"}},
               "spec": {"schedulerName": keys.SCHEDULER_NAME, "containers": [{"name": "main", "image": "x"}]}}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.system.client_ssl())) as s:
            for verb in ("filter", "prioritize"):
                lat = []
                for i in range(n_calls):
                    start = (i * 37) % max(1, len(names) - k)
                    body = json.dumps({"pod": pod, "nodenames": names[start:start + k]}).encode()
                    t = time.perf_counter()
                    async with s.post(f"{self.system.extender_url}/{verb}", data=body,
                                      headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                    lat.append(time.perf_counter() - t)
                out[verb] = {"calls": n_calls, "p50_ms": round(pct(lat, 0.5) * 1000, 2),
                             "p99_ms": round(pct(lat, 0.99) * 1000, 2), "max_ms": round(max(lat) * 1000, 2)}
        log(f"direct extender probes: {out}")
        return out

    # --- main ----------------------------------------------------------------------------------
    async def main(self) -> dict[str, Any]:
        async with self.cluster.api() as api:
            api.configuration.connection_pool_maxsize = 128
            idle = ProcSampler(self.system.operator.pid)  # type: ignore[union-attr]
            nodes = await self.make_nodes(api)
            _cpu, rss = idle.read()
            nodes["operator_rss_mib_after_sync"] = round(rss / 2**20, 1)
            out: dict[str, Any] = {"setup": nodes, "bursts": []}
            if self.args.requeue_trials:
                out["requeue"] = await requeue(self, api, self.args.requeue_trials)
                log(f"requeue: {out['requeue']}")
            await self.bursts(api, out, ("baseline", "gpu"), "extender")
            out["extender_probe"] = await self.probe_extender(api)
            if self.args.dra:
                out["dra_setup"] = await self.to_dra(api)
                await self.bursts(api, out, ("baseline", "dra"), "dra")
            _cpu, rss = idle.read()
            out["operator_rss_mib_end"] = round(rss / 2**20, 1)
            return out

    async def bursts(self, api: client.ApiClient, out: dict[str, Any], kinds: tuple[str, ...], phase: str) -> None:
        """Every burst size and mode, one burst of each of ``kinds`` in turn, appended to
        ``out["bursts"]``; past ``--time-budget`` the (size, mode) groups not started are listed
        in ``out["skipped_bursts"]`` instead."""
        for size in self.args.bursts:
            for mode in self.args.modes:
                if self.args.time_budget and time.monotonic() - self.t_start > self.args.time_budget:
                    out.setdefault("skipped_bursts", []).extend(f"{k} {phase} {mode} {size}" for k in kinds)
                    log(f"time budget of {self.args.time_budget} s spent: {kinds} {mode} {size} skipped")
                    continue
                for kind in kinds:
                    out["bursts"].append(await self.burst(api, size, kind=kind, mode=mode, phase=phase))
                    self._save_partial(out)

    async def to_dra(self, api: client.ApiClient) -> dict[str, Any]:
        """Move every card to DRA: the pool's ``allocation`` to ``dra``, kvgpu's DeviceClass, and
        each node's ResourceSlice (64 in flight). Returns ``{"slices", "devices", "create_s"}``."""
        await asyncio.to_thread(self.cluster.kubectl, "patch", "vgpupool", "default", "--type=merge",
                                "-p", json.dumps({"spec": {"allocation": "dra"}}))
        for dc in device_classes():  # the kvgpu system installs them; a bare cluster may not have them
            try:
                await read_checked(await client.ResourceV1Api(api).create_device_class(
                    dc, _preload_content=False))
            except client.exceptions.ApiException as e:
                if e.status != 409:
                    raise
        self.slices = [s for b in self.node_bodies for s in dra.node_slices(b, "default", SPLIT_COUNT)]
        t0 = time.monotonic()
        res = await kubeio.bounded(self.slices, lambda b: dra.create_slice(api, b), 64)
        created = time.monotonic() - t0
        errors = [r for r in res if isinstance(r, Exception)]
        if errors:
            raise RuntimeError(f"{len(errors)} ResourceSlice creations failed, e.g. {errors[0]!r}")
        devices = sum(len(s["spec"]["devices"]) for s in self.slices)
        log(f"{len(self.slices)} ResourceSlices ({devices} devices) created in {created:.1f} s")
        await asyncio.sleep(self.args.settle)
        return {"slices": len(self.slices), "devices": devices, "create_s": round(created, 2)}

    def _save_partial(self, out: dict[str, Any]) -> None:
        (self.run_dir / "partial.json").write_text(json.dumps(out, indent=1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--bursts", type=lambda s: [int(x) for x in s.split(",") if x], default=[500, 2000])
    p.add_argument("--modes", type=lambda s: [x for x in s.split(",") if x], default=["stream", "queued"])
    p.add_argument("--requeue-trials", type=int, default=50)
    p.add_argument("--requeue-wait", type=float, default=2.0,
                   help="seconds a pending pod waits (rejected, parked) before capacity frees")
    p.add_argument("--burst-timeout", type=float, default=600)
    p.add_argument("--settle", type=float, default=3.0, help="quiet seconds between bursts")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--run-dir", default="")
    p.add_argument("--keep", action="store_true", help="keep the run directory (logs)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--time-budget", type=float, default=0, metavar="SECONDS",
                   help="start no burst (size and mode) later than SECONDS after the bench started; "
                        "those skipped are listed in the results (0: no limit)")
    p.add_argument("--dra", action="store_true",
                   help="after the extender bursts, move the cards to allocation: dra (ResourceSlices) and run "
                        "the same bursts with DRA claims, next to a no-GPU baseline each (bench/scale/dra.py)")
    p.add_argument("--node-choice", choices=["extender", "scheduler"], default="extender",
                   help="the operator's --node-choice: who picks a GPU pod's node (kvgpu.extender.choice)")
    p.add_argument("--apiserver-profile", type=int, default=0, metavar="SECONDS",
                   help="record kube-apiserver's CPU (Go pprof) for SECONDS at the start of each burst "
                        "(GPU and no-GPU, to compare)")
    p.add_argument("--scheduler-profile", type=int, default=0, metavar="SECONDS",
                   help="record the kvgpu kube-scheduler's CPU (Go pprof) for SECONDS of each GPU burst "
                        "(from its start; queued: from the scheduler's start)")
    p.add_argument("--scheduler-trace", type=int, default=0, metavar="SECONDS",
                   help="record the kvgpu kube-scheduler's Go execution trace (where its goroutines wait) "
                        "for SECONDS of each GPU burst, as --scheduler-profile")
    p.add_argument("--profile", action="store_true",
                   help="record the operator with py-spy during the bursts (needs py-spy on PATH)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    started = datetime.now(UTC)
    code = code_version()  # at the start: the code that runs
    bench.start()
    spy = None
    try:
        if args.profile:
            import subprocess

            svg = bench.run_dir / "operator-profile.txt"
            spy_bin = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            spy = subprocess.Popen([spy_bin, "record", "-p", str(bench.system.operator.pid),  # type: ignore[union-attr]
                                    "-o", str(svg), "--rate", "50", "--format", "raw", "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        result = asyncio.run(bench.main())
    finally:
        if spy is not None:
            import signal

            spy.send_signal(signal.SIGINT)
            spy.wait(60)
        bench.stop()
    shown = public_args(argv if argv is not None else sys.argv[1:])
    record = {
        "date": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "python bench/scale/run.py " + " ".join(shown),
        "machine": machine(),
        "node_choice": args.node_choice,
        **({"code": code} if code else {}),
        **result,
    }
    merge_results(Path(args.out), args.nodes, record)
    log(f"results merged into {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
