"""``kubectl vgpu simulate`` without a cluster (kvgpu.cli.simulate): manifests to pods, where they
go, the binding constraint and what would have to free up; and a property test that simulate
and the extender's own filter and bind (kvgpu.extender.server, .binder, on a fake API) place
random pods on random clusters alike."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvgpu import kube
from kvgpu.cli import simulate as sim
from kvgpu.cli.kubectl_vgpu import main
from kvgpu.core import keys
from kvgpu.core.inventory import SimulatedCardSpec, SimulatedNode
from kvgpu.devcluster.fakenodes import node_manifest
from kvgpu.extender.choice import NodeChoice
from kvgpu.extender.protocol import BindingArgs
from kvgpu.extender.server import Extender
from kvgpu.metrics import OperatorMetrics
from kvgpu.reconcile.state import OperatorState

from tests.unit.extender_helpers import FakeKube


def _pod(name: str, ann: dict[str, str], ns: str = "team", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}", "annotations": ann,
                         "labels": {keys.POD_MANAGED_LABEL: "true"}},
            "spec": {"containers": [{"name": "main", "image": "cuda"}], **spec}}


def _state(nodes: int = 2, cards: int = 2, mem: int = 10000, split: int = 10, model: str = "NVIDIA H200"
           ) -> OperatorState:
    objs, pools = sim.hypothetical(nodes, cards, mem, model, split_count=split)
    s = OperatorState()
    s.rebuild(objs, pools, [])
    return s


def test_expand_workload_kinds() -> None:
    tpl = {"metadata": {"annotations": {"kvgpu.io/gpumem": "1000"}}, "spec": {"containers": [{"name": "c"}]}}
    objs = [
        {"kind": "Deployment", "metadata": {"name": "d", "namespace": "a"}, "spec": {"replicas": 3, "template": tpl}},
        {"kind": "Job", "metadata": {"name": "j"}, "spec": {"parallelism": 4, "completions": 2, "template": tpl}},
        {"kind": "List", "items": [{"kind": "StatefulSet", "metadata": {"name": "s"}, "spec": {"template": tpl}}]},
        {"kind": "CronJob", "metadata": {"name": "cj"}, "spec": {"jobTemplate": {"spec": {"template": tpl}}}},
        _pod("p", {}),
    ]
    pods = sim.expand(objs, "dflt")
    assert [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in pods] == [
        "a/d-0", "a/d-1", "a/d-2", "dflt/j-0", "dflt/j-1", "dflt/s-0", "dflt/cj-0", "team/p"]
    assert pods[0]["metadata"]["annotations"] == {"kvgpu.io/gpumem": "1000"}
    assert len({p["metadata"]["uid"] for p in pods}) == len(pods)
    with pytest.raises(ValueError, match="DaemonSet"):
        sim.expand([{"kind": "DaemonSet", "metadata": {"name": "x"}, "spec": {}}], "n")


def test_places_in_order_and_names_memory_and_what_must_end() -> None:
    s = _state(nodes=1, cards=1, mem=10000)
    pods = [_pod(f"p{i}", {"kvgpu.io/gpumem": "4000"}) for i in range(3)]
    v = sim.simulate(s, pods, holders={})
    assert [x.fits for x in v] == [True, True, False]
    assert v[0].node == "node-0" and v[0].cards == {"main": ["0:4000MiB/0%"]}
    assert v[2].constraint == "memory" and v[2].constraints == {"node-0": "memory"}
    assert "most free memory 2000 MiB < 4000 MiB" in v[2].reasons["node-0"]
    assert v[2].free_up == "1 pod(s) on node-0 ending: team/p0"


@pytest.mark.parametrize(("ann", "constraint"), [
    ({"kvgpu.io/gpumem": "20000"}, "memory"),
    ({"kvgpu.io/gpu-type": "A100"}, "type filter"),
    ({"kvgpu.io/gpu": "3"}, "too few cards"),
])
def test_static_constraints_say_nothing_would_free_up(ann: dict[str, str], constraint: str) -> None:
    s = _state(nodes=2, cards=2, mem=10000)
    [v] = sim.simulate(s, [_pod("x", ann)])
    assert not v.fits and v.constraint == constraint, v
    assert v.free_up.startswith("nothing"), v


def test_slots_cores_and_quota_hook() -> None:
    s = _state(nodes=1, cards=1, split=2)
    v = sim.simulate(s, [_pod(f"p{i}", {"kvgpu.io/gpumem": "1000", "kvgpu.io/gpucores": "40"}) for i in range(3)])
    assert v[2].constraint == "slots"
    s = _state(nodes=1, cards=1, split=10)
    v = sim.simulate(s, [_pod(f"p{i}", {"kvgpu.io/gpumem": "1000", "kvgpu.io/gpucores": "40"}) for i in range(3)])
    assert v[2].constraint == "cores"
    [q] = sim.simulate(_state(), [_pod("q", {"kvgpu.io/gpumem": "1000"})], quota=lambda r: "quota team/q: memory")
    assert (q.fits, q.constraint, q.note) == (False, "quota", "quota team/q: memory")
    [n] = sim.simulate(_state(), [_pod("n", {"kvgpu.io/gpumem": "1000"}, nodeSelector={"zone": "nowhere"})])
    assert (n.fits, n.constraint) == (False, "no node")
    [cpu] = sim.simulate(_state(), [{"kind": "Pod", "metadata": {"name": "c", "namespace": "t"},
                                     "spec": {"containers": [{"name": "c"}]}}])
    assert cpu.fits and "no GPU slice" in cpu.note


def test_cli_hypothetical_cluster(tmp_path: Any) -> None:
    f = tmp_path / "d.yaml"
    f.write_text("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: inf}\nspec:\n  replicas: 3\n"
                 "  template:\n    metadata:\n      annotations: {kvgpu.io/gpumem: '6000'}\n"
                 "    spec:\n      containers: [{name: s, image: x}]\n")
    r = CliRunner().invoke(main, ["simulate", "-f", str(f), "--nodes", "1", "--cards", "2", "--card-memory", "10000"])
    assert r.exit_code == 1, r.output
    lines = r.output.splitlines()
    assert lines[0].split() == sim.HEADERS
    assert lines[1].split()[:3] == ["default/inf-0", "yes", "node-0"]
    assert lines[3].split()[:2] == ["default/inf-2", "no"] and "memory" in lines[3]
    assert "2 of 3 pod(s) would fit now." in r.output
    r = CliRunner().invoke(main, ["simulate", "-f", str(f), "--nodes", "2", "--cards", "2", "--card-memory",
                                  "10000", "-o", "json"])
    assert r.exit_code == 0 and all(p["fits"] for p in json.loads(r.output)["pods"])


# --------------------------------------------------------------------------- simulate == extender


def _extender_places(state: OperatorState, pods: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Each pod through the extender's real filter, then its real bind (fake API), in order."""
    ext = Extender(state, api=None, metrics=OperatorMetrics(), node_choice=NodeChoice.EXTENDER)
    out: list[tuple[str, Any]] = []

    async def go() -> None:
        for p in pods:
            names = [n for n in state.ledger.nodes()]
            status, res = await ext.filter(json.dumps({"pod": p, "nodenames": names}).encode())
            assert status == 200
            assert not res.get("error"), res
            if not res["nodenames"]:
                out.append(("", None))
                continue
            [node] = res["nodenames"]
            m = p["metadata"]
            err = await ext.binder.bind(BindingArgs(m["name"], m["namespace"], m["uid"], node))
            assert err == "", err
            alloc = sorted((ca.container, tuple((d.uuid, d.memory_mib, d.cores) for d in ca.devices))
                           for k in state.ledger.pod_keys(m["uid"])
                           for ca in state.ledger.reservation(k).containers)  # type: ignore[union-attr]
            out.append((node, alloc))

    asyncio.run(go())
    return out


