"""``kubectl vgpu simulate``: would these pods fit now, where, and if not, why. Pure but for
:func:`command` (the click command's body, which reads the cluster).

The answer comes from the operator's own code on the operator's own inputs: the nodes (their
``kvgpu.io/inventory``), the VGPUPools and the live VGPUClaims go through
:meth:`kvgpu.reconcile.state.OperatorState.rebuild` (what the operator does at start-up), each
pod through :func:`kvgpu.api.requests.parse_pod` with the default pool's request defaults, and
placement through the same ledger calls as the extender: ``filter`` over the nodes the pod's
``nodeSelector`` admits, the node :func:`kvgpu.extender.choice.best_node` picks by the pod's node
policy, the cards ``allocate`` picks by its GPU policy, reserved under the claim keys the binder
uses. Pods are placed in the order given, each seeing the ones before it, as a burst would be.

For a pod that fits nowhere it names the **binding constraint** on each node (the rule most
cards fail: memory, cores, slots, exclusive, overcommitted pool, or a static one: type filter,
UUID filter, no usable card, too few cards) and **what would have to free up**: the fewest pods
whose end makes room (the GPU preemption's what-if, :func:`kvgpu.allocator.preempt.choose`,
with every pod a candidate), or that nothing would, because the request never fits there.

Not modelled: kube-scheduler's own filters beyond ``nodeSelector`` (affinity, taints, CPU and
memory), the operator's in-memory GPU preemption holds, and soft preferences (the extender hands
such pods to kube-scheduler's scoring; here the node policy decides). Quotas: ``quota`` is a
hook, called with each pod's request, that returns a refusal or None.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvgpu.allocator import fit as F
from kvgpu.allocator.preempt import Holder, NoPlan, choose
from kvgpu.core.requests import PodAllocation, PodRequest
from kvgpu.reconcile.state import OperatorState, claim_key

#: A quota check: the pod's request → why a quota refuses it, or None.
QuotaCheck = Callable[[PodRequest], str | None]

#: Reason code → the constraint it names (kvgpu.allocator.fit's codes).
CONSTRAINT = {
    F.UNHEALTHY: "unusable card", F.NO_POOL: "unusable card", F.MIG: "unusable card",
    F.BAD_MODE: "unusable card", F.NO_CAPACITY: "unusable card", F.DRA: "unusable card",
    F.MPS_ONE_CARD: "mps (one card)",
    F.TYPE_NOT_LISTED: "type filter", F.TYPE_EXCLUDED: "type filter",
    F.UUID_NOT_LISTED: "uuid filter", F.UUID_EXCLUDED: "uuid filter",
    F.NO_SLOT: "slots", F.HELD_EXCLUSIVE: "exclusive", F.NOT_IDLE: "exclusive",
    F.NO_MEMORY: "memory", F.NO_CORES: "cores", F.COMPUTE_FULL: "cores", F.NUMA_SPLIT: "numa",
    F.OVERCOMMITTED: "pool overcommitted",
}
#: Usage-dependent constraints: some pods ending can lift them.
DYNAMIC = frozenset({"slots", "exclusive", "memory", "cores", "pool overcommitted", "numa"})
#: Which constraint names a node when cards fail for several (the first that applies).
ORDER = ("type filter", "uuid filter", "mps (one card)", "unusable card", "pool overcommitted",
         "memory", "cores", "slots", "exclusive", "numa")


@dataclass
class Verdict:
    """What simulate says about one pod."""

    pod: str  # namespace/name
    fits: bool
    node: str = ""
    cards: dict[str, list[str]] = field(default_factory=dict)  # container → ["0:3000MiB/30%", ...]
    constraint: str = ""  # the binding constraint over all nodes ("" when it fits)
    reasons: dict[str, str] = field(default_factory=dict)  # node → the extender's reason
    constraints: dict[str, str] = field(default_factory=dict)  # node → binding constraint there
    free_up: str = ""  # what would have to end for it to fit, or why nothing would do
    note: str = ""  # not a GPU pod, an invalid request, a quota

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- inputs


REPLICATED = {"Deployment", "ReplicaSet", "StatefulSet", "ReplicationController"}


def expand(objs: Iterable[Mapping[str, Any]], namespace: str) -> list[dict[str, Any]]:
    """Pods from manifests: a Pod as it is; a Deployment, ReplicaSet, StatefulSet or
    ReplicationController as ``replicas`` pods of its template (default 1); a Job as
    ``parallelism`` pods (default 1, at most ``completions``); a CronJob as its Job; a List's items.
    Each pod gets a name ``<owner>-<i>``, the manifest's namespace (else ``namespace``) and a
    synthetic UID. Raises ``ValueError`` for a kind it cannot place (e.g. a DaemonSet)."""
    out: list[dict[str, Any]] = []
    for obj in objs:
        kind = str(obj.get("kind", ""))
        meta = dict(obj.get("metadata") or {})
        ns = str(meta.get("namespace") or namespace)
        name = str(meta.get("name") or kind.lower() or "pod")
        spec = obj.get("spec") or {}
        if kind in ("List", "PodList") or (not kind and "items" in obj):
            out += expand(obj.get("items") or [], namespace)
            continue
        if kind == "Pod":
            out.append(_pod(name, ns, meta, spec, f"simulate-{ns}-{name}"))
            continue
        if kind == "CronJob":
            spec = ((spec.get("jobTemplate") or {}).get("spec")) or {}
            kind = "Job"
        if kind in REPLICATED:
            n = int(spec.get("replicas", 1) if spec.get("replicas") is not None else 1)
        elif kind == "Job":
            n = int(spec.get("parallelism", 1) if spec.get("parallelism") is not None else 1)
            if spec.get("completions") is not None:
                n = min(n, int(spec["completions"]))
        else:
            raise ValueError(f"{kind or 'an object without kind'} {name}: give Pods, Deployments, "
                             "ReplicaSets, StatefulSets, Jobs, CronJobs or a List of them")
        tpl = spec.get("template") or {}
        tmeta = dict(tpl.get("metadata") or {})
        for i in range(max(0, n)):
            out.append(_pod(f"{name}-{i}", ns, tmeta, tpl.get("spec") or {}, f"simulate-{ns}-{name}-{i}"))
    return out


def _pod(name: str, ns: str, meta: Mapping[str, Any], spec: Mapping[str, Any], uid: str) -> dict[str, Any]:
    m = {**meta, "name": name, "namespace": ns, "uid": uid}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": m, "spec": dict(spec)}


def hypothetical(nodes: int, cards: int, card_memory_mib: int, model: str, *, split_count: int = 10,
                 memory_scaling: float = 1.0, core_scaling: float = 1.0
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Node objects (as the agent would annotate them) and one pool covering them, for a cluster
    that does not exist: ``nodes`` x ``cards`` cards of ``card_memory_mib`` MiB."""
    from kvgpu.core.inventory import SimulatedCardSpec, SimulatedNode
    from kvgpu.devcluster.fakenodes import node_manifest

    spec = SimulatedCardSpec(model=model, memory_mib=card_memory_mib, count=cards)
    objs = [node_manifest(SimulatedNode(f"node-{i}", (spec,))) for i in range(nodes)]
    pool = {"apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": "default"},
            "spec": {"splitCount": split_count, "memoryScaling": memory_scaling, "coreScaling": core_scaling}}
    return objs, [pool]


