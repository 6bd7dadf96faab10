"""The annotation form's nvidia.com/gpu limit: the webhook adds it (so the kubelet calls the device
plugin's Allocate), the parser checks it against the annotations, validation requires it."""

from __future__ import annotations

from typing import Any

import pytest
from kvgpu.admission import mutate as m
from kvgpu.admission.validate import validate_pod
from kvgpu.api.models import RequestDefaults, VGPUPoolSpec
from kvgpu.api.requests import card_resources_to_add, parse_pod

GPU = "nvidia.com/gpu"


def pod(ann: dict[str, str] | None = None, *, containers: list[dict[str, Any]] | None = None,
        init: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    p: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ns", "annotations": dict(ann or {})},
        "spec": {"containers": containers or [{"name": "main", "image": "cuda"}, {"name": "side", "image": "x"}]},
    }
    if init:
        p["spec"]["initContainers"] = init
    return p


def c(name: str, limits: dict[str, Any] | None = None, requests: dict[str, Any] | None = None,
      **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "image": "x", **extra}
    res = {k: v for k, v in (("limits", limits), ("requests", requests)) if v is not None}
    if res:
        out["resources"] = res
    return out


def mutated(p: dict[str, Any]) -> dict[str, Any]:
    return m.apply_ops(p, m.mutate_pod(p))


def create_errors(p: dict[str, Any]) -> list[str]:
    return validate_pod("CREATE", p, None, "alice", {"kvgpu-operator"})


def limits(p: dict[str, Any], name: str) -> dict[str, Any]:
    cs = p["spec"].get("initContainers", []) + p["spec"]["containers"]
    return next(x for x in cs if x["name"] == name).get("resources", {}).get("limits", {})


# --------------------------------------------------------------------------- mutation


def test_annotation_form_gets_the_card_count_as_a_limit() -> None:
    out = mutated(pod({"kvgpu.io/gpumem": "3000", "kvgpu.io/gpucores": "30"}))
    assert limits(out, "main") == {GPU: "1"}
    assert limits(out, "side") == {}  # no slices: no resource
    assert create_errors(out) == []
    assert m.mutate_pod(out) == []  # idempotent


def test_every_named_container_gets_the_cards_init_containers_too() -> None:
    p = pod({"kvgpu.io/gpu": "2", "kvgpu.io/containers": "prep,main,side"}, init=[c("prep")])
    out = mutated(p)
    assert [limits(out, n) for n in ("prep", "main", "side")] == [{GPU: "2"}] * 3
    assert create_errors(out) == [] and m.mutate_pod(out) == []
    req = parse_pod(out)
    assert req is not None and [(x.container, x.cards, x.init) for x in req.containers] == [
        ("prep", 2, True), ("main", 2, False), ("side", 2, False)]


@pytest.mark.parametrize("resources", [
    None, {}, {"limits": {"cpu": "1"}}, {"requests": {"memory": "1Gi"}},
    {"limits": {"cpu": "1"}, "requests": {"cpu": "1"}},
], ids=["none", "empty", "limits", "requests-only", "both"])
def test_the_limit_is_added_to_whatever_resources_exist(resources: Any) -> None:
    main: dict[str, Any] = {"name": "main", "image": "x"}
    if resources is not None:
        main["resources"] = resources
    p = pod({"kvgpu.io/gpu": "3"}, containers=[main])
    out = mutated(p)
    got = out["spec"]["containers"][0]["resources"]
    assert got["limits"][GPU] == "3"
    for part in ("limits", "requests"):  # the user's entries stay
        for k, v in ((resources or {}).get(part) or {}).items():
            assert got[part][k] == v
    assert GPU not in got.get("requests", {})  # the API server defaults it to the limit
    assert m.mutate_pod(out) == [] and create_errors(out) == []


def test_ops_are_valid_json_patch() -> None:
    jsonpatch = pytest.importorskip("jsonpatch")
    for main in (c("main"), c("main", limits={"cpu": "1"}), c("main", requests={"cpu": "1"})):
        p = pod({"kvgpu.io/gpu": "1"}, containers=[main])
        ops = m.mutate_pod(p)
        assert jsonpatch.apply_patch(p, ops) == m.apply_ops(p, ops)


@pytest.mark.parametrize("main", [
    c("main", limits={GPU: "2"}), c("main", limits={GPU: 2}), c("main", requests={GPU: "2"}),
    c("main", limits={GPU: "2"}, requests={GPU: "2"}),
], ids=["limit", "int", "request", "both"])
def test_a_consistent_user_value_is_kept(main: dict[str, Any]) -> None:
    p = pod({"kvgpu.io/gpu": "2", "kvgpu.io/gpumem": "1000"}, containers=[main])
    out = mutated(p)
    assert out["spec"]["containers"][0]["resources"] == main["resources"]
    assert not any("resources" in op["path"] for op in m.mutate_pod(p))
    assert create_errors(out) == []


def test_a_user_limit_gives_the_cards_when_the_annotation_does_not() -> None:
    p = pod({"kvgpu.io/gpumem": "1000"}, containers=[c("main", limits={GPU: "2"})])
    assert card_resources_to_add(p) == {}
    req = parse_pod(p)
    assert req is not None and req.containers[0].cards == 2
    assert create_errors(mutated(p)) == []


