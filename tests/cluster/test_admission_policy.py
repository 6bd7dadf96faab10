"""The pod policy (:mod:`kvgpu.admission.podpolicy`) against the real kube-apiserver: a mutating
webhook registered after kvgpu's (a tiny HTTPS webhook this test serves, ``reinvocationPolicy:
IfNeeded`` like kvgpu's) tries to turn a plain pod into a GPU pod, or to slip reserved env
vars, allocation annotations, a hostPath onto an ``Allocate`` target or a reserved volume name
into a GPU pod after kvgpu's webhook last saw it; the API server refuses each through the
policy, and admits a harmless change. Without the policy the same attacks pass (the control
below), which is why the policy exists. And a GPU pod costs one admission webhook call at
create, read from the API server's own metrics."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from admissionthread import AdmissionThread, admission_in_thread
from aiohttp import web
from clusterkit import free_port, temporarily_applied
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvgpu.admission.config import MUTATE_WEBHOOK, VALIDATE_WEBHOOK, webhook_configurations
from kvgpu.admission.podpolicy import POD_POLICY_NAME, pod_policy
from kvgpu.admission.server import response_body
from kvgpu.core import keys
from kvgpu.devcluster import Cluster

from tests.unit.test_fuzz_admission import pods as fuzz_pods

OPERATOR_USER = "kvgpu-operator"
NO_NODE = {"kvgpu.io/admission-test": "no-such-node"}  # never placed by a kvgpu scheduler of other tests
MODE = "attack.kvgpu.io/mode"  # label: which change the later webhook makes
ROUND = "attack.kvgpu.io/round"  # annotation: how often the later webhook has been called
PATCH = "attack.kvgpu.io/patch"  # annotation (mode "patch"): the ops of the second call, JSON
FORGED_CLAIM = "gpu=GPU-forged,mem=81559,cores=100"
EVIL_SHIM = "/tmp/kvgpu-evil-shim"

#: mode -> JSON-patch ops the later webhook adds on its second call (the first only strips the
#: managed label, which kvgpu's reinvocation puts back, so the API server calls the later
#: webhook once more: the last word is its own, after kvgpu's webhook last saw the pod).
ATTACKS: dict[str, list[dict[str, Any]]] = {
    "env": [{"op": "add", "path": "/spec/containers/1/env/-",
             "value": {"name": keys.ENV_VISIBLE, "value": "all"}},
            {"op": "add", "path": "/spec/containers/0/env/-",
             "value": {"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "80g"}}],
    "annotation": [{"op": "add", "path": "/metadata/annotations/kvgpu.io~1claim.main", "value": FORGED_CLAIM}],
    "hostpath": [{"op": "add", "path": "/spec/volumes/-", "value": {"name": "evil", "hostPath": {"path": EVIL_SHIM}}},
                 {"op": "add", "path": "/spec/containers/0/volumeMounts/-",
                  "value": {"name": "evil", "mountPath": keys.CONTAINER_SHIM_DIR, "readOnly": True}}],
    "volname": [{"op": "add", "path": "/spec/volumes/-", "value": {"name": "kvgpu-claims", "emptyDir": {}}},
                {"op": "add", "path": "/spec/containers/1/volumeMounts",
                 "value": [{"name": "kvgpu-claims", "mountPath": "/data"}]}],
    "harmless": [{"op": "add", "path": "/spec/containers/0/env/-", "value": {"name": "FOO", "value": "bar"}},
                 {"op": "add", "path": "/metadata/labels/team", "value": "web"},
                 {"op": "add", "path": "/metadata/annotations/example.com~1x", "value": "y"}],
}
#: a plain pod becomes a GPU pod (kvgpu's webhook skipped it: no GPU mention yet) with forged
#: allocation annotations, on the later webhook's first and only call
GPU_ATTACK = [{"op": "add", "path": "/metadata/annotations/kvgpu.io~1gpumem", "value": "3000"},
              {"op": "add", "path": "/metadata/annotations/kvgpu.io~1devices.main", "value": "GPU-forged"}]


class LaterWebhook:
    """The second mutating webhook: its calls as ``(pod name, round)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/test-later-webhook", self.handle)

    async def handle(self, request: web.Request) -> web.Response:
        req = (await request.json())["request"]
        pod = req["object"]
        meta = pod["metadata"]
        mode = meta.get("labels", {}).get(MODE, "")
        n = int(meta.get("annotations", {}).get(ROUND, "0")) + 1
        self.calls.append((meta.get("name", ""), n))
        ops: list[dict[str, Any]] = []
        if not meta.get("annotations"):
            ops.append({"op": "add", "path": "/metadata/annotations", "value": {}})
        ops.append({"op": "add", "path": f"/metadata/annotations/{ROUND.replace('/', '~1')}", "value": str(n)})
        if mode == "gpu" and n == 1:
            ops += GPU_ATTACK
        elif n == 1 and keys.POD_MANAGED_LABEL in meta.get("labels", {}):
            ops.append({"op": "remove", "path": "/metadata/labels/" + keys.POD_MANAGED_LABEL.replace("/", "~1")})
        elif n == 2:
            ops += json.loads(meta["annotations"][PATCH]) if mode == "patch" else ATTACKS.get(mode, [])
        return web.json_response(response_body(req, True, patch=ops))


