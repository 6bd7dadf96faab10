"""VGPUPool / VGPUClaim models: validation, round trips, printer summaries, status size."""

from __future__ import annotations

import json

import pytest
from kvgpu.api.models import (
    ClaimDevice,
    ClaimPhase,
    Condition,
    ConditionStatus,
    Mode,
    VGPUClaim,
    VGPUClaimSpec,
    VGPUClaimStatus,
    VGPUPool,
    VGPUPoolStatus,
    format_mib,
)
from pydantic import ValidationError

UUID = "GPU-0fc3eda5-e98b-a25b-5b0d-d5c8d3f5a448"


def claim_spec(**kw: object) -> VGPUClaimSpec:
    base: dict[str, object] = {
        "podName": "cuda-slice",
        "podUID": "9b0c-1",
        "container": "cuda",
        "node": "gpu-0",
        "devices": [{"uuid": UUID, "index": 0, "model": "NVIDIA H200", "memory": 3000, "cores": 30}],
    }
    base.update(kw)
    return VGPUClaimSpec.model_validate(base)


def test_pool_defaults_match_spec() -> None:
    p = VGPUPool.model_validate(
        {"apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": "a"}}
    )
    s = p.spec
    assert (s.split_count, s.memory_scaling, s.core_scaling, s.mode) == (10, 1.0, 1.0, Mode.HAMI_CORE)
    assert (s.defaults.gpu, s.defaults.gpumem, s.defaults.gpucores, s.defaults.priority) == (1, 0, 0, 1)
    assert s.defaults.gpumem_percentage is None
    assert (s.scheduling.node_policy.value, s.scheduling.gpu_policy.value) == ("binpack", "spread")
    assert p.name == "a"


