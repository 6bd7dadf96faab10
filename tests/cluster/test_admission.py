"""The admission webhooks against the real kube-apiserver: our configurations (CEL match
conditions included) are accepted by it, pods are mutated and refused through kvgpu's admission
server (:mod:`kvgpu.admission.server`), and pods that mention no GPU never reach it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from admissionthread import AdmissionThread, admission_in_thread
from aiohttp import web
from clusterkit import free_port, temporarily_applied
from kvgpu.admission import mutate as m
from kvgpu.admission.config import webhook_configurations
from kvgpu.admission.mutate import MANAGED_LABEL
from kvgpu.admission.server import response_body
from kvgpu.admission.validate import validate_pod
from kvgpu.core import keys
from kvgpu.devcluster import Cluster

OPERATOR_USER = "kvgpu-operator"  # the CN of the dev PKI's operator certificate
# Our pods must never be placed (and annotated) by a kvgpu scheduler that other tests may run.
NO_NODE = {"kvgpu.io/admission-test": "no-such-node"}


@pytest.fixture(scope="module")
def webhooks(cluster: Cluster) -> Iterator[AdmissionThread]:
    pki = cluster.run_dir / "pki"
    port = free_port()
    with admission_in_thread(port, str(pki / "webhook.crt"), str(pki / "webhook.key"), {OPERATOR_USER},
                             extra=_add_sidecar_injector) as op:
        ca = (pki / "ca.crt").read_bytes()
        configs = webhook_configurations(url_base=f"https://127.0.0.1:{port}", service=None, ca_bundle=ca,
                                         exclude_namespaces=[])
        with temporarily_applied(cluster, [*configs, _sidecar_configuration(configs[0], port)]):
            _wait_webhooks_active(cluster, op)
            yield op


SIDECAR_LABEL = "admission-test/sidecar"


def _add_sidecar_injector(app: web.Application) -> None:
    """Another mutating webhook (think: a service mesh) that adds a container after ours ran."""

    async def add_sidecar(request: web.Request) -> web.Response:
        req = (await request.json())["request"]
        names = [c["name"] for c in req["object"]["spec"]["containers"]]
        ops = [] if "mesh" in names else [
            {"op": "add", "path": "/spec/containers/-", "value": {"name": "mesh", "image": "registry.invalid/mesh"}}]
        return web.json_response(response_body(req, True, patch=ops))

    app.router.add_post("/test-add-sidecar", add_sidecar)


def _sidecar_configuration(ours: dict[str, Any], port: int) -> dict[str, Any]:
    (hook,) = json.loads(json.dumps(ours["webhooks"]))
    hook.update(name="sidecar.admission-test.kvgpu.io", reinvocationPolicy="Never",
                objectSelector={"matchLabels": {SIDECAR_LABEL: "yes"}})
    hook["rules"] = hook["rules"][:1]
    hook["clientConfig"]["url"] = f"https://127.0.0.1:{port}/test-add-sidecar"
    del hook["matchConditions"]
    # Named after ours: the API server calls configurations in name order, so it runs second.
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "zz-admission-test-sidecar"}, "webhooks": [hook]}


def _pod(namespace: str, name: str, annotations: dict[str, str] | None = None,
         limits: dict[str, str] | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"name": "main", "image": "registry.invalid/cuda:12"}
    if limits:
        c["resources"] = {"limits": limits}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations or {}},
        "spec": {"containers": [c, {"name": "side", "image": "registry.invalid/busybox"}],
                 "nodeSelector": NO_NODE},
    }


def _wait_webhooks_active(cluster: Cluster, op: AdmissionThread, timeout: float = 30.0) -> None:
    """The API server picks up new webhook configurations asynchronously (and a session-wide
    operator may have had its own under the same names): probe until our thread is called and
    refuses a bad pod (server-side dry run, nothing stored)."""
    probe = _pod("default", "kvgpu-probe", {"kvgpu.io/gpumem": "not-a-size"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(probe), check=False)
        if p.returncode != 0 and "kvgpu.io/gpumem" in p.stderr and op.messages("default/kvgpu-probe"):
            return
        time.sleep(0.3)
    raise TimeoutError(f"the kvgpu webhooks never refused the probe pod: {p.stderr or p.stdout}")


def _create(cluster: Cluster, pod: dict[str, Any], *, check: bool = True) -> Any:
    return cluster.kubectl("create", "-f", "-", input=json.dumps(pod), check=check)


def _get(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return dict(json.loads(cluster.kubectl("get", "pod", name, "-n", namespace, "-o", "json").stdout))


def test_annotated_pod_is_mutated(cluster: Cluster, namespace: str, webhooks: AdmissionThread) -> None:
    _create(cluster, _pod(namespace, "sliced", {"kvgpu.io/gpumem": "3000", "kvgpu.io/gpucores": "30"}))
    pod = _get(cluster, namespace, "sliced")
    assert pod["spec"]["schedulerName"] == keys.SCHEDULER_NAME
    assert pod["metadata"]["labels"][MANAGED_LABEL] == "true"
    main, side = pod["spec"]["containers"]
    env = {e["name"]: e for e in main["env"]}
    assert env[keys.ENV_POD_UID]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    assert env[keys.ENV_CLAIM]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['kvgpu.io/claim.main']"
    assert env[keys.ENV_VISIBLE]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['kvgpu.io/devices.main']"
    assert env[keys.ENV_CLAIM_FILE]["value"] == "/etc/kvgpu/claim"
    # The claim only: the shim, ld.so.preload, region and schedule come from the device plugin.
    mounts = {m["mountPath"]: m for m in main["volumeMounts"]}
    assert set(mounts) == {keys.CONTAINER_CLAIM_DIR}
    assert mounts[keys.CONTAINER_CLAIM_DIR]["readOnly"] is True
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert not any("hostPath" in v for v in pod["spec"]["volumes"])
    assert [i["path"] for i in volumes["kvgpu-claim-main"]["downwardAPI"]["items"]] == ["claim"]
    assert mounts[keys.CONTAINER_CLAIM_DIR]["name"] == "kvgpu-claim-main"
    # The other container sees no cards, whatever its image says.
    assert side["env"] == [{"name": keys.ENV_VISIBLE, "value": "none"}]
    assert not any(m["mountPath"] == "/etc/ld.so.preload" for m in side.get("volumeMounts", []))
    # The device plugin's resource, so that the kubelet calls Allocate: the API server defaults
    # the request to the limit; the container without slices requests none.
    assert main["resources"] == {"limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "1"}}
    assert "nvidia.com/gpu" not in str(side.get("resources", {}))
    # The stored (defaulted) object still passes our own validation.
    assert validate_pod("CREATE", pod, None, "someone", {OPERATOR_USER}) == []


RESTRICTED_SC = {"runAsNonRoot": True, "runAsUser": 1000, "allowPrivilegeEscalation": False,
                 "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


@pytest.mark.parametrize("level", ["baseline", "restricted"])
def test_gpu_pods_pass_pod_security(cluster: Cluster, namespace: str, webhooks: AdmissionThread,
                                    level: str) -> None:
    """The real API server's PodSecurity admission (a default plugin) sees the pod after our
    mutation: with no hostPath injected a GPU pod passes ``baseline``, and a compliant one
    ``restricted``; a tenant's own hostPath is still refused there (so this can fail)."""
    cluster.kubectl("label", "namespace", namespace, f"pod-security.kubernetes.io/enforce={level}")

    def gpu_pod(name: str) -> dict[str, Any]:
        pod = _pod(namespace, name, {"kvgpu.io/gpumem": "3000"})
        if level == "restricted":
            for c in pod["spec"]["containers"]:
                c["securityContext"] = RESTRICTED_SC
        return pod

    _create(cluster, gpu_pod("psa"))
    got = _get(cluster, namespace, "psa")
    assert got["spec"]["schedulerName"] == keys.SCHEDULER_NAME  # mutated, and admitted
    host = gpu_pod("psa-host")
    host["spec"]["volumes"] = [{"name": "data", "hostPath": {"path": "/srv/data"}}]
    p = _create(cluster, host, check=False)
    assert p.returncode != 0 and f'violates PodSecurity "{level}:latest"' in p.stderr, p.stderr
    assert "hostPath" in p.stderr and '"data"' in p.stderr and "kvgpu-" not in p.stderr, p.stderr
    if level == "restricted":  # the same pod without the security context is refused
        p = _create(cluster, _pod(namespace, "psa-root", {"kvgpu.io/gpumem": "3000"}), check=False)
        assert p.returncode != 0 and 'violates PodSecurity "restricted:latest"' in p.stderr, p.stderr


