"""The requeue trial of the scale bench (:mod:`bench.scale.run`): how soon a pod that fits
nowhere is placed once the capacity it waits for frees."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import TYPE_CHECKING, Any

from kubernetes_asyncio import client

from bench.scale import kubeio
from bench.scale.probes import histogram_quantiles, pct, scrape_histogram

if TYPE_CHECKING:
    from bench.scale.run import Bench


async def requeue(bench: Bench, api: client.ApiClient, trials: int) -> dict[str, Any]:
    """A chain of pods that each need the whole requeue-0 card: pod k waits (fits nowhere)
    until pod k-1 is deleted; the time from that delete to pod k Bound is one sample."""
    ns = f"requeue-{bench.rng.randrange(16**6):06x}"
    await kubeio.bounded([ns], lambda n: client.CoreV1Api(api).create_namespace(
        {"metadata": {"name": n}}, _preload_content=False), 1)
    bound: dict[str, asyncio.Event] = {}

    def on_pod(etype: str, obj: dict[str, Any], t: float) -> None:
        name = obj["metadata"]["name"]
        if obj.get("spec", {}).get("nodeName"):
            bound.setdefault(name, asyncio.Event()).set()

    w = kubeio.Watch(api, "pods", ns, on_pod).start()
    await w.synced.wait()

    def body(i: int) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"r{i:03d}", "annotations": {"kvgpu.io/gpumem": "10000"}},
                "spec": {"containers": [{"name": "main", "image": "bench"}],
                         "nodeSelector": {"kvgpu.io/bench": "requeue"},
                         "tolerations": [{"key": "kvgpu.io/bench", "operator": "Exists"}],
                         "terminationGracePeriodSeconds": 0}}

    async def wait_bound(name: str, limit_s: float) -> bool:
        ev = bound.setdefault(name, asyncio.Event())
        try:
            await asyncio.wait_for(ev.wait(), limit_s)
            return True
        except TimeoutError:
            return False

    hist0 = scrape_histogram(bench.metrics_port)
    await kubeio.create_pod(api, ns, body(0))
    if not await wait_bound("r000", 60):
        raise RuntimeError("requeue: the first pod was never bound")
    samples: list[float] = []
    misses = 0
    for i in range(1, trials + 1):
        name = f"r{i:03d}"
        await kubeio.create_pod(api, ns, body(i))
        await asyncio.sleep(bench.args.requeue_wait)  # rejected by filter, parked by kube-scheduler
        if bound.get(name) is not None and bound[name].is_set():
            raise RuntimeError(f"requeue: {name} was bound while the card was full")
        t0 = time.monotonic()
        await kubeio.delete_pod(api, ns, f"r{i - 1:03d}")
        if await wait_bound(name, 30):
            samples.append(time.monotonic() - t0)
        else:
            misses += 1
    await w.stop()
    extender = histogram_quantiles(hist0, scrape_histogram(bench.metrics_port))
    await bench.cleanup_namespace(api, ns, "gpu")
    out = {"extender_one_pod_at_a_time": extender, "trials": trials, "placed": len(samples),
           "missed_30s": misses,
           "wait_before_free_s": bench.args.requeue_wait,
           "p50_s": round(pct(samples, 0.5), 3), "p90_s": round(pct(samples, 0.9), 3),
           "p99_s": round(pct(samples, 0.99), 3), "max_s": round(max(samples), 3) if samples else None,
           "mean_s": round(statistics.fmean(samples), 3) if samples else None,
           "within_2s": sum(s <= 2.0 for s in samples), "samples_s": [round(s, 3) for s in samples]}
    return out
