"""Admission decisions as pure functions: mutate_pod (ops), validate_pod (messages), config."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvgpu.admission import mutate as m
from kvgpu.admission.config import gpu_pod_expression, gpu_workload_expression, webhook_configurations
from kvgpu.admission.handlers import refusal_message
from kvgpu.admission.validate import validate_pod, validate_workload
from kvgpu.core import keys

OPS = {"kvgpu-operator"}


def pod(annotations: dict[str, Any] | None = None, *, containers: list[dict[str, Any]] | None = None,
        init: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    p: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ns", "annotations": dict(annotations or {})},
        "spec": {"schedulerName": "default-scheduler",
                 "containers": containers or [{"name": "main", "image": "cuda"},
                                              {"name": "side", "image": "x"}],
                 **spec},
    }
    if init:
        p["spec"]["initContainers"] = init
    return p


def mutated(p: dict[str, Any]) -> dict[str, Any]:
    return m.apply_ops(p, m.mutate_pod(p))


def create_errors(p: dict[str, Any]) -> list[str]:
    return validate_pod("CREATE", p, None, "alice", OPS)


SLICED = {"kvgpu.io/gpumem": "3000", "kvgpu.io/gpucores": "30"}


# --------------------------------------------------------------------------- mutate


def test_mutation_injects_the_shim_into_the_sliced_container() -> None:
    out = mutated(pod(SLICED))
    assert out["spec"]["schedulerName"] == keys.SCHEDULER_NAME
    assert out["metadata"]["labels"] == {m.MANAGED_LABEL: "true"}
    main, side = out["spec"]["containers"]
    assert main["env"] == m.injected_env("main")
    assert main["volumeMounts"] == m.injected_mounts("main")
    assert side["env"] == [{"name": keys.ENV_VISIBLE, "value": "none"}]
    assert "volumeMounts" not in side
    vols = {v["name"]: v for v in out["spec"]["volumes"]}
    # Only the claim: every host path comes from the device plugin's Allocate (PodSecurity
    # baseline and restricted refuse hostPath volumes; downward-API volumes pass both).
    assert set(vols) == {"kvgpu-claim-main"}
    assert all(set(v) == {"name", "downwardAPI"} for v in out["spec"]["volumes"])
    assert main["volumeMounts"] == [{"name": "kvgpu-claim-main", "mountPath": "/etc/kvgpu", "readOnly": True}]
    # issue 14: the container's own claim, alone, at the fixed path /etc/kvgpu/claim
    assert vols["kvgpu-claim-main"]["downwardAPI"]["items"] == [
        {"path": "claim", "fieldRef": {"apiVersion": "v1",
                                       "fieldPath": "metadata.annotations['kvgpu.io/claim.main']"}}]
    claim_mount = next(v for v in main["volumeMounts"] if v["mountPath"] == keys.CONTAINER_CLAIM_DIR)
    assert claim_mount == {"name": "kvgpu-claim-main", "mountPath": "/etc/kvgpu", "readOnly": True}
    assert {e["name"]: e.get("value") for e in main["env"]}[keys.ENV_CLAIM_FILE] == keys.CONTAINER_CLAIM_FILE


def test_injected_env_reads_the_allocation_annotations() -> None:
    env = {e["name"]: e for e in m.injected_env("main")}
    ref = {k: v.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for k, v in env.items()}
    assert ref[keys.ENV_POD_UID] == "metadata.uid"
    assert ref[keys.ENV_CLAIM] == f"metadata.annotations['{keys.claim_annotation('main')}']"
    assert ref[keys.ENV_VISIBLE] == f"metadata.annotations['{keys.devices_annotation('main')}']"
    assert env[keys.ENV_CLAIM_FILE]["value"] == "/etc/kvgpu/claim"  # the same in every container
    assert env[keys.ENV_REGION_DIR]["value"] == keys.CONTAINER_REGION_DIR
    assert env[keys.ENV_SCHED_DIR]["value"] == keys.CONTAINER_SCHED_DIR
    # The region and schedule directories are the device plugin's mounts, not the webhook's.
    assert {x["mountPath"] for x in m.injected_mounts("main")} == {keys.CONTAINER_CLAIM_DIR}
    assert all(x["readOnly"] for x in m.injected_mounts("main"))


def test_long_container_names_use_the_hashed_key() -> None:
    name = "c" * 50
    p = pod({"kvgpu.io/gpu": "1"}, containers=[{"name": name, "image": "x"}])
    out = mutated(p)
    key = keys.container_key(name)
    assert key.startswith("h-")
    env = {e["name"]: e for e in out["spec"]["containers"][0]["env"]}
    assert env[keys.ENV_CLAIM_FILE]["value"] == "/etc/kvgpu/claim"
    assert f"kvgpu-claim-{key}" in {v["name"] for v in out["spec"]["volumes"]}  # a DNS label
    assert create_errors(out) == []


def test_a_container_named_like_a_hashed_key_is_refused() -> None:
    # Measured: 'h-<16 hex>' next to a long name shared its claim annotation and took its limit.
    long = "trainer-" + "x" * 40
    twin = keys.container_key(long)
    p = pod({"kvgpu.io/gpumem": "1000", "kvgpu.io/containers": f"{long},{twin}"},
            containers=[{"name": long, "image": "x"}, {"name": twin, "image": "x"}])
    errs = create_errors(mutated(p))
    assert any("would share kvgpu's annotation key" in e and twin in e for e in errs), errs
    other = pod({"kvgpu.io/gpumem": "1000"}, containers=[{"name": "h-0123456789abcdef", "image": "x"}])
    assert create_errors(mutated(other)) == []  # such a name alone is fine


@pytest.mark.parametrize("p", [
    pod(SLICED),
    pod({"kvgpu.io/gpu": "2", "kvgpu.io/containers": "main,side"}),
    pod(containers=[{"name": "main", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
        init=[{"name": "prep", "image": "x", "resources": {"limits": {"nvidia.com/gpumem": "1000"}}}]),
    pod(SLICED, containers=[{"name": "main", "image": "x", "env": [{"name": "A", "value": "1"}],
                             "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
        volumes=[{"name": "data", "emptyDir": {}}]),
], ids=["annotations", "two-containers", "hami-init", "existing-lists"])
def test_mutation_is_idempotent_and_passes_validation(p: dict[str, Any]) -> None:
    out = mutated(p)
    assert m.mutate_pod(out) == []  # reinvocation adds nothing
    assert create_errors(out) == []
    # The user's own entries are kept, ours appended.
    for c in p["spec"]["containers"]:
        got = next(x for x in out["spec"]["containers"] if x["name"] == c["name"])
        assert got.get("env", [])[: len(c.get("env", []))] == c.get("env", [])


def test_hami_init_container_is_injected() -> None:
    p = pod(containers=[{"name": "main", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            init=[{"name": "prep", "image": "x", "resources": {"limits": {"nvidia.com/gpumem": "1000"}}}])
    out = mutated(p)
    assert out["spec"]["initContainers"][0]["env"] == m.injected_env("prep")
    claims = {v["name"]: [i["fieldRef"]["fieldPath"] for i in v["downwardAPI"]["items"]]
              for v in out["spec"]["volumes"] if v["name"].startswith(m.VOLUME_CLAIM_PREFIX)}
    assert claims == {"kvgpu-claim-main": ["metadata.annotations['kvgpu.io/claim.main']"],
                      "kvgpu-claim-prep": ["metadata.annotations['kvgpu.io/claim.prep']"]}


def test_no_ops_for_pods_without_slices_or_with_errors() -> None:
    assert m.mutate_pod(pod({"team": "web"})) == []
    assert m.mutate_pod(pod({"nvidia.com/use-gputype": "A100"})) == []
    assert m.mutate_pod(pod({"kvgpu.io/gpumem": "3Gx"})) == []


def test_mutation_keeps_a_foreign_scheduler_and_user_clashes() -> None:
    p = pod(SLICED, schedulerName="volcano")
    p["spec"]["containers"][0]["env"] = [{"name": keys.ENV_CLAIM, "value": "forged"}]
    out = mutated(p)
    assert out["spec"]["schedulerName"] == "volcano"
    claim = [e for e in out["spec"]["containers"][0]["env"] if e["name"] == keys.ENV_CLAIM]
    assert claim == [{"name": keys.ENV_CLAIM, "value": "forged"}]
    errors = create_errors(out)
    assert any("volcano" in e and keys.SCHEDULER_NAME in e for e in errors)
    assert any(keys.ENV_CLAIM in e and "'main'" in e for e in errors)


def test_mutation_escapes_label_keys_in_json_pointers() -> None:
    p = pod(SLICED)
    p["metadata"]["labels"] = {"app": "x"}
    ops = m.mutate_pod(p)
    assert {"op": "add", "path": "/metadata/labels/kvgpu.io~1managed", "value": "true"} in ops
    assert m.apply_ops(p, ops)["metadata"]["labels"] == {"app": "x", m.MANAGED_LABEL: "true"}


def test_ops_are_valid_json_patch() -> None:
    jsonpatch = pytest.importorskip("jsonpatch")
    p = pod(SLICED, volumes=[{"name": "data", "emptyDir": {}}])
    p["metadata"]["labels"] = {"app": "x"}
    ops = m.mutate_pod(p)
    assert jsonpatch.apply_patch(p, ops) == m.apply_ops(p, ops)


# --------------------------------------------------------------------------- validate (CREATE)


def _with(p: dict[str, Any], fn: Any) -> dict[str, Any]:
    p = copy.deepcopy(p)
    fn(p)
    return p


def _c(p: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return p["spec"]["containers"][i]  # type: ignore[no-any-return]


GOOD = mutated(pod(SLICED))

REJECTIONS: list[tuple[str, dict[str, Any], list[str]]] = [
    ("bad-values", mutated(pod({"kvgpu.io/gpumem": "3Gx", "kvgpu.io/gpucores": "130"})),
     ["kvgpu.io/gpumem", '"3Gx"', "3Gi", "kvgpu.io/gpucores", '"130"']),
    ("unknown-key", pod({"kvgpu.io/gpumemory": "3000"}), ["kvgpu.io/gpumemory"]),
    ("forged-claim", _with(GOOD, lambda p: p["metadata"]["annotations"].update(
        {keys.claim_annotation("main"): "x"})), ["kvgpu.io/claim.main", "cannot be set on a new pod"]),
    ("forged-node", pod({keys.POD_NODE: "n1"}), [keys.POD_NODE]),
    ("foreign-scheduler", mutated(pod(SLICED, schedulerName="volcano")), ["'volcano'", keys.SCHEDULER_NAME]),
    ("node-name", _with(GOOD, lambda p: p["spec"].update(nodeName="n1")), ["spec.nodeName", "'n1'"]),
    ("privileged", _with(GOOD, lambda p: _c(p).update(securityContext={"privileged": True})),
     ["'main'", "privileged"]),
    ("sys-admin", _with(GOOD, lambda p: _c(p).update(
        securityContext={"capabilities": {"add": ["SYS_ADMIN"]}})), ["'main'", "SYS_ADMIN"]),
    ("sys-ptrace", _with(GOOD, lambda p: _c(p).update(
        securityContext={"capabilities": {"add": ["SYS_PTRACE"]}})), ["'main'", "SYS_PTRACE"]),
    ("host-pid", _with(GOOD, lambda p: p["spec"].update(hostPID=True)), ["hostPID"]),
    ("host-root", _with(GOOD, lambda p: p["spec"]["volumes"].append(
        {"name": "root", "hostPath": {"path": "/"}})), ["'root'", "'/'"]),
    ("host-dev", _with(GOOD, lambda p: p["spec"]["volumes"].append(
        {"name": "dev", "hostPath": {"path": "/dev/nvidia0"}})), ["'dev'", "/dev/nvidia0"]),
    ("host-var", _with(GOOD, lambda p: p["spec"]["volumes"].append(
        {"name": "var", "hostPath": {"path": "/var/"}})), ["'var'", "'/var/'"]),
    ("host-kvgpu-regions", _with(GOOD, lambda p: p["spec"]["volumes"].append(
        {"name": "r", "hostPath": {"path": "/var/lib/kvgpu"}})), ["'r'", "/var/lib/kvgpu"]),
    ("env-ld-preload", _with(GOOD, lambda p: _c(p)["env"].append({"name": "LD_PRELOAD", "value": ""})),
     ["'main'", "LD_PRELOAD"]),
    ("env-visible-side", _with(GOOD, lambda p: _c(p, 1).update(
        env=[{"name": keys.ENV_VISIBLE, "value": "all"}])), ["'side'", keys.ENV_VISIBLE]),
    ("env-claim-other-container", _with(GOOD, lambda p: _c(p, 1).update(env=[
        {"name": keys.ENV_CLAIM, "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{keys.claim_annotation('main')}']"}}}])),
     ["'side'", keys.ENV_CLAIM]),
    ("env-fieldref-altered", _with(GOOD, lambda p: _c(p)["env"].__setitem__(2, {
        "name": keys.ENV_VISIBLE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['x']"}}})),
     [keys.ENV_VISIBLE]),
    ("env-indexed-limit", _with(GOOD, lambda p: _c(p)["env"].append(
        {"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "80g"})), ["CUDA_DEVICE_MEMORY_LIMIT_0"]),
    ("env-core-policy", _with(GOOD, lambda p: _c(p)["env"].append(
        {"name": "GPU_CORE_UTILIZATION_POLICY", "value": "disable"})), ["GPU_CORE_UTILIZATION_POLICY"]),
    ("init-env", _with(GOOD, lambda p: p["spec"].update(initContainers=[
        {"name": "prep", "image": "x", "env": [{"name": "CUDA_DEVICE_MEMORY_LIMIT", "value": "80g"}]}])),
     ["init container 'prep'", "CUDA_DEVICE_MEMORY_LIMIT"]),
    ("not-mutated", pod(SLICED), ["was not prepared by kvgpu's mutating webhook", "volume kvgpu-claim-main"]),
    ("volume-name-clash", mutated(pod(SLICED, volumes=[{"name": "kvgpu-shim", "emptyDir": {}}])),
     ["'kvgpu-shim' is reserved"]),
    ("mount-path-clash", mutated(pod(SLICED, containers=[{"name": "main", "image": "x", "volumeMounts": [
        {"name": "data", "mountPath": "/etc/ld.so.preload"}]}], volumes=[{"name": "data", "emptyDir": {}}])),
     ["mounts something else at /etc/ld.so.preload"]),
    ("region-without-subpath", _with(GOOD, lambda p: _c(p, 1).update(volumeMounts=[
        {"name": "kvgpu-region", "mountPath": "/all"}])), ["'side'", "'kvgpu-region'"]),
]


@pytest.mark.parametrize(("case", "p", "needles"), REJECTIONS, ids=[r[0] for r in REJECTIONS])
def test_rejections_name_the_problem(case: str, p: dict[str, Any], needles: list[str]) -> None:
    errors = create_errors(p)
    text = "\n".join(errors)
    assert errors, case
    for n in needles:
        assert n in text, f"{case}: {n!r} not in {errors}"


def test_every_bad_key_is_reported_at_once() -> None:
    p = pod({"kvgpu.io/gpumem": "3Gx", "kvgpu.io/gpucores": "130", "kvgpu.io/priority": "urgent"})
    errors = create_errors(p)
    assert len(errors) == 3
    assert "3 problems: (1)" in refusal_message(errors)


def test_managed_label_only_on_gpu_pods() -> None:
    p = pod({"team": "web"})
    p["metadata"]["labels"] = {m.MANAGED_LABEL: "true"}
    assert any(m.MANAGED_LABEL in e for e in create_errors(p))
    plain = pod({"team": "web"})
    assert any(m.MANAGED_LABEL in e for e in validate_pod("UPDATE", p, plain, "alice", OPS))
    assert validate_pod("UPDATE", p, plain, "kvgpu-operator", OPS) == []


def test_pods_without_slices_are_allowed_even_if_odd() -> None:
    assert create_errors(pod({"team": "web"})) == []
    # Not our business when the pod asks for no slices.
    p = pod({"nvidia.com/use-gputype": "A100"})
    _c(p)["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    _c(p)["securityContext"] = {"privileged": True}
    assert create_errors(p) == []


def test_privileged_container_without_slices_is_allowed() -> None:
    assert create_errors(_with(GOOD, lambda p: _c(p, 1).update(securityContext={"privileged": True}))) == []


def test_defaulted_shapes_still_pass() -> None:
    """What the API server stores: fieldRef without apiVersion is defaulted, mode fields added."""
    p = copy.deepcopy(GOOD)
    for e in _c(p)["env"]:
        e.get("valueFrom", {}).get("fieldRef", {}).pop("apiVersion", None)
    for v in p["spec"]["volumes"]:
        if "downwardAPI" in v:
            v["downwardAPI"]["defaultMode"] = 420
    _c(p)["volumeMounts"][0]["mountPropagation"] = "None"
    assert create_errors(p) == []


# --------------------------------------------------------------------------- validate (UPDATE)


BOUND = _with(GOOD, lambda p: p["metadata"]["annotations"].update({
    keys.POD_NODE: "n1", keys.claim_annotation("main"): "v1;x", keys.devices_annotation("main"): "GPU-a"}))


@pytest.mark.parametrize("change", [
    lambda p: p["metadata"]["annotations"].update({keys.devices_annotation("main"): "GPU-b"}),
    lambda p: p["metadata"]["annotations"].pop(keys.claim_annotation("main")),
    lambda p: p["metadata"]["annotations"].update({keys.POD_CLAIMS: "c1"}),
    lambda p: p["metadata"]["annotations"].update({keys.devices_annotation("side"): "GPU-a"}),
], ids=["change", "remove", "add-claims", "add-other-container"])
def test_only_the_operator_changes_allocation_annotations(change: Any) -> None:
    new = _with(BOUND, change)
    errors = validate_pod("UPDATE", new, BOUND, "alice", OPS)
    assert any("only be changed by the kvgpu operator" in e for e in errors), errors
    assert validate_pod("UPDATE", new, BOUND, "kvgpu-operator", OPS) == []


def test_operator_writes_allocation_on_a_pending_pod() -> None:
    assert validate_pod("UPDATE", BOUND, GOOD, "kvgpu-operator", OPS) == []
    assert validate_pod("UPDATE", BOUND, GOOD, "system:serviceaccount:x:y", OPS)


def test_other_updates_are_the_users() -> None:
    new = _with(BOUND, lambda p: p["metadata"].update(labels={m.MANAGED_LABEL: "true", "team": "ml"}))
    assert validate_pod("UPDATE", new, BOUND, "alice", OPS) == []


def test_managed_label_is_protected() -> None:
    new = _with(BOUND, lambda p: p["metadata"].update(labels={}))
    assert any(m.MANAGED_LABEL in e for e in validate_pod("UPDATE", new, BOUND, "alice", OPS))


@pytest.mark.parametrize(("old", "change", "key"), [
    (BOUND, lambda p: p["metadata"]["annotations"].update({"kvgpu.io/gpumem": "6000"}), "kvgpu.io/gpumem"),
    (GOOD, lambda p: p["metadata"]["annotations"].update({"kvgpu.io/containers": "side"}),
     "kvgpu.io/containers"),
    (GOOD, lambda p: p["metadata"]["annotations"].pop("kvgpu.io/gpucores"), "kvgpu.io/gpucores"),
    (pod({"team": "web"}), lambda p: p["metadata"]["annotations"].update({"kvgpu.io/gpu": "1"}),
     "kvgpu.io/gpu"),
    (GOOD, lambda p: p["metadata"]["annotations"].update({"nvidia.com/use-gputype": "A100"}),
     "nvidia.com/use-gputype"),
], ids=["after-scheduling", "containers", "removed", "plain-pod-becomes-gpu", "hami-annotation"])
def test_requests_are_fixed_at_create(old: dict[str, Any], change: Any, key: str) -> None:
    errors = validate_pod("UPDATE", _with(old, change), old, "alice", OPS)
    assert any(key in e and "fixed when the pod is created" in e for e in errors), errors


def test_delete_and_other_subresources_are_allowed() -> None:
    assert validate_pod("DELETE", BOUND, BOUND, "alice", OPS) == []
    forged = _with(BOUND, lambda p: p["metadata"]["annotations"].update({keys.POD_NODE: "n2"}))
    assert validate_pod("UPDATE", forged, BOUND, "alice", OPS, subresource="resize") == []


@pytest.mark.parametrize("change", [
    lambda p: p["metadata"]["annotations"].update({keys.POD_CLAIMS: "victim-main-abcde"}),
    lambda p: p["metadata"]["annotations"].update({keys.claim_annotation("main"): "v1;full"}),
    lambda p: p["metadata"]["labels"].pop(m.MANAGED_LABEL),
], ids=["claims", "claim-string", "managed-label"])
def test_status_writes_may_not_change_kvgpu_metadata(change: Any) -> None:
    forged = _with(BOUND, change)
    errors = validate_pod("UPDATE", forged, BOUND, "alice", OPS, subresource="status")
    assert any("only be changed by the kvgpu operator" in e for e in errors), errors
    assert validate_pod("UPDATE", forged, BOUND, "kvgpu-operator", OPS, subresource="status") == []
    phase = _with(BOUND, lambda p: p.update(status={"phase": "Running"}))
    assert validate_pod("UPDATE", phase, BOUND, "kubelet", OPS, subresource="status") == []


def test_update_refuses_new_privileges_only() -> None:
    priv = _with(BOUND, lambda p: _c(p).update(securityContext={"privileged": True}))
    errors = validate_pod("UPDATE", priv, BOUND, "alice", OPS)
    assert any("privileged" in e for e in errors), errors
    # a pod admitted before the rule existed can still be labelled
    relabelled = _with(priv, lambda p: p["metadata"]["labels"].update(team="web"))
    assert validate_pod("UPDATE", relabelled, priv, "alice", OPS) == []


# --------------------------------------------------------------------------- ephemeral containers


def _debug(p: dict[str, Any], env: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"name": "dbg", "image": "cuda-debug"}
    if env is not None:
        c["env"] = env
    return _with(p, lambda q: q["spec"].update(ephemeralContainers=[c]))


def test_debug_container_sees_no_cards() -> None:
    p = _debug(BOUND)
    ops = m.mutate_ephemeral(p)
    out = m.apply_ops(p, ops)
    assert out["spec"]["ephemeralContainers"][0]["env"] == [m.no_devices_env()]
    assert m.mutate_ephemeral(out) == []
    assert validate_pod("UPDATE", out, BOUND, "alice", OPS, subresource="ephemeralcontainers") == []
    assert m.mutate_ephemeral(_debug(pod({"team": "web"}))) == []


@pytest.mark.parametrize("env", [
    [{"name": keys.ENV_VISIBLE, "value": "all"}],
    [{"name": "CUDA_DISABLE_CONTROL", "value": "1"}],
    [{"name": keys.ENV_CLAIM, "valueFrom": {"fieldRef": {
        "fieldPath": f"metadata.annotations['{keys.claim_annotation('main')}']"}}}],
])
def test_debug_container_cannot_set_reserved_env(env: list[dict[str, Any]]) -> None:
    p = m.apply_ops(_debug(BOUND, env), m.mutate_ephemeral(_debug(BOUND, env)))
    errors = validate_pod("UPDATE", p, BOUND, "kvgpu-operator", OPS, subresource="ephemeralcontainers")
    assert any("ephemeral container 'dbg'" in e and env[0]["name"] in e for e in errors), errors


@pytest.mark.parametrize("sc", [{"privileged": True}, {"capabilities": {"add": ["SYS_PTRACE"]}},
                                {"capabilities": {"add": ["SYS_ADMIN"]}}], ids=["sysadmin", "ptrace", "admin"])
def test_privileged_debug_container_is_refused(sc: dict[str, Any]) -> None:
    dbg = _with(_debug(BOUND), lambda q: q["spec"]["ephemeralContainers"][0].update(securityContext=sc))
    p = m.apply_ops(dbg, m.mutate_ephemeral(dbg))
    errors = validate_pod("UPDATE", p, BOUND, "alice", OPS, subresource="ephemeralcontainers")
    assert any("ephemeral container 'dbg'" in e and "--profile=baseline" in e for e in errors), errors
    # one already there (added before the rule) does not block adding another
    two = _with(p, lambda q: q["spec"]["ephemeralContainers"].append(
        {"name": "dbg2", "image": "x", "env": [m.no_devices_env()]}))
    assert validate_pod("UPDATE", two, p, "alice", OPS, subresource="ephemeralcontainers") == []
    plain = _debug(pod({"team": "web"}))
    assert validate_pod("UPDATE", _with(plain, lambda q: q["spec"]["ephemeralContainers"][0].update(
        securityContext=sc)), pod({"team": "web"}), "alice", OPS, subresource="ephemeralcontainers") == []


@pytest.mark.parametrize(("path", "refused"), [
    ("/", True), ("//", True), ("/dev", True), ("/dev/shm", True), ("/var", True), ("/usr", True),
    ("/usr/local/kvgpu/lib", True), ("/var/lib/kubelet/pods", True), ("/run/containerd", True),
    ("/data/models", False), ("/var/log/app", False), ("/mnt/datasets", False), ("/devices", False),
])
def test_sensitive_host_paths(path: str, refused: bool) -> None:
    from kvgpu.admission.validate import sensitive_host_path

    assert sensitive_host_path(path) is refused


@pytest.mark.parametrize("name,path", [
    ("mine", keys.HOST_REGION_ROOT), ("mine", keys.HOST_SCHED_DIR), ("mine", keys.HOST_SHIM_DIR),
    ("mine", keys.HOST_PRELOAD_FILE),
    # the volume names older releases injected get no exception either
    ("kvgpu-region", keys.HOST_REGION_ROOT), ("kvgpu-sched", keys.HOST_SCHED_DIR),
    ("kvgpu-shim", keys.HOST_SHIM_DIR), ("kvgpu-preload", keys.HOST_PRELOAD_FILE),
])
def test_no_host_path_of_kvgpu_is_allowed(name: str, path: str) -> None:
    """kvgpu injects no hostPath: a tenant's volume at the region root or the schedule (to forge
    usage) is refused whatever it is called, even as the old injected shape."""
    assert create_errors(GOOD) == []
    assert not any("hostPath" in v for v in GOOD["spec"]["volumes"])
    borrowed = _with(GOOD, lambda p: p["spec"]["volumes"].append(
        {"name": name, "hostPath": {"path": path, "type": "DirectoryOrCreate"}}))
    errors = create_errors(borrowed)
    assert any(f"volume {name!r} mounts host path {path!r}" in e for e in errors), errors


@pytest.mark.parametrize("target", [keys.CONTAINER_SHIM_DIR, "/etc/ld.so.preload", keys.CONTAINER_REGION_DIR,
                                    keys.CONTAINER_SCHED_DIR, keys.CONTAINER_MPS_DIR])
def test_a_mount_at_a_device_plugin_target_is_refused(target: str) -> None:
    """The device plugin mounts the shim, ld.so.preload, the region, the schedule and the MPS
    pipes: a sliced container's own volume at one of those paths would compete with it."""
    def add(p: dict[str, Any]) -> None:
        p["spec"]["volumes"].append({"name": "data", "emptyDir": {}})
        p["spec"]["containers"][0].setdefault("volumeMounts", []).append({"name": "data", "mountPath": target})
    errors = create_errors(_with(GOOD, add))
    assert any(f"mounts something else at {target}" in e for e in errors), errors


