"""The Helm chart charts/kvgpu and the Dockerfiles without a cluster: `helm lint`, `helm template`
with the defaults, HAMi-style values, cert-manager and the monitors; generated templates
current, RBAC without wildcards, container arguments the CLI accepts, files the Dockerfiles copy
exist. (The chart against the real API server: tests/cluster/test_manifests.py, test_chart.py.)"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from tests.helmkit import CHART, helm, one, render

ROOT = Path(__file__).resolve().parents[2]
CM = {"certManager": {"enabled": True}}


def _gen() -> Any:
    spec = importlib.util.spec_from_file_location("gen_manifests", ROOT / "hack" / "gen_manifests.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_CACHE: dict[str, list[dict[str, Any]]] = {}


def _docs(mode: str = "default") -> list[dict[str, Any]]:
    """The chart rendered with its defaults ("default") or with cert-manager ("cert-manager")."""
    if mode not in _CACHE:
        _CACHE[mode] = render(CM if mode == "cert-manager" else None)
    return _CACHE[mode]


_one = one


def test_generated_files_are_current() -> None:
    stale = _gen().stale()
    assert not stale, f"run `python hack/gen_manifests.py`: {[str(p) for p in stale]} differ"


def test_chart_lints() -> None:
    p = helm("lint", str(CHART), "--strict", "--kube-version", "1.36.3")
    assert "0 chart(s) failed" in p.stdout, p.stdout


def test_crds_are_the_generated_ones_and_only_in_the_chart() -> None:
    """One copy: charts/kvgpu/crds/ is what `make crds` writes; --include-crds renders them."""
    from kvgpu.api.crdgen import render as crd_render

    generated = {k for k in crd_render() if k.endswith(".yaml")}
    assert generated == {f"charts/kvgpu/crds/{p.name}" for p in (CHART / "crds").glob("*.yaml")}
    crds = [d for d in render(include_crds=True) if d["kind"] == "CustomResourceDefinition"]
    assert sorted(d["metadata"]["name"] for d in crds) == [
        "vgpuclaims.kvgpu.io", "vgpupools.kvgpu.io", "vgpuquotas.kvgpu.io"]
    assert not (ROOT / "crds").exists() and not (ROOT / "manifests").exists()


@pytest.mark.parametrize("mode", ["default", "cert-manager"])
def test_rbac_has_no_wildcards_and_one_account_per_component(mode: str) -> None:
    docs = _docs(mode)
    roles = [d for d in docs if d["kind"] in ("ClusterRole", "Role")]
    assert {r["metadata"]["name"] for r in roles if r["kind"] == "ClusterRole"} == {
        "kvgpu-operator", "kvgpu-scheduler", "kvgpu-agent", "kvgpu-view", "kvgpu-edit"}
    for r in roles:
        for rule in r["rules"]:
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in rule.get(field, []), (r["metadata"]["name"], rule)
            assert "escalate" not in rule["verbs"] and "bind" not in rule["verbs"]
            if "secrets" in rule["resources"]:
                # only the operator's certificate containers, without cert-manager, and by name
                assert mode == "default" and r["kind"] == "Role" and r["metadata"]["name"] == "kvgpu-operator-lease"
                assert rule["verbs"] == ["create"] or (set(rule["verbs"]) == {"get", "update"} and set(
                    rule["resourceNames"]) == {"kvgpu-ca", "kvgpu-extender-ca", "kvgpu-webhook-tls",
                                               "kvgpu-extender-tls", "kvgpu-scheduler-extender-client"})
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    assert accounts == {"kvgpu-operator", "kvgpu-scheduler", "kvgpu-agent"}
    kinds = ("StatefulSet", "Deployment", "DaemonSet")
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in kinds}
    for name, w in workloads.items():
        pod = w["spec"]["template"]["spec"]
        if name == "kvgpu-mps":  # the MPS daemons' owner makes no API call: no account, no token
            assert "serviceAccountName" not in pod and pod["automountServiceAccountToken"] is False
            continue
        assert pod["serviceAccountName"] == name


def _verbs(role: dict[str, Any], group: str, resource: str) -> set[str]:
    rules = [r for r in role["rules"] if group in r["apiGroups"] and resource in r["resources"]]
    return {v for r in rules for v in r["verbs"]}


def test_operator_role_covers_its_calls() -> None:
    role = _one(_docs(), "ClusterRole", "kvgpu-operator")
    assert {"get", "list", "watch", "patch"} <= _verbs(role, "", "pods")
    assert _verbs(role, "", "pods/binding") == {"create"}
    assert {"list", "watch", "patch"} <= _verbs(role, "", "nodes")
    assert {"create", "delete", "list", "watch", "get"} <= _verbs(role, "kvgpu.io", "vgpuclaims")
    assert _verbs(role, "kvgpu.io", "vgpuclaims/status") == {"patch"}
    assert _verbs(role, "kvgpu.io", "vgpupools/status") == {"patch"}
    assert _verbs(role, "", "resourcequotas") == {"list", "watch"}  # read only: KCM owns their status
    assert _verbs(role, "kvgpu.io", "vgpuquotas") == {"list", "watch"}
    assert _verbs(role, "kvgpu.io", "vgpuquotas/status") == {"patch"}
    lease = _one(_docs(), "Role", "kvgpu-operator-lease")
    assert any(r.get("resourceNames") == ["kvgpu-operator"] and set(r["verbs"]) == {"get", "update"}
               for r in lease["rules"])
    assert _verbs(role, "", "events") == {"create", "patch"}  # patch: a repeat's count
    # The operator never deletes pods; it writes only its own webhook configurations (caBundle,
    # by name), and with cert-manager none at all.
    assert "delete" not in _verbs(role, "", "pods")
    for kind, name in (("mutatingwebhookconfigurations", "kvgpu-mutate"),
                       ("validatingwebhookconfigurations", "kvgpu-validate")):
        [rule] = [r for r in role["rules"] if kind in r["resources"]]
        assert rule["resourceNames"] == [name] and set(rule["verbs"]) == {"get", "update"}
    cm_role = _one(_docs("cert-manager"), "ClusterRole", "kvgpu-operator")
    assert not _verbs(cm_role, "admissionregistration.k8s.io", "mutatingwebhookconfigurations")


def test_scheduler_lease_is_scoped() -> None:
    docs = _docs()
    cluster_role = _one(docs, "ClusterRole", "kvgpu-scheduler")
    assert not _verbs(cluster_role, "coordination.k8s.io", "leases")
    role = _one(docs, "Role", "kvgpu-scheduler-leader-election")
    assert role["metadata"]["namespace"] == "kvgpu-system"
    named = [r for r in role["rules"] if r.get("resourceNames")]
    assert named == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                      "resourceNames": ["kvgpu-scheduler"], "verbs": ["get", "list", "watch", "update"]}]
    cfg = yaml.safe_load(_one(docs, "ConfigMap", "kvgpu-scheduler-config")["data"]["config.yaml"])
    assert cfg["leaderElection"] == {"leaderElect": True, "resourceNamespace": "kvgpu-system",
                                     "resourceName": "kvgpu-scheduler"}
    svc = _one(docs, "Service", "kvgpu-operator")
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "extender")
    url = f"https://kvgpu-operator.kvgpu-system.svc:{port}/scheduler"
    assert [e["urlPrefix"] for e in cfg["extenders"]] == [url, url]  # filter and prioritize, then bind
    dep = _one(docs, "Deployment", "kvgpu-scheduler")
    [c] = dep["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "registry.k8s.io/kube-scheduler:v1.36.3"
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "config")
    assert f"--config={mount}/config.yaml" in c["command"]


@pytest.mark.parametrize("mode", ["default", "cert-manager"])
def test_webhooks_point_at_the_webhook_service(mode: str) -> None:
    docs = _docs(mode)
    svc = _one(docs, "Service", "kvgpu-webhook")
    [port] = svc["spec"]["ports"]
    sts = _one(docs, "StatefulSet", "kvgpu-operator")
    c = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "operator")
    target = next(p["containerPort"] for p in c["ports"] if p["name"] == port["targetPort"])
    assert f"--webhook-port={target}" in c["args"]
    configs = [d for d in docs if d["kind"].endswith("WebhookConfiguration")]
    hooks = [h for d in configs for h in d["webhooks"]]
    assert len(hooks) == 3
    for h in hooks:
        ref = h["clientConfig"]["service"]
        assert (ref["namespace"], ref["name"], ref["port"]) == ("kvgpu-system", "kvgpu-webhook", port["port"])
        assert h["failurePolicy"] == "Fail" and h["timeoutSeconds"] == 5
        assert "caBundle" not in h["clientConfig"], "set at run time (kvgpu certs or cert-manager)"
        [sel] = h["namespaceSelector"]["matchExpressions"]
        assert sel["values"] == ["kube-node-lease", "kube-public", "kube-system", "kvgpu-system"]
        assert sel["operator"] == "NotIn"
    cert_manager = [d for d in docs if d["apiVersion"].startswith("cert-manager.io/")]
    if mode == "default":
        assert not cert_manager, "no cert-manager objects by default"
        assert all("annotations" not in d["metadata"] for d in configs)
        return
    # cert-manager's CA injector fills the bundle from the serving Certificate.
    for d in configs:
        assert d["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": "kvgpu-system/kvgpu-webhook"}
    cert = _one(docs, "Certificate", "kvgpu-webhook")
    assert "kvgpu-webhook.kvgpu-system.svc" in cert["spec"]["dnsNames"]
    assert cert["spec"]["secretName"] == _mounted_secret(sts["spec"]["template"]["spec"], c,
                                                         next(a.split("=", 1)[1] for a in c["args"]
                                                              if a.startswith("--webhook-cert=")))
    assert {d["kind"] for d in cert_manager} == {"Issuer", "Certificate"}


def test_webhook_selector_matches_the_code_that_generates_it() -> None:
    """The chart's namespaceSelector is what kvgpu.admission.config would write for the same
    exclusions (the template replaces only that part of the generated objects)."""
    from kvgpu.admission.config import webhook_configurations

    docs = render({"webhook": {"excludeNamespaces": ["monitoring"]}}, namespace="gpu-sys")
    mutating, _ = webhook_configurations(url_base=None, service=("gpu-sys", "kvgpu-webhook", 443), ca_bundle=b"",
                                         exclude_namespaces=["gpu-sys", "monitoring"])
    rendered = _one(docs, "MutatingWebhookConfiguration", "kvgpu-mutate")
    assert rendered["webhooks"][0]["namespaceSelector"] == mutating["webhooks"][0]["namespaceSelector"]
    assert rendered["webhooks"][0]["matchConditions"] == mutating["webhooks"][0]["matchConditions"]
    [op] = [c for c in _one(docs, "StatefulSet", "kvgpu-operator")["spec"]["template"]["spec"]["containers"]
            if c["name"] == "operator"]
    assert {a.split("=", 1)[1] for a in op["args"] if a.startswith("--exclude-namespace=")} == {
        "gpu-sys", "monitoring"}


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def test_operator_arguments_parse_and_elect_a_leader() -> None:
    from kvgpu.cli.main import main

    sts = _one(_docs(), "StatefulSet", "kvgpu-operator")
    assert sts["spec"]["replicas"] == 2
    [c] = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "operator"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    args = _expand(c["args"], {"POD_NAME": "kvgpu-operator-0"})
    assert args[0] == "operator"
    ctx = main.commands["operator"].make_context("operator", _strip_paths(args[1:]))
    assert ctx.params["leader_elect"] is True and ctx.params["peering"] is False
    assert ctx.params["lease_namespace"] == "kvgpu-system"
    # The admission worker count is explicit: the container's CPU and memory are sized for it.
    assert any(a.startswith("--webhook-workers=") for a in args) and ctx.params["webhook_workers"] == 2


def _strip_paths(args: list[str]) -> list[str]:
    """Drop the file options (their files exist only in the pod), after checking their mounts."""
    return [a for a in args if not a.startswith(("--webhook-cert=", "--webhook-key=", "--shim-source=",
                                                 "--extender-cert=", "--extender-key=", "--extender-client-ca="))]


def _mounted_secret(pod_spec: dict[str, Any], container: dict[str, Any], path: str) -> str:
    """The Secret whose content ``container`` reads at ``path``: a Secret volume mounted at its
    directory, or (operator-issued certificates) the emptyDir that the pod's ``kvgpu certs``
    init container fills as ``<out-dir>/<secret>/<file>`` before the container starts."""
    directory = path.rsplit("/", 1)[0]
    mounts = [m for m in container["volumeMounts"] if directory.startswith(m["mountPath"])]
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    [vol] = [v for v in pod_spec["volumes"] if v["name"] == mount["name"]]
    if "secret" in vol:
        assert mount["mountPath"] == directory
        return str(vol["secret"]["secretName"])
    assert "emptyDir" in vol, vol
    [init] = [c for c in pod_spec.get("initContainers", []) if c["args"][0] == "certs"]
    assert "--once" in init["args"]
    [out] = [a.split("=", 1)[1] for a in init["args"] if a.startswith("--out-dir=")]
    assert any(m["name"] == vol["name"] and m["mountPath"] == out for m in init["volumeMounts"])
    parent, secret = directory.rsplit("/", 1)
    assert parent == out and mount["mountPath"] == out
    return secret


def _certificates(mode: str) -> dict[str, tuple[str, str, list[str], bool]]:
    """Secret -> (its signing CA, CN, DNS names, server?) in ``mode``: cert-manager's Certificates,
    or what `kvgpu certs` issues (kvgpu.certs.issue.kvgpu_layout, with the pod's arguments)."""
    if mode == "cert-manager":
        docs = _docs(mode)
        issuers = {d["metadata"]["name"]: d["spec"]["ca"]["secretName"] for d in docs
                   if d["kind"] == "Issuer" and "ca" in d["spec"]}
        return {c["spec"]["secretName"]: (issuers.get(c["spec"]["issuerRef"]["name"], "self-signed"),
                                          c["spec"].get("commonName", ""), c["spec"].get("dnsNames", []),
                                          "client auth" not in c["spec"].get("usages", []))
                for c in docs if c["kind"] == "Certificate"}
    from kvgpu.certs.issue import kvgpu_layout

    sts = _one(_docs(mode), "StatefulSet", "kvgpu-operator")
    [init] = sts["spec"]["template"]["spec"]["initContainers"]
    ctx = click.Context(click.Command("x"))
    from kvgpu.cli.certs import certs_cmd
    ctx = certs_cmd.make_context("certs", [a for a in init["args"][1:] if not a.startswith("--out-dir=")])
    layout = kvgpu_layout("kvgpu-system", ctx.params["webhook_service"], ctx.params["extender_service"],
                          ctx.params["scheduler_client"])
    return {name: (ca, spec.common_name, list(spec.dns_names), spec.server)
            for name, (ca, spec) in layout.leaves.items()}


@pytest.mark.parametrize("mode", ["default", "cert-manager"])
def test_extender_is_mutual_tls_end_to_end(mode: str) -> None:
    """Issue 14: the operator serves the extender with its serving certificate and trusts
    clients by the extender CA; kube-scheduler presents the client certificate whose CN the
    operator allows and trusts the same CA; probes and scrapes use the plain metrics port. The
    certificates come from the operator pod's `kvgpu certs` (default) or cert-manager."""
    from kvgpu.cli.main import main

    docs, certs = _docs(mode), _certificates(mode)
    sts = _one(docs, "StatefulSet", "kvgpu-operator")
    op_spec = sts["spec"]["template"]["spec"]
    [op] = [c for c in op_spec["containers"] if c["name"] == "operator"]
    flags = dict(a.split("=", 1) for a in op["args"] if a.startswith("--") and "=" in a)
    assert "--extender-insecure" not in op["args"]
    serving = {_mounted_secret(op_spec, op, flags[f]) for f in ("--extender-cert", "--extender-key",
                                                                "--extender-client-ca")}
    assert serving == {"kvgpu-extender-tls"}
    assert flags["--extender-client-ca"].endswith("/ca.crt")
    ca, _, dns, server = certs["kvgpu-extender-tls"]
    client_ca, client_cn, _, client_server = certs["kvgpu-scheduler-extender-client"]
    assert ca == client_ca == "kvgpu-extender-ca" and server and not client_server
    assert certs["kvgpu-webhook-tls"][0] != ca, "no webhook certificate is an extender client"
    assert "kvgpu-operator.kvgpu-system.svc" in dns
    ctx = main.commands["operator"].make_context("operator", _strip_paths(op["args"][1:]))
    assert client_cn in ",".join(ctx.params["extender_allowed_clients"]).split(",")
    # kube-scheduler's side
    cfg = yaml.safe_load(_one(docs, "ConfigMap", "kvgpu-scheduler-config")["data"]["config.yaml"])
    dep = _one(docs, "Deployment", "kvgpu-scheduler")
    dep_spec = dep["spec"]["template"]["spec"]
    [sched] = dep_spec["containers"]
    assert len(cfg["extenders"]) == 2  # filter and prioritize, then bind: both over mutual TLS
    for ext in cfg["extenders"]:
        assert ext["enableHTTPS"] is True and ext["urlPrefix"].startswith("https://")
        tls = ext["tlsConfig"]
        assert not tls.get("insecure")
        for key in ("certFile", "keyFile", "caFile"):
            assert _mounted_secret(dep_spec, sched, tls[key]) == "kvgpu-scheduler-extender-client"
    assert tls["certFile"].endswith("/tls.crt") and tls["caFile"].endswith("/ca.crt")
    # probes and Prometheus: the plain port, never the extender's
    ports = {p["name"]: p["containerPort"] for p in op["ports"]}
    assert flags["--metrics-address"] == f"0.0.0.0:{ports['metrics']}"
    assert flags["--extender-address"] == f"0.0.0.0:{ports['extender']}"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert op[probe]["httpGet"]["port"] == "metrics"
    assert sts["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
    svc = _one(docs, "Service", "kvgpu-operator")
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {"extender": "extender",
                                                                         "metrics": "metrics"}


def test_network_policy_admits_the_extender_only_from_the_scheduler() -> None:
    docs = _docs()
    pol = _one(docs, "NetworkPolicy", "kvgpu-operator")
    sts = _one(docs, "StatefulSet", "kvgpu-operator")
    assert pol["spec"]["podSelector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    by_port = {p["port"]: rule for rule in pol["spec"]["ingress"] for p in rule["ports"]}
    assert set(by_port) == {"extender", "webhooks", "metrics"}
    dep = _one(docs, "Deployment", "kvgpu-scheduler")
    assert by_port["extender"]["from"] == [{"podSelector": {"matchLabels": dep["spec"]["selector"]["matchLabels"]}}]
    assert "from" not in by_port["webhooks"], "the API server's source address is not predictable"
    assert by_port["metrics"]["from"] == [{"namespaceSelector": {"matchLabels": {"kvgpu.io/metrics-scraper": "true"}}}]
    [op] = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "operator"]
    assert set(by_port) == {p["name"] for p in op["ports"]}, "every container port has its rule"
    assert not [d for d in render({"networkPolicy": {"enabled": False}}) if d["kind"] == "NetworkPolicy"]


def test_agent_daemonset() -> None:
    from kvgpu.core import keys

    ds = _one(_docs(), "DaemonSet", "kvgpu-agent")
    spec = ds["spec"]["template"]["spec"]
    [c] = spec["containers"]
    assert spec["hostPID"] is True and spec["runtimeClassName"] == "nvidia"
    paths = {v["hostPath"]["path"]: v["name"] for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    for host in ("/usr/local/kvgpu", "/var/lib/kvgpu", "/var/lib/kubelet/device-plugins",
                 "/var/lib/kubelet/pod-resources", "/usr/local/nvidia"):
        assert mounts[paths[host]] == host, "host paths are mounted where they are on the host"
    ro = {m["name"] for m in c["volumeMounts"] if m.get("readOnly")}
    assert {paths["/usr/local/nvidia"], paths["/dev"]} <= ro
    # Allocate chowns a container's region directory to its runAsUser (CHOWN); the backstop kills
    # tenants' processes of any user (KILL); nothing else.
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "KILL"]}
    # Allocate hands the kubelet these as host paths (the shim, ld.so.preload, the container's
    # region, the schedule): the agent must see each where it is on the host.
    for p in (keys.HOST_SHIM_DIR, keys.HOST_PRELOAD_FILE, keys.HOST_REGION_ROOT, keys.HOST_SCHED_DIR):
        assert any(p.startswith(h + "/") for h in paths), p
    required = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    terms = required["nodeSelectorTerms"]
    assert {"key": keys.NODE_LABEL_GPU, "operator": "In", "values": ["true"]} in \
        [e for t in terms for e in t["matchExpressions"]]
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    agent_cmd = _agent_command()
    if agent_cmd is not None:  # the agent CLI may land after the manifests
        ctx = agent_cmd.make_context("agent", _strip_paths(list(c["args"][1:])))
        assert not ctx.params["simulated"] and not ctx.params["no_device_plugin"]
        # Allocate's device specs name host paths: the agent sees the host's /dev at --dev-root.
        assert mounts[paths["/dev"]] == ctx.params["dev_root"] and ctx.params["host_dev_root"] == "/dev"
        # The webhook injects no hostPath: Allocate mounts the shim (directory mode).
        assert ctx.params["device_specs"] and ctx.params["mounts"] == "dir"


def test_mps_daemons_have_their_own_daemonset() -> None:
    """The MPS daemons live in the cgroup of the container that started them: their owner is a
    DaemonSet of its own, so an agent container restart or upgrade leaves them running."""
    from kvgpu.cli.main import agent_cmd, mps_daemons_cmd
    from kvgpu.core import keys

    docs = _docs()
    agent = _one(docs, "DaemonSet", "kvgpu-agent")["spec"]["template"]["spec"]
    ds = _one(docs, "DaemonSet", "kvgpu-mps")
    spec = ds["spec"]["template"]["spec"]
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}, "a chart upgrade keeps the daemons"
    for key in ("affinity", "tolerations", "runtimeClassName", "priorityClassName"):
        assert spec[key] == agent[key], key  # wherever the agent runs, with the same runtime
    assert "hostPID" not in spec and "hostNetwork" not in spec
    [c] = spec["containers"]
    assert c["image"] == agent["containers"][0]["image"] and "livenessProbe" not in c
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SETUID", "SETGID"]}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False and not c["securityContext"]["privileged"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and "compute" in env["NVIDIA_DRIVER_CAPABILITIES"]
    ctx = mps_daemons_cmd.make_context("mps-daemons", list(c["args"][1:]))
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    assert [(host[m["name"]], m["mountPath"]) for m in c["volumeMounts"]] == [(keys.HOST_MPS_ROOT, keys.HOST_MPS_ROOT)]
    assert ctx.params["root"] == keys.HOST_MPS_ROOT
    # the agent writes wanted.json and reads status.json in the same host folder, at the same path
    [a] = agent["containers"]
    agent_host = {v["name"]: v["hostPath"]["path"] for v in agent["volumes"] if "hostPath" in v}
    assert {(agent_host[m["name"]], m["mountPath"]) for m in a["volumeMounts"]} >= {(keys.HOST_MPS_ROOT,) * 2}
    actx = agent_cmd.make_context("agent", _strip_paths(list(a["args"][1:])))
    assert actx.params["mps_daemons"] == "separate"

    off = render({"devicePlugin": {"mps": {"enabled": False}}})
    assert not [d for d in off if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "kvgpu-mps"]
    [a] = _one(off, "DaemonSet", "kvgpu-agent")["spec"]["template"]["spec"]["containers"]
    assert "--mps-daemons=agent" in a["args"]


