"""kube-apiserver CPU per pod create with and without kvgpu's pod policy (the CEL
ValidatingAdmissionPolicy ``pods.kvgpu.io``), measured A/B on the local control plane: dry-run
creates (admission runs in full, nothing is stored) of the scale bench's GPU and plain pods,
the API server's CPU time from ``/proc`` per create, in alternating rounds to show the noise.

    .venv/bin/python bench/scale/admission_cost.py [--pods 3000] [--rounds 2]

Prints one line per round and variant, then JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: bench/scale/admission_cost.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kubernetes_asyncio import client
from kvgpu.admission.podpolicy import POD_POLICY_NAME
from kvgpu.devcluster import Cluster
from kvgpu.devcluster.system import KvgpuSystem

from bench.scale.workload import pod_body

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def dry_run_creates(api: client.ApiClient, ns: str, bodies: list[dict[str, Any]], limit: int = 32) -> None:
    core = client.CoreV1Api(api)
    sem = asyncio.Semaphore(limit)

    async def one(body: dict[str, Any]) -> None:
        async with sem:
            resp = await core.create_namespaced_pod(ns, body, dry_run="All", _preload_content=False)
            await resp.read()
            resp.release()

    await asyncio.gather(*(one(b) for b in bodies))


async def measure(cluster: Cluster, pods: int, rounds: int) -> list[dict[str, Any]]:
    cluster.kubectl("create", "namespace", "admission-cost")
    pid = cluster.components["kube-apiserver"].pid
    binding = json.loads(cluster.kubectl("get", "validatingadmissionpolicybinding", POD_POLICY_NAME,
                                         "-o", "json").stdout)
    for k in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
        binding["metadata"].pop(k, None)
    rng = random.Random(7)
    kinds = {"gpu": [pod_body(f"g{i:05d}", gpu=True, rng=rng) for i in range(pods)],
             "plain": [pod_body(f"p{i:05d}", gpu=False, rng=rng) for i in range(pods)]}
    out = []
    async with cluster.api() as api:
        await dry_run_creates(api, "admission-cost", kinds["gpu"][:300])  # warm up
        for rnd in range(rounds):
            for policy in (True, False):
                if policy:
                    cluster.kubectl("apply", "-f", "-", input=json.dumps(binding))
                else:
                    cluster.kubectl("delete", "validatingadmissionpolicybinding", POD_POLICY_NAME)
                await asyncio.sleep(3)  # the API server's policy informer
                row: dict[str, Any] = {"round": rnd, "pod_policy": policy}
                for kind, bodies in kinds.items():
                    c0 = cpu_seconds(pid)
                    await dry_run_creates(api, "admission-cost", bodies)
                    row[f"{kind}_ms_per_create"] = round(1000 * (cpu_seconds(pid) - c0) / pods, 2)
                print(row, flush=True)
                out.append(row)
    return out


def cli(doc: str, prefix: str, measure: Callable[..., Awaitable[Any]]) -> int:
    """The A/B benches' command line: ``--pods``, ``--rounds``; ``measure(cluster, system, pods,
    rounds)`` on a fresh local control plane with kvgpu installed; its result printed as JSON."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--pods", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    cluster = Cluster(Path(tempfile.mkdtemp(prefix=prefix)))
    cluster.start()
    system = KvgpuSystem(cluster).start()
    try:
        result = asyncio.run(measure(cluster, system, args.pods, args.rounds))
    finally:
        system.stop()
        cluster.stop()
    print(json.dumps(result, indent=1))
    return 0


def main() -> int:
    return cli(__doc__ or "", "kvgpu-admission-cost-", lambda c, _s, pods, rounds: measure(c, pods, rounds))


if __name__ == "__main__":
    raise SystemExit(main())
