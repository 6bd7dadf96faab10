"""Property tests of namespace quotas on the pure core (OperatorState: the ledger and the quota
book, no I/O): binds of many pods interleaved in any order never take a namespace past a quota,
the book always equals what the ledger holds, the filter's early refusal is never wrong, and
releases give the usage back.

A bind is modelled as the binder runs it on the operator's event loop: ``filter`` (the quota
check from the request alone) may run long before ``reserve`` (allocate + check_quota + reserve,
one synchronous step, as in :mod:`kvgpu.extender.binder`), and the API calls in between may
fail (``fail``: release). Hypothesis picks the interleaving of these steps across pods, which is
every order the awaits between them allow.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvgpu.allocator.ledger import AllocationError
from kvgpu.allocator.quota import DIMENSIONS, Amounts, Limit, Quota, pod_usage, request_floor, usage_by_namespace
from kvgpu.core.requests import ContainerRequest, PodAllocation, PodRequest
from kvgpu.reconcile.state import OperatorState

from tests.unit.allocator_helpers import node

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMESPACES = ("a", "b")
NODES = ("n0", "n1", "n2")


@st.composite
def containers(draw: Any, name: str, init: bool) -> ContainerRequest:
    kind = draw(st.sampled_from(["mib", "mib", "percent", "whole"]))
    cards = draw(st.integers(1, 2))
    cores = draw(st.sampled_from([0, 10, 30, 50, 100]))
    if kind == "mib":
        return ContainerRequest(name, cards=cards, memory_mib=draw(st.integers(256, 6000)), cores=cores, init=init)
    if kind == "percent":
        return ContainerRequest(name, cards=cards, memory_percent=draw(st.integers(5, 60)), cores=cores, init=init)
    return ContainerRequest(name, cards=cards, memory_mib=0, cores=cores, init=init)


@st.composite
def pods(draw: Any, i: int) -> PodRequest:
    apps = [draw(containers(f"c{k}", False)) for k in range(draw(st.integers(0, 2)))]
    inits = [draw(containers(f"i{k}", True)) for k in range(draw(st.integers(0 if apps else 1, 1)))]
    return PodRequest(draw(st.sampled_from(NAMESPACES)), f"p{i}", f"uid-{i}", tuple(apps + inits))


@st.composite
def quotas(draw: Any, ns: str) -> list[Quota]:
    out = []
    for j in range(draw(st.integers(0, 2))):
        dims = draw(st.lists(st.sampled_from(DIMENSIONS), min_size=1, max_size=4, unique=True))
        top = {"memory": 30000, "cores": 400, "cards": 6, "slices": 8}
        limits = tuple(Limit(d, f"spec.hard.{d}", draw(st.integers(0, top[d]))) for d in dims)
        out.append(Quota(draw(st.sampled_from(["ResourceQuota", "VGPUQuota"])), ns, f"q{j}", limits))
    return out


@st.composite
def scenarios(draw: Any) -> tuple[list[Quota], list[PodRequest], list[tuple[str, int, str]]]:
    qs = [q for ns in NAMESPACES for q in draw(quotas(ns))]
    n = draw(st.integers(1, 12))
    ps = [draw(pods(i)) for i in range(n)]
    ops = draw(st.lists(st.tuples(st.sampled_from(["filter", "reserve", "reserve", "fail", "release"]),
                                  st.integers(0, n - 1), st.sampled_from(NODES)), max_size=60))
    return qs, ps, ops


def _state(qs: list[Quota]) -> OperatorState:
    state = OperatorState()
    for name in NODES:
        state.ledger.set_node(node(name, 3, memory_mib=10000))
    for q in qs:
        state.quotas.set_quota(q)
    return state


def _keys(req: PodRequest) -> dict[str, str]:
    return {c.container: f"{req.namespace}/{req.name}-{c.container}" for c in req.containers}


def _bind(state: OperatorState, req: PodRequest, node_name: str) -> PodAllocation | None:
    """What the binder does between its awaits: allocate, check the quotas, reserve; on any
    refusal nothing is left reserved."""
    if state.ledger.pod_node(req.uid) is not None:
        return None
    try:
        alloc = state.ledger.allocate(req, node_name)
        state.check_quota(req.namespace, alloc)
        for ca in alloc.containers:
            state.reserve(_keys(req)[ca.container], PodAllocation(req.uid, node_name, (ca,)))
    except AllocationError:
        state.release_pod(req.uid)
        return None
    return alloc


def _from_ledger(state: OperatorState) -> dict[str, Amounts]:
    return usage_by_namespace((k.partition("/")[0], a.pod_uid, ca)
                              for k, a in state.ledger.reservations().items() for ca in a.containers)


def _check(state: OperatorState, qs: list[Quota]) -> None:
    truth = _from_ledger(state)
    for ns in NAMESPACES:
        used = state.quotas.used(ns)
        assert used == truth.get(ns, Amounts()), (ns, used, truth)
        for q in qs:
            if q.namespace != ns:
                continue
            for lim in q.limits:
                assert used.get(lim.dimension) <= lim.hard, f"{q.ref} {lim.key}: {used} > {lim.hard}"


@SETTINGS
@given(scenarios())
def test_interleaved_binds_never_pass_a_quota(scenario: Any) -> None:
    qs, ps, ops = scenario
    state = _state(qs)
    for op, i, node_name in ops:
        req = ps[i]
        if op == "filter":
            why = state.quota_refusal(req)
            if why is not None:  # the early refusal must be right: the bind would refuse it too
                assert _bind(state, req, node_name) is None, why
        elif op == "reserve":
            floor = request_floor(req.containers)
            alloc = _bind(state, req, node_name)
            if alloc is not None:
                got = pod_usage(alloc.containers)
                assert all(floor.get(d) <= got.get(d) for d in DIMENSIONS), (floor, got)
        elif op == "fail":  # an API call of the bind failed: the binder releases the pod
            state.release_pod(req.uid)
        else:  # the pod ended: its claims are released one by one (the claim watch)
            before = state.quotas.used(req.namespace)
            held = state.quotas.pod(req.uid)
            for k in list(state.ledger.pod_keys(req.uid)):
                state.release_key(k)
            if held is not None:
                assert state.quotas.used(req.namespace) == before - held[1]
        _check(state, qs)
    for req in ps:
        state.release_pod(req.uid)
    assert all(state.quotas.used(ns) == Amounts() for ns in NAMESPACES)
    assert state.quotas.pods() == {}


@SETTINGS
@given(scenarios())
def test_rebuild_from_the_claims_gives_the_same_usage(scenario: Any) -> None:
    """After a restart the book is rebuilt from the claims (the ledger's reservations): the
    usage per namespace is what the live operator had."""
    qs, ps, ops = scenario
    state = _state(qs)
    for op, i, node_name in ops:
        if op == "reserve":
            _bind(state, ps[i], node_name)
        elif op in ("fail", "release"):
            state.release_pod(ps[i].uid)
    live = {ns: state.quotas.used(ns) for ns in NAMESPACES}
    claims = []
    for key, alloc in state.ledger.reservations().items():
        ns, _, name = key.partition("/")
        [ca] = alloc.containers
        claims.append({"metadata": {"namespace": ns, "name": name},
                       "spec": {"podUID": alloc.pod_uid, "node": alloc.node, "container": ca.container,
                                "init": ca.init, "priority": ca.priority,
                                "devices": [{"uuid": d.uuid, "index": d.index, "model": d.model,
                                             "memory": d.memory_mib, "cores": d.cores} for d in ca.devices]}})
    fresh = _state(qs)
    fresh.rebuild([], [], claims)  # no Node objects: the ledger keeps the reservations on unknown nodes
    assert {ns: fresh.quotas.used(ns) for ns in NAMESPACES} == live


@SETTINGS
@given(scenarios(), st.sampled_from(NAMESPACES))
def test_a_lowered_quota_admits_nothing_more_of_that_dimension(scenario: Any, ns: str) -> None:
    """A quota lowered below the usage (kubectl edit) keeps the running pods and admits no pod
    that asks for a dimension it passes; once it is gone, a pod that fits is bound again."""
    _, ps, ops = scenario
    state = _state([])
    for op, i, node_name in ops:
        if op == "reserve":
            _bind(state, ps[i], node_name)
    used = state.quotas.used(ns)
    low = Quota("VGPUQuota", ns, "low", tuple(Limit(d, f"spec.hard.{d}", max(0, used.get(d) - 1)) for d in DIMENSIONS))
    state.quotas.set_quota(low)
    before = state.ledger.reservations()
    for req in ps:
        if req.namespace != ns or state.ledger.pod_node(req.uid) is not None:
            continue
        for node_name in NODES:  # every pod asks for at least one slice: none is admitted
            assert _bind(state, req, node_name) is None
    assert state.ledger.reservations() == before
    state.quotas.remove_quota("VGPUQuota", ns, "low")  # the quota gone: a pod that fits is bound again
    for req in ps:
        if req.namespace == ns and state.ledger.pod_node(req.uid) is None:
            for node_name in NODES:
                fits = bool(state.ledger.filter(req, [node_name])[0])
                assert (_bind(state, req, node_name) is not None) == fits
                if fits:
                    break