def _agent_command() -> click.Command | None:
    from kvgpu.cli.main import main

    return main.commands.get("agent") if isinstance(main, click.Group) else None


def _dockerfile_sources(path: Path) -> list[str]:
    srcs: list[str] = []
    for line in path.read_text().splitlines():
        words = shlex.split(line) if line.startswith("COPY ") else []
        if words and not any(w.startswith("--from=") for w in words):
            srcs += words[1:-1]
    return srcs


@pytest.mark.parametrize("name", ["Dockerfile.operator", "Dockerfile.agent"])
def test_dockerfiles_copy_files_that_exist(name: str) -> None:
    path = ROOT / name
    srcs = _dockerfile_sources(path)
    assert "operator/" in srcs and "pyproject.toml" in srcs
    for s in srcs:
        assert (ROOT / s).exists(), f"{name} copies {s}, which does not exist"
    text = path.read_text()
    assert text.count("\nFROM ") >= 2, "multi-stage"
    assert 'ENTRYPOINT ["kvgpu"]' in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    for s in srcs:
        assert s.rstrip("/") not in ignored


def test_agent_image_carries_the_shim_where_the_daemonset_looks() -> None:
    text = (ROOT / "Dockerfile.agent").read_text()
    assert "shim/build.py --plain-gcc" in text
    m = re.search(r"COPY --from=shim \S+libvgpu\.so (\S+)", text)
    assert m
    ds = _one(_docs(), "DaemonSet", "kvgpu-agent")
    [c] = ds["spec"]["template"]["spec"]["containers"]
    assert f"--shim-source={m.group(1)}" in c["args"]


