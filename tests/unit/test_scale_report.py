"""The scale bench's accounting of what a pod costs the API server (bench/scale)."""

from __future__ import annotations

from bench.scale import report
from bench.scale.probes import ProcSampler, cpu_ms_per_pod
from bench.scale.run import apiserver_cpu_ms_per_pod, per_pod_requests


def test_requests_and_webhook_calls_are_counted_apart_per_pod() -> None:
    before = {"POST pods": 10.0, "POST pods/binding": 10.0, "webhook pods.mutate.kvgpu.io": 10.0}
    after = {"POST pods": 110.0, "POST pods/binding": 110.0, "PATCH nodes": 105.0,
             "webhook pods.mutate.kvgpu.io": 110.0, "webhook pods.validate.kvgpu.io": 100.0}
    assert per_pod_requests(before, after, 100) == {"PATCH nodes": 1.05, "POST pods": 1.0, "POST pods/binding": 1.0}
    assert per_pod_requests(before, after, 100, webhooks=True) == {
        "pods.mutate.kvgpu.io": 1.0, "pods.validate.kvgpu.io": 1.0}


def test_apiserver_cpu_per_pod_in_milliseconds() -> None:
    assert apiserver_cpu_ms_per_pod({"kube-apiserver": 8.6, "etcd": 1.0}, 500) == 17.2
    assert apiserver_cpu_ms_per_pod({"etcd": 1.0}, 500) is None


def _burst(kind: str, pods_per_s: float, requests: dict[str, float], hooks: dict[str, float] | None,
           apiserver_s: float) -> dict[str, object]:
    return {"kind": kind, "mode": "stream", "pods": 500, "bound_per_s": pods_per_s,
            "api_requests_per_pod": requests, "webhook_calls_per_pod": hooks,
            "cpu_seconds_by_process": {"kube-apiserver": apiserver_s}}


def _run(gpu_requests: dict[str, float], hooks: dict[str, float], gpu_rate: float) -> dict[str, object]:
    base = {"POST pods": 1.0, "POST pods/binding": 1.0, "POST events": 1.0, "PATCH pods/status": 1.0}
    return {"machine": {"cores": 2}, "setup": {"nodes": 1001}, "node_choice": "extender",
            "bursts": [_burst("baseline", 300.0, base, {}, 2.0), _burst("gpu", gpu_rate, gpu_requests, hooks, 5.0)]}


def test_cost_goals_are_judged_on_every_burst() -> None:
    cheap = {"POST pods": 1.0, "POST vgpuclaims": 1.0, "POST pods/binding": 1.0, "POST events": 1.0,
             "PATCH pods/status": 1.0}
    rows = report.cost_summary([_run(cheap, {"pods.mutate.kvgpu.io": 1.0}, 160.0)])
    assert [r.split("|")[2].split(":")[0].strip() for r in rows] == ["**yes**"] * 3
    assert "10.0-10.0 ms per GPU pod against 4.0-4.0 ms" in rows[1]
    assert "(of which Node and VGPUPool status writes, amortised: 0-0)" in rows[1]

    dear = {**cheap, "PATCH vgpuclaims/status": 2.0, "PATCH nodes": 0.25}
    rows = report.cost_summary([_run(dear, {"pods.mutate.kvgpu.io": 1.0, "pods.validate.kvgpu.io": 1.0}, 100.0)])
    assert [r.split("|")[2].split(":")[0].strip() for r in rows] == ["**no**"] * 3
    assert "7.25-7.25 per GPU pod (of which Node and VGPUPool status writes, amortised: 0.25-0.25) " \
        "against 4-4 per no-GPU pod" in rows[1]


def test_cost_table_shows_both_kinds_side_by_side() -> None:
    rows = report.cost_table(_run({"POST pods": 1.0, "POST vgpuclaims": 1.0}, {"pods.mutate.kvgpu.io": 1.0}, 160.0))
    assert rows[2].startswith("| stream 500 | 4 / 2 | 1 (pods.mutate.kvgpu.io 1) | 4.0 / 10.0 |")


def test_cpu_since_a_mark_counts_from_the_reading_at_the_mark() -> None:
    sampler = ProcSampler({"a": 1, "b": 2})
    sampler.samples = {"a": [(0.0, 1.0, 0), (1.0, 3.0, 0), (2.0, 7.0, 0)],
                       "b": [(1.5, 2.0, 0), (2.0, 2.5, 0)]}  # b first read after the mark
    assert sampler.cpu_by_process() == {"a": 6.0, "b": 0.5}
    assert sampler.cpu_by_process(since=1.0) == {"a": 4.0, "b": 0.5}
    assert cpu_ms_per_pod({"a": 4.0, "b": 0.5}, 500) == 9.0
    assert cpu_ms_per_pod({"a": 4.0, "b": 0.5}, 500, each=True) == {"a": 8.0, "b": 1.0, "total": 9.0}


def test_a_mark_reads_every_process_now() -> None:
    import os

    sampler = ProcSampler({"me": os.getpid()})
    t = sampler.mark()
    assert [s[0] for s in sampler.samples["me"]] == [t]
    assert sampler.samples["me"][0][1] > 0


def test_drain_table_sets_each_kinds_total_beside_its_processes() -> None:
    run = _run({"POST pods": 1.0}, {"pods.mutate.kvgpu.io": 1.0}, 160.0)
    base, gpu = run["bursts"]  # type: ignore[misc]
    base["drain_cpu_ms_per_pod"] = {"kube-apiserver": 3.0, "scheduler-default-scheduler": 1.5, "total": 4.5}
    gpu["drain_cpu_ms_per_pod"] = {"kube-apiserver": 7.0, "operator": 2.5, "etcd": 0.0, "total": 9.5}
    rows = report.drain_table(run)
    assert rows[2] == ("| stream 500 | 4.5 / 9.5 | kube-apiserver 7, operator 2.5 "
                       "| kube-apiserver 3, scheduler-default-scheduler 1.5 |")
    del gpu["drain_cpu_ms_per_pod"]
    assert report.drain_table(run) == []
