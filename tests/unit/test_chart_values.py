"""charts/kvgpu's values reach what kvgpu does with them (`helm template`, no cluster): HAMi's
value names (slicing and request defaults into the VGPUPool, the kube-scheduler image, resource
names refused when they differ), the scheduler tag following the cluster's version, log format,
the Prometheus Operator monitors, the host-network and extender-URL knobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import yaml
from kvgpu.dra.slices import device_classes

from tests.helmkit import CHART, helm, one, render, template_args

WORKLOADS = ("StatefulSet", "Deployment", "DaemonSet")

#: A HAMi user's values file (charts/hami/values.yaml names), as it would carry over.
HAMI_VALUES = {
    "devicePlugin": {"deviceSplitCount": 4, "deviceMemoryScaling": 1.5, "deviceCoreScaling": 2,
                     "nvidiaNodeSelector": {"gpu": "on"}},
    "scheduler": {"defaultMem": 2000, "defaultCores": 30, "defaultGPUNum": 2,
                  "defaultSchedulerPolicy": {"nodeSchedulerPolicy": "spread", "gpuSchedulerPolicy": "binpack"},
                  "kubeScheduler": {"image": "registry.cn-hangzhou.aliyuncs.com/google_containers/kube-scheduler",
                                    "imageTag": "v1.36.1"},
                  "admissionWebhook": {"whitelistNamespaces": ["ml-infra"]}},
    "resourceName": "nvidia.com/gpu", "resourceMem": "nvidia.com/gpumem",
    "resourceMemPercentage": "nvidia.com/gpumem-percentage", "resourceCores": "nvidia.com/gpucores",
    "resourcePriority": "nvidia.com/priority",
}


def _containers(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, dict[str, Any]]:
    spec = one(docs, kind, name)["spec"]["template"]["spec"]
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}


def _scheduler_image(docs: list[dict[str, Any]]) -> str:
    return str(_containers(docs, "Deployment", "kvgpu-scheduler")["kube-scheduler"]["image"])


def test_defaults_render_the_whole_system() -> None:
    docs = render()
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == sorted({"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                            "StatefulSet", "Service", "PodDisruptionBudget", "ConfigMap", "Deployment",
                            "DaemonSet", "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
                            "NetworkPolicy", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                            "VGPUPool", "DeviceClass"})
    assert one(docs, "DeviceClass", "gpu.kvgpu.io")["spec"] == device_classes()[0]["spec"]
    assert "DeviceClass" not in {d["kind"] for d in render({"dra": {"deviceClass": False}})}
    elsewhere = [(d["kind"], d["metadata"]["name"]) for d in docs
                 if d["metadata"].get("namespace") not in (None, "kvgpu-system")]
    assert elsewhere == [("RoleBinding", "kvgpu-scheduler-authentication-reader")]  # in kube-system
    pool = one(docs, "VGPUPool", "default")
    assert pool["spec"] == {"nodeSelector": {}, "mode": "hami-core", "splitCount": 10, "memoryScaling": 1,
                            "coreScaling": 1, "defaults": {"gpu": 1, "gpumem": 0, "gpucores": 0},
                            "scheduling": {"nodePolicy": "binpack", "gpuPolicy": "spread"}}


def test_default_pool_validates_against_the_model() -> None:
    from kvgpu.api.models import VGPUPoolSpec

    for values in (None, HAMI_VALUES):
        VGPUPoolSpec.model_validate(one(render(values), "VGPUPool", "default")["spec"])


@pytest.mark.parametrize(("kube_version", "tag"), [("1.36.3", "v1.36.3"), ("v1.33.2", "v1.33.2"),
                                                   ("1.35.0+k3s1", "v1.35.0")])
def test_scheduler_image_follows_the_cluster_version(kube_version: str, tag: str) -> None:
    assert _scheduler_image(render(kube_version=kube_version)) == f"registry.k8s.io/kube-scheduler:{tag}"


def test_hami_values_carry_over() -> None:
    docs = render(HAMI_VALUES)
    pool = one(docs, "VGPUPool", "default")["spec"]
    assert (pool["splitCount"], pool["memoryScaling"], pool["coreScaling"]) == (4, 1.5, 2)
    assert pool["defaults"] == {"gpu": 2, "gpumem": 2000, "gpucores": 30}
    assert pool["scheduling"] == {"nodePolicy": "spread", "gpuPolicy": "binpack"}
    # HAMi <= 2.4: image + imageTag
    assert _scheduler_image(docs) == "registry.cn-hangzhou.aliyuncs.com/google_containers/kube-scheduler:v1.36.1"
    # HAMi >= 2.5: image: {registry, repository, tag}; an empty tag follows the cluster
    modern = render({"scheduler": {"kubeScheduler": {"image": {"registry": "mirror.example", "repository":
                                                               "k8s/kube-scheduler", "tag": "",
                                                               "pullPolicy": "Always"}}}},
                    kube_version="1.34.4")
    assert _scheduler_image(modern) == "mirror.example/k8s/kube-scheduler:v1.34.4"
    assert _containers(modern, "Deployment", "kvgpu-scheduler")["kube-scheduler"]["imagePullPolicy"] == "Always"
    # whitelistNamespaces: excluded by the webhooks and the operator
    hook = one(docs, "MutatingWebhookConfiguration", "kvgpu-mutate")["webhooks"][0]
    assert "ml-infra" in hook["namespaceSelector"]["matchExpressions"][0]["values"]
    assert "--exclude-namespace=ml-infra" in _containers(docs, "StatefulSet", "kvgpu-operator")["operator"]["args"]
    # HAMi's agent placement: nvidiaNodeSelector in place of the default affinity
    agent_pod = one(docs, "DaemonSet", "kvgpu-agent")["spec"]["template"]["spec"]
    assert agent_pod["nodeSelector"] == {"gpu": "on"} and "affinity" not in agent_pod
    default_pod = one(render(), "DaemonSet", "kvgpu-agent")["spec"]["template"]["spec"]
    assert "nodeSelector" not in default_pod
    terms = default_pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert [t["matchExpressions"][0]["key"] for t in terms["nodeSelectorTerms"]] == [
        "nvidia.com/gpu.present", "kvgpu.io/gpu-node"]
    # HAMi's scheduler.certManager.enabled means cert-manager here too
    cm = render({"scheduler": {"certManager": {"enabled": True}}})
    assert {d["kind"] for d in cm if d["apiVersion"].startswith("cert-manager.io/")} == {"Issuer", "Certificate"}


@pytest.mark.parametrize(("key", "value"), [("resourceMem", "example.com/vram"), ("resourceName", "nvidia.com/vgpu"),
                                            ("schedulerName", "hami-scheduler")])
def test_values_kvgpu_cannot_honour_are_refused(key: str, value: str) -> None:
    p = helm(*template_args({key: value}), check=False)
    assert p.returncode != 0
    assert f"{key}: \"{value}\" is not supported" in p.stderr, p.stderr


def test_a_plain_http_extender_url_is_refused() -> None:
    p = helm(*template_args({"scheduler": {"extenderURL": "http://op:8888/scheduler"}}), check=False)
    assert p.returncode != 0 and "scheduler.extenderURL" in p.stderr and "https://" in p.stderr


def test_values_reach_the_container_arguments() -> None:
    docs = render({"operator": {"replicas": 3, "webhookWorkers": 4, "bindEvents": True, "nodeChoice": "scheduler",
                                "ports": {"extender": 18888, "metrics": 19090, "webhook": 19443},
                                "hostNetwork": True, "extraArgs": ["--priority=3"]},
                   "devicePlugin": {"deviceSpecs": False, "driverRoot": "none", "metricsPort": 19394,
                                    "interval": 10, "hostNetwork": True, "runtimeClassName": "",
                                    "nodeSelector": {"gpu": "on"}},
                   "scheduler": {"replicas": 1, "hostNetwork": True,
                                 "extenderURL": "https://kvgpu-operator.kvgpu-system.svc.cluster.local:18888/scheduler"},
                   "webhook": {"extraOperatorUsernames": ["system:serviceaccount:ops:kvgpu-admin"],
                               "excludeNamespaces": ["infra"]}})
    sts = one(docs, "StatefulSet", "kvgpu-operator")
    assert sts["spec"]["replicas"] == 3
    pod = sts["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    op = _containers(docs, "StatefulSet", "kvgpu-operator")["operator"]["args"]
    for arg in ("--webhook-workers=4", "--bind-events", "--node-choice=scheduler", "--extender-address=0.0.0.0:18888",
                "--metrics-address=0.0.0.0:19090", "--webhook-port=19443", "--priority=3",
                "--operator-username=system:serviceaccount:ops:kvgpu-admin"):
        assert arg in op
    from kvgpu.cli.main import main

    ctx = main.commands["operator"].make_context("operator", [a for a in op[1:] if "/etc/kvgpu/" not in a])
    assert ctx.params["webhook_workers"] == 4 and ctx.params["bind_events"] is True
    agent_pod = one(docs, "DaemonSet", "kvgpu-agent")["spec"]["template"]["spec"]
    assert agent_pod["hostNetwork"] is True and "runtimeClassName" not in agent_pod
    assert agent_pod["nodeSelector"] == {"gpu": "on"}
    agent = _containers(docs, "DaemonSet", "kvgpu-agent")["agent"]
    ctx = main.commands["agent"].make_context("agent", [a for a in agent["args"][1:] if "--shim-source" not in a])
    assert ctx.params["device_specs"] is False and ctx.params["driver_root"] == "none"
    assert ctx.params["metrics_port"] == 19394 and ctx.params["interval"] == 10
    assert agent["ports"] == [{"name": "metrics", "containerPort": 19394, "protocol": "TCP"}]
    sched = one(docs, "Deployment", "kvgpu-scheduler")
    assert sched["spec"]["replicas"] == 1 and sched["spec"]["template"]["spec"]["hostNetwork"] is True
    cfg = yaml.safe_load(one(docs, "ConfigMap", "kvgpu-scheduler-config")["data"]["config.yaml"])
    assert [e["urlPrefix"] for e in cfg["extenders"]] == \
        ["https://kvgpu-operator.kvgpu-system.svc.cluster.local:18888/scheduler"] * 2
    policy = one(docs, "ValidatingAdmissionPolicy", "vgpuclaims.kvgpu.io")
    expr = policy["spec"]["validations"][0]["expression"]
    assert "'system:serviceaccount:ops:kvgpu-admin', 'system:serviceaccount:kvgpu-system:kvgpu-operator'" in expr
    # The pod policy is scoped to the namespaces the webhooks serve.
    binding = one(docs, "ValidatingAdmissionPolicyBinding", "pods.kvgpu.io")
    hooks = one(docs, "MutatingWebhookConfiguration", "kvgpu-mutate")["webhooks"][0]
    assert binding["spec"]["matchResources"]["namespaceSelector"] == hooks["namespaceSelector"]
    assert hooks["namespaceSelector"]["matchExpressions"][0]["values"] == ["infra", "kube-system", "kvgpu-system"]
    assert one(docs, "ValidatingAdmissionPolicy", "pods.kvgpu.io")["spec"]["failurePolicy"] == "Fail"


def test_certificate_containers_parse_and_only_without_cert_manager() -> None:
    from kvgpu.cli.certs import certs_cmd

    docs = render({"certs": {"rotationInterval": 600}})
    cs = _containers(docs, "StatefulSet", "kvgpu-operator")
    init, side = cs["certs-init"], cs["certs"]
    ctx = certs_cmd.make_context("certs", init["args"][1:])
    assert ctx.params["once"] is True and str(ctx.params["out_dir"]) == "/etc/kvgpu/tls"
    ctx = certs_cmd.make_context("certs", side["args"][1:])
    assert ctx.params["once"] is False and ctx.params["interval"] == 600
    assert {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in init["env"]}[
        "POD_NAMESPACE"] == "metadata.namespace"
    cm = _containers(render({"certManager": {"enabled": True}}), "StatefulSet", "kvgpu-operator")
    assert set(cm) == {"operator"}


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_log_format_reaches_every_kvgpu_container(fmt: str) -> None:
    docs = render({"logFormat": fmt, "logLevel": "debug"})
    kvgpu = [c for kind, name in (("StatefulSet", "kvgpu-operator"), ("DaemonSet", "kvgpu-agent"))
             for c in _containers(docs, kind, name).values()]
    assert len(kvgpu) == 4  # certs-init, operator, certs, agent
    for c in kvgpu:
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env.get("KVGPU_LOG_FORMAT") == ("json" if fmt == "json" else None), c["name"]
        assert env["KVGPU_LOG_LEVEL"] == "DEBUG"


def test_json_logs_are_one_object_per_line() -> None:
    """Under KVGPU_LOG_FORMAT=json (the chart's default) kvgpu.logs writes one JSON object per
    line with level, event and timestamp, for structlog and stdlib (Kopf's) loggers alike."""
    code = ("import logging, structlog\n"
            "from kvgpu.logs import configure_logging\n"
            "configure_logging()\n"
            "structlog.get_logger('kvgpu.test').info('claim bound', pod='team/a', cards=2)\n"
            "logging.getLogger('kopf.objects').warning('multi\\nline message')\n"
            "structlog.get_logger('kvgpu.test').error('failed', reason='x')\n")
    env = {**os.environ, "KVGPU_LOG_FORMAT": "json", "KVGPU_LOG_LEVEL": "INFO"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 3, p.stderr
    objs = [json.loads(line) for line in lines]
    assert [o["level"] for o in objs] == ["info", "warning", "error"]
    assert [o["event"] for o in objs] == ["claim bound", "multi\nline message", "failed"]
    assert all(o["timestamp"].endswith("Z") and "T" in o["timestamp"] for o in objs)
    assert objs[0]["pod"] == "team/a" and objs[0]["cards"] == 2 and objs[0]["logger"] == "kvgpu.test"


def test_monitors_off_by_default_and_on_for_both_components() -> None:
    assert not [d for d in render() if d["apiVersion"].startswith("monitoring.coreos.com/")]
    docs = render({"monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                                  "podMonitor": {"enabled": True, "interval": "15s"}}})
    mons = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["apiVersion"] == "monitoring.coreos.com/v1"}
    assert set(mons) == {(k, f"kvgpu-{c}") for k in ("ServiceMonitor", "PodMonitor") for c in ("operator", "agent")}
    for (kind, name), m in mons.items():
        component = name.removeprefix("kvgpu-")
        assert m["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "kvgpu",
                                                        "app.kubernetes.io/component": component}
        [ep] = m["spec"]["endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"]
        assert ep["port"] == "metrics" and ep["path"] == "/metrics"
        assert ep["honorLabels"] is True  # the tenant's namespace/pod labels stay as exported
        if kind == "ServiceMonitor":
            assert m["metadata"]["labels"]["release"] == "prom"
            # the selected Service exists and has the port by that name
            svcs = [d for d in docs if d["kind"] == "Service" and all(
                d["metadata"]["labels"].get(k) == v for k, v in m["spec"]["selector"]["matchLabels"].items())]
            assert any(p["name"] == "metrics" for s in svcs for p in s["spec"]["ports"])
        else:
            assert ep["interval"] == "15s"
            workload = next(d for d in docs if d["kind"] in WORKLOADS and
                            d["spec"]["selector"]["matchLabels"] == m["spec"]["selector"]["matchLabels"])
            ports = [p["name"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])]
            assert "metrics" in ports


def test_webhook_url_and_extender_url_join_the_certificates() -> None:
    """For a cluster whose API server cannot reach Services (e.g. the operator on hostNetwork):
    webhook.url replaces the Service in every webhook, and the hosts of both URLs become names
    of the serving certificates `kvgpu certs` issues (or cert-manager's Certificates)."""
    from kvgpu.certs.issue import kvgpu_layout
    from kvgpu.cli.certs import certs_cmd

    values = {"webhook": {"url": "https://10.0.0.5:19443/"},
              "scheduler": {"extenderURL": "https://gpu-node-1.example:8888/scheduler"},
              "certs": {"extenderSANs": ["127.0.0.1"]}}
    docs = render(values)
    hooks = [h for d in docs if d["kind"].endswith("WebhookConfiguration") for h in d["webhooks"]]
    assert sorted(h["clientConfig"]["url"] for h in hooks) == [
        "https://10.0.0.5:19443/kvgpu-mutate-pods", "https://10.0.0.5:19443/kvgpu-validate-pods",
        "https://10.0.0.5:19443/kvgpu-validate-workloads"]
    assert all("service" not in h["clientConfig"] for h in hooks)
    init = _containers(docs, "StatefulSet", "kvgpu-operator")["certs-init"]
    p = certs_cmd.make_context("certs", [a for a in init["args"][1:]]).params
    layout = kvgpu_layout("kvgpu-system", p["webhook_service"], p["extender_service"], p["scheduler_client"],
                          p["webhook_sans"], p["extender_sans"])
    assert layout.leaves["kvgpu-webhook-tls"][1].ip_addresses == ("10.0.0.5",)
    ext = layout.leaves["kvgpu-extender-tls"][1]
    assert "gpu-node-1.example" in ext.dns_names and ext.ip_addresses == ("127.0.0.1",)
    cm = render({**values, "certManager": {"enabled": True}})
    assert one(cm, "Certificate", "kvgpu-webhook")["spec"]["ipAddresses"] == ["10.0.0.5"]
    serving = one(cm, "Certificate", "kvgpu-extender")["spec"]
    assert "gpu-node-1.example" in serving["dnsNames"] and serving["ipAddresses"] == ["127.0.0.1"]
    p2 = helm(*template_args({"webhook": {"url": "http://10.0.0.5:9443"}}), check=False)
    assert p2.returncode != 0 and 'webhook.url: "http://10.0.0.5:9443" must be an https:// URL' in p2.stderr


@pytest.mark.parametrize(("values", "where", "why"), [
    ({"devicePlugin": {"deviceSplitCount": 0}}, "/devicePlugin/deviceSplitCount", "minimum: got 0, want 1"),
    ({"devicePlugin": {"deviceSplitCount": "ten"}}, "/devicePlugin/deviceSplitCount", "got string, want integer"),
    ({"devicePlugin": {"deviceMemoryScaling": 0}}, "/devicePlugin/deviceMemoryScaling", "exclusiveMinimum"),
    ({"scheduler": {"defaultCores": 150}}, "/scheduler/defaultCores", "maximum: got 150, want 100"),
    ({"scheduler": {"defaultGPUNum": 0}}, "/scheduler/defaultGPUNum", "minimum"),
    ({"pool": {"mode": "shared"}}, "/pool/mode", "value must be one of 'hami-core', 'exclusive', 'mps'"),
    ({"scheduler": {"defaultSchedulerPolicy": {"gpuSchedulerPolicy": "topology"}}},
     "/scheduler/defaultSchedulerPolicy/gpuSchedulerPolicy", "binpack"),
    ({"logFormat": "text"}, "/logFormat", "value must be one of 'json', 'console'"),
])
def test_bad_values_fail_naming_the_key(values: dict[str, Any], where: str, why: str) -> None:
    """values.schema.json (generated: the pool-bound values take VGPUPoolSpec's bounds)."""
    p = helm(*template_args(values), check=False)
    assert p.returncode != 0
    assert f"at '{where}'" in p.stderr and why in p.stderr, p.stderr


def test_schema_bounds_are_the_pool_models() -> None:
    from kvgpu.api.modelbase import MAX_CARD_MEMORY_MIB, MAX_CARDS, MAX_SPLIT_COUNT

    from tests.helmkit import CHART

    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]
    dp, sch = schema["devicePlugin"]["properties"], schema["scheduler"]["properties"]
    assert dp["deviceSplitCount"] == {"type": "integer", "minimum": 1, "maximum": MAX_SPLIT_COUNT}
    assert sch["defaultMem"]["maximum"] == MAX_CARD_MEMORY_MIB and sch["defaultGPUNum"]["maximum"] == MAX_CARDS
    # a HAMi values file's other keys are allowed (kvgpu ignores them)
    render({"devicePlugin": {"migStrategy": "none"}, "mluResourceName": "cambricon.com/vmlu"})


def test_grafana_dashboard_configmap_carries_the_checked_dashboard() -> None:
    assert not [d for d in render() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "kvgpu-grafana-dashboard"]
    docs = render({"monitoring": {"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}}})
    [cm] = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "kvgpu-grafana-dashboard"]
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    # the very file tests/unit/test_dashboard.py checks against the exported metrics
    assert json.loads(cm["data"]["kvgpu.json"]) == json.loads((CHART / "dashboards" / "kvgpu.json").read_text())


@pytest.mark.parametrize("enabled", [True, False])
def test_dra_plugin_dirs_args_and_rbac(enabled: bool) -> None:
    from kvgpu.cli.main import main

    docs = render({"devicePlugin": {"dra": {"enabled": enabled, "cdiDir": "/etc/cdi"}}})
    agent = _containers(docs, "DaemonSet", "kvgpu-agent")["agent"]
    ctx = main.commands["agent"].make_context("agent", [a for a in agent["args"][1:] if "--shim-source" not in a])
    assert ctx.params["dra"] is enabled
    mounts = {m["mountPath"] for m in agent["volumeMounts"]}
    dra_dirs = {"/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins/gpu.kvgpu.io", "/etc/cdi"}
    if enabled:
        assert ctx.params["cdi_dir"] == "/etc/cdi" and dra_dirs <= mounts
        volumes = one(docs, "DaemonSet", "kvgpu-agent")["spec"]["template"]["spec"]["volumes"]
        assert {"path": "/etc/cdi", "type": "DirectoryOrCreate"} in [v.get("hostPath") for v in volumes]
    else:
        assert not dra_dirs & mounts
    rules = one(docs, "ClusterRole", "kvgpu-agent")["rules"]
    dra_rules = {r["resources"][0]: set(r["verbs"]) for r in rules if r["apiGroups"] == ["resource.k8s.io"]}
    assert dra_rules == {"resourceslices": {"get", "list", "watch", "create", "update", "delete"},
                         "resourceclaims": {"get"}}