def _later_configuration(ours: dict[str, Any], port: int) -> dict[str, Any]:
    (hook,) = json.loads(json.dumps(ours["webhooks"]))
    hook.update(name="later.admission-test.kvgpu.io", reinvocationPolicy="IfNeeded",
                objectSelector={"matchExpressions": [{"key": MODE, "operator": "Exists"}]})
    hook["rules"] = hook["rules"][:1]
    hook["clientConfig"]["url"] = f"https://127.0.0.1:{port}/test-later-webhook"
    del hook["matchConditions"]
    # Named after ours: the API server calls configurations in name order.
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "zz-admission-test-later"}, "webhooks": [hook]}


@pytest.fixture(scope="module")
def later() -> LaterWebhook:
    return LaterWebhook()


@pytest.fixture(scope="module")
def webhooks(cluster: Cluster, later: LaterWebhook) -> Iterator[AdmissionThread]:
    pki = cluster.run_dir / "pki"
    port = free_port()
    with admission_in_thread(port, str(pki / "webhook.crt"), str(pki / "webhook.key"), {OPERATOR_USER},
                             extra=later.add_to) as op:
        ca = (pki / "ca.crt").read_bytes()
        configs = webhook_configurations(url_base=f"https://127.0.0.1:{port}", service=None, ca_bundle=ca,
                                         exclude_namespaces=[])
        with temporarily_applied(cluster, [*pod_policy([]), *configs, _later_configuration(configs[0], port)]):
            _wait_until(cluster, lambda: _probe_refused(cluster, op), "kvgpu's webhook and the pod policy")
            yield op


def _pod(namespace: str, name: str, mode: str | None, gpu: bool = True) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace,
                            "annotations": {"kvgpu.io/gpumem": "3000"} if gpu else {}}
    if mode:
        meta["labels"] = {MODE: mode}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "main", "image": "registry.invalid/cuda:12"},
                                    {"name": "side", "image": "registry.invalid/busybox"}],
                     "nodeSelector": NO_NODE}}


def _dry_run(cluster: Cluster, pod: dict[str, Any]) -> Any:
    return cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(pod),
                           check=False)


def _probe_refused(cluster: Cluster, op: AdmissionThread) -> bool:
    bad = _dry_run(cluster, {**_pod("default", "kvgpu-probe", None),
                             "metadata": {"name": "kvgpu-probe", "annotations": {"kvgpu.io/gpumem": "x"}}})
    if bad.returncode == 0 or not op.messages("default/kvgpu-probe"):
        return False
    return _policy_refuses(cluster)