def test_pool_round_trip_camel_case() -> None:
    body = {
        "apiVersion": "kvgpu.io/v1alpha1",
        "kind": "VGPUPool",
        "metadata": {"name": "a"},
        "spec": {
            "nodeSelector": {
                "matchLabels": {"a": "b"},
                "matchExpressions": [{"key": "k", "operator": "Exists"}],
            },
            "devices": {"models": ["H200"], "indexes": [0, 1]},
            "splitCount": 4,
            "memoryScaling": 1.5,
            "mode": "exclusive",
            "defaults": {"gpumemPercentage": 25},
            "scheduling": {"gpuPolicy": "binpack"},
        },
    }
    p = VGPUPool.model_validate(body)
    out = p.to_body()
    assert out["spec"]["devices"]["models"] == ["H200"]
    assert out["spec"]["defaults"]["gpumemPercentage"] == 25
    assert out["spec"]["mode"] == "exclusive"
    assert VGPUPool.model_validate(out) == p
    with pytest.raises(ValidationError):
        p.spec.split_count = 3  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(
    "spec",
    [
        {"splitCount": 0},
        {"splitCount": 101},
        {"memoryScaling": 0},
        {"coreScaling": -1},
        {"mode": "mig"},
        {"defaults": {"gpumem": 3000, "gpumemPercentage": 50}},
        {"defaults": {"gpu": 0}},
        {"defaults": {"gpucores": 101}},
        {"defaults": {"priority": 2}},
        {"scheduling": {"nodePolicy": "pack"}},
        {"nodeSelector": {"matchExpressions": [{"key": "k", "operator": "In"}]}},
        {"nodeSelector": {"matchExpressions": [{"key": "k", "operator": "Exists", "values": ["x"]}]}},
        {"devices": {"uuids": ["not-a-uuid"]}},
        {"devices": {"indexes": [64]}},
        {"splitCount": 10, "typo": 1},
    ],
)
def test_pool_spec_invalid(spec: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        VGPUPool.model_validate({"metadata": {"name": "x"}, "spec": spec})


def test_claim_summaries_and_round_trip() -> None:
    spec = claim_spec(
        devices=[
            {"uuid": UUID, "index": 0, "model": "NVIDIA H200", "memory": 3000, "cores": 30},
            {"uuid": UUID[:-1] + "9", "index": 3, "model": "NVIDIA H200", "memory": 3000, "cores": 30},
        ]
    )
    assert (spec.gpu_summary, spec.memory_summary, spec.cores_summary) == ("0,3", "3000Mi", "30%")
    claim = VGPUClaim(
        metadata={"name": "cuda-slice-cuda", "namespace": "ns"},
        spec=spec,
        status=VGPUClaimStatus(phase=ClaimPhase.RESERVED),
    )
    body = claim.to_body()
    assert body["spec"]["podUID"] == "9b0c-1" and body["spec"]["gpuSummary"] == "0,3"
    assert body["status"]["phase"] == "Reserved"
    assert VGPUClaim.model_validate(body) == claim  # computed fields are accepted back


@pytest.mark.parametrize(
    "kw",
    [
        {"devices": []},
        {"devices": [{"uuid": "x", "index": 0, "model": "m", "memory": 1, "cores": 0}]},
        {"devices": [{"uuid": UUID, "index": 0, "model": "m", "memory": 0, "cores": 0}]},
        {"devices": [{"uuid": UUID, "index": 0, "model": "m", "memory": 1, "cores": 101}]},
        {"priority": 2},
        {"container": "Bad_Name"},
        {"podName": ""},
    ],
)
def test_claim_spec_invalid(kw: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        claim_spec(**kw)


def test_claim_device_shape() -> None:
    d = ClaimDevice(uuid=UUID, index=1, model="NVIDIA H200", memory=3000, cores=30)
    assert d.model_dump(by_alias=True) == {
        "uuid": UUID,
        "index": 1,
        "model": "NVIDIA H200",
        "memory": 3000,
        "cores": 30,
    }


def test_pool_status_summaries() -> None:
    s = VGPUPoolStatus(slots_used=3, slots_total=80, memory_used_mib=9000, memory_total_mib=8 * 143771)
    assert s.slots_summary == "3/80"
    assert s.memory_summary == "9000Mi/1.1Ti"
    body = s.model_dump(mode="json", by_alias=True)
    assert body["slotsSummary"] == "3/80" and body["memoryTotalMiB"] == 8 * 143771
    assert VGPUPoolStatus.model_validate(body) == s


@pytest.mark.parametrize(
    ("mib", "text"),
    [
        (0, "0Mi"),
        (3000, "3000Mi"),
        (1024, "1Gi"),
        (10240, "10Gi"),
        (143771, "140Gi"),
        (1 << 20, "1Ti"),
        (-5, "-5Mi"),
    ],
)
def test_format_mib(mib: int, text: str) -> None:
    assert format_mib(mib) == text


def test_pool_status_stays_small_at_5000_nodes_x_8_cards() -> None:
    """Aggregate counts only: the status of a pool covering 40,000 H200s is tiny (etcd limit 1.5 MiB)."""
    cards = 5000 * 8
    conds = [
        Condition(
            type=t,
            status=ConditionStatus.TRUE,
            reason="R" * 64,
            message="m" * 1024,
            last_transition_time="2026-11-30T06:00:00Z",
            observed_generation=9,
        )
        for t in ("Ready", "Conflict")
    ]
    s = VGPUPoolStatus(
        observed_generation=9,
        nodes=5000,
        cards=cards,
        unhealthy_cards=cards,
        slots_used=cards * 10,
        slots_total=cards * 10,
        memory_used_mib=cards * 143771 * 16,
        memory_total_mib=cards * 143771 * 16,
        cores_used=cards * 1600,
        cores_total=cards * 1600,
        claims=cards * 100,
        conditions=conds,
    )
    size = len(json.dumps(s.model_dump(mode="json", by_alias=True)))
    assert size < 4096, size
    # and the schema bounds every list in the status
    schema = VGPUPoolStatus.model_json_schema(by_alias=True)
    assert schema["properties"]["conditions"]["maxItems"] == 16