def test_a_reserved_volume_name_is_refused_unmounted() -> None:
    errors = create_errors(_with(GOOD, lambda p: p["spec"]["volumes"].append({"name": "kvgpu-shim", "emptyDir": {}})))
    assert any("volume name 'kvgpu-shim' is reserved" in e for e in errors), errors


# --------------------------------------------------------------------------- workloads


def deployment(annotations: dict[str, str], **container: Any) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "ns"},
            "spec": {"template": {"metadata": {"annotations": annotations},
                                  "spec": {"containers": [{"name": "main", "image": "x", **container}]}}}}


def test_workload_templates_are_validated_like_pods() -> None:
    assert validate_workload("CREATE", deployment(SLICED), None) == []  # no injection expected
    errors = validate_workload("CREATE", deployment({"kvgpu.io/gpumem": "3Gx", keys.POD_NODE: "n"},
                                                    securityContext={"privileged": True}), None)
    text = "\n".join(errors)
    assert all(e.startswith("pod template: ") for e in errors)
    for needle in ('"3Gx"', keys.POD_NODE):
        assert needle in text
    assert "privileged" not in text  # no request parsed: containers unknown, nothing more to say
    errors = validate_workload("CREATE", deployment(SLICED, securityContext={"privileged": True}), None)
    assert any("privileged" in e for e in errors)
    cron = {"apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": "c"},
            "spec": {"jobTemplate": {"spec": {"template": deployment({"kvgpu.io/gpucores": "101"})
                                              ["spec"]["template"]}}}}
    assert any('"101"' in e for e in validate_workload("CREATE", cron, None))