def test_images_and_their_values() -> None:
    def images(docs: list[dict[str, Any]]) -> set[str]:
        return {c["image"] for d in docs if d["kind"] in ("StatefulSet", "Deployment", "DaemonSet")
                for c in [*d["spec"]["template"]["spec"]["containers"],
                          *d["spec"]["template"]["spec"].get("initContainers", [])]}

    assert images(_docs()) == {"ghcr.io/kvgpu/kvgpu-operator:0.1.0", "ghcr.io/kvgpu/kvgpu-agent:0.1.0",
                               "registry.k8s.io/kube-scheduler:v1.36.3"}
    docs = render({"global": {"imageTag": "dev-1"},
                   "operator": {"image": {"registry": "", "repository": "local/op", "tag": "abc",
                                          "pullPolicy": "Never"}},
                   "devicePlugin": {"image": {"registry": "reg.example:5000", "repository": "kvgpu/agent",
                                              "pullPolicy": "Always"}}})
    assert images(docs) == {"local/op:abc", "reg.example:5000/kvgpu/agent:dev-1",
                            "registry.k8s.io/kube-scheduler:v1.36.3"}
    sts = _one(docs, "StatefulSet", "kvgpu-operator")["spec"]["template"]["spec"]
    assert {c["imagePullPolicy"] for c in [*sts["containers"], *sts["initContainers"]]} == {"Never"}
    [agent] = _one(docs, "DaemonSet", "kvgpu-agent")["spec"]["template"]["spec"]["containers"]
    assert agent["imagePullPolicy"] == "Always"