def test_doctor_sample_pod_passes_restricted(cluster: Cluster, namespace: str, webhooks: AdmissionThread) -> None:
    """``kubectl vgpu doctor``'s sample pod runs in namespaces of every PodSecurity level."""
    from kvgpu.cli.vgpu.doctor import sample_pod

    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    node = {"metadata": {"name": "no-such-node", "labels": {}}}
    pod = sample_pod(node, namespace, "registry.invalid/cuda:12", 256, 10, 60)
    p = cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(pod), check=False)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["spec"]["schedulerName"] == keys.SCHEDULER_NAME


def test_annotation_form_requests_the_cards_init_containers_too(
    cluster: Cluster, namespace: str, webhooks: AdmissionThread,
) -> None:
    pod = _pod(namespace, "cards", {"kvgpu.io/gpu": "2", "kvgpu.io/gpumem": "1000",
                                    "kvgpu.io/containers": "prep,main"})
    pod["spec"]["initContainers"] = [{"name": "prep", "image": "registry.invalid/cuda:12",
                                      "resources": {"limits": {"cpu": "100m"}}}]
    _create(cluster, pod)
    got = _get(cluster, namespace, "cards")
    prep, main = got["spec"]["initContainers"][0], got["spec"]["containers"][0]
    assert prep["resources"]["limits"] == {"cpu": "100m", "nvidia.com/gpu": "2"}
    assert prep["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert main["resources"]["requests"] == {"nvidia.com/gpu": "2"}
    assert m.mutate_pod(got) == []
    assert validate_pod("CREATE", got, None, "someone", {OPERATOR_USER}) == []
    # A user value that disagrees with the annotation is refused, naming the key.
    bad = _pod(namespace, "cards-bad", {"kvgpu.io/gpu": "2"}, limits={"nvidia.com/gpu": "1"})
    p = _create(cluster, bad, check=False)
    assert p.returncode != 0
    assert 'nvidia.com/gpu of container "main": "1" disagrees with kvgpu.io/gpu ("2")' in p.stderr, p.stderr


def test_reinvoked_after_another_webhook_adds_a_container(
    cluster: Cluster, namespace: str, webhooks: AdmissionThread,
) -> None:
    pod = _pod(namespace, "meshed", {"kvgpu.io/gpumem": "3000"})
    pod["metadata"]["labels"] = {SIDECAR_LABEL: "yes"}
    _create(cluster, pod)
    got = {c["name"]: c for c in _get(cluster, namespace, "meshed")["spec"]["containers"]}
    assert set(got) == {"main", "side", "mesh"}
    # reinvocationPolicy IfNeeded: we ran again after the sidecar appeared, and only added to it.
    assert got["mesh"]["env"] == [{"name": keys.ENV_VISIBLE, "value": "none"}]
    assert [e["name"] for e in got["main"]["env"]] == [e["name"] for e in m.injected_env("main")]
    assert len(got["main"]["volumeMounts"]) == len(m.injected_mounts("main"))
    calls = webhooks.messages(f"mutate CREATE pod {namespace}/meshed:")
    assert len(calls) == 2 and calls[1].endswith(": 1 patch ops"), calls


def test_hami_limits_pod_is_mutated(cluster: Cluster, namespace: str, webhooks: AdmissionThread) -> None:
    pod = _pod(namespace, "hami", limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000"})
    init = {"name": "prep", "image": "registry.invalid/cuda:12",
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    pod["spec"]["initContainers"] = [init]
    _create(cluster, pod)
    got = _get(cluster, namespace, "hami")
    assert got["spec"]["schedulerName"] == keys.SCHEDULER_NAME
    for c in (got["spec"]["initContainers"][0], got["spec"]["containers"][0]):
        names = {e["name"] for e in c["env"]}
        assert names >= {keys.ENV_CLAIM, keys.ENV_VISIBLE, keys.ENV_POD_UID}, c["name"]
    vols = {v["name"] for v in got["spec"]["volumes"]}
    assert {"kvgpu-claim-main", "kvgpu-claim-prep"} <= vols


def test_bad_value_is_refused_with_the_message(
    cluster: Cluster, namespace: str, webhooks: AdmissionThread,
) -> None:
    p = _create(cluster, _pod(namespace, "bad", {"kvgpu.io/gpumem": "3Gx", "kvgpu.io/gpucores": "130"}),
                check=False)
    assert p.returncode != 0
    # one webhook call per pod CREATE: the mutating webhook validates too
    assert 'admission webhook "pods.mutate.kvgpu.io" denied the request' in p.stderr, p.stderr
    assert "kvgpu.io/gpumem" in p.stderr and "3Gx" in p.stderr and "3Gi" in p.stderr, p.stderr
    assert "kvgpu.io/gpucores" in p.stderr and "130" in p.stderr, p.stderr  # every bad key at once


def test_forged_allocation_annotation_is_refused(
    cluster: Cluster, namespace: str, webhooks: AdmissionThread,
) -> None:
    forged = {"kvgpu.io/gpumem": "3000", "kvgpu.io/claim.main": "v1;GPU-0;m=80000"}
    p = _create(cluster, _pod(namespace, "forged", forged), check=False)
    assert p.returncode != 0 and "kvgpu.io/claim.main" in p.stderr, p.stderr


def test_foreign_scheduler_and_preset_node_are_refused(
    cluster: Cluster, namespace: str, webhooks: AdmissionThread,
) -> None:
    pod = _pod(namespace, "volcano", {"kvgpu.io/gpumem": "3000"})
    pod["spec"]["schedulerName"] = "volcano"
    p = _create(cluster, pod, check=False)
    assert p.returncode != 0 and "volcano" in p.stderr and keys.SCHEDULER_NAME in p.stderr, p.stderr
    pod = _pod(namespace, "pinned", {"kvgpu.io/gpumem": "3000"})
    pod["spec"]["nodeName"] = "gpu-node-1"
    p = _create(cluster, pod, check=False)
    assert p.returncode != 0 and "spec.nodeName" in p.stderr, p.stderr


def test_reserved_env_is_refused(cluster: Cluster, namespace: str, webhooks: AdmissionThread) -> None:
    pod = _pod(namespace, "sneaky", {"kvgpu.io/gpumem": "3000"})
    pod["spec"]["containers"][0]["env"] = [{"name": "CUDA_DISABLE_CONTROL", "value": "true"}]
    pod["spec"]["containers"][1]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    p = _create(cluster, pod, check=False)
    assert p.returncode != 0, p.stdout
    assert "CUDA_DISABLE_CONTROL" in p.stderr and "NVIDIA_VISIBLE_DEVICES" in p.stderr, p.stderr


def test_allocation_annotations_change_only_by_the_operator(
    cluster: Cluster, namespace: str, webhooks: AdmissionThread,
) -> None:
    _create(cluster, _pod(namespace, "bound", {"kvgpu.io/gpumem": "3000"}))
    key = keys.devices_annotation("main")
    as_operator = f"--kubeconfig={cluster.operator_kubeconfig}"  # the last --kubeconfig wins
    cluster.kubectl(as_operator, "annotate", "pod", "bound", "-n", namespace, f"{key}=GPU-aaaa")
    p = cluster.kubectl("annotate", "pod", "bound", "-n", namespace, "--overwrite", f"{key}=GPU-bbbb",
                        check=False)
    assert p.returncode != 0 and key in p.stderr and "only be changed by the kvgpu operator" in p.stderr, \
        p.stderr
    p = cluster.kubectl("annotate", "pod", "bound", "-n", namespace, f"{key}-", check=False)
    assert p.returncode != 0 and key in p.stderr, p.stderr
    p = cluster.kubectl("label", "pod", "bound", "-n", namespace, f"{MANAGED_LABEL}-", check=False)
    assert p.returncode != 0 and MANAGED_LABEL in p.stderr, p.stderr
    assert _get(cluster, namespace, "bound")["metadata"]["annotations"][key] == "GPU-aaaa"
    p = cluster.kubectl("annotate", "pod", "bound", "-n", namespace, "--overwrite", "kvgpu.io/gpumem=6000",
                        check=False)
    assert p.returncode != 0 and "fixed when the pod is created" in p.stderr, p.stderr
    # Anything else stays the user's to change.
    cluster.kubectl("label", "pod", "bound", "-n", namespace, "team=ml")
    cluster.kubectl("annotate", "pod", "bound", "-n", namespace, "note=hello")


def test_debug_container_gets_no_cards(cluster: Cluster, namespace: str, webhooks: AdmissionThread) -> None:
    _create(cluster, _pod(namespace, "dbg", {"kvgpu.io/gpumem": "3000"}))
    p = cluster.kubectl("debug", "dbg", "-n", namespace, "--image=registry.invalid/cuda-debug",
                        "--container=evil", "--env=NVIDIA_VISIBLE_DEVICES=all", check=False)
    assert p.returncode != 0 and "ephemeral container 'evil'" in p.stderr, p.stderr
    # kubectl's default profile (general) adds SYS_PTRACE, refused in a sliced pod (it could patch the
    # shim's limits in the tenant's process); baseline is the profile for sliced pods
    cluster.kubectl("debug", "dbg", "-n", namespace, "--image=registry.invalid/cuda-debug", "--container=ok",
                    "--profile=baseline")
    (eph,) = _get(cluster, namespace, "dbg")["spec"]["ephemeralContainers"]
    assert eph["name"] == "ok" and eph["env"] == [{"name": keys.ENV_VISIBLE, "value": "none"}]


def _deployment(namespace: str, name: str, annotations: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}}, "template": {
                "metadata": {"labels": {"app": name}, "annotations": annotations},
                "spec": {"containers": [{"name": "main", "image": "registry.invalid/cuda:12"}],
                         "nodeSelector": NO_NODE}}}}


