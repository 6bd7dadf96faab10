"""``kubectl vgpu`` views without a cluster: objects built the way the operator and the agent
build them (fake node manifests, the real allocator, claim bodies from the binder)."""

from __future__ import annotations

import datetime
import json
from typing import Any

from click.testing import CliRunner
from kvgpu.api.requests import parse_pod
from kvgpu.cli.kubectl_vgpu import KubeOptions, main
from kvgpu.cli.vgpu import views
from kvgpu.core import keys
from kvgpu.core.inventory import SimulatedCardSpec, SimulatedNode
from kvgpu.devcluster.fakenodes import node_manifest
from kvgpu.extender.binder import claim_body
from kvgpu.reconcile.state import OperatorState

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
POOL = {"apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": "default"},
        "spec": {"nodeSelector": {"matchLabels": {"kvgpu.io/gpu-node": "true"}}, "splitCount": 10}}


def _pod(name: str, ann: dict[str, str], uid: str | None = None, ns: str = "team",
         selector: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "uid": uid or f"uid-{name}", "annotations": ann},
            "spec": {"schedulerName": keys.SCHEDULER_NAME, "nodeSelector": selector or {},
                     "containers": [{"name": "main", "image": "cuda"}]},
            "status": {"phase": "Pending"}}


def _world(cards: int = 2, memory_mib: int = 10000) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Two fake nodes; one pod of 6000 MiB / 30 % bound to card 0 of n0. Returns (nodes, claims)."""
    spec = SimulatedCardSpec(memory_mib=memory_mib, count=cards)
    sims = [SimulatedNode(f"n{i}", (spec,)) for i in range(2)]
    nodes = [node_manifest(s) for s in sims]
    for n in nodes:
        n["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    st = OperatorState()
    st.rebuild(nodes, [POOL], [])
    pod = _pod("train", {"kvgpu.io/gpumem": "6000", "kvgpu.io/gpucores": "30"})
    req = parse_pod(pod, st.default_pool_spec())
    assert req is not None
    alloc = st.ledger.allocate(req, "n0")
    claim = claim_body(pod, alloc, "main", "default")
    claim["metadata"]["creationTimestamp"] = "2026-01-02T03:00:00Z"
    claim["status"] = {"phase": "Running"}
    return nodes, [claim]


# --------------------------------------------------------------------------- formatting


def test_table_aligns_columns_without_trailing_blanks() -> None:
    out = views.table(["A", "LONGER"], [["xxxx", "1"], ["y", ""]])
    assert out.splitlines() == ["A      LONGER", "xxxx   1", "y"]


def test_age_like_kubectl() -> None:
    assert views.age("2026-01-02T03:04:00Z", NOW) == "5s"
    assert views.age("2026-01-02T02:04:05Z", NOW) == "60m"
    assert views.age("2026-01-01T03:04:05Z", NOW) == "24h"
    assert views.age("2025-12-01T03:04:05Z", NOW) == "32d"
    assert views.age(None, NOW) == "-" and views.age("garbage", NOW) == "-"


# --------------------------------------------------------------------------- nodes


def test_card_rows_from_the_claims_and_agent_inventory() -> None:
    """Used amounts are the claims' as the operator's allocator counts them: nothing on the
    Node says them."""
    nodes, claims = _world()
    assert all(keys.NODE_ALLOCATION not in n["metadata"]["annotations"] for n in nodes)
    rows = views.card_rows(nodes, views.node_allocations(nodes, [POOL], claims))
    assert [(r.node, r.index) for r in rows] == [("n0", 0), ("n0", 1), ("n1", 0), ("n1", 1)]
    used = rows[0]
    assert used.slots == (1, 10) and used.memory_mib == (6000, 10000) and used.cores == (30, 100)
    assert used.pods == 1 and used.health == "Healthy" and used.pool == "default"
    assert rows[1].slots == (0, 10) and rows[1].memory_mib == (0, 10000)
    table = views.table(views.CARD_HEADERS, [r.cells() for r in rows])
    lines = table.splitlines()
    assert lines[0].split() == ["NODE", "GPU", "MODEL", "POOL", "SLOTS", "MEMORY(MiB)", "PHYSICAL(MiB)",
                                "CORES(%)", "HEALTH", "STATE"]
    assert lines[1].split() == [
        "n0", "0", "NVIDIA", "H200", "default", "1/10", "6000/10000", "10000", "30/100", "Healthy", "-"]


def test_card_rows_unhealthy_card_and_claims_not_listed() -> None:
    nodes, _ = _world()
    inv = json.loads(nodes[1]["metadata"]["annotations"][keys.NODE_INVENTORY])
    inv["cards"][1].update(healthy=False, reason="XID 79 (fell off the bus)")
    inv["cards"][0]["slicing"] = {"pool": "default", "splitCount": 4, "memoryScaling": 1.5,
                                  "coreScaling": 1.0}
    nodes[1]["metadata"]["annotations"] = {keys.NODE_INVENTORY: json.dumps(inv)}
    rows = [r for r in views.card_rows(nodes, None) if r.node == "n1"]  # claims could not be listed
    assert rows[0].slots == (None, 4) and rows[0].memory_mib == (None, 15000) and rows[0].pods is None
    assert rows[0].cells()[4:8] == ["-/4", "-/15000", "10000", "-/100"]
    assert rows[1].health == "Unhealthy: XID 79 (fell off the bus)"
    assert rows[0].note == "claims not listed"
    assert rows[1].note == "no VGPUPool covers the card" and rows[1].cells()[4] == "-/-"
    wide = rows[1].cells(wide=True)
    assert wide[3] == rows[1].uuid and wide[-1] == rows[1].note


def test_card_rows_skip_plain_nodes_and_bad_annotations() -> None:
    plain = {"metadata": {"name": "cpu", "annotations": {}}}
    broken = {"metadata": {"name": "b", "annotations": {keys.NODE_INVENTORY: "{not json"}}}
    assert views.card_rows([plain, broken], views.node_allocations([plain, broken], [POOL], [])) == []


def test_card_rows_note_unusable_and_exclusive() -> None:
    alloc = {"version": 1, "node": "x", "slots": [1, 10], "memoryMiB": [100, 100], "cores": [100, 100],
             "cards": [
        {"uuid": "GPU-a", "index": 0, "model": "M", "pool": "p", "usable": True, "reason": "",
         "slots": [1, 10], "memoryMiB": [100, 100], "cores": [100, 100], "pods": 1, "exclusive": True},
        {"uuid": "GPU-b", "index": 1, "model": "M", "pool": "", "usable": False, "reason": "MIG mode",
         "slots": [0, 0], "memoryMiB": [0, 0], "cores": [0, 0], "pods": 0, "exclusive": False}]}
    node = {"metadata": {"name": "x", "annotations": {}}}
    rows = views.card_rows([node], {"x": alloc})
    assert [r.note for r in rows] == ["exclusive", "MIG mode"]
    assert rows[0].health == "Unknown"  # no inventory from the agent


# --------------------------------------------------------------------------- claims


def _labels(pod: str, claim: str, uuid: str | None) -> str:
    dev = f',device_uuid="{uuid}",device_index="0"' if uuid else ""
    return f'{{node="n0",namespace="team",pod="{pod}",container="main",claim="{claim}"{dev}}}'


def _metrics(u: str) -> str:
    return "\n".join([
        "# TYPE kvgpu_container_memory_used_bytes gauge",
        f"kvgpu_container_memory_used_bytes{_labels('train', 'c', u)} 1.572864e+09",
        f"kvgpu_container_memory_used_bytes{_labels('gone', 'd', u)} 0",
        "# TYPE kvgpu_container_sm_utilization_percent gauge",
        f"kvgpu_container_sm_utilization_percent{_labels('train', 'c', u)} 28.6",
        "# TYPE kvgpu_container_region_active gauge",
        f"kvgpu_container_region_active{_labels('train', 'c', None)} 1",
        f"kvgpu_container_region_active{_labels('gone', 'd', None)} 0",
        "",
    ])


def test_parse_usage_keeps_only_readable_regions() -> None:
    usage = views.parse_usage(_metrics("GPU-1"))
    assert usage == {("team", "train", "main", "GPU-1"): views.Usage(1.572864e9, 28.6)}


def test_claim_rows_with_and_without_usage() -> None:
    _, claims = _world()
    uuid = claims[0]["spec"]["devices"][0]["uuid"]
    [bare] = views.claim_rows(claims, NOW)
    assert (bare.pod, bare.container, bare.node, bare.gpu, bare.memory, bare.cores, bare.phase, bare.age) == \
        ("train", "main", "n0", "0", "6000Mi", "30%", "Running", "4m")
    assert bare.memory_used == "-" and bare.sm_util == "-"
    [row] = views.claim_rows(claims, NOW, views.parse_usage(_metrics(uuid)))
    assert row.memory_used == "1500Mi" and row.sm_util == "29%"
    assert row.cells(all_namespaces=True)[0] == "team"
    assert views.claim_headers(True, wide=True)[:2] == ["NAMESPACE", "NAME"]
    assert row.cells(all_namespaces=False, wide=True)[0] == row.name
    assert len(views.claim_headers(False)) == len(row.cells(False))


# --------------------------------------------------------------------------- why


def _event(pod: dict[str, Any], reason: str, message: str, ts: str, count: int = 1) -> dict[str, Any]:
    return {"involvedObject": {"kind": "Pod", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]},
            "reason": reason, "message": message, "type": "Warning", "lastTimestamp": ts, "count": count}


def test_why_pending_no_room_lists_reasons_and_events() -> None:
    nodes, claims = _world(cards=1)
    pod = _pod("big", {"kvgpu.io/gpumem": "8000"})
    events = [
        _event(pod, "FailedScheduling", "0/2 nodes are available: 2 no node has room.",
               "2026-01-02T03:03:05Z", 4),
        _event(pod, "NoGPUCapacity", "no node has room for the GPU request: n0: ...", "2026-01-02T03:04:00Z"),
        _event({"metadata": {"name": "big", "uid": "older"}}, "NoGPUCapacity", "stale",
               "2026-01-02T03:04:01Z"),
        {**_event(pod, "Scheduled", "ok", "2026-01-02T03:04:02Z"), "type": "Normal"},
    ]
    ex = views.explain_pod(pod, events=events, nodes=nodes, pools=[POOL], claims=claims, now=NOW)
    assert ex.request == ["main: 1 card, 8000 MiB, no core limit, priority 1"]
    assert ex.events == ["5s ago  NoGPUCapacity: no node has room for the GPU request: n0: ...",
                         "60s ago  FailedScheduling (x4): 0/2 nodes are available: 2 no node has room."]
    # n0's only card has 4000 MiB left; n1's card is free.
    assert ex.feasible == ["n1"] and set(ex.reasons) == {"n0"}
    text = views.format_explanation(ex)
    assert "Room now: 1 of 2 node(s) fit the request: n1" in text
    # Without the claims the allocator sees every card empty, and says so.
    ex2 = views.explain_pod(pod, events=[], nodes=nodes, pools=[POOL], claims=None, now=NOW)
    assert ex2.feasible == ["n0", "n1"] and any("could not be listed" in n for n in ex2.notes)
    assert "Events: none about scheduling yet." in views.format_explanation(ex2)


def test_why_nothing_fits_and_node_selector() -> None:
    nodes, claims = _world(cards=1)
    pod = _pod("huge", {"kvgpu.io/gpumem": "9000", "kvgpu.io/gpu": "1"},
               selector={"kubernetes.io/hostname": "n0"})
    ex = views.explain_pod(pod, events=[], nodes=nodes, pools=[POOL], claims=claims, now=NOW)
    assert ex.nodes_considered == 1 and ex.feasible == [] and list(ex.reasons) == ["n0"]
    text = views.format_explanation(ex)
    assert "Room now: none of 1 GPU node(s) fits the request:" in text
    assert f"  n0: {ex.reasons['n0']}" in text
    assert "nodeSelector" in text


def test_why_invalid_request_and_not_ours_and_bound() -> None:
    nodes, claims = _world()
    bad = _pod("bad", {"kvgpu.io/gpumem": "lots", "kvgpu.io/gpucores": "130"})
    ex = views.explain_pod(bad, events=[], nodes=nodes, pools=[POOL], claims=claims, now=NOW)
    assert len(ex.request_errors) == 2 and any("kvgpu.io/gpumem" in e for e in ex.request_errors)
    assert "The GPU request is invalid" in views.format_explanation(ex)

    plain = _pod("web", {})
    plain["spec"]["schedulerName"] = "default-scheduler"
    ex = views.explain_pod(plain, events=[], nodes=nodes, pools=[POOL], claims=claims, now=NOW)
    assert ex.not_ours and "asks for no GPU slices" in views.format_explanation(ex)

    bound = _pod("train", {"kvgpu.io/gpumem": "6000", keys.POD_CLAIMS: claims[0]["metadata"]["name"]})
    bound["spec"]["nodeName"] = "n0"
    bound["status"]["phase"] = "Running"
    ex = views.explain_pod(bound, events=[], nodes=nodes, pools=[POOL], claims=claims, now=NOW)
    text = views.format_explanation(ex)
    assert text.startswith("Pod team/train: Running on node n0")
    assert f"Claims: {claims[0]['metadata']['name']}." in text and "Room now" not in text


def test_why_notes_a_pod_the_webhook_skipped() -> None:
    nodes, claims = _world()
    pod = _pod("skipped", {"kvgpu.io/gpumem": "1000"})
    pod["spec"]["schedulerName"] = "default-scheduler"
    ex = views.explain_pod(pod, events=[], nodes=nodes, pools=[POOL], claims=claims, now=NOW)
    assert any("mutating webhook did not process it" in n for n in ex.notes)


# --------------------------------------------------------------------------- CLI plumbing


def test_options_after_the_subcommand_win() -> None:
    base = KubeOptions(kubeconfig="a", namespace="x")
    merged = base.merged(namespace="y", all_namespaces=False, context=None, output="")
    assert (merged.kubeconfig, merged.namespace, merged.all_namespaces) == ("a", "y", False)


def test_cli_reports_a_bad_kubeconfig(tmp_path: Any) -> None:
    res = CliRunner().invoke(main, ["--kubeconfig", str(tmp_path / "none"), "nodes"])
    assert res.exit_code != 0
    assert "kubeconfig" in res.output.lower() or "no kubeconfig" in res.output.lower()


def test_agent_usage_scrapes_each_needed_node_through_the_pod_proxy(monkeypatch: Any) -> None:
    import asyncio

    from kubernetes_asyncio import client
    from kvgpu.cli import kubectl_vgpu

    calls: list[tuple[str, str, str]] = []

    class FakeCore:
        def __init__(self, api: Any) -> None:
            pass

        async def list_namespaced_pod(self, namespace: str, label_selector: str) -> dict[str, Any]:
            assert (namespace, label_selector) == ("kvgpu-system", kubectl_vgpu.AGENT_SELECTOR)
            return {"items": [
                {"metadata": {"name": f"agent-{n}"}, "spec": {"nodeName": n}, "status": {"phase": phase}}
                for n, phase in (("n0", "Running"), ("n1", "Running"), ("n2", "Pending"), ("n3", "Running"))]}

        async def connect_get_namespaced_pod_proxy_with_path(
            self, name: str, namespace: str, path: str
        ) -> str:
            calls.append((name, namespace, path))
            if name.startswith("agent-n1"):
                raise OSError("connection refused")
            return _metrics("GPU-1")

    monkeypatch.setattr(client, "CoreV1Api", FakeCore)
    usage = asyncio.run(kubectl_vgpu.agent_usage(object(), {"n0", "n1", "n2"}))
    assert sorted(calls) == [("agent-n0:9394", "kvgpu-system", "metrics"),
                             ("agent-n1:9394", "kvgpu-system", "metrics")]
    assert usage == {("team", "train", "main", "GPU-1"): views.Usage(1.572864e9, 28.6)}


def test_namespace_defaults_to_the_context_like_kubectl(tmp_path: Any) -> None:
    import yaml
    from kvgpu.cli.kubectl_vgpu import _current_namespace

    kc = tmp_path / "config"
    kc.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "a",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "a", "context": {"cluster": "c", "user": "u", "namespace": "ml"}},
                     {"name": "b", "context": {"cluster": "c", "user": "u"}}],
    }))
    assert _current_namespace(KubeOptions(kubeconfig=str(kc))) == "ml"
    assert _current_namespace(KubeOptions(kubeconfig=str(kc), context="b")) == "default"
    assert _current_namespace(KubeOptions(kubeconfig=str(kc), namespace="x")) == "x"
