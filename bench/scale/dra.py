"""DRA mode of the scale bench (:mod:`bench.scale.run`, ``--dra``): the same fake nodes' cards as
``resource.k8s.io/v1`` ResourceSlices of driver ``gpu.kvgpu.io`` (built by
:func:`kvgpu.dra.slices.resource_slices`, as the node agent publishes them), and GPU pods that
each get one claim from a ResourceClaimTemplate (the seed's slice: 3000 MiB, 30 % of the SMs),
allocated by the default kube-scheduler's DRA plugin. No kubelet runs, so no claim is prepared
(``NodePrepareResources`` is the real node's part, tests/realnode): what is measured is the
control plane's work per pod (template → claim by kube-controller-manager, allocation by
kube-scheduler, Binding).

A card is in one pool: the bench moves the pool of every card from ``allocation: extender`` to
``allocation: dra`` after the extender bursts, so both modes use the same nodes and cards.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from kubernetes_asyncio import client
from kvgpu.core import keys
from kvgpu.core.inventory import NodeInventory, Slicing
from kvgpu.dra.slices import CAPACITY_CORES, CAPACITY_MEMORY, CAPACITY_SHARES, DRIVER, resource_slices
from kvgpu.kube import read_checked

#: The seed's slice (the README's example pod), as one claim per pod.
SEED_MEMORY = "3000Mi"
SEED_CORES = "30"
TEMPLATE = "seed"
CLAIM = "gpu"


def claim_template(ns: str, name: str = TEMPLATE, memory: str = SEED_MEMORY, cores: str = SEED_CORES
                   ) -> dict[str, Any]:
    """A ResourceClaimTemplate asking ``gpu.kvgpu.io`` for one device with ``memory`` (a quantity,
    e.g. ``"3000Mi"``) and ``cores`` (percent, e.g. ``"30"``) of its consumable capacity."""
    req = {"name": CLAIM, "exactly": {"deviceClassName": DRIVER,
                                      "capacity": {"requests": {CAPACITY_MEMORY: memory, CAPACITY_CORES: cores}}}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": ns}, "spec": {"spec": {"devices": {"requests": [req]}}}}


def pod_body(name: str, template: str = TEMPLATE) -> dict[str, Any]:
    """A pod whose one container uses a claim made from ``template``; scheduled by the default
    kube-scheduler (no kvgpu annotation, no ``schedulerName``)."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"kvgpu.io/bench": "scale"}},
        "spec": {"resourceClaims": [{"name": CLAIM, "resourceClaimTemplateName": template}],
                 "containers": [{"name": "main", "image": "bench",
                                 "resources": {"requests": {"cpu": "10m", "memory": "16Mi"},
                                               "claims": [{"name": CLAIM}]}}],
                 "terminationGracePeriodSeconds": 0,
                 "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists"}]},
    }


def node_slices(node: dict[str, Any], pool: str, split_count: int) -> list[dict[str, Any]]:
    """The ResourceSlices of one fake node (a Node manifest carrying ``kvgpu.io/inventory``) once
    its cards are in ``pool`` with ``allocation: dra`` and ``split_count`` shares per card."""
    inv = NodeInventory.loads(node["metadata"]["annotations"][keys.NODE_INVENTORY])
    slicing = Slicing(pool=pool, split_count=split_count, allocation="dra")
    return resource_slices(inv.with_slicing({c.uuid: slicing for c in inv.cards}))


def _quantity_mib(q: str) -> float:
    """``"3000Mi"`` / ``"3Gi"`` / plain bytes as MiB. Raises ``ValueError`` for other forms."""
    for suffix, scale in (("Ki", 1 / 1024), ("Mi", 1.0), ("Gi", 1024.0), ("Ti", 1024.0**2)):
        if q.endswith(suffix):
            return float(q[: -len(suffix)]) * scale
    return float(q) / 2**20


def check_allocations(claims: list[dict[str, Any]], slices: list[dict[str, Any]]) -> dict[str, Any]:
    """What kube-scheduler allocated, checked against the devices' capacity.

    ``claims``: ResourceClaim objects; ``slices``: the ResourceSlices published. Returns
    ``{"claims", "allocated", "devices_used", "max_claims_per_device", "over_capacity"}``, where
    ``over_capacity`` lists ``"<pool>/<device>: <capacity> <used> > <total>"`` for every device
    whose allocations consume more memory (MiB), cores or shares than it has (empty when the
    scheduler kept to capacity), and a result of another driver or without consumed capacity
    counts there too."""
    totals: dict[tuple[str, str], dict[str, float]] = {}
    for s in slices:
        pool = s["spec"]["pool"]["name"]
        for d in s["spec"]["devices"]:
            cap = d.get("capacity") or {}
            totals[(pool, d["name"])] = {
                CAPACITY_MEMORY: _quantity_mib(cap[CAPACITY_MEMORY]["value"]),
                CAPACITY_CORES: float(cap[CAPACITY_CORES]["value"]),
                CAPACITY_SHARES: float(cap[CAPACITY_SHARES]["value"])}
    used: dict[tuple[str, str], Counter[str]] = {}
    bad: list[str] = []
    allocated = 0
    for c in claims:
        results = (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
        if results:
            allocated += 1
        for r in results:
            key = (r.get("pool", ""), r.get("device", ""))
            consumed = r.get("consumedCapacity") or {}
            if r.get("driver") != DRIVER or key not in totals or not consumed:
                bad.append(f"{key[0]}/{key[1]}: not a published {DRIVER} device with consumed capacity")
                continue
            u = used.setdefault(key, Counter())
            u[CAPACITY_MEMORY] += _quantity_mib(consumed.get(CAPACITY_MEMORY, "0"))
            u[CAPACITY_CORES] += float(consumed.get(CAPACITY_CORES, "0"))
            u[CAPACITY_SHARES] += float(consumed.get(CAPACITY_SHARES, "0"))
            u["claims"] += 1
    for key, u in sorted(used.items()):
        for cap, total in totals[key].items():
            if u[cap] > total:
                bad.append(f"{key[0]}/{key[1]}: {cap} {u[cap]:g} > {total:g}")
    return {"claims": len(claims), "allocated": allocated, "devices_used": len(used),
            "max_claims_per_device": max((u["claims"] for u in used.values()), default=0),
            "over_capacity": bad}


async def create_slice(api: client.ApiClient, body: dict[str, Any]) -> None:
    """Create one ResourceSlice (a 409 for one already there is fine)."""
    try:
        await read_checked(await client.ResourceV1Api(api).create_resource_slice(body, _preload_content=False))
    except client.ApiException as e:
        if e.status != 409:
            raise


async def create_template(api: client.ApiClient, ns: str) -> None:
    """Create the seed's ResourceClaimTemplate in ``ns``."""
    await read_checked(await client.ResourceV1Api(api).create_namespaced_resource_claim_template(
        ns, claim_template(ns), _preload_content=False))


async def list_claims(api: client.ApiClient, ns: str) -> list[dict[str, Any]]:
    """The ResourceClaims in ``ns`` as plain dicts."""
    resp = await client.ResourceV1Api(api).list_namespaced_resource_claim(ns, _preload_content=False)
    return list(json.loads(await read_checked(resp)).get("items") or [])
