"""The pure parts of the silent no-GPU fixes (issue 22, messages): key suggestions, case
variants, unknown keys, HAMi resources written as annotations, requests on a workload's own
metadata, milli memory values and the pools' minimum slice."""

from __future__ import annotations

from typing import Any

import pytest
from kvgpu.admission.config import gpu_pod_expression, gpu_workload_expression
from kvgpu.admission.handlers import VALIDATE_ID, VALIDATE_WORKLOADS_ID, review
from kvgpu.admission.server import response_body
from kvgpu.admission.validate import validate_workload
from kvgpu.admission.warn import pod_warnings, workload_warnings
from kvgpu.api import requests as r
from kvgpu.api.models import DEFAULT_MIN_SLICE_MIB, VGPUPoolSpec
from kvgpu.api.pools import SliceMinimum, slice_minimum
from kvgpu.core import keys


def pod(ann: dict[str, str], limits: dict[str, str] | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"name": "main", "image": "x"}
    if limits:
        c["resources"] = {"limits": limits}
    return {"kind": "Pod", "metadata": {"name": "p", "namespace": "ns", "annotations": ann},
            "spec": {"containers": [c]}}


def errors(p: dict[str, Any]) -> list[str]:
    return [str(e) for e in r.validate_pod(p)]


@pytest.mark.parametrize(("name", "key"), [
    ("gpu-count", r.GPU), ("gpus", r.GPU), ("gpu_num", r.GPU), ("gpu-number", r.GPU), ("num-gpus", r.GPU),
    ("cards", r.GPU), ("gpu.count", r.GPU),
    ("gpu-mem", r.GPUMEM), ("gpumemory", r.GPUMEM), ("gpu-memory", r.GPUMEM), ("memory", r.GPUMEM),
    ("vram", r.GPUMEM), ("vgpu-memory", r.GPUMEM), ("GPU_MEM", r.GPUMEM),
    ("gpu-cores", r.GPUCORES), ("cores", r.GPUCORES), ("gpucroes", r.GPUCORES), ("core-percent", r.GPUCORES),
    ("gpu-memory-percentage", r.GPUMEM_PERCENTAGE), ("mem-percent", r.GPUMEM_PERCENTAGE),
    ("priorty", r.PRIORITY), ("container", r.CONTAINERS), ("model", r.GPU_TYPE),
    ("exclude-type", r.EXCLUDE_GPU_TYPE), ("numa", r.NUMA_BIND), ("scheduler-policy", r.GPU_POLICY),
    ("node-scheduler-policy", r.NODE_POLICY),
    ("foo", None), ("node", None), ("admission-test", None), ("use", None), ("", None),
])
def test_suggest_key(name: str, key: str | None) -> None:
    assert r.suggest_key(name) == key


@pytest.mark.parametrize("key", ["kvgpu.io/GPUMEM", "Kvgpu.io/gpumem", "KVGPU.IO/gpumem", "kvgpu.io/GpuMem"])
def test_case_variants_are_refused_naming_the_key(key: str) -> None:
    assert r.wants_slices(pod({key: "3000"}))
    assert errors(pod({key: "3000"})) == [
        f'{key}: "3000" is not a kvgpu request annotation (annotation keys are case-sensitive); use kvgpu.io/gpumem']


def test_gpu_count_suggests_the_card_key() -> None:
    assert errors(pod({"kvgpu.io/gpu-count": "2"})) == [
        'kvgpu.io/gpu-count: "2" is not a kvgpu request annotation; did you mean kvgpu.io/gpu?']


def test_unknown_keys_warn_and_operator_keys_do_not() -> None:
    operator = {k: "x" for k in (keys.POD_CLAIMS, keys.POD_REQUEUE, keys.POD_NODE, keys.POD_MANAGED_LABEL,
                                 keys.NODE_INVENTORY, keys.NODE_ALLOCATION, keys.NODE_LABEL_GPU,
                                 keys.claim_annotation("main"), keys.devices_annotation("main"))}
    assert r.unknown_annotations({**operator, r.GPUMEM: "3000", "example.com/x": "1"}) == []
    assert r.unknown_annotations({"kvgpu.io/foo": "1", "KVGPU.io/bar": "1", "kvgpu.io/gpumemory": "1"}) == [
        "KVGPU.io/bar", "kvgpu.io/foo"]  # gpumemory is refused with a suggestion instead
    p = pod({"kvgpu.io/foo": "1", r.GPUMEM: "3000"})
    assert errors(p) == []
    (w,) = pod_warnings("CREATE", p)
    assert w.startswith("annotation kvgpu.io/foo is not a kvgpu key and gives the pod no GPU") and len(w) < 256
    assert pod_warnings("UPDATE", p) == [] and pod_warnings("CREATE", p, "status") == []
    d = review(VALIDATE_ID, {"operation": "CREATE", "object": pod({"kvgpu.io/foo": "1"}),
                             "userInfo": {"username": "u"}}, set())
    assert d.allowed and d.warnings == [w]
    assert response_body({"uid": "1"}, True, warnings=d.warnings)["response"]["warnings"] == [w]


@pytest.mark.parametrize(("key", "ours"), [
    ("nvidia.com/gpumem", "kvgpu.io/gpumem"), ("nvidia.com/gpu", "kvgpu.io/gpu"),
    ("nvidia.com/gpucores", "kvgpu.io/gpucores"), ("NVIDIA.com/gpumem-percentage", "kvgpu.io/gpumem-percentage"),
])
def test_hami_resources_as_annotations_are_refused(key: str, ours: str) -> None:
    assert r.wants_slices(pod({key: "30"}))
    assert errors(pod({key: "30"})) == [
        f'{key}: "30" is a container resource, not a pod annotation; set it under the container\'s '
        f'resources.limits ({key.lower()}: "30") or the annotation {ours}']
    # HAMi's real annotations are not containers' resources.
    assert r.misplaced_resource("nvidia.com/use-gputype") is None