def test_hami_form_is_not_touched() -> None:
    p = pod(containers=[c("main", limits={GPU: "1"})], init=[c("prep", limits={"nvidia.com/gpumem": "1000"})])
    assert card_resources_to_add(p) == {}
    out = mutated(p)
    assert limits(out, "main") == {GPU: "1"} and limits(out, "prep") == {"nvidia.com/gpumem": "1000"}


def test_selection_only_pod_reads_the_same_after_mutation() -> None:
    p = pod({"kvgpu.io/gpu-type": "H200"})
    out = mutated(p)
    assert limits(out, "main") == {GPU: "1"}
    assert parse_pod(p) == parse_pod(out)
    assert create_errors(out) == [] and m.mutate_pod(out) == []


def test_parse_is_unchanged_by_the_mutation() -> None:
    for ann in ({"kvgpu.io/gpu": "2", "kvgpu.io/gpumem-percentage": "25"},
                {"kvgpu.io/gpumem": "3Gi", "kvgpu.io/gpucores": "10", "kvgpu.io/priority": "0"},
                {"kvgpu.io/containers": "side"}):
        p = pod(ann)
        assert parse_pod(mutated(p)) == parse_pod(p)


def test_the_mutated_limit_wins_over_a_pool_default() -> None:
    # The webhook knows no pool, so a pod without kvgpu.io/gpu is pinned to HAMi's 1 card.
    pool = VGPUPoolSpec(defaults=RequestDefaults(gpu=2))
    p = pod({"kvgpu.io/gpumem": "1000"})
    assert parse_pod(p, pool).containers[0].cards == 2  # type: ignore[union-attr]
    assert parse_pod(mutated(p), pool).containers[0].cards == 1  # type: ignore[union-attr]


# --------------------------------------------------------------------------- validation


def test_missing_limit_means_the_webhook_did_not_run() -> None:
    p = mutated(pod({"kvgpu.io/gpu": "2"}))
    del p["spec"]["containers"][0]["resources"]
    (msg,) = create_errors(p)
    assert "not prepared by kvgpu's mutating webhook" in msg and f"limit {GPU}: 2 in container 'main'" in msg


@pytest.mark.parametrize(("ann", "containers", "needle"), [
    ({"kvgpu.io/gpu": "2"}, [c("main", limits={GPU: "1"})],
     'nvidia.com/gpu of container "main": "1" disagrees with kvgpu.io/gpu ("2")'),
    ({"kvgpu.io/gpu": "1"}, [c("main", limits={GPU: "0"})],
     'nvidia.com/gpu of container "main": "0" is out of range'),
    ({"kvgpu.io/gpu": "1"}, [c("main", limits={GPU: "x"})],
     'nvidia.com/gpu of container "main": "x" is not a whole number'),
    ({"kvgpu.io/gpumem": "1000", "kvgpu.io/containers": "main,side"},
     [c("main", limits={GPU: "1"}), c("side", limits={GPU: "2"})],
     'nvidia.com/gpu of container "side": "2" disagrees with the nvidia.com/gpu limit of container "main"'),
    ({"kvgpu.io/gpu": "1"}, [c("main"), c("side", limits={GPU: "1"})],
     'nvidia.com/gpu of container "side": "1" is set on a container that gets no slices'),
    ({"kvgpu.io/gpu": "1"}, [c("main", limits={GPU: "1", "nvidia.com/gpucores": "30"})],
     "kvgpu.io/gpu: \"1\" cannot be combined with nvidia.com/* container limits (set on main)"),
], ids=["disagrees", "zero", "not-a-number", "two-counts", "other-container", "hami-amounts"])
def test_conflicting_user_limits_are_refused_naming_the_key(
    ann: dict[str, str], containers: list[dict[str, Any]], needle: str,
) -> None:
    p = pod(ann, containers=containers)
    assert m.mutate_pod(p) == []  # a request with errors gets no ops
    errors = create_errors(p)
    assert any(needle in e for e in errors), errors


def test_zero_on_a_container_without_slices_is_fine() -> None:
    p = pod({"kvgpu.io/gpu": "1"}, containers=[c("main"), c("side", limits={GPU: "0"})])
    out = mutated(p)
    assert limits(out, "main") == {GPU: "1"} and limits(out, "side") == {GPU: "0"}
    assert create_errors(out) == []


# --------------------------------------------------------------------------- one mount per target


@pytest.mark.parametrize("p", [
    pod({"kvgpu.io/gpu": "1", "kvgpu.io/containers": "main,side"}),
    pod(containers=[c("main", limits={GPU: "1"})], init=[c("prep", limits={"nvidia.com/gpumem": "1000"})]),
], ids=["annotations", "hami"])
def test_each_injected_target_is_mounted_once(p: dict[str, Any]) -> None:
    assert len({x["mountPath"] for x in m.injected_mounts("main")}) == len(m.injected_mounts("main"))
    out = mutated(mutated(p))
    for x in out["spec"].get("initContainers", []) + out["spec"]["containers"]:
        paths = [v["mountPath"] for v in x.get("volumeMounts", [])]
        assert len(paths) == len(set(paths)), (x["name"], paths)
    names = [v["name"] for v in out["spec"]["volumes"]]
    assert len(names) == len(set(names))