def _policy_refuses(cluster: Cluster) -> bool:
    p = _dry_run(cluster, _pod("default", "kvgpu-probe-gpu", "gpu", gpu=False))
    return p.returncode != 0 and POD_POLICY_NAME in p.stderr


def _wait_until(cluster: Cluster, cond: Any, what: str, timeout: float = 30.0) -> None:
    """The API server loads webhook configurations and policies asynchronously."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.3)
    raise TimeoutError(f"{what} never took effect")


def _calls(later: LaterWebhook, name: str) -> list[int]:
    return [n for pod, n in later.calls if pod == name]


def test_a_later_webhook_cannot_make_a_plain_pod_a_gpu_pod(
    cluster: Cluster, namespace: str, webhooks: AdmissionThread, later: LaterWebhook,
) -> None:
    p = _dry_run(cluster, _pod(namespace, "plain-to-gpu", "gpu", gpu=False))
    assert p.returncode != 0, p.stdout
    assert POD_POLICY_NAME in p.stderr and f"no {keys.POD_ADMITTED} annotation" in p.stderr, p.stderr
    assert _calls(later, "plain-to-gpu") == [1]
    assert not webhooks.messages(f"{namespace}/plain-to-gpu"), "kvgpu's webhook never saw it"


@pytest.mark.parametrize(("mode", "needle"), [
    ("env", "env var kvgpu reserves"),
    ("annotation", "allocation annotations"),
    ("hostpath", "mounts at a path the device plugin mounts"),
    ("volname", "a volume uses a name kvgpu reserves"),
])
def test_a_later_webhook_cannot_change_a_gpu_pod_after_kvgpu(
    cluster: Cluster, namespace: str, webhooks: AdmissionThread, later: LaterWebhook, mode: str, needle: str,
) -> None:
    name = f"late-{mode}"
    p = _dry_run(cluster, _pod(namespace, name, mode))
    assert p.returncode != 0, p.stdout
    assert POD_POLICY_NAME in p.stderr and needle in p.stderr, p.stderr
    # The later webhook had the last word: called again after kvgpu's reinvocation.
    assert _calls(later, name) == [1, 2]
    ours = webhooks.messages(f"mutate CREATE pod {namespace}/{name}:")
    assert len(ours) == 2, ours


# After kvgpu's mutation: containers/0 is "main" (sliced: env, claim mount, nvidia.com/gpu
# limit; env/2 is NVIDIA_VISIBLE_DEVICES), containers/1 "side" (NVIDIA_VISIBLE_DEVICES=none).
_MORE = {
    "scheduler": ([{"op": "replace", "path": "/spec/schedulerName", "value": "default-scheduler"}],
                  "scheduled by 'kvgpu-scheduler'"),
    "node-name": ([{"op": "add", "path": "/spec/nodeName", "value": "some-node"}], "no preset spec.nodeName"),
    "privileged": ([{"op": "add", "path": "/spec/containers/0/securityContext", "value": {"privileged": True}}],
                   "is privileged"),
    "host-pid": ([{"op": "add", "path": "/spec/hostPID", "value": True}], "sets hostPID"),
    "visible-all": ([{"op": "replace", "path": "/spec/containers/0/env/2",
                      "value": {"name": keys.ENV_VISIBLE, "value": "all"}}], "env var kvgpu reserves"),
    "new-container": ([{"op": "add", "path": "/spec/containers/-", "value": {"name": "late", "image": "x"}}],
                      f"lacks {keys.ENV_VISIBLE}"),
    "side-reads-claim": ([{"op": "add", "path": "/spec/containers/1/volumeMounts", "value": [
        {"name": "kvgpu-claim-main", "mountPath": keys.CONTAINER_CLAIM_DIR, "readOnly": True}]}],
        "mounts kvgpu's claim volume"),
    "claim-replaced": ([{"op": "add", "path": "/spec/volumes/-", "value": {"name": "mine", "emptyDir": {}}},
                        {"op": "replace", "path": "/spec/containers/0/volumeMounts/0/name", "value": "mine"}],
                       "lacks its claim mount"),
    "region-root": ([{"op": "add", "path": "/spec/volumes/-",
                      "value": {"name": "regions", "hostPath": {"path": "/var/lib/kvgpu/containers"}}}],
                    "hostPath volume of a pod with GPU slices"),
    "unclean-hostpath": ([{"op": "add", "path": "/spec/volumes/-",
                           "value": {"name": "regions", "hostPath": {"path": "/var/lib//kvgpu"}}}],
                         "not a clean absolute path"),
    "side-gets-a-card": ([{"op": "add", "path": "/spec/containers/1/resources",
                           "value": {"limits": {"nvidia.com/gpu": "1"}}}], "GPU slice resources differ"),
    "card-removed": ([{"op": "remove", "path": "/spec/containers/0/resources"}],  # limit and defaulted request
                     "each container with slices requests nvidia.com/gpu"),
    # the marker forged empty and the card limit dropped: the injected env still gives it away
    "marker-emptied": ([{"op": "replace", "path": "/metadata/annotations/kvgpu.io~1admitted", "value": ""},
                        {"op": "remove", "path": "/spec/containers/0/resources"}], "env var kvgpu reserves"),
    "card-swapped-for-a-sibling": ([{"op": "remove", "path": "/spec/containers/0/resources"},
                                    {"op": "add", "path": "/spec/containers/1/resources",
                                     "value": {"limits": {"nvidia.com/gpu": "1"}}}], "GPU slice resources differ"),
}


@pytest.mark.parametrize("case", sorted(_MORE))
def test_every_rule_holds_against_a_later_webhook(
    cluster: Cluster, namespace: str, webhooks: AdmissionThread, later: LaterWebhook, case: str,
) -> None:
    ops, needle = _MORE[case]
    pod = _pod(namespace, f"late-{case}", "patch")
    pod["metadata"]["annotations"][PATCH] = json.dumps(ops)
    p = _dry_run(cluster, pod)
    assert p.returncode != 0, p.stdout
    assert POD_POLICY_NAME in p.stderr and needle in p.stderr, p.stderr
    assert _calls(later, f"late-{case}") == [1, 2]


def test_a_harmless_host_path_from_a_later_webhook_is_admitted(
    cluster: Cluster, namespace: str, webhooks: AdmissionThread, later: LaterWebhook,
) -> None:
    pod = _pod(namespace, "late-datasets", "patch")
    pod["metadata"]["annotations"][PATCH] = json.dumps([{"op": "add", "path": "/spec/volumes/-", "value": {
        "name": "datasets", "hostPath": {"path": "/opt/datasets"}}}])
    p = _dry_run(cluster, pod)
    assert p.returncode == 0, p.stderr
    assert _calls(later, "late-datasets") == [1, 2]


@st.composite
def gpu_pods(draw: Any) -> dict[str, Any]:
    """Pods kvgpu's webhook mostly admits with slices: either form, one to three containers and
    maybe an init container, the slices on some of them, harmless env, volumes and mounts."""
    names = draw(st.lists(st.sampled_from(["main", "side", "worker"]), min_size=1, max_size=3, unique=True))
    vol = draw(st.sampled_from(["data", "kvgpu-data"]))  # kvgpu- names other than kvgpu's are the user's
    ctrs: list[dict[str, Any]] = [{"name": n, "image": "x"} for n in names]
    inits = [{"name": "prep", "image": "x"}] if draw(st.booleans()) else []
    ann: dict[str, str] = {}
    if draw(st.booleans()):
        ann["kvgpu.io/gpumem"] = draw(st.sampled_from(["1000", "3000", "3Gi"]))
        if draw(st.booleans()):
            ann["kvgpu.io/gpu"] = draw(st.sampled_from(["1", "2"]))
        if len(names) > 1 or inits:
            chosen = draw(st.lists(st.sampled_from(names + [c["name"] for c in inits]), min_size=1, unique=True))
            ann["kvgpu.io/containers"] = ",".join(chosen)
        if draw(st.booleans()):
            ann["kvgpu.io/mode"] = "mps"
    else:
        for c in draw(st.lists(st.sampled_from(ctrs), min_size=1, unique_by=lambda c: c["name"])):
            c["resources"] = {"limits": draw(st.sampled_from([
                {"nvidia.com/mig-1g.18gb": "1"},  # a MIG instance: a plain extended resource, not a slice
                {"nvidia.com/gpu": "1"}, {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000"},
                {"nvidia.com/gpumem": "3000"}, {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "30"}]))}
    for c in ctrs + inits:
        if draw(st.booleans()):
            c["env"] = [{"name": "HOME", "value": "/tmp"}]
        if draw(st.booleans()):
            c["volumeMounts"] = [{"name": vol, "mountPath": draw(st.sampled_from(["/data", "/data/", "/mnt/x"]))}]
    spec: dict[str, Any] = {"containers": ctrs}
    if inits:
        spec["initContainers"] = inits
    if any("volumeMounts" in c for c in ctrs + inits):
        spec["volumes"] = [draw(st.sampled_from([{"name": vol, "emptyDir": {}},
                                                 {"name": vol, "hostPath": {"path": "/opt/datasets"}}]))]
    if draw(st.booleans()):
        spec["schedulerName"] = "default-scheduler"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "fuzz", "annotations": ann}, "spec": spec}


@given(pod=st.one_of(gpu_pods(), fuzz_pods()))
@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_the_policy_admits_every_pod_kvgpus_webhook_admits(
    cluster: Cluster, namespace: str, webhooks: AdmissionThread, pod: dict[str, Any],
) -> None:
    """No false refusals: random GPU pods, and the admission fuzzer's (tests/unit/test_fuzz_admission.py),
    through the real API server; whatever kvgpu's webhook admits, the policy admits too."""
    pod["metadata"]["namespace"] = namespace
    p = _dry_run(cluster, pod)
    assert POD_POLICY_NAME not in p.stderr, (pod, p.stderr)