@pytest.mark.parametrize(("name", "aggregate"), [("kvgpu-view", "aggregate-to-view"),
                                                  ("kvgpu-edit", "aggregate-to-edit")])
def test_tenant_roles_read_claims_pools_and_quotas_only(name: str, aggregate: str) -> None:
    role = _one(_docs(), "ClusterRole", name)
    assert role["metadata"]["labels"][f"rbac.authorization.k8s.io/{aggregate}"] == "true"
    for resource in ("vgpuclaims", "vgpupools", "vgpuquotas"):
        assert _verbs(role, "kvgpu.io", resource) == {"get", "list", "watch"}
    assert {res for r in role["rules"] for res in r["resources"]} == {"vgpuclaims", "vgpupools", "vgpuquotas"}
    assert not [d for d in render({"rbac": {"tenantRoles": False}}) if d["metadata"]["name"] == name]


def test_the_agent_kills_escaped_and_over_limit_processes_unless_told_to_report() -> None:
    agent_cmd = _agent_command()
    assert agent_cmd is not None

    def params(values: dict[str, Any] | None) -> dict[str, Any]:
        [c] = one(render(values), "DaemonSet", "kvgpu-agent")["spec"]["template"]["spec"]["containers"]
        return agent_cmd.make_context("agent", _strip_paths(list(c["args"][1:]))).params

    default = params(None)
    assert default["unenforced"] == "kill" and default["unenforced_grace"] == 10.0
    assert default["over_limit"] == "kill" and default["over_limit_slack"] == 64
    assert default["over_cores"] == "kill" and default["over_cores_slack"] == 20 and default["over_cores_grace"] == 30
    told = params({"devicePlugin": {"unenforced": "report", "unenforcedGrace": 30, "overLimit": "report",
                                    "overLimitSlack": 128, "overCores": "report", "overCoresSlack": 35,
                                    "overCoresGrace": 60}})
    assert told["unenforced"] == "report" and told["unenforced_grace"] == 30.0
    assert told["over_limit"] == "report" and told["over_limit_slack"] == 128
    assert told["over_cores"] == "report" and told["over_cores_slack"] == 35 and told["over_cores_grace"] == 60
    for key in ("unenforced", "overLimit", "overCores"):
        with pytest.raises(RuntimeError, match=key):
            render({"devicePlugin": {key: "ignore"}})