def test_workloads_are_checked_at_apply_and_their_pods_mutated(
    cluster: Cluster, namespace: str, webhooks: AdmissionThread,
) -> None:
    bad = _deployment(namespace, "bad", {"kvgpu.io/gpumem": "3Gx"})
    p = cluster.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert p.returncode != 0 and "workloads.validate.kvgpu.io" in p.stderr and "3Gx" in p.stderr, p.stderr
    cron = {"apiVersion": "batch/v1", "kind": "CronJob",
            "metadata": {"name": "nightly", "namespace": namespace},
            "spec": {"schedule": "0 3 * * *", "jobTemplate": {"spec": {"template": {
                "metadata": {"annotations": {"kvgpu.io/gpucores": "101"}},
                "spec": {"restartPolicy": "Never",
                         "containers": [{"name": "main", "image": "registry.invalid/cuda:12"}]}}}}}}
    p = cluster.kubectl("apply", "-f", "-", input=json.dumps(cron), check=False)
    assert p.returncode != 0 and '"101"' in p.stderr, p.stderr
    # A good Deployment: the ReplicaSet controller's pod (generateName, no uid yet) is mutated.
    good = _deployment(namespace, "good", {"kvgpu.io/gpumem": "3Gi"})
    cluster.kubectl("apply", "-f", "-", input=json.dumps(good))
    deadline = time.monotonic() + 60
    pods: list[dict[str, Any]] = []
    while not pods and time.monotonic() < deadline:
        out = cluster.kubectl("get", "pods", "-n", namespace, "-l", "app=good", "-o", "json").stdout
        pods = json.loads(out)["items"]
        time.sleep(0.3)
    assert pods, "the ReplicaSet never created its pod"
    assert pods[0]["spec"]["schedulerName"] == keys.SCHEDULER_NAME
    assert pods[0]["metadata"]["labels"][MANAGED_LABEL] == "true"
    cluster.kubectl("scale", "deployment", "good", "-n", namespace, "--replicas=0")
    # Workloads without GPU keys are not even sent to the operator.
    cluster.kubectl("apply", "-f", "-", input=json.dumps(_deployment(namespace, "web", {"team": "web"})))
    assert not webhooks.messages(f"deployments {namespace}/web")
    assert webhooks.messages(f"deployments {namespace}/good")


