"""``kubectl vgpu doctor``'s checks, each a pure function of API objects: every failure mode gives
the line that names it and its fix. Nodes are built as the fake-node code builds them
(kvgpu.devcluster.fakenodes), inventories as the agent's registrar publishes them."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

from kvgpu.cli.vgpu import doctor
from kvgpu.cli.vgpu.doctor import FAIL, OK, SKIP, Finding, SampleOutcome
from kvgpu.core import keys
from kvgpu.core.inventory import SimulatedCardSpec, SimulatedNode, Slicing
from kvgpu.devcluster.fakenodes import node_manifest

RES = "nvidia.com/gpu"
NS = "kvgpu-system"


def _node(cards: int = 2, split: int = 10, healthy: bool = True, shim: dict[str, Any] | None = None) -> dict[str, Any]:
    n = node_manifest(SimulatedNode("gpu-a", (SimulatedCardSpec(count=cards),)), split_count=split)
    inv = SimulatedNode("gpu-a", (SimulatedCardSpec(count=cards),)).inventory()
    inv = inv.with_slicing({c.uuid: Slicing(pool="default", split_count=split) for c in inv.cards})
    if not healthy:
        inv = dataclasses.replace(inv, cards=tuple(dataclasses.replace(c, healthy=False, reason="XID 79")
                                                   for c in inv.cards))
    n["metadata"]["annotations"][keys.NODE_INVENTORY] = inv.dumps()
    st = {"version": "1", "file": "libvgpu.so.1", "sha256": "ab", "loadable": True, "error": ""}
    n["metadata"]["annotations"][keys.NODE_SHIM] = json.dumps(shim if shim is not None else st)
    return n


def _pod(ready: bool = True, phase: str = "Running") -> dict[str, Any]:
    return {"metadata": {"name": "kvgpu-agent-x1", "namespace": NS}, "spec": {"nodeName": "gpu-a"},
            "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def _fails(f: Finding, *words: str) -> None:
    assert f.status == FAIL, f
    text = doctor.line("gpu-a", [f])
    assert text.startswith(f"gpu-a  FAIL  {f.check}: "), text
    for w in words:
        assert w in text, (w, text)


def test_a_healthy_node_passes_every_check() -> None:
    n = _node()
    found = [doctor.check_agent("gpu-a", [_pod()], None, NS), doctor.check_inventory(n, [], NS),
             doctor.check_device_plugin(n, RES, [], NS), doctor.check_nvidia_plugin(n, [], RES),
             doctor.check_shim(n, [_pod()], NS),
             doctor.check_sample(SampleOutcome("Succeeded", "gpu-a", "KVGPU-DOCTOR memory.total=256\n"), 256, 60,
                                 "team")]
    assert [f.status for f in found] == [OK] * 6, found
    assert doctor.line("gpu-a", found) == "gpu-a  OK"


def test_agent_missing_not_ready_or_unreachable() -> None:
    _fails(doctor.check_agent("gpu-a", [], None, NS), "no kvgpu agent pod on the node",
           "kubectl -n kvgpu-system describe daemonset kvgpu-agent", "kubectl label node gpu-a kvgpu.io/gpu-node=true")
    _fails(doctor.check_agent("gpu-a", [_pod(ready=False, phase="Pending")], None, NS),
           "kvgpu-agent-x1 is not Ready (Pending)", "kubectl -n kvgpu-system logs kvgpu-agent-x1")
    _fails(doctor.check_agent("gpu-a", [_pod()], "forbidden: pods/proxy", NS), "does not answer",
           "forbidden", "/api/v1/namespaces/kvgpu-system/pods/kvgpu-agent-x1:9394/proxy/metrics")
    # the chart's devicePlugin.metricsPort: the port the pod names "metrics" is the one asked
    moved = _pod()
    moved["spec"]["containers"] = [{"name": "agent", "ports": [{"name": "health", "containerPort": 1},
                                                                 {"name": "metrics", "containerPort": 19394}]}]
    assert doctor.metrics_port(moved) == 19394 and doctor.metrics_port(_pod()) == doctor.AGENT_METRICS_PORT
    _fails(doctor.check_agent("gpu-a", [moved], "refused", NS), "/pods/kvgpu-agent-x1:19394/proxy/metrics")


def test_inventory_missing_unparseable_empty_unpooled_unhealthy() -> None:
    n = _node()
    del n["metadata"]["annotations"][keys.NODE_INVENTORY]
    _fails(doctor.check_inventory(n, [], NS), "no kvgpu.io/inventory annotation",
           "get pods -o wide -l app.kubernetes.io/component=agent", "spec.nodeName=gpu-a")
    _fails(doctor.check_inventory(n, [_pod()], NS), "kubectl -n kvgpu-system logs kvgpu-agent-x1")
    n["metadata"]["annotations"][keys.NODE_INVENTORY] = "{not json"
    _fails(doctor.check_inventory(n, [], NS), "kvgpu.io/inventory does not parse")
    _fails(doctor.check_inventory(_node(cards=0), [], NS), "found no GPU", "nvidia-smi")
    unpooled = node_manifest(SimulatedNode("gpu-a", (SimulatedCardSpec(count=2),)))  # no slicing: no pool
    _fails(doctor.check_inventory(unpooled, [], NS), "2 card(s) but no VGPUPool covers them", "kubectl apply -f")
    _fails(doctor.check_inventory(_node(healthy=False), [_pod()], NS), "every sliced card is unhealthy (XID 79)",
           "kubectl describe node gpu-a")


def test_device_plugin_not_registered_or_all_unhealthy() -> None:
    n = copy.deepcopy(_node())  # capacity and allocatable are one dict in node_manifest
    n["status"]["capacity"].pop(RES)
    n["status"]["allocatable"].pop(RES, None)
    _fails(doctor.check_device_plugin(n, RES, [], NS), "no nvidia.com/gpu in the node's capacity", "not registered")
    n = copy.deepcopy(_node())
    n["status"]["allocatable"] = {**n["status"]["allocatable"], RES: "0"}
    _fails(doctor.check_device_plugin(n, RES, [], NS), "capacity 20 but allocatable 0")
    assert doctor.check_device_plugin(_node(), RES, [], NS).message == "nvidia.com/gpu 20/20 allocatable"


def test_nvidia_device_plugin_next_to_kvgpus() -> None:
    nv = {"metadata": {"name": "nvidia-device-plugin-daemonset-abc", "namespace": "gpu-operator"},
          "spec": {"nodeName": "gpu-a"}}
    _fails(doctor.check_nvidia_plugin(_node(), [nv], RES), "gpu-operator/nvidia-device-plugin-daemonset-abc",
           "--set devicePlugin.enabled=false")
    n = _node()
    n["status"]["capacity"][RES] = "2"  # one per card: NVIDIA's plugin won the registration
    _fails(doctor.check_nvidia_plugin(n, [], RES), "capacity 2, but kvgpu offers 20")


def test_shim_not_reported_missing_or_unloadable() -> None:
    n = _node()
    del n["metadata"]["annotations"][keys.NODE_SHIM]
    _fails(doctor.check_shim(n, [_pod()], NS), "does not report the shim", "--shim-source")
    gone = {"version": "1", "file": "", "sha256": "ab", "loadable": False,
            "error": "/usr/local/kvgpu/lib/libvgpu.so is missing (the link points at libvgpu.so.1, which is gone)"}
    _fails(doctor.check_shim(_node(shim=gone), [_pod()], NS), "the shim is not usable on the node",
           "libvgpu.so is missing", "kubectl -n kvgpu-system delete pod kvgpu-agent-x1", "reinstalls")
    _fails(doctor.check_shim(_node(shim=gone), [], NS), "rollout restart daemonset kvgpu-agent")


def test_sample_outcomes() -> None:
    assert doctor.check_sample(None, 256, 60, "team").status == SKIP
    _fails(doctor.check_sample(SampleOutcome(error="pods is forbidden"), 256, 60, "team"), "could not be created",
           "kubectl auth can-i create pods -n team")
    pending = SampleOutcome("Pending", "", "", ("FailedScheduling: 0/3 nodes are available",), timed_out=True)
    _fails(doctor.check_sample(pending, 256, 60, "team"), "did not finish in 60 s (never scheduled)",
           "FailedScheduling: 0/3", "kubectl vgpu why")
    _fails(doctor.check_sample(SampleOutcome("Failed", "gpu-a", "sh: python3: not found\n"), 256, 60, "team"),
           "the sample pod Failed: sh: python3: not found", "--sample-image")
    _fails(doctor.check_sample(SampleOutcome("Succeeded", "gpu-a", "KVGPU-DOCTOR memory.total=143771"), 256, 60, "t"),
           "saw 143771 MiB, not its 256 MiB limit", "/etc/ld.so.preload")


def test_sample_pod_goes_through_kvgpu_scheduler_to_its_node() -> None:
    n = _node()
    n["metadata"]["labels"]["kubernetes.io/hostname"] = "gpu-a-host"
    pod = doctor.sample_pod(n, "team", "img:1", 256, 10, 90)
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "gpu-a-host"}
    assert "nodeName" not in pod["spec"]  # the extender and the bind must run
    assert pod["metadata"]["annotations"] == {"kvgpu.io/gpu": "1", "kvgpu.io/gpumem": "256", "kvgpu.io/gpucores": "10"}
    assert pod["spec"]["activeDeadlineSeconds"] == 90 and pod["spec"]["restartPolicy"] == "Never"
    c = pod["spec"]["containers"][0]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert doctor.sample_total_mib("noise\nKVGPU-DOCTOR memory.total=256\n") == 256
    assert doctor.sample_total_mib("nothing") is None


def _workload(kind: str, name: str, want: int, ready: int) -> dict[str, Any]:
    return {"kind": kind, "metadata": {"name": name}, "spec": {"replicas": want}, "status": {"readyReplicas": ready}}


def test_operator_and_scheduler_workloads() -> None:
    assert doctor.check_operator([], NS).status == SKIP
    assert doctor.check_operator([_workload("Deployment", "kvgpu-operator", 2, 1)], NS).status == OK
    _fails(doctor.check_operator([_workload("Deployment", "kvgpu-operator", 2, 0)], NS),
           "deployment/kvgpu-operator 0/2 ready", "kubectl -n kvgpu-system describe deployment/kvgpu-operator")
    _fails(doctor.check_scheduler([_workload("Deployment", "kvgpu-scheduler", 1, 0)], NS),
           "kvgpu-scheduler: deployment/kvgpu-scheduler 0/1 ready")


def test_webhooks_missing_or_without_ca_bundle() -> None:
    good_m = {"metadata": {"name": "kvgpu-mutate"}, "webhooks": [{"name": "pods.mutate.kvgpu.io",
                                                                  "clientConfig": {"caBundle": "TFMw"}}]}
    good_v = {"metadata": {"name": "kvgpu-validate"}, "webhooks": [{"name": "pods.validate.kvgpu.io",
                                                                    "clientConfig": {"caBundle": "TFMw"}}]}
    assert doctor.check_webhooks([good_m], [good_v]).status == OK
    _fails(doctor.check_webhooks([], [good_v]), "mutatingwebhookconfiguration/kvgpu-mutate not found", "helm install")
    no_ca = copy.deepcopy(good_v)
    no_ca["webhooks"][0]["clientConfig"] = {"service": {"name": "kvgpu-webhook"}}
    _fails(doctor.check_webhooks([good_m], [no_ca]), "kvgpu-validate/pods.validate.kvgpu.io has no caBundle",
           "certificate")


def test_namespace_and_admission_prerequisites() -> None:
    # kvgpu injects no hostPath: every PodSecurity level admits GPU pods (restricted: compliant ones).
    for level in ("privileged", "baseline", "restricted"):
        ns = {"metadata": {"name": "team", "labels": {doctor.PSA_ENFORCE: level}}}
        found = doctor.check_namespace(ns, "team")
        assert found.status == OK and f"PodSecurity enforce {level}" in found.message, found
    assert "non-root" in doctor.check_namespace(ns, "team").message  # restricted says what a pod needs
    bad = {"metadata": {"name": "team", "labels": {doctor.PSA_ENFORCE: "strict"}}}
    _fails(doctor.check_namespace(bad, "team"), "not one of privileged, baseline, restricted",
           "pod-security.kubernetes.io/enforce=baseline")
    _fails(doctor.check_namespace(None, "team"), "namespace team not found")
    assert doctor.check_namespace({"metadata": {"name": "team"}}, "team").status == OK
    refused = 'pods "x" is forbidden: violates PodSecurity "baseline:latest": hostPath volumes'
    _fails(doctor.check_admission(None, refused, "team"), "violates PodSecurity", "older kvgpu webhook")
    _fails(doctor.check_admission(None, 'failed calling webhook "pods.mutate.kvgpu.io": connection refused', "t"),
           "cannot call the kvgpu webhook", "endpoints")
    _fails(doctor.check_admission({"spec": {"schedulerName": "default-scheduler"}}, "", "kube-system"),
           "did not mutate", "--namespace")
    assert doctor.check_admission({"spec": {"schedulerName": keys.SCHEDULER_NAME}}, "", "t").status == OK


def test_line_lists_every_failure_and_skips_are_not_failures() -> None:
    found = [Finding("agent", FAIL, "a", "fa"), Finding("sample", SKIP, "s"), Finding("shim", FAIL, "b", "fb")]
    assert doctor.line("n1", found) == "n1  FAIL  agent: a -> fix: fa | shim: b -> fix: fb"
    assert doctor.line("n1", [Finding("sample", SKIP, "s")]) == "n1  OK"
