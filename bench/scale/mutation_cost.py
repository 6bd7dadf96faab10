"""CPU per GPU pod create with kvgpu's mutating webhook against a MutatingAdmissionPolicy (GA
in Kubernetes 1.36: CEL mutation inside kube-apiserver, no webhook call) that makes the same
change, measured A/B on the local control plane (issue 17: the webhook call is one of the three
~2 ms parts of a GPU pod's extra API-server cost).

The policy here is a measuring device, not a product: it mutates single-container pods the way
the webhook does (the admitted marker, the managed label, kvgpu-scheduler, the claim volume and
mount, the six injected env vars, ``nvidia.com/gpu``), with none of the webhook's parsing or
refusals. Each variant runs dry-run creates of the scale bench's GPU pods (admission in full,
the pod policy ``pods.kvgpu.io`` included, nothing stored) and reads the CPU time of
kube-apiserver and of the operator with its webhook workers from ``/proc``; before measuring,
the policy's output is checked against the webhook's for 300 pods, and the run stops at the
first difference (a mismatched or refused pod would measure another path).

    .venv/bin/python bench/scale/mutation_cost.py [--pods 3000] [--rounds 2]

Prints one line per round and variant, then JSON.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: bench/scale/mutation_cost.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kubernetes_asyncio import client
from kvgpu.admission import mutate
from kvgpu.admission.config import gpu_pod_expression
from kvgpu.core import keys
from kvgpu.devcluster import Cluster
from kvgpu.devcluster.system import KvgpuSystem

from bench.scale.admission_cost import cli, cpu_seconds
from bench.scale.probes import webhook_workers
from bench.scale.workload import pod_body

NS = "mutation-cost"
POLICY = "bench-mutate.kvgpu.io"
WEBHOOK = "kvgpu-mutate"


C = "CONTAINERNAME"  # stands for variables.c (the container's name) in the webhook's own output


def cel(v: Any) -> str:
    """A CEL literal of a JSON value; a string holding :data:`C` becomes a concatenation. Map
    values are ``dyn`` (the API server's type checker refuses a map literal of mixed types)."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{cel(k)}: dyn({cel(x)})" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(cel(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    return " + variables.c + ".join(json.dumps(part) for part in str(v).split(C))


def _add(path: str, key: str, value: str, whole: str) -> str:
    """CEL: JSONPatch ops adding ``value`` under ``path`` (a map key, or ``-`` for a list), or the
    whole map or list ``whole`` when ``path`` is not there yet."""
    obj = "object" + "".join(f".{p}" if not p.isdigit() else f"[{p}]" for p in path.strip("/").split("/"))
    return (f"(has({obj}) ? [JSONPatch{{op: 'add', path: '{path}/{key}', value: {value}}}] : "
            f"[JSONPatch{{op: 'add', path: '{path}', value: {whole}}}])")


def policy() -> dict[str, Any]:
    """The MutatingAdmissionPolicy (admissionregistration.k8s.io/v1) that mimics the webhook."""
    env = mutate.injected_env(C)
    vol = mutate.injected_volumes([C])[0]
    mount = mutate.injected_mounts(C)[0]
    ann, label = keys.POD_ADMITTED.replace("/", "~1"), f"{keys.GROUP}~1managed"
    envs = ("(has(object.spec.containers[0].env) ? variables.env.map(e, JSONPatch{op: 'add', "
            "path: '/spec/containers/0/env/-', value: e}) : "
            "[JSONPatch{op: 'add', path: '/spec/containers/0/env', value: variables.env}])")
    patch = " + ".join([
        _add("/metadata/annotations", ann, "variables.c", f"{{'{keys.POD_ADMITTED}': variables.c}}"),
        _add("/metadata/labels", label, "'true'", f"{{'{keys.GROUP}/managed': 'true'}}"),
        "[JSONPatch{op: 'add', path: '/spec/schedulerName', value: 'kvgpu-scheduler'}]",
        _add("/spec/volumes", "-", "variables.vol", "[variables.vol]"),
        envs,
        _add("/spec/containers/0/volumeMounts", "-", "variables.mount", "[variables.mount]"),
        _add("/spec/containers/0/resources/limits", "nvidia.com~1gpu", "variables.n",
             "{'nvidia.com/gpu': variables.n}"),
    ])
    gpus = (f"has(object.metadata.annotations) && '{keys.GROUP}/gpu' in object.metadata.annotations ? "
            f"object.metadata.annotations['{keys.GROUP}/gpu'] : "
            "has(object.spec.containers[0].resources.limits) && "
            "'nvidia.com/gpu' in object.spec.containers[0].resources.limits ? "
            "string(object.spec.containers[0].resources.limits['nvidia.com/gpu']) : '1'")
    return {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicy",
        "metadata": {"name": POLICY},
        "spec": {
            "failurePolicy": "Fail", "reinvocationPolicy": "Never",
            "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                    "operations": ["CREATE"], "resources": ["pods"]}]},
            "matchConditions": [{"name": "mentions-gpus", "expression": gpu_pod_expression(update=False)}],
            "variables": [{"name": "c", "expression": "object.spec.containers[0].name"},
                          {"name": "n", "expression": gpus},
                          {"name": "env", "expression": cel(env)},
                          {"name": "vol", "expression": cel(vol)},
                          {"name": "mount", "expression": cel(mount)}],
            "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression": patch}}],
        },
    }