def test_pod_without_gpu_keys_never_reaches_the_webhook(
    cluster: Cluster, namespace: str, webhooks: AdmissionThread,
) -> None:
    _create(cluster, _pod(namespace, "plain", {"team": "web"}))
    cluster.kubectl("label", "pod", "plain", "-n", namespace, "x=y")
    # ... unless it tries to look like one (CEL routes the label; validation refuses it).
    p = cluster.kubectl("label", "pod", "plain", "-n", namespace, f"{MANAGED_LABEL}=true", check=False)
    assert p.returncode != 0 and MANAGED_LABEL in p.stderr, p.stderr
    pod = _get(cluster, namespace, "plain")
    assert pod["spec"]["schedulerName"] == "default-scheduler"
    assert MANAGED_LABEL not in pod["metadata"].get("labels", {})
    assert all("env" not in c for c in pod["spec"]["containers"])
    # Positive control: the same request for a GPU pod is logged by the handlers.
    _create(cluster, _pod(namespace, "gpu", {"kvgpu.io/gpu": "1"}))
    assert webhooks.messages(f"{namespace}/gpu"), "the handlers log every call they get"
    calls = webhooks.messages(f"{namespace}/plain")
    assert len(calls) == 1 and "validate UPDATE" in calls[0], calls  # only the label attempt
