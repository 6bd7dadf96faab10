"""The pod policy's objects (:mod:`kvgpu.admission.podpolicy`) and the admission marker the
mutating webhook sets (:func:`kvgpu.admission.mutate.admitted_ops`). What the CEL decides is
tested against the real API server in tests/cluster/test_admission_policy.py."""

from __future__ import annotations

from typing import Any

import pytest
from kvgpu.admission import mutate as m
from kvgpu.admission.config import gpu_pod_expression
from kvgpu.admission.handlers import MUTATE_ID, review
from kvgpu.admission.podpolicy import POD_POLICY_NAME, pod_policy, q
from kvgpu.core import keys

OPS = frozenset({"kvgpu-operator"})


def _pod(annotations: dict[str, str] | None = None, limits: dict[str, str] | None = None) -> dict[str, Any]:
    main: dict[str, Any] = {"name": "main", "image": "cuda"}
    if limits:
        main["resources"] = {"limits": limits}
    return {"metadata": {"name": "p", "namespace": "ns", "annotations": annotations or {}},
            "spec": {"containers": [main, {"name": "side", "image": "busybox"}]}}


def _mutated(pod: dict[str, Any]) -> dict[str, Any]:
    d = review(MUTATE_ID, {"operation": "CREATE", "object": pod, "userInfo": {"username": "alice"}}, OPS)
    assert d.allowed, d.message
    return m.apply_ops(pod, d.patch)


def test_policy_and_binding_shape() -> None:
    policy, binding = pod_policy(["kvgpu-system"])
    assert policy["kind"] == "ValidatingAdmissionPolicy" and policy["metadata"]["name"] == POD_POLICY_NAME
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}]
    # The same scoping as the mutating webhook: only pods that mention GPUs.
    assert spec["matchConditions"] == [{"name": "mentions-gpus", "expression": gpu_pod_expression(update=False)}]
    assert [v["name"] for v in spec["variables"]] == ["sliced", "admitted", "guarded"]
    assert all(v["message"].startswith(f"refused after every mutating webhook ({POD_POLICY_NAME}): ")
               and v["reason"] == "Forbidden" for v in spec["validations"])
    assert binding["spec"]["policyName"] == POD_POLICY_NAME and binding["spec"]["validationActions"] == ["Deny"]
    (expr,) = binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"]
    assert expr == {"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                    "values": ["kube-system", "kvgpu-system"]}


def test_policy_names_what_it_guards() -> None:
    text = " ".join(v["expression"] for v in pod_policy([])[0]["spec"]["validations"])
    for needle in (keys.POD_ADMITTED, keys.POD_NODE, keys.CLAIM_PREFIX, keys.DEVICES_PREFIX, keys.ENV_VISIBLE,
                   "CUDA_DEVICE_MEMORY_LIMIT", "LD_PRELOAD", keys.SCHEDULER_NAME, "hostPath", "hostPID",
                   *m.DEVICE_PLUGIN_TARGETS, *m.RESERVED_VOLUMES, "/var/lib/kvgpu", "SYS_ADMIN"):
        assert needle in text, needle


def test_cel_string_literals_escape_quotes() -> None:
    assert q("a'b\\c") == "'a\\'b\\\\c'"


@pytest.mark.parametrize(("pod", "value"), [
    (_pod({"kvgpu.io/gpumem": "3000"}), "main"),
    (_pod({"kvgpu.io/gpumem": "3000", "kvgpu.io/containers": "main,side"}), "main,side"),
    (_pod(limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000"}), "main"),
    (_pod({"nvidia.com/use-gputype": "A100"}), ""),  # mentions GPUs, requests no slice
], ids=["annotation-form", "two-containers", "hami-form", "no-slices"])
def test_the_marker_lists_the_sliced_containers(pod: dict[str, Any], value: str) -> None:
    out = _mutated(pod)
    assert out["metadata"]["annotations"][keys.POD_ADMITTED] == value
    assert m.admitted_ops(out) == []  # idempotent: a reinvocation adds nothing


def test_the_marker_replaces_a_forged_one_and_skips_plain_pods() -> None:
    out = _mutated(_pod({"kvgpu.io/gpumem": "3000", keys.POD_ADMITTED: "main,side"}))
    assert out["metadata"]["annotations"][keys.POD_ADMITTED] == "main"
    plain = _pod({"team": "web"})
    assert m.admitted_ops(plain) == [] and not m.mentions_gpus(plain)


@pytest.mark.parametrize("pod", [
    _pod({"Kvgpu.io/gpumem": "3"}), _pod({"hami.io/x": "1"}), _pod(limits={"nvidia.com/gpumem": "1"}),
    {"metadata": {"labels": {keys.POD_MANAGED_LABEL: "true"}}, "spec": {}},
    {"metadata": {}, "spec": {"initContainers": [{"name": "i", "resources": {"requests": {"nvidia.com/gpu": "1"}}}]}},
])
def test_mentions_gpus_follows_the_match_condition(pod: dict[str, Any]) -> None:
    assert m.mentions_gpus(pod)