def test_unchanged_workload_templates_pass_updates() -> None:
    bad = deployment({"kvgpu.io/gpumem": "3Gx"})
    scaled = _with(bad, lambda d: d["spec"].update(replicas=3))
    assert validate_workload("UPDATE", scaled, bad, ) == []
    assert validate_workload("UPDATE", bad, deployment(SLICED))
    assert validate_workload("DELETE", bad, bad) == []
    assert validate_workload("CREATE", {"kind": "Service", "spec": {}}, None) == []


# --------------------------------------------------------------------------- robustness

_keys = st.one_of(
    st.sampled_from([
        "kvgpu.io/gpu", "kvgpu.io/gpumem", "kvgpu.io/gpumem-percentage", "kvgpu.io/gpucores",
        "kvgpu.io/priority", "kvgpu.io/containers", "kvgpu.io/gpu-type", "kvgpu.io/numa-bind",
        "kvgpu.io/node-policy", "kvgpu.io/gpu-uuid", "nvidia.com/use-gputype", "hami.io/gpu-scheduler-policy",
        keys.POD_NODE, keys.POD_CLAIMS, keys.claim_annotation("main"), "kvgpu.io/", "team",
    ]),
    st.text(max_size=30),
)
_values = st.one_of(
    st.text(max_size=20), st.sampled_from(["", "0", "1", "100", "3Gi", "-1", "main,side", "1e9"]),
    st.integers(), st.none(), st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(ann=st.dictionaries(_keys, _values, max_size=6), old_ann=st.dictionaries(_keys, _values, max_size=4),
       op=st.sampled_from(["CREATE", "UPDATE"]))
def test_arbitrary_annotations_never_crash(ann: dict[Any, Any], old_ann: dict[Any, Any], op: str) -> None:
    p = pod(ann)
    out = m.apply_ops(p, m.mutate_pod(p))
    for candidate in (p, out):
        errors = validate_pod(op, candidate, pod(old_ann), "alice", OPS)
        assert isinstance(errors, list) and all(isinstance(e, str) and e for e in errors)
    assert m.mutate_pod(out) == []


@given(body=st.recursive(st.none() | st.text(max_size=5) | st.integers(),
                         lambda ch: st.lists(ch, max_size=3)
                         | st.dictionaries(st.text(max_size=8), ch, max_size=3),
                         max_leaves=15))
@settings(max_examples=200, deadline=None)
def test_malformed_bodies_never_crash(body: Any) -> None:
    p = {"metadata": body, "spec": body}
    validate_pod("CREATE", p, None, "alice", OPS)
    validate_pod("UPDATE", p, p, "alice", OPS)


# --------------------------------------------------------------------------- configurations


def test_configurations_shape() -> None:
    mut, val = webhook_configurations(url_base="https://127.0.0.1:9443/", service=None, ca_bundle=b"PEM",
                                      exclude_namespaces=["kvgpu-system"])
    assert mut["kind"] == "MutatingWebhookConfiguration" and mut["metadata"]["name"] == "kvgpu-mutate"
    assert val["kind"] == "ValidatingWebhookConfiguration" and val["metadata"]["name"] == "kvgpu-validate"
    (mw,), (vw, ww) = mut["webhooks"], val["webhooks"]
    assert mw["name"] == "pods.mutate.kvgpu.io" and vw["name"] == "pods.validate.kvgpu.io"
    assert mw["clientConfig"]["url"] == "https://127.0.0.1:9443/kvgpu-mutate-pods"
    assert vw["clientConfig"]["url"] == "https://127.0.0.1:9443/kvgpu-validate-pods"
    assert mw["clientConfig"]["caBundle"] == "UEVN"
    assert mw["reinvocationPolicy"] == "IfNeeded" and "reinvocationPolicy" not in vw
    assert [(r["operations"], r["resources"]) for r in mw["rules"]] == [
        (["CREATE"], ["pods"]), (["UPDATE"], ["pods/ephemeralcontainers"])]
    # One webhook call per new pod: the validating webhook sees no pod CREATE; what mutating
    # webhooks after ours do is checked by the pod policy (podpolicy, CEL in the API server).
    assert [(r["operations"], r["resources"]) for r in vw["rules"]] == [
        (["UPDATE"], ["pods"]), (["UPDATE"], ["pods/ephemeralcontainers"]),
        (["UPDATE"], ["pods/status"])]
    for w in (mw, vw, ww):
        assert w["failurePolicy"] == "Fail" and w["sideEffects"] == "None" and w["timeoutSeconds"] == 5
        assert w["admissionReviewVersions"] == ["v1"]
        (expr,) = w["namespaceSelector"]["matchExpressions"]
        assert expr == {"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                        "values": ["kube-system", "kvgpu-system"]}
    assert "oldObject" in vw["matchConditions"][0]["expression"]
    assert "oldObject" not in mw["matchConditions"][0]["expression"]


def test_configurations_with_a_service() -> None:
    mut, _ = webhook_configurations(url_base=None, service=("kvgpu-system", "kvgpu-webhook", 443),
                                    ca_bundle=b"x", exclude_namespaces=[])
    assert mut["webhooks"][0]["clientConfig"]["service"] == {
        "namespace": "kvgpu-system", "name": "kvgpu-webhook", "port": 443, "path": "/kvgpu-mutate-pods"}
    inject = {"cert-manager.io/inject-ca-from": "kvgpu-system/kvgpu-webhook"}
    mut, val = webhook_configurations(url_base=None, service=("kvgpu-system", "kvgpu-webhook", 443),
                                      ca_bundle=b"", exclude_namespaces=[], annotations=inject)
    for cfg in (mut, val):
        assert cfg["metadata"]["annotations"] == inject
        assert all("caBundle" not in w["clientConfig"] for w in cfg["webhooks"])
    with pytest.raises(ValueError):
        webhook_configurations(url_base="https://x", service=("a", "b", 1), ca_bundle=b"",
                               exclude_namespaces=[])


def test_match_expression_mentions_every_prefix() -> None:
    for e in (gpu_pod_expression(update=False), gpu_workload_expression()):
        for needle in ("'kvgpu.io/'", "'nvidia.com/'", "'hami.io/'", "initContainers", "limits", "requests"):
            assert needle in e
    assert "jobTemplate" in gpu_workload_expression()


def test_workload_webhook() -> None:
    _, val = webhook_configurations(url_base="https://h:1", service=None, ca_bundle=b"",
                                    exclude_namespaces=[])
    ww = val["webhooks"][1]
    assert ww["name"] == "workloads.validate.kvgpu.io"
    assert ww["clientConfig"]["url"] == "https://h:1/kvgpu-validate-workloads"
    groups = {r["apiGroups"][0]: set(r["resources"]) for r in ww["rules"]}
    assert groups["apps"] == {"deployments", "statefulsets", "daemonsets", "replicasets"}
    assert groups["batch"] == {"jobs", "cronjobs"}


_names = st.sampled_from(["main", "side", "prep", "x" * 45, "a-b"])
_env = st.lists(st.fixed_dictionaries({"name": st.sampled_from(["A", "PATH", "HOME", "B_C"]),
                                       "value": st.text(max_size=4)}), max_size=3)
_mounts = st.lists(st.fixed_dictionaries({"name": st.just("data"),
                                          "mountPath": st.sampled_from(["/data", "/cache", "/x/y"])}),
                   max_size=2, unique_by=lambda v: v["mountPath"])


@st.composite
def _pods(draw: Any) -> dict[str, Any]:
    names = draw(st.lists(_names, min_size=1, max_size=4, unique=True))
    n_init = draw(st.integers(0, len(names) - 1))
    hami = draw(st.booleans())

    def container(n: str) -> dict[str, Any]:
        c: dict[str, Any] = {"name": n, "image": "x"}
        if draw(st.booleans()):
            c["env"] = draw(_env)
        if draw(st.booleans()):
            c["volumeMounts"] = draw(_mounts)
        if hami and draw(st.booleans()):
            c["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
        return c

    ann = {} if hami else {"kvgpu.io/gpumem": "1000",
                           "kvgpu.io/containers": ",".join(draw(st.sets(st.sampled_from(names[n_init:]),
                                                                        min_size=1)))}
    p = pod(ann, containers=[container(n) for n in names[n_init:]],
            init=[container(n) for n in names[:n_init]] or None)
    if draw(st.booleans()):
        p["spec"]["volumes"] = [{"name": "data", "emptyDir": {}}]
    if draw(st.booleans()):
        p["metadata"]["labels"] = {"app": "x"}
    return p


@settings(max_examples=200, deadline=None)
@given(p=_pods())
def test_any_clean_pod_is_injected_once_and_then_valid(p: dict[str, Any]) -> None:
    jsonpatch = pytest.importorskip("jsonpatch")
    ops = m.mutate_pod(p)
    out = jsonpatch.apply_patch(p, ops)
    assert out == m.apply_ops(p, ops)
    assert m.mutate_pod(out) == []
    assert create_errors(out) == [], (p, ops)
    for kind in ("initContainers", "containers"):
        for before, after in zip(p["spec"].get(kind, []), out["spec"].get(kind, []), strict=True):
            assert after.get("env", [])[: len(before.get("env", []))] == before.get("env", [])  # user first


def test_a_container_cannot_mount_a_siblings_claim_volume() -> None:
    """Issue 14: each sliced container gets only its own claim; mounting another container's
    claim volume (to hand the shim a bigger claim) is refused, and so is a user volume that
    takes a claim volume's name."""
    annotations = {**SLICED, "kvgpu.io/containers": "main,side"}
    out = mutated(pod(annotations))
    assert create_errors(out) == []
    side = out["spec"]["containers"][1]
    assert {v["name"] for v in side["volumeMounts"]} >= {"kvgpu-claim-side"}
    side["volumeMounts"].append({"name": "kvgpu-claim-main", "mountPath": "/mnt/c", "readOnly": True})
    assert any("kvgpu-claim-main" in e for e in create_errors(out))
    bad = mutated(pod(SLICED))
    bad["spec"]["containers"][1]["volumeMounts"] = [{"name": "kvgpu-claim-main", "mountPath": "/etc/kvgpu"}]
    assert any("kvgpu-claim-main" in e for e in create_errors(bad))


def test_the_compute_schedule_cannot_be_mounted_by_the_pod() -> None:
    """Issue 14 ("Shared compute schedule"): the node agent alone writes the schedule, which the
    device plugin mounts read-only; a pod that mounts something at the schedule's path, or
    names the old kvgpu-sched volume, is refused."""
    out = mutated(pod(SLICED))
    assert create_errors(out) == []
    assert not any(x["mountPath"] == keys.CONTAINER_SCHED_DIR for x in out["spec"]["containers"][0]["volumeMounts"])
    out["spec"]["volumes"].append({"name": "s", "emptyDir": {}})
    out["spec"]["containers"][0]["volumeMounts"].append({"name": "s", "mountPath": keys.CONTAINER_SCHED_DIR})
    assert any(keys.CONTAINER_SCHED_DIR in e for e in create_errors(out))
    out = mutated(pod(SLICED))
    out["spec"]["containers"][0]["volumeMounts"].append({"name": "kvgpu-sched", "mountPath": "/mnt/s"})
    assert any("kvgpu-sched" in e for e in create_errors(out))


def test_a_pod_of_an_older_release_still_takes_updates() -> None:
    """Pods admitted before this release carry kvgpu's old hostPath volumes; an UPDATE that adds
    nothing (a label of the user's) is not refused for them, a new hostPath is."""
    old = copy.deepcopy(BOUND)
    old["spec"]["volumes"] += [{"name": "kvgpu-region", "hostPath": {"path": keys.HOST_REGION_ROOT,
                                                                     "type": "DirectoryOrCreate"}}]
    new = _with(old, lambda p: p["metadata"].setdefault("labels", {}).update({"team": "a"}))
    assert validate_pod("UPDATE", new, old, "alice", OPS) == []
    more = _with(old, lambda p: p["spec"]["volumes"].append({"name": "s", "hostPath": {"path": keys.HOST_SCHED_DIR}}))
    errors = validate_pod("UPDATE", more, old, "alice", OPS)
    assert any(f"mounts host path {keys.HOST_SCHED_DIR!r}" in e for e in errors), errors
