"""Fuzzing the admission inputs (hypothesis): random request annotations, HAMi limits, odd
container layouts and malformed pod documents.

Properties:

* ``parse_pod`` returns ``None`` or a request, or raises :class:`RequestError` whose message
  names the offending key; nothing else escapes;
* the validating webhook's ``validate_pod`` / ``validate_workload`` never raise and answer a
  list of non-empty strings; a refused request keys carries its key in the message;
* the mutating webhook's ``mutate_pod`` never raises; its ops apply cleanly to the pod, apply
  again as a no-op (idempotent), and the mutated pod passes validation when the request is valid.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvgpu.admission.mutate import apply_ops, mutate_pod
from kvgpu.admission.validate import validate_pod, validate_workload
from kvgpu.api import requests as rq
from kvgpu.api.pools import SliceMinimum
from kvgpu.api.requests import RequestError, parse_pod
from kvgpu.api.requests import validate_pod as request_errors
from kvgpu.core import keys

OPERATOR = "kvgpu-operator"
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

REQUEST_KEYS = [
    rq.GPU, rq.GPUMEM, rq.GPUMEM_PERCENTAGE, rq.GPUCORES, rq.PRIORITY, rq.CONTAINERS, rq.GPU_TYPE,
    rq.EXCLUDE_GPU_TYPE, rq.GPU_UUID, rq.EXCLUDE_GPU_UUID, rq.NUMA_BIND, rq.NODE_POLICY, rq.GPU_POLICY,
    rq.HAMI_USE_TYPE, rq.HAMI_NOUSE_TYPE, rq.HAMI_USE_UUID, rq.HAMI_NOUSE_UUID, rq.HAMI_NUMA_BIND,
    rq.HAMI_NODE_POLICY, rq.HAMI_GPU_POLICY, rq.HAMI_VGPU_MODE, rq.HAMI_SCORING_WEIGHTS,
    # near misses and operator-owned keys
    "kvgpu.io/gpumemory", "kvgpu.io/gpu-mem", "kvgpu.io/claims", "kvgpu.io/bound-node",
    "kvgpu.io/claim.main", "kvgpu.io/devices.main", "kvgpu.io/requeue", "example.com/other",
]
LIMIT_KEYS = [rq.HAMI_GPU, rq.HAMI_GPUMEM, rq.HAMI_GPUMEM_PERCENTAGE, rq.HAMI_GPUCORES, rq.HAMI_PRIORITY,
              "cpu", "memory", "nvidia.com/gpumemory"]

# Values: plausible ones, boundary numbers, quantities, garbage and huge strings.
values = st.one_of(
    st.sampled_from(["0", "1", "2", "8", "9", "100", "101", "-1", "3000", "3Gi", "3000Mi", "3k", "1.5",
                     "0.5Gi", "1e3", "1Ei", "999999999999999999999", "", " ", "binpack", "spread", "true",
                     "false", "yes", "A100,H200", "main", "main,c1", ",,",
                     "GPU-00000000-0000-0000-0000-000000000000",
                     "NaN", "inf", "0x10", "\uff11\uff12", "3000 ", "\u0000", "{}", "[1]"]),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.text(max_size=40),
    st.text(min_size=300, max_size=400),
)
# YAML lets users write non-strings where the API wants strings; the API server would refuse
# most, but the parsers must not crash on them either.
odd_values = st.one_of(values, st.integers(), st.booleans(), st.none(), st.floats(allow_nan=True),
                       st.lists(st.integers(), max_size=3),
                       st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))

annotations = st.dictionaries(st.sampled_from(REQUEST_KEYS), values, max_size=6)
limits = st.dictionaries(st.sampled_from(LIMIT_KEYS), values, max_size=4)
container_names = st.sampled_from(["main", "c1", "side", "init", "Main", "a" * 70, ""])


@st.composite
def containers(draw: Any, max_size: int = 3) -> list[dict[str, Any]]:
    out = []
    for name in draw(st.lists(container_names, min_size=0, max_size=max_size, unique=True)):
        c: dict[str, Any] = {"name": name, "image": "x"}
        where = draw(st.sampled_from(["limits", "requests", "both", "none"]))
        lim = draw(limits)
        if where in ("limits", "both"):
            c.setdefault("resources", {})["limits"] = lim
        if where in ("requests", "both"):
            c.setdefault("resources", {})["requests"] = lim
        if draw(st.booleans()):
            c["env"] = draw(st.lists(st.fixed_dictionaries(
                {"name": st.sampled_from(["KVGPU_CLAIM", "NVIDIA_VISIBLE_DEVICES", "LD_PRELOAD", "HOME",
                                          "CUDA_DEVICE_MEMORY_LIMIT_0", "X"]),
                 "value": st.text(max_size=10)}), max_size=2))
        out.append(c)
    return out


@st.composite
def pods(draw: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": draw(containers())}
    if draw(st.booleans()):
        spec["initContainers"] = draw(containers(max_size=2))
    if draw(st.booleans()):
        spec["schedulerName"] = draw(st.sampled_from(["default-scheduler", "kvgpu-scheduler", "other"]))
    meta: dict[str, Any] = {"name": "p", "namespace": "ns", "annotations": draw(annotations)}
    if draw(st.booleans()):
        meta["labels"] = {"kvgpu.io/managed": draw(st.sampled_from(["true", "false", ""]))}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


@st.composite
def valid_pods(draw: Any) -> dict[str, Any]:
    """Pods with a request that parses (annotation or HAMi form), so binds can succeed."""
    ann: dict[str, str] = {}
    limits: dict[str, str] = {}
    if draw(st.booleans()):
        ann[rq.GPU] = str(draw(st.integers(1, 2)))
        ann[rq.GPUMEM] = draw(st.sampled_from(["1000", "3000", "3Gi", "12000", "20000"]))
        ann[rq.GPUCORES] = str(draw(st.integers(0, 100)))
    else:
        limits = {rq.HAMI_GPU: "1", rq.HAMI_GPUMEM: str(draw(st.integers(1, 20000))),
                  rq.HAMI_GPUCORES: str(draw(st.integers(0, 100)))}
    ctr: dict[str, Any] = {"name": "main", "image": "x"}
    if limits:
        ctr["resources"] = {"limits": limits}
    meta = {"name": "p", "namespace": "ns", "annotations": ann}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"containers": [ctr]}}


# Structurally broken documents: wrong types at every level.
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                      st.text(max_size=8))
json_any = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)), max_leaves=12)


@st.composite
def broken_pods(draw: Any) -> Any:
    pod = draw(pods())
    where = draw(st.sampled_from(["root", "metadata", "annotations", "spec", "containers", "container",
                                  "resources", "limits", "value"]))
    junk = draw(json_any)
    if where == "root":
        return junk
    if where == "metadata":
        pod["metadata"] = junk
    elif where == "annotations":
        pod["metadata"]["annotations"] = junk
    elif where == "spec":
        pod["spec"] = junk
    elif where == "containers":
        pod["spec"]["containers"] = junk
    elif where == "container" and pod["spec"]["containers"]:
        pod["spec"]["containers"][0] = junk
    elif where == "resources" and pod["spec"]["containers"]:
        pod["spec"]["containers"][0]["resources"] = junk
    elif where == "limits" and pod["spec"]["containers"]:
        pod["spec"]["containers"][0]["resources"] = {"limits": junk}
    else:
        pod["metadata"]["annotations"] = {draw(st.sampled_from(REQUEST_KEYS)): draw(odd_values)}
    return pod


def _check_request_error(e: RequestError) -> None:
    text = str(e)
    assert text.strip(), "empty error message"
    errors = getattr(e, "errors", (e,))
    for one in errors:
        assert one.key and one.key in str(one), f"message does not name its key: {one}"
        assert one.allowed and one.allowed in str(one), f"message does not give the allowed form: {one}"


@FUZZ
@given(pod=pods())
def test_parse_pod_returns_a_request_or_a_clear_error(pod: dict[str, Any]) -> None:
    try:
        req = parse_pod(pod)
    except RequestError as e:
        _check_request_error(e)
        return
    if req is not None:
        assert req.containers, "a request with no container"
        names = {c["name"] for c in pod["spec"]["containers"]} | {
            c["name"] for c in pod["spec"].get("initContainers") or []}
        for c in req.containers:
            assert c.container in names


@FUZZ
@given(pod=broken_pods())
def test_parse_pod_on_malformed_documents(pod: Any) -> None:
    try:
        parse_pod(pod)
    except RequestError as e:
        _check_request_error(e)
    errs = request_errors(pod)
    assert all(isinstance(e, RequestError) and str(e).strip() for e in errs)


@FUZZ
@given(pod=st.one_of(pods(), broken_pods()), old=st.one_of(st.none(), pods(), broken_pods()),
       op=st.sampled_from(["CREATE", "UPDATE", "DELETE", "CONNECT", ""]),
       user=st.sampled_from([OPERATOR, "alice", ""]),
       sub=st.sampled_from([None, "ephemeralcontainers", "status", "binding"]))
def test_validating_webhook_never_raises(pod: Any, old: Any, op: str, user: str, sub: str | None) -> None:
    errors = validate_pod(op, pod, old, user, {OPERATOR}, subresource=sub)
    assert isinstance(errors, list)
    assert all(isinstance(e, str) and e.strip() for e in errors)


@FUZZ
@given(pod=pods())
def test_invalid_requests_are_refused_naming_the_key(pod: dict[str, Any]) -> None:
    """What the request parser rejects, the webhook refuses at CREATE, and the refusal names the key."""
    try:
        parse_pod(pod)
    except RequestError as e:
        errors = validate_pod("CREATE", pod, None, "alice", {OPERATOR})
        assert errors, f"invalid request admitted: {e}"
        text = " ".join(errors)
        for one in getattr(e, "errors", (e,)):
            assert one.key in text, (one.key, errors)


@FUZZ
@given(pod=st.one_of(pods(), broken_pods()), kind=st.sampled_from(["Deployment", "Job", "CronJob", "Pod"]),
       op=st.sampled_from(["CREATE", "UPDATE"]))
def test_workload_validation_never_raises(pod: Any, kind: str, op: str) -> None:
    if kind == "CronJob":
        obj: Any = {"kind": kind, "spec": {"jobTemplate": {"spec": {"template": pod}}}}
    elif kind == "Pod":
        obj = pod
    else:
        obj = {"kind": kind, "spec": {"template": pod}}
    errors = validate_workload(op, obj, None)
    assert isinstance(errors, list) and all(isinstance(e, str) and e.strip() for e in errors)


@FUZZ
@given(pod=st.one_of(pods(), broken_pods()))
def test_mutating_webhook_never_raises_and_is_idempotent(pod: Any) -> None:
    before = copy.deepcopy(pod)
    ops = mutate_pod(pod)
    assert pod == before, "mutate_pod changed its input"
    if not ops or not isinstance(pod.get("metadata"), dict):
        return  # the API server never sends a pod without metadata; the ops need not apply there
    mutated = apply_ops(pod, ops)
    assert mutate_pod(mutated) == [], "a second mutation would change the pod again"
    # A valid request, once mutated, passes the validating webhook at CREATE, unless the user
    # set something only refused on purpose (another scheduler, reserved env vars, annotations
    # only the operator writes).
    try:
        parse_pod(pod)
    except RequestError:
        return
    spec = pod.get("spec") or {}
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    names = [c.get("name") for k in ("containers", "initContainers") for c in spec.get(k) or []]
    if len(names) != len(set(names)):
        return  # the API server refuses a pod whose init and app containers share a name
    if spec.get("schedulerName") == "other" or any(
            c.get("env") for k in ("containers", "initContainers") for c in spec.get(k) or []) or any(
            keys.is_allocation_annotation(k) for k in annotations):
        return
    # no minimum slice here: the property is the mutation's, the minimum a pool's policy
    assert validate_pod("CREATE", mutated, None, "alice", {OPERATOR}, min_slice=SliceMinimum(0)) == []