def deployment(own: dict[str, str], template: dict[str, str]) -> dict[str, Any]:
    return {"kind": "Deployment", "metadata": {"name": "d", "namespace": "ns", "annotations": own},
            "spec": {"template": {"metadata": {"annotations": template},
                                  "spec": {"containers": [{"name": "main", "image": "x"}]}}}}


def test_requests_on_a_workloads_own_metadata_are_warned() -> None:
    d = deployment({r.GPUMEM: "3000", "kvgpu.io/GPUCORES": "30", "other.io/x": "1"}, {})
    assert validate_workload("CREATE", d, None) == []
    assert workload_warnings("CREATE", d, None) == [
        f"Deployment metadata.annotations {k} does not reach the pods, which get no GPU from it; put it under "
        "spec.template.metadata.annotations" for k in ("kvgpu.io/GPUCORES", r.GPUMEM)]
    assert workload_warnings("CREATE", deployment({r.GPUMEM: "3000"}, {r.GPUMEM: "3000"}), None) == []
    assert workload_warnings("UPDATE", d, d) == []  # said at CREATE already
    cron = {"kind": "CronJob", "metadata": {"annotations": {"nvidia.com/gpu": "1"}},
            "spec": {"jobTemplate": {"spec": {"template": {"spec": {"containers": [{"name": "m"}]}}}}}}
    (w,) = workload_warnings("CREATE", cron, None)
    assert "nvidia.com/gpu " in w and "spec.jobTemplate.spec.template.metadata.annotations" in w
    d = review(VALIDATE_WORKLOADS_ID, {"operation": "CREATE", "object": deployment({r.GPUMEM: "1"}, {}),
                                       "resource": {"group": "apps", "resource": "deployments"}}, set())
    assert d.allowed and len(d.warnings) == 1


def test_match_conditions_see_case_variants_and_workload_metadata() -> None:
    assert "k.lowerAscii().startsWith('kvgpu.io/')" in gpu_pod_expression(update=False)
    assert "object.metadata.annotations.exists(k, k.lowerAscii().startsWith('kvgpu.io/')" in \
        gpu_workload_expression()


MILLI = 'uses the suffix m, a fraction of a unit (m is milli, not MiB: 3000m is 3)'


def test_milli_memory_is_refused_in_both_forms() -> None:
    assert errors(pod({r.GPUMEM: "3000m"})) == [f'kvgpu.io/gpumem: "3000m" {MILLI}; {r.FORM_MEMORY}']
    assert errors(pod({}, {r.HAMI_GPU: "1", r.HAMI_GPUMEM: "3000m"})) == [
        f'nvidia.com/gpumem of container "main": "3000m" {MILLI}; {r.FORM_MEMORY}']
    # What the API server sends for a limit of 3000m: its canonical "3".
    (e,) = r.slice_minimum_errors(pod({}, {r.HAMI_GPU: "1", r.HAMI_GPUMEM: "3"}), 256, "src")
    assert str(e) == ('nvidia.com/gpumem of container "main": "3" is 3 MiB, below the minimum slice of 256 MiB '
                      '(src; a limit written 3000m reaches kvgpu as 3: m is milli, not MiB: 3000m is 3); '
                      'use at least 256 MiB, like 3000 or 3Gi, or 0 for the whole card')


def test_minimum_slice() -> None:
    assert VGPUPoolSpec().min_slice_memory == DEFAULT_MIN_SLICE_MIB == 256
    assert VGPUPoolSpec.model_validate({"minSliceMemory": 0}).min_slice_memory == 0
    with pytest.raises(ValueError):
        VGPUPoolSpec.model_validate({"minSliceMemory": -1})
    assert slice_minimum([]) == SliceMinimum(256, None)
    pools = [{"metadata": {"name": "big"}, "spec": {"minSliceMemory": 1024}},
             {"metadata": {"name": "small"}, "spec": {"minSliceMemory": 64}},
             {"metadata": {"name": "bad"}, "spec": {"minSliceMemory": "x"}}]
    assert slice_minimum(pools) == SliceMinimum(64, "small")
    (e,) = r.slice_minimum_errors(pod({r.GPUMEM: "1"}), 64, SliceMinimum(64, "small").source)
    assert str(e) == ('kvgpu.io/gpumem: "1" is 1 MiB, below the minimum slice of 64 MiB (spec.minSliceMemory of '
                      'VGPUPool "small", the smallest of the pools); use at least 64 MiB, like 3000 or 3Gi, or 0 '
                      'for the whole card')
    for ok in ({r.GPUMEM: "64"}, {r.GPUMEM: "0"}, {r.GPUMEM_PERCENTAGE: "1"}, {r.GPU: "1"}, {r.GPUMEM: "x"}):
        assert r.slice_minimum_errors(pod(ok), 64, "src") == []
    assert r.slice_minimum_errors(pod({r.GPUMEM: "1"}), 0, "src") == []
    d = review(VALIDATE_ID, {"operation": "CREATE", "object": pod({r.GPUMEM: "100"}), "userInfo": {}}, set(),
               SliceMinimum(128, "p"))
    assert not d.allowed and 'below the minimum slice of 128 MiB (spec.minSliceMemory of VGPUPool "p"' in d.message
    d = review(VALIDATE_ID, {"operation": "CREATE", "object": pod({r.GPUMEM: "100"}), "userInfo": {}}, set())
    assert "below the minimum slice of 256 MiB (kvgpu's default" in d.message
