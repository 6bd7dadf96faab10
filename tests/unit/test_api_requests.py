"""Request parsing: every key valid and invalid, defaults, HAMi form, workloads, and a property test."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvgpu.api.models import RequestDefaults, SchedulingPolicy, VGPUPoolSpec
from kvgpu.api.requests import (
    RequestError,
    RequestErrors,
    parse_memory_mib,
    parse_pod,
    pod_template,
    requests_slices,
    validate_pod,
    wants_slices,
)
from kvgpu.core.requests import ContainerRequest, Policy

IMG = "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"


def pod(
    ann: dict[str, Any] | None = None,
    limits: dict[str, Any] | None = None,
    *,
    containers: tuple[str, ...] = ("cuda",),
    inits: tuple[str, ...] = (),
    requests: dict[str, Any] | None = None,
) -> dict[str, Any]:
    cs: list[dict[str, Any]] = [{"name": n, "image": IMG} for n in containers]
    res: dict[str, Any] = {}
    if limits is not None:
        res["limits"] = limits
    if requests is not None:
        res["requests"] = requests
    if res:
        cs[0]["resources"] = res
    spec: dict[str, Any] = {"containers": cs}
    if inits:
        spec["initContainers"] = [{"name": n, "image": IMG} for n in inits]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "annotations": ann or {}},
        "spec": spec,
    }


def one(req: Any) -> ContainerRequest:
    assert req is not None and len(req.containers) == 1
    return req.containers[0]


def errors(p: dict[str, Any]) -> list[str]:
    return [str(e) for e in validate_pod(p)]


# --------------------------------------------------------------------------- valid values, per key

VALID_ANNOTATIONS: list[tuple[dict[str, str], dict[str, Any]]] = [
    # key/value → expected ContainerRequest fields
    ({"kvgpu.io/gpu": "1"}, {"cards": 1, "memory_mib": 0, "cores": 100}),  # whole card → exclusive
    ({"kvgpu.io/gpu": "4"}, {"cards": 4}),
    ({"kvgpu.io/gpu": " 2 "}, {"cards": 2}),
    ({"kvgpu.io/gpumem": "3000"}, {"cards": 1, "memory_mib": 3000, "cores": 0}),
    ({"kvgpu.io/gpumem": "3Gi"}, {"memory_mib": 3072}),
    ({"kvgpu.io/gpumem": "3000Mi"}, {"memory_mib": 3000}),
    ({"kvgpu.io/gpumem": "1.5Gi"}, {"memory_mib": 1536}),
    ({"kvgpu.io/gpumem": "3k"}, {"memory_mib": 3000}),
    ({"kvgpu.io/gpumem": "1048576"}, {"memory_mib": 1 << 20}),
    ({"kvgpu.io/gpumem": "0"}, {"memory_mib": 0, "cores": 100}),
    ({"kvgpu.io/gpumem-percentage": "50"}, {"memory_mib": 0, "memory_percent": 50, "cores": 0}),
    ({"kvgpu.io/gpumem-percentage": "100"}, {"memory_mib": 0, "memory_percent": None, "cores": 100}),
    ({"kvgpu.io/gpucores": "30"}, {"cores": 30, "memory_mib": 0}),
    ({"kvgpu.io/gpucores": "0"}, {"cores": 0}),
    ({"kvgpu.io/gpucores": "100"}, {"cores": 100}),
    ({"kvgpu.io/priority": "0"}, {"priority": 0}),
    ({"kvgpu.io/priority": "1"}, {"priority": 1}),
    ({"kvgpu.io/gpu-type": "A100, H200"}, {"types": ("A100", "H200")}),
    ({"kvgpu.io/gpu-type": ""}, {"types": ()}),
    ({"kvgpu.io/exclude-gpu-type": "T4"}, {"exclude_types": ("T4",)}),
    ({"kvgpu.io/gpu-uuid": "GPU-abc-1,GPU-abc-2"}, {"uuids": ("GPU-abc-1", "GPU-abc-2")}),
    ({"kvgpu.io/exclude-gpu-uuid": "GPU-x"}, {"exclude_uuids": ("GPU-x",)}),
    ({"kvgpu.io/numa-bind": "true"}, {"numa_bind": True}),
    ({"kvgpu.io/numa-bind": "false"}, {"numa_bind": False}),
    ({"nvidia.com/use-gputype": "A100", "kvgpu.io/gpu": "1"}, {"types": ("A100",)}),
    ({"nvidia.com/nouse-gputype": "1080", "kvgpu.io/gpu": "1"}, {"exclude_types": ("1080",)}),
    ({"nvidia.com/use-gpuuuid": "GPU-a", "kvgpu.io/gpu": "1"}, {"uuids": ("GPU-a",)}),
    ({"nvidia.com/nouse-gpuuuid": "GPU-a", "kvgpu.io/gpu": "1"}, {"exclude_uuids": ("GPU-a",)}),
    ({"nvidia.com/numa-bind": "1", "kvgpu.io/gpu": "1"}, {"numa_bind": True}),
    ({"kvgpu.io/gpu-type": "A100", "nvidia.com/use-gputype": "A100"}, {"types": ("A100",)}),
]


@pytest.mark.parametrize(
    ("ann", "want"), VALID_ANNOTATIONS, ids=lambda x: str(x) if isinstance(x, dict) else ""
)
def test_valid_annotation(ann: dict[str, str], want: dict[str, Any]) -> None:
    c = one(parse_pod(pod(ann)))
    for field, value in want.items():
        assert getattr(c, field) == value, field
    assert c.container == "cuda" and not c.init


@pytest.mark.parametrize(
    ("ann", "node", "gpu"),
    [
        ({"kvgpu.io/node-policy": "spread"}, Policy.SPREAD, Policy.SPREAD),
        ({"kvgpu.io/gpu-policy": "binpack"}, Policy.BINPACK, Policy.BINPACK),
        ({"kvgpu.io/gpu-policy": "Binpack"}, Policy.BINPACK, Policy.BINPACK),
        ({"hami.io/node-scheduler-policy": "spread", "kvgpu.io/gpu": "1"}, Policy.SPREAD, Policy.SPREAD),
        ({"hami.io/gpu-scheduler-policy": "binpack", "kvgpu.io/gpu": "1"}, Policy.BINPACK, Policy.BINPACK),
        ({"kvgpu.io/gpu": "1"}, Policy.BINPACK, Policy.SPREAD),
    ],
)
def test_policies(ann: dict[str, str], node: Policy, gpu: Policy) -> None:
    req = parse_pod(pod(ann))
    assert req is not None
    assert (req.node_policy, req.gpu_policy) == (node, gpu)


# --------------------------------------------------------------------------- invalid values, per key

MEM = "use MiB like 3000 or a quantity like 3Gi"
CARDS = "use a whole number of cards from 1 to 64"
CORES = "use a whole number from 0 to 100 (percent of the card's SMs; 100 = an exclusive card)"
PCT = "use a whole number from 1 to 100 (percent of the card's memory)"

INVALID_ANNOTATIONS: list[tuple[dict[str, str], str]] = [
    ({"kvgpu.io/gpumem": "3Gx"}, f'kvgpu.io/gpumem: "3Gx" is not a memory quantity; {MEM}'),
    ({"kvgpu.io/gpumem": ""}, f'kvgpu.io/gpumem: "" is not a memory quantity; {MEM}'),
    ({"kvgpu.io/gpumem": "Infinity"}, f'kvgpu.io/gpumem: "Infinity" is not a memory quantity; {MEM}'),
    ({"kvgpu.io/gpumem": "-5"}, f'kvgpu.io/gpumem: "-5" is negative; {MEM}'),
    # Only Kubernetes' ASCII quantity grammar (found by a new-user test: Python's number parsing
    # took full-width digits and underscores), and no sub-unit suffixes. Surrounding
    # whitespace is stripped for every key, on purpose.
    ({"kvgpu.io/gpumem": "３０００"}, f'kvgpu.io/gpumem: "３０００" is not a memory quantity; {MEM}'),
    ({"kvgpu.io/gpumem": "3_000"}, f'kvgpu.io/gpumem: "3_000" is not a memory quantity; {MEM}'),
    ({"kvgpu.io/gpumem": "3000m"},
     f'kvgpu.io/gpumem: "3000m" uses the suffix m, a fraction of a unit (m is milli, not MiB: 3000m is 3); '
     f'{MEM}'),
    ({"kvgpu.io/gpumem": "2500Ki"}, f'kvgpu.io/gpumem: "2500Ki" is not a whole number of MiB; {MEM}'),
    ({"kvgpu.io/gpumem": "0.5"}, f'kvgpu.io/gpumem: "0.5" is not a whole number of MiB; {MEM}'),
    (
        {"kvgpu.io/gpumem": "2Ti"},
        f'kvgpu.io/gpumem: "2Ti" is more than 1048576 MiB (1 TiB) per card, counted in bytes; {MEM}',
    ),
    ({"kvgpu.io/gpu": "0"}, f'kvgpu.io/gpu: "0" is out of range; {CARDS}'),
    ({"kvgpu.io/gpu": "65"}, f'kvgpu.io/gpu: "65" is out of range; {CARDS}'),
    ({"kvgpu.io/gpu": "two"}, f'kvgpu.io/gpu: "two" is not a whole number; {CARDS}'),
    ({"kvgpu.io/gpu": "1.5"}, f'kvgpu.io/gpu: "1.5" is not a whole number; {CARDS}'),
    ({"kvgpu.io/gpu": "-1"}, f'kvgpu.io/gpu: "-1" is not a whole number; {CARDS}'),
    ({"kvgpu.io/gpumem-percentage": "0"}, f'kvgpu.io/gpumem-percentage: "0" is out of range; {PCT}'),
    ({"kvgpu.io/gpumem-percentage": "120"}, f'kvgpu.io/gpumem-percentage: "120" is out of range; {PCT}'),
    (
        {"kvgpu.io/gpumem-percentage": "50%"},
        f'kvgpu.io/gpumem-percentage: "50%" is not a whole number; {PCT}',
    ),
    ({"kvgpu.io/gpucores": "101"}, f'kvgpu.io/gpucores: "101" is out of range; {CORES}'),
    ({"kvgpu.io/gpucores": "30%"}, f'kvgpu.io/gpucores: "30%" is not a whole number; {CORES}'),
    ({"kvgpu.io/priority": "2"}, 'kvgpu.io/priority: "2" is out of range; use 0 (high) or 1 (low)'),
    (
        {"kvgpu.io/priority": "high"},
        'kvgpu.io/priority: "high" is not a whole number; use 0 (high) or 1 (low)',
    ),
    ({"kvgpu.io/numa-bind": "yes"}, 'kvgpu.io/numa-bind: "yes" is not a boolean; use true or false'),
    (
        {"kvgpu.io/node-policy": "pack"},
        'kvgpu.io/node-policy: "pack" is not a policy kvgpu knows; use binpack or spread',
    ),
    (
        {"kvgpu.io/gpu-policy": "topology-aware"},
        'kvgpu.io/gpu-policy: "topology-aware" is not a policy kvgpu knows; use binpack or spread',
    ),
    (
        {"kvgpu.io/gpu-uuid": "GPU-a,0"},
        'kvgpu.io/gpu-uuid: "GPU-a,0" has "0", which is not a card UUID; '
        "use a comma list of card UUIDs like GPU-8f6c2a4e-...",
    ),
    (
        {"kvgpu.io/containers": "cuda,nope"},
        'kvgpu.io/containers: "cuda,nope" names "nope", which is not a container of the pod; '
        "use a comma list of the pod's container names: cuda",
    ),
    (
        {"kvgpu.io/containers": " , "},
        'kvgpu.io/containers: " , " names no container; use a comma list of the pod\'s container names: cuda',
    ),
    (
        {"kvgpu.io/gpumem": "3000", "kvgpu.io/gpumem-percentage": "10"},
        'kvgpu.io/gpumem-percentage: "10" cannot be used together with kvgpu.io/gpumem; '
        "set memory one way: MiB/quantity or percent",
    ),
    (
        {"kvgpu.io/gpumemory": "3000"},
        'kvgpu.io/gpumemory: "3000" is not a kvgpu request annotation; did you mean kvgpu.io/gpumem?',
    ),
    (
        {"kvgpu.io/gpu-type": "A100", "nvidia.com/use-gputype": "H100"},
        'nvidia.com/use-gputype: "H100" disagrees with kvgpu.io/gpu-type ("A100"); '
        "set one of them, or both to the same value",
    ),
    (
        {"kvgpu.io/gpu": "1", "hami.io/gpu-scheduler-policy": "binpack,numa"},
        'hami.io/gpu-scheduler-policy: "binpack,numa" is not a policy kvgpu knows; use binpack or spread',
    ),
    (
        {"kvgpu.io/gpu": "1", "nvidia.com/vgpu-mode": "mig"},
        'nvidia.com/vgpu-mode: "mig" is not supported; '
        "use hami-core, or choose the mode with the VGPUPool that covers the cards",
    ),
    (
        {"kvgpu.io/gpu": "1", "hami.io/device-scoring-weights": "slot=1"},
        'hami.io/device-scoring-weights: "slot=1" is not supported by kvgpu; '
        "remove it and use kvgpu.io/node-policy / kvgpu.io/gpu-policy",
    ),
]


@pytest.mark.parametrize(("ann", "message"), INVALID_ANNOTATIONS, ids=lambda x: str(x)[:60])
def test_invalid_annotation(ann: dict[str, str], message: str) -> None:
    assert errors(pod(ann)) == [message]
    with pytest.raises(RequestError) as exc:
        parse_pod(pod(ann))
    assert str(exc.value) == message


def test_all_errors_are_collected() -> None:
    p = pod(
        {"kvgpu.io/gpu": "0", "kvgpu.io/gpumem": "3Gx", "kvgpu.io/gpucores": "200", "kvgpu.io/numa-bind": "x"}
    )
    errs = validate_pod(p)
    assert sorted(e.key for e in errs) == [
        "kvgpu.io/gpu",
        "kvgpu.io/gpucores",
        "kvgpu.io/gpumem",
        "kvgpu.io/numa-bind",
    ]
    with pytest.raises(RequestErrors) as exc:
        parse_pod(p)
    assert len(exc.value.errors) == 4
    assert str(exc.value).count("\n") == 3
    assert all(isinstance(e, RequestError) for e in exc.value.errors)
    e0 = exc.value.errors[0]
    assert e0.key and e0.allowed and e0.problem


def test_message_truncates_long_values() -> None:
    (msg,) = errors(pod({"kvgpu.io/gpumem": "x" * 500}))
    assert len(msg) < 200 and "…" in msg


# --------------------------------------------------------------------------- HAMi resource form

VALID_HAMI: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"nvidia.com/gpu": 1}, {"cards": 1, "memory_mib": 0, "cores": 100}),  # HAMi: whole card, exclusive
    ({"nvidia.com/gpu": "2", "nvidia.com/gpumem": "3000"}, {"cards": 2, "memory_mib": 3000, "cores": 0}),
    (
        {"nvidia.com/gpu": 1, "nvidia.com/gpumem": "3k"},
        {"memory_mib": 3000},
    ),  # the API server prints 3000 as 3k
    (
        {"nvidia.com/gpu": 1, "nvidia.com/gpumem": "3Gi"},
        {"memory_mib": 3072},
    ),  # HAMi drops this; we understand it
    ({"nvidia.com/gpu": 1, "nvidia.com/gpucores": 30}, {"memory_mib": 0, "cores": 30}),
    ({"nvidia.com/gpumem": 3000}, {"cards": 1, "memory_mib": 3000, "cores": 0}),  # gpu defaulted
    ({"nvidia.com/gpumem-percentage": 50}, {"cards": 1, "memory_percent": 50, "cores": 0}),
    (
        {"nvidia.com/gpu": 2, "nvidia.com/gpumem-percentage": 100},
        {"cards": 2, "memory_percent": None, "cores": 100},
    ),
    (
        {"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 0},
        {"memory_percent": None, "cores": 100},
    ),  # 0 = unset
    ({"nvidia.com/gpu": 1, "nvidia.com/priority": 0}, {"priority": 0}),
]


@pytest.mark.parametrize(("limits", "want"), VALID_HAMI, ids=lambda x: str(x) if isinstance(x, dict) else "")
def test_valid_hami(limits: dict[str, Any], want: dict[str, Any]) -> None:
    c = one(parse_pod(pod(limits=limits)))
    for field, value in want.items():
        assert getattr(c, field) == value, field


def test_hami_requests_used_when_no_limits() -> None:
    c = one(parse_pod(pod(requests={"nvidia.com/gpu": "1", "nvidia.com/gpumem": "2000"})))
    assert c.memory_mib == 2000


def test_hami_limits_win_over_requests() -> None:
    c = one(parse_pod(pod(limits={"nvidia.com/gpumem": "2000"}, requests={"nvidia.com/gpumem": "1000"})))
    assert c.memory_mib == 2000


H = 'of container "cuda"'
INVALID_HAMI: list[tuple[dict[str, Any], str]] = [
    (
        {"nvidia.com/gpu": 1, "nvidia.com/gpumem": "3Gx"},
        f'nvidia.com/gpumem {H}: "3Gx" is not a memory quantity; {MEM}',
    ),
    (
        {"nvidia.com/gpu": 1, "nvidia.com/gpumem": "3G"},
        f'nvidia.com/gpumem {H}: "3G" is more than 1048576 MiB (1 TiB) per card, counted in MiB '
        f"(plain and decimal-suffixed numbers count MiB); {MEM}",
    ),
    (
        {"nvidia.com/gpu": 1, "nvidia.com/gpucores": 150},
        f'nvidia.com/gpucores {H}: "150" is out of range; {CORES}',
    ),
    (
        {"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 120},
        f'nvidia.com/gpumem-percentage {H}: "120" is out of range; '
        "use a whole number from 0 to 100 (percent of the card's memory; 0 = unset)",
    ),
    ({"nvidia.com/gpu": "1.5"}, f'nvidia.com/gpu {H}: "1.5" is not a whole number; {CARDS}'),
    ({"nvidia.com/gpu": "100"}, f'nvidia.com/gpu {H}: "100" is out of range; {CARDS}'),
    (
        {"nvidia.com/gpu": 1, "nvidia.com/priority": 5},
        f'nvidia.com/priority {H}: "5" is out of range; use 0 (high) or 1 (low)',
    ),
    (
        {"nvidia.com/gpu": 0, "nvidia.com/gpumem": 3000},
        f'nvidia.com/gpu {H}: "0" asks for no card but nvidia.com/gpumem is set; {CARDS}',
    ),
    (
        {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000, "nvidia.com/gpumem-percentage": 10},
        f'nvidia.com/gpumem-percentage {H}: "10" cannot be used together with nvidia.com/gpumem; '
        "set memory one way: MiB/quantity or percent",
    ),
    (
        {"nvidia.com/priority": 0},
        f'nvidia.com/priority {H}: "0" has no effect without a GPU request; '
        "add nvidia.com/gpu (or gpumem/gpucores), or remove it",
    ),
]


@pytest.mark.parametrize(("limits", "message"), INVALID_HAMI, ids=lambda x: str(x)[:60])
def test_invalid_hami(limits: dict[str, Any], message: str) -> None:
    assert errors(pod(limits=limits)) == [message]


def test_hami_gpu_zero_alone_is_no_request() -> None:
    p = pod(limits={"nvidia.com/gpu": "0"})
    assert not wants_slices(p)
    assert parse_pod(p) is None


def test_mixing_forms_is_refused() -> None:
    (msg,) = errors(pod({"kvgpu.io/gpucores": "30"}, {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000}))
    assert msg.startswith('kvgpu.io/gpucores: "30" cannot be combined with nvidia.com/* container limits')


def test_annotation_form_with_the_card_limit_is_not_mixing() -> None:
    # The mutating webhook adds nvidia.com/gpu (the card count) to annotation-form containers.
    c = one(parse_pod(pod({"kvgpu.io/gpucores": "30"}, {"nvidia.com/gpu": 1})))
    assert (c.cards, c.cores) == (1, 30)
    (msg,) = errors(pod({"kvgpu.io/gpu": "2"}, {"nvidia.com/gpu": 1}))
    assert msg.startswith('nvidia.com/gpu of container "cuda": "1" disagrees with kvgpu.io/gpu ("2")')


def test_hami_form_takes_kvgpu_selection_annotations() -> None:
    c = one(parse_pod(pod({"kvgpu.io/gpu-type": "H200"}, {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000})))
    assert c.types == ("H200",) and c.memory_mib == 1000


def test_hami_several_containers_and_init() -> None:
    p = pod(containers=("a", "b"), inits=("prep",))
    p["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpumem": "1000"}}
    p["spec"]["containers"][1]["resources"] = {
        "limits": {"nvidia.com/gpumem": "2000", "nvidia.com/gpucores": 20}
    }
    p["spec"]["initContainers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    req = parse_pod(p)
    assert req is not None
    assert [(c.container, c.init, c.memory_mib, c.cores) for c in req.containers] == [
        ("prep", True, 0, 100),
        ("a", False, 1000, 0),
        ("b", False, 2000, 20),
    ]


def test_sidecar_counts_as_app_container() -> None:
    p = pod({"kvgpu.io/containers": "side"}, inits=("side",))
    p["spec"]["initContainers"][0]["restartPolicy"] = "Always"
    assert one(parse_pod(p)).init is False


# --------------------------------------------------------------------------- containers, defaults, shapes


def test_default_target_is_first_app_container() -> None:
    req = parse_pod(pod({"kvgpu.io/gpumem": "1000"}, containers=("main", "side"), inits=("prep",)))
    assert [c.container for c in req.containers] == ["main"]  # type: ignore[union-attr]


def test_containers_annotation_order_follows_pod() -> None:
    p = pod(
        {"kvgpu.io/containers": "side,prep", "kvgpu.io/gpumem": "1000"},
        containers=("main", "side"),
        inits=("prep",),
    )
    req = parse_pod(p)
    assert [(c.container, c.init) for c in req.containers] == [("prep", True), ("side", False)]  # type: ignore[union-attr]


def test_pool_defaults_apply() -> None:
    pool = VGPUPoolSpec(
        defaults=RequestDefaults(gpu=2, gpumem_percentage=25, gpucores=10, priority=0),
        scheduling=SchedulingPolicy(node_policy="spread", gpu_policy="binpack"),  # type: ignore[arg-type]
    )
    req = parse_pod(pod({"kvgpu.io/gpu-type": "H200"}), pool)
    assert req is not None
    c = one(req)
    assert (c.cards, c.memory_mib, c.memory_percent, c.cores, c.priority) == (2, 0, 25, 10, 0)
    assert (req.node_policy, req.gpu_policy) == (Policy.SPREAD, Policy.BINPACK)
    # the pod's own values win
    c = one(parse_pod(pod({"kvgpu.io/gpumem": "1000", "kvgpu.io/gpucores": "5"}), pool))
    assert (c.memory_mib, c.memory_percent, c.cores) == (1000, None, 5)


def test_pool_default_cores_beat_exclusive_rule() -> None:
    pool = VGPUPoolSpec(defaults=RequestDefaults(gpucores=40))
    assert one(parse_pod(pod({"kvgpu.io/gpu": "1"}), pool)).cores == 40
    pool = VGPUPoolSpec(defaults=RequestDefaults(gpumem=5000))
    assert one(parse_pod(pod({"kvgpu.io/gpu": "1"}), pool)).cores == 0  # memory not whole: no exclusivity


def test_no_request() -> None:
    p = pod({"nvidia.com/use-gputype": "A100", "other/x": "1"}, {"cpu": "1", "memory": "1Gi"})
    assert not wants_slices(p) and parse_pod(p) is None and validate_pod(p) == []
    assert requests_slices is wants_slices


def test_operator_annotations_are_not_requests() -> None:
    operator_owned = {
        "kvgpu.io/bound-node": "n1",
        "kvgpu.io/claims": "c",
        "kvgpu.io/claim.cuda": "v1;...",
        "kvgpu.io/requeue": "2026-11-30T06:00:00Z",
        "kvgpu.io/last-handled-configuration": "{}",  # Kopf's diff-base (prefix kvgpu.io)
        "kvgpu.io/on_pod": "{}",  # Kopf's progress storage
    }
    p = pod(operator_owned)
    assert not wants_slices(p) and parse_pod(p) is None
    c = one(parse_pod(pod({**operator_owned, "kvgpu.io/gpumem": "1000"})))
    assert c.memory_mib == 1000


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [
        ("kvgpu.io/gpumemory", "kvgpu.io/gpumem"),
        ("kvgpu.io/cores", "kvgpu.io/gpucores"),
        ("kvgpu.io/container", "kvgpu.io/containers"),
        ("kvgpu.io/priorty", "kvgpu.io/priority"),
    ],
)
def test_misspelt_keys_are_refused_with_a_suggestion(key: str, suggestion: str) -> None:
    p = pod({key: "1"})
    assert wants_slices(p)
    assert errors(p) == [f'{key}: "1" is not a kvgpu request annotation; did you mean {suggestion}?']


def test_identity_fields() -> None:
    req = parse_pod(pod({"kvgpu.io/gpu": "1"}))
    assert req is not None and (req.namespace, req.name, req.uid, req.key) == ("ns", "p", "u-1", "ns/p")
    p = pod({"kvgpu.io/gpu": "1"})
    p["metadata"] = {"generateName": "job-", "annotations": {"kvgpu.io/gpu": "1"}}
    assert parse_pod(p).name == "job-"  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", ["Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"])
def test_workload_templates(kind: str) -> None:
    inner = pod({"kvgpu.io/gpumem": "2Gi"})
    obj = {
        "kind": kind,
        "metadata": {"name": "w", "namespace": "ns"},
        "spec": {
            "template": {"metadata": {"annotations": inner["metadata"]["annotations"]}, "spec": inner["spec"]}
        },
    }
    assert wants_slices(obj)
    req = parse_pod(obj)
    assert req is not None and req.name == "w" and one(req).memory_mib == 2048


def test_cronjob_template() -> None:
    inner = pod({"kvgpu.io/gpucores": "20"})
    obj = {
        "kind": "CronJob",
        "metadata": {"name": "c"},
        "spec": {
            "jobTemplate": {"spec": {"template": {"metadata": inner["metadata"], "spec": inner["spec"]}}}
        },
    }
    assert one(parse_pod(obj)).cores == 20


def test_malformed_pods() -> None:
    assert not wants_slices({"kind": "Service"})
    with pytest.raises(RequestError):
        pod_template({"kind": "Service"})
    with pytest.raises(RequestErrors, match="spec") as exc:
        parse_pod({"kind": "Pod", "metadata": {}})
    assert len(exc.value.errors) == 1
    p = pod({"kvgpu.io/gpu": "1"})
    p["spec"]["containers"] = []
    assert errors(p) == ['spec.containers: "[]" is empty; give the pod at least one container']


def test_parse_memory_mib_direct() -> None:
    assert parse_memory_mib("k", 3000) == 3000
    assert parse_memory_mib("k", "1Mi") == 1
    with pytest.raises(RequestError, match="not a memory quantity"):
        parse_memory_mib("k", None)
    with pytest.raises(RequestError, match="not a memory quantity"):
        parse_memory_mib("k", True)


# --------------------------------------------------------------------------- property tests

_KEYS = st.sampled_from(
    [
        "kvgpu.io/gpu",
        "kvgpu.io/gpumem",
        "kvgpu.io/gpumem-percentage",
        "kvgpu.io/gpucores",
        "kvgpu.io/priority",
        "kvgpu.io/containers",
        "kvgpu.io/gpu-type",
        "kvgpu.io/gpu-uuid",
        "kvgpu.io/numa-bind",
        "kvgpu.io/node-policy",
        "kvgpu.io/gpu-policy",
        "kvgpu.io/whatever",
        "nvidia.com/use-gputype",
        "nvidia.com/use-gpuuuid",
        "nvidia.com/numa-bind",
        "nvidia.com/vgpu-mode",
        "hami.io/gpu-scheduler-policy",
        "hami.io/node-scheduler-policy",
        "app",
        "kvgpu.io/claims",
    ]
) | st.text(max_size=30)
_VALUES = st.one_of(
    st.text(max_size=20),
    st.sampled_from(
        [
            "1",
            "0",
            "100",
            "3Gi",
            "3000",
            "3k",
            "1e3",
            "Infinity",
            "NaN",
            "-0",
            "1.5",
            "cuda",
            "GPU-a",
            "binpack",
            "true",
            "0x10",
            "1E",
            "9" * 40,
            "1e999999",
            " ",
            ",",
        ]
    ),
    st.integers(-(10**20), 10**20),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True),
    st.lists(st.text(max_size=3), max_size=2),
)
_RESOURCE_KEYS = st.sampled_from(
    [
        "nvidia.com/gpu",
        "nvidia.com/gpumem",
        "nvidia.com/gpumem-percentage",
        "nvidia.com/gpucores",
        "nvidia.com/priority",
        "cpu",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_KEYS, _VALUES, max_size=6), st.dictionaries(_RESOURCE_KEYS, _VALUES, max_size=4))
def test_arbitrary_input_parses_or_raises_request_error(ann: dict[str, Any], limits: dict[str, Any]) -> None:
    p = pod(ann, limits)
    try:
        req = parse_pod(p)
    except RequestError as e:
        assert str(e)
        assert validate_pod(p)
        return
    assert validate_pod(p) == []
    if req is None:
        assert not wants_slices(p)
        return
    assert wants_slices(p)
    for c in req.containers:
        assert 1 <= c.cards <= 64
        assert 0 <= c.memory_mib <= 1 << 20
        assert c.memory_percent is None or 1 <= c.memory_percent <= 99
        assert 0 <= c.cores <= 100 and c.priority in (0, 1)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 1 << 20))
def test_memory_round_trip(mib: int) -> None:
    assert parse_memory_mib("k", str(mib)) == mib
    assert parse_memory_mib("k", f"{mib}Mi") == mib
    assert parse_memory_mib("k", f"{mib * 1024}Ki") == mib
    if mib % 1024 == 0:
        assert parse_memory_mib("k", f"{mib // 1024}Gi") == mib


@settings(max_examples=100, deadline=None)
@given(
    st.recursive(
        st.none() | st.integers() | st.text(max_size=5),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
        max_leaves=12,
    )
)
def test_arbitrary_objects_never_crash(obj: Any) -> None:
    for candidate in (obj, {"kind": "Pod", "metadata": {"annotations": {"kvgpu.io/gpu": "1"}}, "spec": obj}):
        try:
            parse_pod(candidate)
        except RequestError:
            pass
        wants_slices(candidate)
