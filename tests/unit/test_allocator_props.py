"""Property tests for the allocator (hypothesis).

Random small clusters (mixed models, NUMA nodes, unhealthy/MIG/unsliced cards, split counts,
memory and core scaling, exclusive-mode pools) and random sequences of binds and releases of
random pods (several containers, init containers, several cards, percent/absolute/whole-card
memory, exclusive cores, type/UUID filters, NUMA bind). Checked against an independent
re-computation of the rules, not against the ledger's own bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvgpu.allocator import AllocationError, Ledger
from kvgpu.allocator import ledger as ledger_mod
from kvgpu.core.inventory import Card, NodeInventory, Slicing, simulated_uuid
from kvgpu.core.requests import ContainerRequest, PodAllocation, PodRequest, Policy

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MODELS = ["NVIDIA H200", "NVIDIA A100-SXM4-40GB", "NVIDIA L4"]
TYPES = ["h200", "a100", "l4", "nvidia"]

slicings = st.sampled_from([True] * 5 + [False]).flatmap(
    lambda covered: (
        st.builds(
            Slicing,
            pool=st.sampled_from(["p1", "p2"]),
            split_count=st.integers(1, 4),
            memory_scaling=st.sampled_from([1.0, 1.5, 2.0]),
            core_scaling=st.sampled_from([1.0, 1.0, 2.0]),
            mode=st.sampled_from(["hami-core", "hami-core", "hami-core", "exclusive"]),
        )
        if covered
        else st.none()
    )
)
card_specs = st.tuples(
    st.sampled_from(MODELS),
    st.sampled_from([4000, 8000, 10000, 16000]),
    st.sampled_from([0, 0, 1, None]),
    st.sampled_from([True] * 6 + [False]),  # healthy
    st.sampled_from([False] * 8 + [True]),  # MIG mode
    slicings,
)


@st.composite
def inventories(draw) -> list[NodeInventory]:
    out = []
    for i in range(draw(st.integers(1, 3))):
        name = f"n{i}"
        specs = draw(st.lists(card_specs, min_size=1, max_size=4))
        cards = tuple(
            Card(simulated_uuid(name, j), j, m, mem, 100, numa, mig, healthy, "", sl)
            for j, (m, mem, numa, healthy, mig, sl) in enumerate(specs)
        )
        out.append(NodeInventory(name, cards, "simulated"))
    return out


def uuid_list(draw) -> tuple[str, ...]:
    picks = draw(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3)), max_size=3))
    return tuple(sorted({simulated_uuid(f"n{a}", b) for a, b in picks}))


@st.composite
def containers(draw, name: str) -> ContainerRequest:
    kind = draw(st.sampled_from(["abs", "abs", "abs", "pct", "whole"]))
    return ContainerRequest(
        container=name,
        cards=draw(st.sampled_from([1, 1, 1, 2, 3])),
        memory_mib=draw(st.sampled_from([500, 1000, 3000, 6000, 9000])) if kind == "abs" else 0,
        memory_percent=draw(st.sampled_from([10, 25, 50, 100])) if kind == "pct" else None,
        cores=draw(st.sampled_from([0, 0, 10, 30, 50, 100])),
        priority=draw(st.sampled_from([0, 1])),
        types=tuple(draw(st.lists(st.sampled_from(TYPES), min_size=1, max_size=2)))
        if draw(st.integers(0, 2)) == 0
        else (),
        exclude_types=(draw(st.sampled_from(TYPES[:3])),) if draw(st.integers(0, 5)) == 0 else (),
        uuids=uuid_list(draw) if draw(st.integers(0, 5)) == 0 else (),
        exclude_uuids=uuid_list(draw) if draw(st.integers(0, 4)) == 0 else (),
        numa_bind=draw(st.integers(0, 3)) == 0,
        init=draw(st.integers(0, 4)) == 0,
    )


@st.composite
def pods(draw, uid: str) -> PodRequest:
    k = draw(st.sampled_from([1, 1, 1, 2, 3]))
    cs = tuple(draw(containers(f"c{i}")) for i in range(k))
    return PodRequest(
        "ns",
        f"pod-{uid}",
        uid,
        cs,
        draw(st.sampled_from(list(Policy))),
        draw(st.sampled_from(list(Policy))),
    )


@dataclass(frozen=True)
class Op:
    kind: str  # "bind" | "release"
    pod: PodRequest | None = None
    node: int = 0
    release: int = 0


@st.composite
def twin_inventories(draw) -> list[NodeInventory]:
    """2-4 nodes with the same cards but their own UUIDs: the filter memo shares verdicts
    between nodes in the same state, which must never leak a UUID-dependent answer."""
    base = draw(inventories())[0]
    return [
        NodeInventory(f"n{i}", tuple(replace(c, uuid=simulated_uuid(f"n{i}", c.index)) for c in base.cards),
                      "simulated")
        for i in range(draw(st.integers(2, 4)))
    ]


@st.composite
def scenarios(draw, twins: bool = False) -> tuple[list[NodeInventory], list[Op]]:
    invs = draw(twin_inventories() if twins else inventories())
    ops = []
    for i in range(draw(st.integers(1, 14))):
        if draw(st.integers(0, 3)) == 0:
            ops.append(Op("release", release=draw(st.integers(0, 20))))
        else:
            ops.append(Op("bind", pod=draw(pods(f"u{i}")), node=draw(st.integers(0, 3))))
    return invs, ops


# ---------------------------------------------------------------- independent model


def capacity(card: Card) -> tuple[int, int, int] | None:
    """(slots, MiB, cores) of a usable card, None for a card that takes no slices."""
    sl = card.slicing
    if sl is None or not card.healthy or card.mig_mode or sl.mode not in ("hami-core", "exclusive"):
        return None
    slots = 1 if sl.mode == "exclusive" else sl.split_count
    return slots, int(card.memory_mib * sl.memory_scaling), round(100 * sl.core_scaling)


def check_invariants(led: Ledger, invs: list[NodeInventory], requests: dict[str, PodRequest]) -> None:
    cards = {c.uuid: (inv.node, c) for inv in invs for c in inv.cards}
    # Independent collapse: per pod and card, apps add up, init containers take the max.
    per_card: dict[str, dict[str, list[int]]] = {}
    by_pod: dict[str, list] = {}
    for alloc in led.reservations().values():
        by_pod.setdefault(alloc.pod_uid, []).append(alloc)
    for uid, allocs in by_pod.items():
        req = {c.container: c for c in requests[uid].containers}
        app: dict[str, list[int]] = {}
        init: dict[str, list[int]] = {}
        for alloc in allocs:
            for ca in alloc.containers:
                r = req[ca.container]
                uuids = [d.uuid for d in ca.devices]
                assert len(uuids) == r.cards == len(set(uuids)), "distinct cards, as many as asked"
                numas = set()
                for d in ca.devices:
                    node, card = cards[d.uuid]
                    assert node == alloc.node
                    cap = capacity(card)
                    assert cap is not None, "never on an unusable card"
                    m = card.model.lower()
                    assert not r.types or any(t in m for t in r.types)
                    assert not any(t in m for t in r.exclude_types)
                    assert not r.uuids or d.uuid in r.uuids
                    assert d.uuid not in r.exclude_uuids
                    numas.add(card.numa)
                    assert 1 <= d.memory_mib <= cap[1] and 0 <= d.cores <= 100
                    if card.slicing and card.slicing.mode == "exclusive":
                        assert (d.memory_mib, d.cores) == (cap[1], 100)
                    elif r.memory_mib:
                        assert d.memory_mib == r.memory_mib
                    elif r.memory_percent:
                        assert d.memory_mib == max(1, cap[1] * r.memory_percent // 100)
                    else:
                        assert d.memory_mib == cap[1]
                    tgt = init if ca.init else app
                    f = tgt.setdefault(d.uuid, [0, 0, 0, 0])
                    if ca.init:
                        f[0] = 1
                        f[1], f[2] = max(f[1], d.memory_mib), max(f[2], d.cores)
                    else:
                        f[0] += 1
                        f[1] += d.memory_mib
                        f[2] += d.cores
                    f[3] |= d.cores >= 100
                if r.numa_bind:
                    assert len(numas) == 1, "numa_bind: one NUMA node"
        for u in app.keys() | init.keys():
            a, i = app.get(u, [0, 0, 0, 0]), init.get(u, [0, 0, 0, 0])
            per_card.setdefault(u, {})[uid] = [max(a[k], i[k]) for k in range(3)] + [a[3] | i[3]]
    for inv in invs:
        usage = led.node_usage(inv.node)
        for cu in usage.cards:
            card = cards[cu.uuid][1]
            pods_here = per_card.get(cu.uuid, {})
            slots = sum(f[0] for f in pods_here.values())
            mem = sum(f[1] for f in pods_here.values())
            cores = sum(f[2] for f in pods_here.values())
            excl = sum(f[3] for f in pods_here.values())
            assert (cu.slots_used, cu.memory_used_mib, cu.cores_used, cu.pods) == (
                slots,
                mem,
                cores,
                len(pods_here),
            )
            cap = capacity(card)
            if cap is None:
                assert not pods_here
                continue
            assert slots <= cap[0] and mem <= cap[1] and cores <= cap[2], "over-allocated"
            if excl:
                assert len(pods_here) == 1, "an exclusive slice shares its card with no other pod"
    assert led.problems() == []


def run(invs: list[NodeInventory], ops: list[Op], led: Ledger | None = None, check: bool = False):
    """Apply ``ops``; returns (ledger, requests by UID, per-op outcomes)."""
    led = led or Ledger()
    if not led.nodes():
        for inv in invs:
            led.set_node(inv)
    names = [inv.node for inv in invs]
    requests: dict[str, PodRequest] = {}
    bound: list[str] = []
    outcomes: list[object] = []
    for op in ops:
        if op.kind == "release":
            if bound:
                uid = bound.pop(op.release % len(bound))
                outcomes.append(led.release(uid))
            continue
        assert op.pod is not None
        pod = op.pod
        requests[pod.uid] = pod
        feasible, reasons = led.filter(pod, names)
        outcomes.append((feasible, reasons))
        if check:
            assert set(feasible) | set(reasons) == set(names) and not set(feasible) & set(reasons)
            for n in names:
                try:
                    led.allocate(pod, n)
                    ok = True
                except AllocationError as e:
                    ok = False
                    assert str(e).endswith(f": {reasons.get(n)}"), "filter and allocate give one reason"
                assert ok == (n in feasible), f"filter and allocate disagree on {n}: {reasons.get(n)}"
                # The O(1) pre-filter only rejects nodes where full placement fails too.
                placed = ledger_mod._place(led._nodes[n], pod, ledger_mod._needs(pod))
                assert isinstance(placed, PodAllocation) == ok, f"pre-filter too strict on {n}"
        if feasible:
            target = feasible[op.node % len(feasible)]
            outcomes.append(led.bind(pod, target))
            bound.append(pod.uid)
        if check:
            check_invariants(led, invs, requests)
    return led, requests, outcomes


# ---------------------------------------------------------------- properties


@SETTINGS
@given(scenarios())
def test_never_overallocates_and_filter_matches_allocate(scenario) -> None:
    invs, ops = scenario
    run(invs, ops, check=True)


@SETTINGS
@given(scenarios(), pods("probe"))
def test_bind_then_release_restores_the_ledger_exactly(scenario, probe) -> None:
    invs, ops = scenario
    led, _, _ = run(invs, ops)
    before = led.snapshot()
    usage_before = led.usage()
    feasible, _ = led.filter(probe)
    for n in feasible:
        led.bind(probe, n)
        assert led.release(probe.uid) == [probe.uid]
        assert led.snapshot() == before
    assert led.usage() == usage_before


@SETTINGS
@given(scenarios())
def test_rebuilt_ledger_equals_live_one(scenario) -> None:
    invs, ops = scenario
    led, _, _ = run(invs, ops)
    again = Ledger.rebuild(list(reversed(invs)), led.reservations())
    assert again.snapshot() == led.snapshot()
    assert again.usage() == led.usage()
    # Per-container keys (one VGPUClaim per container) rebuild the same usage.
    split: dict[str, PodAllocation] = {}
    for alloc in led.reservations().values():
        for ca in alloc.containers:
            split[f"ns/{alloc.pod_uid}-{ca.container}"] = PodAllocation(alloc.pod_uid, alloc.node, (ca,))
    per_container = Ledger.rebuild(invs, split)
    assert per_container.usage() == led.usage()


@SETTINGS
@given(scenarios(twins=True), st.lists(pods("probe"), min_size=1, max_size=4))
def test_nodes_in_the_same_state_share_verdicts_without_changing_answers(scenario, probes) -> None:
    invs, ops = scenario
    a, _, _ = run(invs, ops)
    b, _, _ = run(invs, ops, led=Ledger(cache=False))
    for i, same_uid in enumerate(probes):  # several shapes, each decided once per node state
        probe = replace(same_uid, uid=f"probe-{i}")
        assert a.filter(probe) == b.filter(probe)
        feasible = a.filter(probe)[0]
        if feasible:  # a reservation changes one node's state; the others keep theirs
            assert a.bind(probe, feasible[0], key=f"probe-{i}") == b.bind(probe, feasible[0], key=f"probe-{i}")
            assert a.filter(probe) == b.filter(probe)


@SETTINGS
@given(scenarios(), pods("probe"))
def test_same_inputs_same_answers(scenario, probe) -> None:
    invs, ops = scenario
    a, _, out_a = run(invs, ops)
    b = Ledger(cache=False)  # the filter memo must not change any answer
    for inv in reversed(invs):  # nor must insertion order
        b.set_node(inv)
    b, _, out_b = run(invs, ops, led=b)
    assert out_a == out_b
    assert a.snapshot() == b.snapshot()
    assert a.filter(probe) == b.filter(probe)
    assert a.score(probe, a.nodes()) == b.score(probe, b.nodes())
    for n in a.filter(probe)[0]:
        assert a.allocate(probe, n) == b.allocate(probe, n)


@SETTINGS
@given(scenarios(), pods("probe"))
def test_reserving_container_by_container_never_fails_and_equals_one_key(scenario, probe) -> None:
    """The extender reserves one key per container (one VGPUClaim each) after ``allocate``:
    every intermediate step must fit, and the end state equals reserving the pod at once."""
    invs, ops = scenario
    led, _, _ = run(invs, ops)
    before = led.snapshot()
    for n in led.filter(probe)[0]:
        alloc = led.allocate(probe, n)
        led.reserve("whole", alloc)
        whole = led.usage()
        led.release("whole")
        for ca in alloc.containers:
            led.reserve(f"ns/probe-{ca.container}", PodAllocation(probe.uid, n, (ca,)))
        assert led.usage() == whole
        assert led.problems() == []
        assert len(led.release(probe.uid)) == len(alloc.containers)
        assert led.snapshot() == before