def binding() -> dict[str, Any]:
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicyBinding",
            "metadata": {"name": POLICY}, "spec": {"policyName": POLICY}}


async def creates(api: client.ApiClient, bodies: list[dict[str, Any]], limit: int = 32) -> list[dict[str, Any]]:
    """Dry-run creates; the pods as admission left them (an error: its status)."""
    core = client.CoreV1Api(api)
    sem = asyncio.Semaphore(limit)

    async def one(body: dict[str, Any]) -> dict[str, Any]:
        async with sem:
            try:
                resp = await core.create_namespaced_pod(NS, body, dry_run="All", _preload_content=False)
                out = json.loads(await resp.read())
                resp.release()
                return out
            except client.ApiException as e:
                return {"error": e.status, "body": e.body}

    return list(await asyncio.gather(*(one(b) for b in bodies)))


def comparable(pod: dict[str, Any]) -> Any:
    """What admission decides of a pod (not its server-set identity or managedFields)."""
    if "error" in pod or "spec" not in pod:  # refused (a Status, not a Pod)
        return {"error": pod.get("error") or pod.get("code"), "message": pod.get("message") or pod.get("body")}
    meta = pod["metadata"]
    return {"annotations": meta.get("annotations"), "labels": meta.get("labels"), "spec": pod["spec"]}


class Variants:
    """Switches between the webhook and the policy (one is installed at a time)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        hook = json.loads(cluster.kubectl("get", "mutatingwebhookconfiguration", WEBHOOK, "-o", "json").stdout)
        for k in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
            hook["metadata"].pop(k, None)
        self.hook = hook
        cluster.kubectl("apply", "-f", "-", input=json.dumps(policy()))

    async def use(self, variant: str) -> None:
        k = self.cluster.kubectl
        if variant == "policy":
            k("apply", "-f", "-", input=json.dumps(binding()))
            k("delete", "mutatingwebhookconfiguration", WEBHOOK, "--ignore-not-found")
        else:
            k("apply", "-f", "-", input=json.dumps(self.hook))
            k("delete", "mutatingadmissionpolicybinding", POLICY, "--ignore-not-found")
        await asyncio.sleep(3)  # the API server's policy and webhook informers


def cpu(pids: list[int]) -> float:
    return sum(cpu_seconds(p) for p in pids)


async def measure(cluster: Cluster, system: KvgpuSystem, pods: int, rounds: int) -> dict[str, Any]:
    cluster.kubectl("create", "namespace", NS)
    api_pid = cluster.components["kube-apiserver"].pid
    assert system.operator is not None
    op_pids = [system.operator.pid, *webhook_workers(system.operator.pid)]
    rng = random.Random(7)
    bodies = [pod_body(f"g{i:05d}", gpu=True, rng=rng) for i in range(pods)]
    variants = Variants(cluster)
    out: dict[str, Any] = {"pods": pods, "rows": []}
    async with cluster.api() as api:
        got = {}
        for v in ("webhook", "policy"):
            await variants.use(v)
            got[v] = [comparable(p) for p in await creates(api, bodies[:300])]
        out["checked"] = len(got["webhook"])
        out["refused"] = {v: sum("error" in p for p in ps) for v, ps in got.items()}
        diffs = [(a, b) for a, b in zip(got["webhook"], got["policy"], strict=True) if a != b]
        out["mismatches"] = len(diffs)
        print("checked", out["checked"], "refused", out["refused"], "mismatches", out["mismatches"], flush=True)
        if diffs:  # the policy would measure another path
            a, b = diffs[0]
            raise SystemExit(f"the policy does not make the webhook's pod:\nwebhook: {json.dumps(a)[:1500]}"
                             f"\npolicy:  {json.dumps(b)[:1500]}")
        for rnd in range(rounds):
            for v in ("webhook", "policy"):
                await variants.use(v)
                a0, o0 = cpu_seconds(api_pid), cpu(op_pids)
                await creates(api, bodies)
                row = {"round": rnd, "variant": v,
                       "apiserver_ms_per_pod": round(1000 * (cpu_seconds(api_pid) - a0) / pods, 2),
                       "operator_ms_per_pod": round(1000 * (cpu(op_pids) - o0) / pods, 2)}
                print(row, flush=True)
                out["rows"].append(row)
        await variants.use("webhook")
    return out


def main() -> int:
    return cli(__doc__ or "", "kvgpu-mutation-cost-", measure)


if __name__ == "__main__":
    raise SystemExit(main())