def test_a_pod_without_slices_keeps_its_own_env_and_volumes(
    cluster: Cluster, namespace: str, webhooks: AdmissionThread,
) -> None:
    """A pod that mentions GPUs but asks for no slice (a HAMi card-type selector only) is not
    kvgpu's to police beyond allocation annotations, for the policy as for validation."""
    pod = _pod(namespace, "no-slices", None, gpu=False)
    pod["metadata"]["annotations"] = {"nvidia.com/use-gputype": "A100"}
    pod["spec"]["containers"][0]["env"] = [{"name": "LD_PRELOAD", "value": "/opt/lib/libtrace.so"},
                                           {"name": keys.ENV_VISIBLE, "value": "all"}]
    pod["spec"]["volumes"] = [{"name": "kvgpu-shim", "emptyDir": {}}]
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "kvgpu-shim", "mountPath": "/opt/lib"}]
    p = _dry_run(cluster, pod)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["metadata"]["annotations"][keys.POD_ADMITTED] == ""


def test_a_mig_pod_passes(cluster: Cluster, namespace: str, webhooks: AdmissionThread) -> None:
    """A MIG instance (``nvidia.com/mig-<profile>``, NVIDIA's mixed strategy) is a plain extended
    resource kvgpu's webhook injects nothing for; the policy does not take it for a slice."""
    pod = _pod(namespace, "mig", None, gpu=False)
    pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/mig-1g.18gb": "1"}}
    p = _dry_run(cluster, pod)
    assert p.returncode == 0, p.stderr


