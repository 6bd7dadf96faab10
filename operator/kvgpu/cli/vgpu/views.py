"""What ``kubectl vgpu`` shows, as pure functions of API objects (plain dicts): no client here.

- :func:`card_rows`: one row per physical card from the nodes' ``kvgpu.io/inventory`` (agent)
  annotations and each node's use as the operator's allocator counts it from the VGPUClaims
  (:func:`node_allocations`);
- :func:`claim_rows`: one row per VGPUClaim and card, with the usage the node agents export when
  it is known (:func:`parse_usage` reads their Prometheus text);
- :func:`explain_pod`: why a pod is (not) pending — its request as kvgpu parses it, the events
  that explain it, and which nodes would have room (the operator's own allocator, rebuilt from the
  same nodes, pools and claims);
- :func:`table`: kubectl-style columns.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvgpu.api.vgpuclaim import claim_phase
from kvgpu.core import keys

UNKNOWN = "-"
MIB = 1024 * 1024


# --------------------------------------------------------------------------- generic formatting


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Left-aligned columns separated by three spaces, like ``kubectl get`` (no trailing blanks)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def age(timestamp: str | None, now: datetime.datetime) -> str:
    """kubectl's short age: ``45s``, ``12m``, ``5h``, ``3d``; ``-`` when unknown."""
    if not timestamp:
        return UNKNOWN
    try:
        t = datetime.datetime.strptime(timestamp[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=datetime.UTC)
    except ValueError:
        return UNKNOWN
    s = max(0, int((now - t).total_seconds()))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 48 * 3600:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def used_total(pair: Any) -> str:
    """``[used, total]`` → ``used/total``; ``-`` parts for what is unknown."""
    if isinstance(pair, list | tuple) and len(pair) == 2:
        u, t = pair
        return f"{UNKNOWN if u is None else u}/{UNKNOWN if t is None else t}"
    return UNKNOWN


def _annotations(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("annotations") or {}


def _json(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        d = json.loads(text)
    except ValueError:
        return None
    return d if isinstance(d, dict) else None


# --------------------------------------------------------------------------- nodes


@dataclass(frozen=True)
class CardRow:
    node: str
    index: int
    uuid: str
    model: str
    pool: str
    slots: tuple[int | None, int | None]
    memory_mib: tuple[int | None, int | None]
    cores: tuple[int | None, int | None]
    pods: int | None
    health: str
    note: str
    physical_mib: int | None = None  # the card's own memory (MEMORY's total is virtual: x memoryScaling)
    state: str = ""  # "Overcommitted (slots 5/2)": more in use than the pool's shape allows now

    def cells(self, wide: bool = False) -> list[str]:
        c = [self.node, str(self.index), self.model, self.pool or UNKNOWN, used_total(self.slots),
             used_total(self.memory_mib), UNKNOWN if self.physical_mib is None else str(self.physical_mib),
             used_total(self.cores), self.health, self.state or UNKNOWN]
        if wide:
            c[3:3] = [self.uuid]
            c += [UNKNOWN if self.pods is None else str(self.pods), self.note]
        return c

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("slots", "memory_mib", "cores"):
            d[k] = list(d[k])
        return d


CARD_HEADERS = ["NODE", "GPU", "MODEL", "POOL", "SLOTS", "MEMORY(MiB)", "PHYSICAL(MiB)", "CORES(%)", "HEALTH",
                "STATE"]
CARD_HEADERS_WIDE = [*CARD_HEADERS[:3], "UUID", *CARD_HEADERS[3:], "PODS", "NOTE"]


def _pair(v: Any) -> tuple[int | None, int | None]:
    if isinstance(v, list | tuple) and len(v) == 2:
        return (None if v[0] is None else int(v[0]), None if v[1] is None else int(v[1]))
    return (None, None)


def _health(card: Mapping[str, Any] | None) -> str:
    if card is None:
        return "Unknown"
    if card.get("healthy", True):
        return "Healthy"
    reason = str(card.get("reason") or "").strip()
    return f"Unhealthy: {reason}" if reason else "Unhealthy"


def _totals_from_inventory(card: Mapping[str, Any]) -> tuple[int | None, int | None, int | None]:
    """Capacity of a sliced card when the operator has not summarised the node yet."""
    sl = card.get("slicing")
    if not sl:
        return (None, None, None)
    slots = int(sl.get("splitCount", 10))
    mem = int(int(card.get("memoryMiB", 0)) * float(sl.get("memoryScaling", 1.0)))
    cores = int(100 * float(sl.get("coreScaling", 1.0)))
    return (slots, mem, cores)


def card_state(slots: tuple[int | None, int | None], mem: tuple[int | None, int | None],
               cores: tuple[int | None, int | None], physical: int | None) -> str:
    """``Overcommitted (slots 5/2)`` when a card holds more than its pool's shape allows now (the
    pool was shrunk under live slices: no new slices there until enough end); else
    ``Oversubscribed (6000/4000 MiB physical)`` when the slices' memory limits sum past the card's
    physical memory (memoryScaling > 1: a tenant can get CUDA's out-of-memory before its limit);
    else ``""``."""
    over = [f"{what} {u}/{t}" for what, (u, t) in (("slots", slots), ("memory", mem), ("cores", cores))
            if u is not None and t is not None and u > t]
    if over:
        return f"Overcommitted ({', '.join(over)})"
    if physical is not None and mem[0] is not None and mem[0] > physical:
        return f"Oversubscribed ({mem[0]}/{physical} MiB physical)"
    return ""


def node_allocations(nodes: Sequence[Mapping[str, Any]], pools: Sequence[Mapping[str, Any]],
                     claims: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each known node's use per card (``kvgpu.allocator.usage.NodeUsage.to_json``), counted by
    the operator's own allocator rebuilt from the nodes, pools and claims, as at its start-up."""
    from kvgpu.reconcile.state import OperatorState

    state = OperatorState()
    state.rebuild([dict(n) for n in nodes], [dict(p) for p in pools], [dict(c) for c in claims])
    return {n: state.ledger.node_usage(n).to_json() for n in state.ledger.nodes()}


def card_rows(nodes: Iterable[Mapping[str, Any]],
              allocations: Mapping[str, Mapping[str, Any]] | None) -> list[CardRow]:
    """A row per card of every node that has an inventory or an allocation, sorted by node and
    card index. Used amounts come from ``allocations`` (:func:`node_allocations`; ``None``: the
    claims could not be listed, used amounts ``-``); health and physical memory from the agent's
    inventory; ``state`` from :func:`card_state`; a card the allocator does not slice says why
    in ``note``."""
    rows: list[CardRow] = []
    for node in nodes:
        name = str((node.get("metadata") or {}).get("name", ""))
        ann = _annotations(node)
        inv = _json(ann.get(keys.NODE_INVENTORY))
        alloc = (allocations or {}).get(name)
        inv_cards = {str(c.get("uuid")): c for c in (inv or {}).get("cards") or [] if isinstance(c, dict)}
        alloc_cards = {str(c.get("uuid")): c for c in (alloc or {}).get("cards") or [] if isinstance(c, dict)}
        for uuid in sorted(set(inv_cards) | set(alloc_cards)):
            ic, ac = inv_cards.get(uuid), alloc_cards.get(uuid)
            base = ac or ic or {}
            if ac is not None:
                slots, mem, cores = _pair(ac.get("slots")), _pair(ac.get("memoryMiB")), _pair(ac.get("cores"))
                pool = str(ac.get("pool") or "")
                pods: int | None = int(ac.get("pods", 0))
                notes = []
                if not ac.get("usable", True):
                    notes.append(str(ac.get("reason") or "not sliced"))
                if ac.get("exclusive"):
                    notes.append("exclusive")
                note = ", ".join(notes)
            else:
                assert ic is not None
                ts, tm, tc = _totals_from_inventory(ic)
                slots, mem, cores = (None, ts), (None, tm), (None, tc)
                pool = str((ic.get("slicing") or {}).get("pool") or "")
                pods = None
                note = ("no VGPUPool covers the card" if not ic.get("slicing")
                        else "claims not listed" if allocations is None else "inventory not readable")
            phys = int(ic["memoryMiB"]) if ic is not None and isinstance(ic.get("memoryMiB"), int) else None
            rows.append(CardRow(
                node=name, index=int(base.get("index", -1)), uuid=uuid, model=str(base.get("model", "")),
                pool=pool, slots=slots, memory_mib=mem, cores=cores, pods=pods, health=_health(ic), note=note,
                physical_mib=phys, state=card_state(slots, mem, cores, phys),
            ))
    rows.sort(key=lambda r: (r.node, r.index, r.uuid))
    return rows


# --------------------------------------------------------------------------- claims and usage


@dataclass(frozen=True)
class Usage:
    """One container's use of one card as the node agent last saw it."""

    memory_used_bytes: float
    sm_percent: float | None = None


UsageKey = tuple[str, str, str, str]  # namespace, pod, container, card UUID


def parse_usage(text: str) -> dict[UsageKey, Usage]:
    """Usage from an agent's ``/metrics`` (Prometheus text). Containers whose shim region the agent
    could not read (``kvgpu_container_region_active`` 0) are left out: their usage is unknown."""
    from prometheus_client.parser import text_string_to_metric_families

    used: dict[UsageKey, float] = {}
    sm: dict[UsageKey, float] = {}
    active: dict[tuple[str, str, str], bool] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            lb = s.labels
            if s.name == "kvgpu_container_region_active":
                active[(lb.get("namespace", ""), lb.get("pod", ""), lb.get("container", ""))] = s.value > 0
                continue
            if s.name not in ("kvgpu_container_memory_used_bytes", "kvgpu_container_sm_utilization_percent"):
                continue
            k = (lb.get("namespace", ""), lb.get("pod", ""), lb.get("container", ""),
                 lb.get("device_uuid", ""))
            (used if s.name == "kvgpu_container_memory_used_bytes" else sm)[k] = s.value
    return {k: Usage(v, sm.get(k)) for k, v in used.items() if active.get(k[:3], False)}


@dataclass(frozen=True)
class ClaimRow:
    namespace: str
    name: str
    pod: str
    container: str
    node: str
    gpu: str
    memory: str
    cores: str
    phase: str
    age: str
    memory_used: str = UNKNOWN
    sm_util: str = UNKNOWN

    def cells(self, all_namespaces: bool, wide: bool = False) -> list[str]:
        c = [self.pod, self.container, self.node, self.gpu, self.memory, self.cores, self.phase,
             self.memory_used, self.sm_util, self.age]
        if wide:
            c.insert(0, self.name)
        if all_namespaces:
            c.insert(0, self.namespace)
        return c

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


CLAIM_HEADERS = ["POD", "CONTAINER", "NODE", "GPU", "MEMORY", "CORES", "PHASE", "MEM-USED", "SM-UTIL", "AGE"]


def claim_headers(all_namespaces: bool, wide: bool = False) -> list[str]:
    h = list(CLAIM_HEADERS)
    if wide:
        h.insert(0, "NAME")
    if all_namespaces:
        h.insert(0, "NAMESPACE")
    return h


def _mib(b: float) -> str:
    return f"{round(b / MIB)}Mi"


def claim_rows(
    claims: Iterable[Mapping[str, Any]],
    now: datetime.datetime,
    usage: Mapping[UsageKey, Usage] | None = None,
) -> list[ClaimRow]:
    """A row per claim (the columns of ``kubectl get vgpuclaims``) plus memory used and SM
    utilisation per card, comma-separated in the claim's card order, when the agent of the claim's
    node reported them (``-`` otherwise)."""
    usage = usage or {}
    rows = []
    for c in claims:
        meta, spec = c.get("metadata") or {}, c.get("spec") or {}
        devices = [d for d in spec.get("devices") or [] if isinstance(d, dict)]
        ns, pod = str(meta.get("namespace", "")), str(spec.get("podName", ""))
        ctr = str(spec.get("container", ""))
        us = [usage.get((ns, pod, ctr, str(d.get("uuid", "")))) for d in devices]
        mem_used = ",".join(_mib(u.memory_used_bytes) for u in us if u) if devices and all(us) else UNKNOWN
        sms = [u.sm_percent for u in us if u]
        sm = ",".join(f"{round(s)}%" for s in sms if s is not None) \
            if devices and all(us) and all(s is not None for s in sms) else UNKNOWN
        rows.append(ClaimRow(
            namespace=ns, name=str(meta.get("name", "")), pod=pod, container=ctr,
            node=str(spec.get("node", "")),
            gpu=str(spec.get("gpuSummary") or ",".join(str(d.get("index", "?")) for d in devices)),
            memory=str(spec.get("memorySummary") or ",".join(f"{d.get('memory', '?')}Mi" for d in devices)),
            cores=str(spec.get("coresSummary") or ",".join(f"{d.get('cores', '?')}%" for d in devices)),
            phase=claim_phase(c), age=age(meta.get("creationTimestamp"), now),
            memory_used=mem_used, sm_util=sm,
        ))
    rows.sort(key=lambda r: (r.namespace, r.pod, r.container, r.name))
    return rows


# --------------------------------------------------------------------------- why is my pod pending


EXPLAINING_REASONS = ("NoGPUCapacity", "FailedScheduling")


@dataclass
class Explanation:
    namespace: str
    pod: str
    phase: str
    node: str = ""  # set when the pod is bound
    scheduler: str = ""
    request: list[str] = field(default_factory=list)  # one line per container
    request_errors: list[str] = field(default_factory=list)
    not_ours: bool = False  # the pod asks for no slices
    events: list[str] = field(default_factory=list)  # newest first
    feasible: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)  # node → why no room
    nodes_considered: int = 0
    notes: list[str] = field(default_factory=list)
    claims: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _describe_request(c: Any) -> str:
    if c.memory_percent is not None:
        mem = f"{c.memory_percent}% of each card's memory"
    elif c.memory_mib:
        mem = f"{c.memory_mib} MiB"
    else:
        mem = "the whole memory of each card"
    parts = [f"{c.cards} card{'s' if c.cards != 1 else ''}", mem,
             f"{c.cores}% cores" if c.cores else "no core limit", f"priority {c.priority}"]
    for label, vals in (("type", c.types), ("not type", c.exclude_types), ("uuid", c.uuids),
                        ("not uuid", c.exclude_uuids)):
        if vals:
            parts.append(f"{label} {','.join(vals)}")
    if c.numa_bind:
        parts.append("one NUMA node")
    return f"{c.container}{' (init)' if c.init else ''}: " + ", ".join(parts)


def _event_time(e: Mapping[str, Any]) -> str:
    created = (e.get("metadata") or {}).get("creationTimestamp")
    return str(e.get("lastTimestamp") or e.get("eventTime") or created or "")


def pod_events(
    events: Iterable[Mapping[str, Any]], pod: Mapping[str, Any], now: datetime.datetime
) -> list[str]:
    """The pod's scheduling events (``NoGPUCapacity`` from the extender, ``FailedScheduling`` from
    kube-scheduler, and any other Warning), newest first, as ``AGE REASON (xN): message``."""
    meta = pod.get("metadata") or {}
    uid = meta.get("uid")
    mine = []
    for e in events:
        inv = e.get("involvedObject") or e.get("regarding") or {}
        if inv.get("kind", "Pod") != "Pod" or inv.get("name") != meta.get("name"):
            continue
        if uid and inv.get("uid") and inv.get("uid") != uid:
            continue  # an earlier pod of the same name
        if e.get("reason") not in EXPLAINING_REASONS and e.get("type") != "Warning":
            continue
        mine.append(e)
    mine.sort(key=_event_time, reverse=True)
    out = []
    for e in mine:
        count = int(e.get("count") or (e.get("series") or {}).get("count") or 1)
        times = f" (x{count})" if count > 1 else ""
        msg = str(e.get("message") or e.get("note") or "").strip()
        out.append(f"{age(_event_time(e), now)} ago  {e.get('reason')}{times}: {msg}")
    return out


def _selector_matches(pod: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    want = (pod.get("spec") or {}).get("nodeSelector") or {}
    labels = (node.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in want.items())


def explain_pod(
    pod: Mapping[str, Any],
    *,
    events: Iterable[Mapping[str, Any]],
    nodes: Sequence[Mapping[str, Any]],
    pools: Sequence[Mapping[str, Any]],
    claims: Sequence[Mapping[str, Any]] | None,
    now: datetime.datetime,
) -> Explanation:
    """Everything ``kubectl vgpu why`` says about a pod. ``claims`` ``None``: they could not be
    listed, so room is judged without the current reservations (noted)."""
    from kvgpu.api.requests import RequestError, parse_pod
    from kvgpu.reconcile.state import OperatorState

    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    ex = Explanation(namespace=str(meta.get("namespace", "")), pod=str(meta.get("name", "")),
                     phase=str(status.get("phase") or "Pending"), node=str(spec.get("nodeName") or ""),
                     scheduler=str(spec.get("schedulerName") or "default-scheduler"))
    ex.events = pod_events(events, pod, now)
    ex.claims = [c for c in (_annotations(pod).get(keys.POD_CLAIMS) or "").split(",") if c]
    state = OperatorState()
    problems = state.rebuild(
        [dict(n) for n in nodes], [dict(p) for p in pools], [dict(c) for c in claims or []])
    ex.notes += [f"ignored: {p}" for p in problems]
    if claims is None:
        ex.notes.append("VGPUClaims could not be listed: room is judged as if no slice were taken")
    try:
        req = parse_pod(pod, state.default_pool_spec())
    except RequestError as e:
        errs = getattr(e, "errors", None) or [e]
        ex.request_errors = [str(x) for x in errs]
        return ex
    if req is None:
        ex.not_ours = True
        return ex
    ex.request = [_describe_request(c) for c in req.containers]
    if ex.node:
        return ex
    if ex.scheduler != keys.SCHEDULER_NAME:
        ex.notes.append(
            f"the pod's schedulerName is {ex.scheduler!r}, not {keys.SCHEDULER_NAME!r}: "
            "kvgpu's mutating webhook did not process it "
            "(webhook not installed, or its namespace is excluded)")
    known = set(state.ledger.nodes())
    candidates = [str(n["metadata"]["name"]) for n in nodes
                  if _selector_matches(pod, n) and str(n["metadata"]["name"]) in known]
    if spec.get("nodeSelector"):
        ex.notes.append("only nodes matching the pod's nodeSelector are considered "
                        "(affinity, taints and cpu/memory are kube-scheduler's and not evaluated here)")
    ex.nodes_considered = len(candidates)
    feasible, reasons = state.ledger.filter(req, candidates)
    ex.feasible, ex.reasons = list(feasible), dict(reasons)
    return ex


def format_explanation(ex: Explanation, max_nodes: int = 20) -> str:
    lines = [f"Pod {ex.namespace}/{ex.pod}: {ex.phase}" + (f" on node {ex.node}" if ex.node else "")]
    if ex.request_errors:
        lines.append("The GPU request is invalid "
                     "(the webhook refuses such pods; the extender finds no node):")
        lines += [f"  - {e}" for e in ex.request_errors]
    elif ex.not_ours:
        lines.append("The pod asks for no GPU slices: kvgpu does not schedule it.")
    else:
        lines.append("Request:")
        lines += [f"  {r}" for r in ex.request]
    if ex.node:
        lines.append(f"Scheduled: not pending. Claims: {', '.join(ex.claims) or UNKNOWN}.")
    if ex.events:
        lines.append("Events (newest first):")
        lines += [f"  {e}" for e in ex.events]
    elif not ex.node:
        lines.append("Events: none about scheduling yet.")
        if ex.scheduler == keys.SCHEDULER_NAME and not ex.request_errors:
            lines.append(f"  (if this stays, check that the {keys.SCHEDULER_NAME} kube-scheduler and the "
                         "kvgpu operator run: kubectl -n kvgpu-system get pods)")
    if not ex.node and not ex.request_errors and not ex.not_ours:
        if ex.feasible:
            more = " ..." if len(ex.feasible) > max_nodes else ""
            lines.append(f"Room now: {len(ex.feasible)} of {ex.nodes_considered} node(s) fit the request: "
                         + ", ".join(ex.feasible[:max_nodes]) + more)
            lines.append("  (the scheduler retries pending pods when capacity frees; if this stays, "
                         "check the events above and kube-scheduler's other constraints)")
        elif ex.nodes_considered == 0:
            lines.append("Room now: no GPU node known to kvgpu matches the pod "
                         "(no inventory, or its nodeSelector).")
        else:
            lines.append(f"Room now: none of {ex.nodes_considered} GPU node(s) fits the request:")
            shown = sorted(ex.reasons.items())
            lines += [f"  {n}: {r}" for n, r in shown[:max_nodes]]
            if len(shown) > max_nodes:
                lines.append(f"  ... and {len(shown) - max_nodes} more")
    if ex.notes:
        lines.append("Notes:")
        lines += [f"  - {n}" for n in ex.notes]
    return "\n".join(lines)