def _sim_places(state: OperatorState, pods: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for p, v in zip(pods, sim.simulate(state, pods), strict=True):
        uid = p["metadata"]["uid"]
        if not v.fits:
            out.append(("", None))
            continue
        alloc = sorted((ca.container, tuple((d.uuid, d.memory_mib, d.cores) for d in ca.devices))
                       for k in state.ledger.pod_keys(uid) for ca in state.ledger.reservation(k).containers)  # type: ignore[union-attr]
        out.append((v.node, alloc))
    return out


POD = st.fixed_dictionaries({
    "kvgpu.io/gpu": st.sampled_from(["1", "1", "2"]),
    "kvgpu.io/gpumem": st.sampled_from(["1000", "3000", "6000", "9000"]),
    "kvgpu.io/gpucores": st.sampled_from(["0", "20", "50", "100"]),
}, optional={"kvgpu.io/node-policy": st.sampled_from(["binpack", "spread"]),
             "kvgpu.io/gpu-policy": st.sampled_from(["binpack", "spread"]),
             "kvgpu.io/gpu-type": st.sampled_from(["H200", "A100"])})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=st.lists(st.tuples(st.integers(1, 3), st.sampled_from([8000, 10000, 20000]),
                                st.sampled_from(["NVIDIA H200", "NVIDIA A100"])), min_size=1, max_size=4),
       split=st.integers(1, 4), pods=st.lists(POD, min_size=1, max_size=12))
def test_simulate_agrees_with_the_extenders_filter_and_bind(nodes: list[tuple[int, int, str]], split: int,
                                                             pods: list[dict[str, str]]) -> None:
    def world() -> OperatorState:
        s = OperatorState()
        objs = [node_manifest(SimulatedNode(f"n{i}", (SimulatedCardSpec(model=m, memory_mib=mem, count=k),)))
                for i, (k, mem, m) in enumerate(nodes)]
        s.rebuild(objs, [{"apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": "default"},
                          "spec": {"splitCount": split}}], [])
        s.ready = True
        return s

    objs = [_pod(f"p{i}", ann) for i, ann in enumerate(pods)]
    fake = FakeKube()
    with pytest.MonkeyPatch.context() as mp:
        for name in ("get_pod", "create_claim", "get_claim", "delete_claim", "patch_pod_metadata",
                     "create_binding", "patch_claim_status", "post_event"):
            mp.setattr(kube, name, getattr(fake, name))
        by_extender = _extender_places(world(), objs)
    assert _sim_places(world(), objs) == by_extender