def test_the_policy_type_checks_against_the_pod_schema(cluster: Cluster, webhooks: AdmissionThread) -> None:
    """The API server type-checks the CEL against the Pod schema (a misspelt field is a warning
    there, and never matches at run time)."""
    def checked() -> dict[str, Any] | None:
        obj = json.loads(cluster.kubectl("get", "validatingadmissionpolicy", POD_POLICY_NAME, "-o", "json").stdout)
        status = obj.get("status") or {}
        return status if status.get("observedGeneration") == obj["metadata"]["generation"] else None

    _wait_until(cluster, lambda: checked() is not None, "the policy's type check")
    status = checked() or {}
    assert not (status.get("typeChecking") or {}).get("expressionWarnings"), status


def test_a_harmless_later_change_is_admitted(
    cluster: Cluster, namespace: str, webhooks: AdmissionThread, later: LaterWebhook,
) -> None:
    p = _dry_run(cluster, _pod(namespace, "late-harmless", "harmless"))
    assert p.returncode == 0, p.stderr
    pod = json.loads(p.stdout)
    assert _calls(later, "late-harmless") == [1, 2]
    assert pod["metadata"]["annotations"][keys.POD_ADMITTED] == "main"
    assert pod["metadata"]["labels"] == {MODE: "harmless", keys.POD_MANAGED_LABEL: "true", "team": "web"}
    assert pod["spec"]["schedulerName"] == keys.SCHEDULER_NAME
    main = pod["spec"]["containers"][0]
    assert {"name": "FOO", "value": "bar"} in main["env"]


