"""Namespace quotas (issue 16): the arithmetic (kvgpu.allocator.quota), what is read from a
ResourceQuota or a VGPUQuota (kvgpu.api.quotas), and the bind and filter refusing a pod over a
quota with the quota, used, requested and hard amounts named."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from kvgpu.allocator.quota import Amounts, Limit, Quota, QuotaBook, pod_usage, request_floor, usage_by_namespace
from kvgpu.api import quotas as api
from kvgpu.core.requests import ContainerAllocation, ContainerRequest, DeviceGrant
from kvgpu.extender.binder import Binder
from kvgpu.extender.protocol import BindingArgs

from tests.unit.extender_helpers import make_state
from tests.unit.test_bind_faults import FakeApi, gpu_pod


def grant(uuid: str, mem: int, cores: int = 0) -> DeviceGrant:
    return DeviceGrant(uuid, 0, "NVIDIA H200", mem, cores)


def rq(hard: dict[str, str], name: str = "gpu", ns: str = "ns") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": name, "namespace": ns},
            "spec": {"hard": hard}}


# --------------------------------------------------------------------------- arithmetic


def test_hami_counting_per_card_times_cards() -> None:
    two = ContainerAllocation("main", (grant("GPU-a", 2048, 30), grant("GPU-b", 2048, 30)))
    assert pod_usage([two]) == Amounts(memory=4096, cores=60, cards=2, slices=2)
    assert request_floor([ContainerRequest("main", cards=2, memory_mib=2048, cores=30)]) == Amounts(4096, 60, 2, 2)


def test_init_containers_count_as_the_max_of_init_and_the_sum_of_app_containers() -> None:
    app1 = ContainerAllocation("a", (grant("GPU-a", 1000, 10),))
    app2 = ContainerAllocation("b", (grant("GPU-a", 1500, 10),))  # the same card: one card, two slices
    init = ContainerAllocation("i", (grant("GPU-a", 6000, 5), grant("GPU-b", 100, 5)), init=True)
    assert pod_usage([app1, app2]) == Amounts(2500, 20, 1, 2)
    assert pod_usage([app1, app2, init]) == Amounts(6100, 20, 2, 2)
    only_init = ContainerAllocation("i", (grant("GPU-a", 9000),), init=True)
    assert pod_usage([only_init]) == Amounts(9000, 0, 1, 1)
    reqs = [ContainerRequest("a", memory_mib=1000), ContainerRequest("i", cards=2, memory_mib=3000, init=True)]
    assert request_floor(reqs) == Amounts(6000, 0, 2, 2)


def test_floor_counts_no_memory_for_percent_or_whole_card_and_never_exceeds_the_grant() -> None:
    assert request_floor([ContainerRequest("m", memory_percent=50)]).memory == 0
    assert request_floor([ContainerRequest("m", memory_mib=0)]).memory == 0  # the whole card
    # what the grant of a 50 % request on a 10,000 MiB card counts
    assert pod_usage([ContainerAllocation("m", (grant("GPU-a", 5000),))]).memory == 5000


def test_refusal_names_the_quota_key_used_requested_and_hard() -> None:
    book = QuotaBook()
    book.set_quota(Quota("ResourceQuota", "ns", "gpu", (Limit("memory", "limits.nvidia.com/gpumem", 4096),)))
    assert book.check("ns", Amounts(memory=4096)) is None
    book.set_pod("p1", "ns", Amounts(memory=4096, cards=2, slices=2))
    why = book.check("ns", Amounts(memory=4096), "p2")
    assert why == ("GPU quota exceeded: ResourceQuota ns/gpu limits.nvidia.com/gpumem: used 4096 + requested 4096 "
                   "> hard 4096 (MiB)")
    assert "%" not in why
    assert book.check("ns", Amounts(memory=4096), "p1") is None, "a pod's own usage is not counted twice"
    assert book.check("ns", Amounts(cores=10)) is None, "no limit on cores"
    assert book.check("other", Amounts(memory=10**9)) is None
    book.set_pod("p1", "ns", None)
    assert book.used("ns") == Amounts() and book.check("ns", Amounts(memory=4096), "p2") is None


def test_every_quota_of_a_namespace_applies_and_a_zero_request_is_never_refused() -> None:
    book = QuotaBook()
    book.set_quota(Quota("ResourceQuota", "ns", "a", (Limit("memory", "limits.nvidia.com/gpumem", 10000),)))
    book.set_quota(Quota("VGPUQuota", "ns", "b", (Limit("cards", "spec.hard.cards", 1),
                                                  Limit("cores", "spec.hard.cores", 0))))
    why = book.check("ns", Amounts(memory=100, cards=2, slices=2))
    assert why is not None and "VGPUQuota ns/b spec.hard.cards: used 0 + requested 2 > hard 1 (cards)" in why
    assert book.check("ns", Amounts(memory=100, cards=1, slices=1)) is None  # cores 0 asked: cores 0 allowed
    assert "spec.hard.cores" in (book.check("ns", Amounts(memory=100, cores=1, cards=1, slices=1)) or "")
    assert book.remove_quota("VGPUQuota", "ns", "b") and not book.remove_quota("VGPUQuota", "ns", "b")
    assert book.check("ns", Amounts(memory=100, cores=1, cards=2, slices=2)) is None


def test_usage_by_namespace_groups_claims_per_pod() -> None:
    a = ContainerAllocation("a", (grant("GPU-a", 1000),))
    i = ContainerAllocation("i", (grant("GPU-a", 3000),), init=True)
    b = ContainerAllocation("main", (grant("GPU-b", 500),))
    got = usage_by_namespace([("x", "u1", a), ("x", "u1", i), ("x", "u2", b), ("y", "u3", b)])
    assert got == {"x": Amounts(3500, 0, 2, 2), "y": Amounts(500, 0, 1, 1)}


# --------------------------------------------------------------------------- API objects


def test_resource_quota_keys_in_both_forms_and_units() -> None:
    q, problems = api.from_resource_quota(rq({
        "limits.nvidia.com/gpumem": "4Gi", "requests.nvidia.com/gpumem": "6000", "limits.nvidia.com/gpucores": "150",
        "requests.nvidia.com/gpu": "3", "limits.cpu": "4", "nvidia.com/gpu": "1",
        "limits.nvidia.com/gpumem-percentage": "50"}))
    assert not problems and q is not None
    assert q.ref == "ResourceQuota ns/gpu"
    assert [(lim.dimension, lim.key, lim.hard) for lim in q.limits] == [
        ("memory", "limits.nvidia.com/gpumem", 4096), ("memory", "requests.nvidia.com/gpumem", 6000),
        ("cores", "limits.nvidia.com/gpucores", 150), ("slices", "requests.nvidia.com/gpu", 3)]
    assert api.from_resource_quota(rq({"pods": "10", "limits.cpu": "2"})) == (None, [])
    bad, problems = api.from_resource_quota(rq({"limits.nvidia.com/gpumem": "lots", "limits.nvidia.com/gpu": "2"}))
    assert bad is not None and [lim.key for lim in bad.limits] == ["limits.nvidia.com/gpu"]
    assert problems and "limits.nvidia.com/gpumem" in problems[0]


def test_vgpu_quota_limits_and_the_status_the_operator_writes() -> None:
    obj = {"apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUQuota", "metadata": {"name": "team", "namespace": "ns",
                                                                                "generation": 3},
           "spec": {"hard": {"memory": 4096, "slices": 4}}, "status": {"used": {"memory": 1}}}
    q = api.from_vgpu_quota(obj)
    assert q == Quota("VGPUQuota", "ns", "team", (Limit("memory", "spec.hard.memory", 4096),
                                                  Limit("slices", "spec.hard.slices", 4)))
    st = api.vgpu_quota_status(q, Amounts(4096, 60, 2, 2), 3)
    assert st["hard"] == {"memory": 4096, "slices": 4}
    assert st["used"] == {"memory": 4096, "cores": 60, "cards": 2, "slices": 2}
    assert (st["memorySummary"], st["coresSummary"], st["slicesSummary"]) == ("4Gi/4Gi", "60/-", "2/4")
    assert st["observedGeneration"] == 3
    assert api.VGPUQuotaStatus.model_validate(st).used.memory == 4096  # round trip, summaries dropped
    with pytest.raises(ValueError):
        api.from_vgpu_quota({"metadata": {"name": "x", "namespace": "ns"}, "spec": {"hard": {"memory": -1}}})


def test_vgpu_quota_crd_is_generated_with_its_columns() -> None:
    from kvgpu.api import crdgen

    crd = crdgen.crds()["kvgpu.io_vgpuquotas.yaml"]
    assert crd["spec"]["scope"] == "Namespaced" and crd["spec"]["names"]["kind"] == "VGPUQuota"
    v = crd["spec"]["versions"][0]
    assert "status" in v["subresources"]
    assert [c["name"] for c in v["additionalPrinterColumns"]] == ["Memory", "Cores", "Cards", "Slices", "Age"]
    hard = v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["hard"]["properties"]
    assert set(hard) == {"memory", "cores", "cards", "slices"} and hard["memory"]["minimum"] == 0
    assert "## VGPUQuota" in crdgen.render_docs()


# --------------------------------------------------------------------------- bind and filter


def _quota_state(hard_mib: int) -> Any:
    state = make_state()
    state.quotas.set_quota(Quota("ResourceQuota", "ns", "gpu", (Limit("memory", "limits.nvidia.com/gpumem",
                                                                      hard_mib),)))
    return state


def _two_card_pod(name: str, uid: str) -> dict[str, Any]:
    pod = gpu_pod(name, uid=uid, mem="2048")
    pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 2
    return pod


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    from kvgpu import kube

    f = FakeApi()
    for n in ("get_pod", "create_claim", "get_claim", "delete_claim", "create_binding"):
        monkeypatch.setattr(kube, n, getattr(f, n))
    return f


def test_bind_refuses_the_pod_over_the_quota_and_keeps_nothing(fake: FakeApi) -> None:
    state = _quota_state(4096)
    b = Binder(state, api=None)
    fake.pods["a"] = _two_card_pod("a", "uid-a")
    fake.pods["b"] = _two_card_pod("b", "uid-b")
    assert asyncio.run(b.bind(BindingArgs("a", "ns", "uid-a", "n0"))) == ""
    assert state.quotas.used("ns") == Amounts(4096, 0, 2, 2)
    err = asyncio.run(b.bind(BindingArgs("b", "ns", "uid-b", "n1")))
    assert "ResourceQuota ns/gpu limits.nvidia.com/gpumem: used 4096 + requested 4096 > hard 4096" in err
    assert state.ledger.pod_node("uid-b") is None and not [c for c in fake.claims if c.startswith("b-")]
    state.release_pod("uid-a")  # its claims released: usage returns
    assert state.quotas.used("ns") == Amounts()
    assert asyncio.run(b.bind(BindingArgs("b", "ns", "uid-b", "n1"))) == ""


def test_concurrent_binds_never_pass_the_quota(fake: FakeApi) -> None:
    """50 binds of one namespace gathered on one loop (each awaits the fake API between its
    steps, so they interleave): at most 4096 MiB bound, two pods of 2 x 1024 MiB."""
    state = _quota_state(4096)
    b = Binder(state, api=None)
    args = []
    for i in range(50):
        uid = f"uid-{i:02d}"
        pod = gpu_pod(f"p{i}", uid=uid, mem="1024")
        pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 2
        fake.pods[f"p{i}"] = pod
        args.append(BindingArgs(f"p{i}", "ns", uid, ("n0", "n1", "n2")[i % 3]))

    async def all_binds() -> list[str]:
        return list(await asyncio.gather(*(b.bind(a) for a in args)))

    errors = asyncio.run(all_binds())
    bound = [a for a, e in zip(args, errors, strict=True) if e == ""]
    assert len(bound) == 2, errors
    assert all("GPU quota exceeded: ResourceQuota ns/gpu" in e for e in errors if e)
    mem = sum(d["memory"] for c in fake.claims.values() for d in c["spec"]["devices"])
    assert mem == 4096 == state.quotas.used("ns").memory


def test_filter_refuses_every_node_naming_the_quota(harness: Any) -> None:
    h = harness
    h.state.quotas.set_quota(Quota("VGPUQuota", "ns", "team", (Limit("slices", "spec.hard.slices", 1),)))
    h.state.quotas.set_pod("other", "ns", Amounts(1000, 0, 1, 1))
    pod = gpu_pod("p", uid="uid-p", mem="1000")
    body = json.dumps({"Pod": pod, "NodeNames": ["n0", "n1"]}).encode()
    status, res = h.post("filter", body)
    assert status == 200 and not res.get("Error"), res
    failed = res.get("failedAndUnresolvableNodes") or {}  # kube-scheduler's own preemption cannot help
    assert not res.get("nodenames") and set(failed) == {"n0", "n1"}, res
    assert all("VGPUQuota ns/team spec.hard.slices: used 1 + requested 1 > hard 1 (slices)" in r
               for r in failed.values()), failed
    assert "uid-p" in h.state.pending


# --------------------------------------------------------------------------- the operator's adapter, the plugin


def test_quota_sync_feeds_the_book_and_writes_vgpu_quota_status(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgpu import kube
    from kvgpu.reconcile.quotas import QuotaSync

    state = make_state()
    nudged: list[str] = []
    sync = QuotaSync(state, nudged.append)
    written: list[tuple[str, str, dict[str, Any]]] = []

    async def patch(api: Any, ns: str, name: str, status: dict[str, Any]) -> bool:
        written.append((ns, name, status))
        return True

    monkeypatch.setattr(kube, "patch_vgpuquota_status", patch)
    sync.on_resource_quota("ADDED", rq({"limits.nvidia.com/gpumem": "4096"}))
    assert nudged and state.quotas.quotas("ns")[0].ref == "ResourceQuota ns/gpu"
    sync.on_resource_quota("MODIFIED", rq({"limits.nvidia.com/gpumem": "4096"}))  # KCM's status write
    assert len(nudged) == 1
    vq = {"metadata": {"name": "team", "namespace": "ns", "generation": 2}, "spec": {"hard": {"memory": 8000}}}
    sync.on_vgpu_quota("ADDED", vq)
    state.quotas.set_pod("u", "ns", Amounts(2048, 30, 1, 1))
    asyncio.run(sync.flush(None))
    [(ns, name, st)] = written
    assert (ns, name) == ("ns", "team") and st["used"]["memory"] == 2048 and st["observedGeneration"] == 2
    assert st["hard"] == {"memory": 8000, "cores": None, "cards": None, "slices": None}  # merge patch: null drops
    sync.on_vgpu_quota("MODIFIED", {**vq, "status": api.vgpu_quota_status(state.quotas.quotas("ns")[1],
                                                                          Amounts(2048, 30, 1, 1), 2)})
    asyncio.run(sync.flush(None))
    assert len(written) == 1, "the object shows the status already: no write"
    sync.on_resource_quota("DELETED", rq({}))
    sync.on_vgpu_quota("DELETED", vq)
    assert state.quotas.quotas("ns") == []


def test_kubectl_vgpu_quota_rows_count_live_claims_hami_way() -> None:
    from kvgpu.cli.vgpu.quota import headers, quota_rows

    def claim(name: str, uid: str, mems: list[int], phase: str = "Bound") -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "ns"}, "status": {"phase": phase},
                "spec": {"podUID": uid, "node": "n0", "container": "main", "podName": name,
                         "devices": [{"uuid": f"GPU-{i}", "index": i, "model": "m", "memory": m, "cores": 0}
                                     for i, m in enumerate(mems)]}}

    rows = quota_rows([rq({"limits.nvidia.com/gpumem": "8Gi", "limits.nvidia.com/gpu": "4"}), rq({"pods": "1"}, "x")],
                      [{"metadata": {"name": "team", "namespace": "ns"}, "spec": {"hard": {"cards": 3}}}],
                      [claim("a", "u1", [2048, 2048]), claim("b", "u2", [1000], "Released")])
    assert [(r.quota, r.resource, r.used, r.hard) for r in rows] == [
        ("ResourceQuota/gpu", "limits.nvidia.com/gpu", 2, 4),
        ("ResourceQuota/gpu", "limits.nvidia.com/gpumem", 4096, 8192),
        ("VGPUQuota/team", "spec.hard.cards", 2, 3)]
    assert rows[1].cells(False) == ["ResourceQuota/gpu", "limits.nvidia.com/gpumem", "4Gi", "8Gi"]
    assert headers(True)[0] == "NAMESPACE" and rows[0].cells(True)[0] == "ns"