# --------------------------------------------------------------------------- the decision


def _selector_ok(pod: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    want = (pod.get("spec") or {}).get("nodeSelector") or {}
    return all(labels.get(k) == v for k, v in want.items())


def _cards(alloc: PodAllocation) -> dict[str, list[str]]:
    return {ca.container: [f"{d.index}:{d.memory_mib}MiB/{d.cores}%" for d in ca.devices]
            for ca in alloc.containers}


def node_constraint(state: OperatorState, req: PodRequest, node: str) -> str:
    """The binding constraint for ``req`` on ``node``: of the containers that do not fit alone,
    the first; on its cards, a static rule when too few cards pass it, else the usage rule most
    cards fail (ties by :data:`ORDER`)."""
    codes = state.ledger.card_codes(req, node)
    for c in req.containers:
        per = codes[c.container]
        if sum(1 for x in per if x is None) >= c.cards:
            continue
        if len(per) < c.cards:
            return "too few cards"
        static = [CONSTRAINT[x] for x in per if x is not None and CONSTRAINT[x] not in DYNAMIC]
        if len(per) - len(static) < c.cards:
            return min(static, key=lambda k: (-static.count(k), ORDER.index(k)))
        dyn = [CONSTRAINT[x] for x in per if x is not None and CONSTRAINT[x] in DYNAMIC]
        if dyn:
            return min(dyn, key=lambda k: (-dyn.count(k), ORDER.index(k)))
    return "numa" if any(c.numa_bind for c in req.containers) else "placement"


def _free_up(state: OperatorState, req: PodRequest, nodes: Sequence[str],
             holders: Mapping[str, Holder]) -> str:
    """The fewest pods whose end makes room for ``req`` (every pod a candidate), or why none."""
    inv = {n: i for n in nodes if (i := state.ledger_inventory(n)) is not None}
    plan = choose(req, 2, inv, state.ledger.reservations().values(),
                  {u: Holder(h.uid, h.namespace, h.name, 0) for u, h in holders.items()}, nodes=list(inv))
    if isinstance(plan, NoPlan):
        if "would not fit even with all" in plan.reason or "no pod of lower priority" in plan.reason:
            return "nothing: the request does not fit any node considered even with every slice there free"
        return plan.reason
    who = ", ".join(v.ref for v in plan.victims)
    return f"{len(plan.victims)} pod(s) on {plan.node} ending: {who}"


def simulate(state: OperatorState, pods: Sequence[Mapping[str, Any]], *,
             holders: Mapping[str, Holder] | None = None, quota: QuotaCheck | None = None) -> list[Verdict]:
    """Place ``pods`` in order on ``state`` (which is changed: the placed pods are reserved), as
    the extender would, and say why the others do not fit. ``holders``: pod UID → the pod, for
    naming what would have to end (default: the UIDs themselves)."""
    from kvgpu.api.requests import RequestError, parse_pod
    from kvgpu.extender.binder import claim_name
    from kvgpu.extender.choice import best_node

    out: list[Verdict] = []
    placed: dict[str, Holder] = {}  # pods placed by this run (they count for the later ones)
    for pod in pods:
        meta = pod.get("metadata") or {}
        who = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        try:
            req = parse_pod(pod, state.default_pool_spec())
        except RequestError as e:
            out.append(Verdict(who, False, constraint="invalid request", note=str(e)))
            continue
        if req is None:
            out.append(Verdict(who, True, note="asks for no GPU slice: not kvgpu's to place"))
            continue
        if quota is not None and (why := quota(req)) is not None:
            out.append(Verdict(who, False, constraint="quota", note=why))
            continue
        names = [n for n in state.ledger.nodes()
                 if (rec := state.nodes.get(n)) is not None and _selector_ok(pod, rec.labels)]
        feasible, reasons = state.ledger.filter(req, names)
        if feasible:
            node = best_node(state.ledger.rank(req, feasible))
            alloc = state.ledger.allocate(req, node)
            for ca in alloc.containers:
                key = claim_key(req.namespace, claim_name(req.name, ca.container, req.uid))
                state.reserve(key, PodAllocation(req.uid, node, (ca,)))
            placed[req.uid] = Holder(req.uid, req.namespace, req.name, 0)
            out.append(Verdict(who, True, node=node, cards=_cards(alloc)))
            continue
        v = Verdict(who, False, reasons=dict(reasons))
        if not names:
            v.constraint = "no node"
            v.note = "no GPU node known to kvgpu matches the pod's nodeSelector"
            out.append(v)
            continue
        v.constraints = {n: node_constraint(state, req, n) for n in names}
        counts = list(v.constraints.values())
        v.constraint = min(counts, key=lambda k: (-counts.count(k), ORDER.index(k) if k in ORDER else 99))
        known = {**(holders or {}), **placed}
        for a in state.ledger.reservations().values():
            known.setdefault(a.pod_uid, Holder(a.pod_uid, "", a.pod_uid, 0))
        v.free_up = _free_up(state, req, names, known)
        out.append(v)
    return out


def holders_from_claims(claims: Iterable[Mapping[str, Any]]) -> dict[str, Holder]:
    """Pod UID → the pod (namespace, name) from VGPUClaims, for naming what would have to end."""
    out: dict[str, Holder] = {}
    for c in claims:
        spec, meta = c.get("spec") or {}, c.get("metadata") or {}
        if uid := spec.get("podUID"):
            out[str(uid)] = Holder(str(uid), str(meta.get("namespace", "")), str(spec.get("podName", "")), 0)
    return out


# --------------------------------------------------------------------------- output


HEADERS = ["POD", "FITS", "NODE", "CARDS", "CONSTRAINT"]


def rows(verdicts: Sequence[Verdict]) -> list[list[str]]:
    out = []
    for v in verdicts:
        cards = "; ".join(f"{c}={','.join(g)}" for c, g in v.cards.items()) if v.cards else "-"
        out.append([v.pod, "yes" if v.fits else "no", v.node or "-", cards, v.constraint or "-"])
    return out


def details(verdicts: Sequence[Verdict], max_nodes: int = 8) -> list[str]:
    """The lines under the table: for each pod that does not fit, each node's reason and
    constraint, and what would have to free up."""
    lines: list[str] = []
    for v in verdicts:
        if v.fits and not v.note:
            continue
        lines.append(f"{v.pod}: " + (v.note if v.note else f"does not fit (binding constraint: {v.constraint})"))
        shown = sorted(v.reasons.items())
        for n, r in shown[:max_nodes]:
            lines.append(f"  {n} [{v.constraints.get(n, '?')}]: {r}")
        if len(shown) > max_nodes:
            lines.append(f"  ... and {len(shown) - max_nodes} more nodes")
        if v.free_up:
            lines.append(f"  to fit: {v.free_up}")
    return lines


def summary(verdicts: Sequence[Verdict]) -> str:
    fit = sum(1 for v in verdicts if v.fits)
    return f"{fit} of {len(verdicts)} pod(s) would fit now."


# --------------------------------------------------------------------------- reading the cluster


def load(paths: Sequence[str], stdin: Any = None) -> list[dict[str, Any]]:
    """Objects from YAML or JSON files (``-``: standard input), several documents each."""
    import sys

    import yaml

    out: list[dict[str, Any]] = []
    for p in paths:
        if p == "-":
            text = (stdin or sys.stdin).read()
        else:
            with open(p, encoding="utf-8") as f:
                text = f.read()
        out += [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]
    return out


async def live_state(api: Any) -> tuple[OperatorState, dict[str, Holder], list[str]]:
    """The operator's state rebuilt from the cluster's nodes, pools, claims and quotas, as at its
    start-up; the pods holding slices; the rebuild's problems (and quotas it could not read)."""
    import asyncio

    from kubernetes_asyncio.client.exceptions import ApiException

    from kvgpu import kube
    from kvgpu.reconcile.quotas import QuotaSync

    nodes, pools, claims = await asyncio.gather(
        kube.list_all(api, "nodes"), kube.list_all(api, "vgpupools"), kube.list_all(api, "vgpuclaims"))
    state = OperatorState()
    problems = state.rebuild(nodes, pools, claims)
    try:  # the namespaces' quotas, as the operator loads them before it answers a bind
        await QuotaSync(state).load(api)
    except ApiException as e:  # e.g. no right to list quotas: say so, simulate without them
        problems.append(f"quotas not read ({e.status} {e.reason}): quota refusals are not simulated")
    live = [c for c in claims if (c.get("status") or {}).get("phase") not in ("Released", "Failed")]
    return state, holders_from_claims(live), problems