@contextmanager
def _without_policy_binding(cluster: Cluster) -> Iterator[None]:
    """The pod policy's binding deleted for the block (the build without the policy), then
    applied again and waited for."""
    _, binding = pod_policy([])
    cluster.kubectl("delete", "validatingadmissionpolicybinding", POD_POLICY_NAME)
    try:
        _wait_until(cluster, lambda: not _policy_refuses(cluster), "deleting the policy binding")
        yield
    finally:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(binding))
        _wait_until(cluster, lambda: _policy_refuses(cluster), "the policy binding")


def test_without_the_policy_the_attacks_pass(
    cluster: Cluster, namespace: str, webhooks: AdmissionThread,
) -> None:
    """Control: kvgpu's one webhook call alone does not stop these attacks; the policy does."""
    with _without_policy_binding(cluster):
        admitted = {}
        for mode in ("gpu", *ATTACKS):
            p = _dry_run(cluster, _pod(namespace, f"nopolicy-{mode}", mode, gpu=mode != "gpu"))
            admitted[mode] = p.returncode == 0
            if mode == "env" and p.returncode == 0:
                side = json.loads(p.stdout)["spec"]["containers"][1]
                assert {"name": keys.ENV_VISIBLE, "value": "all"} in side["env"]
    assert admitted == dict.fromkeys(("gpu", *ATTACKS), True)


def _webhook_calls(cluster: Cluster) -> dict[tuple[str, str], float]:
    """The API server's admission webhook calls so far, by (webhook name, operation)."""
    out: dict[tuple[str, str], float] = {}
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    for line in text.splitlines():
        if not line.startswith("apiserver_admission_webhook_admission_duration_seconds_count{"):
            continue
        labels = line[line.index("{") + 1:line.rindex("}")]
        kv = dict(p.split("=", 1) for p in labels.replace('",', '"\n').splitlines())
        key = (kv["name"].strip('"'), kv["operation"].strip('"'))
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_one_webhook_call_per_gpu_pod(cluster: Cluster, namespace: str, webhooks: AdmissionThread) -> None:
    pods = 4
    before = _webhook_calls(cluster)
    for i in range(pods):
        pod = _pod(namespace, f"counted-{i}", None)
        cluster.kubectl("create", "-f", "-", input=json.dumps(pod))
    after = _webhook_calls(cluster)

    def delta(name: str, op: str) -> float:
        return after.get((name, op), 0.0) - before.get((name, op), 0.0)

    assert delta(MUTATE_WEBHOOK, "CREATE") == pods
    assert delta(VALIDATE_WEBHOOK, "CREATE") == 0
    assert sum(v - before.get(k, 0.0) for k, v in after.items() if k[1] == "CREATE") == pods
    stored = json.loads(cluster.kubectl("get", "pod", "counted-0", "-n", namespace, "-o", "json").stdout)
    assert stored["metadata"]["annotations"][keys.POD_ADMITTED] == "main"
