"""manifests/ and the Dockerfiles without a cluster: generated files current, RBAC without
wildcards, container arguments the CLI accepts, files the Dockerfiles copy exist.
(The render and a server-side dry-run against the real API server: tests/cluster/test_manifests.py.)"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"


def _gen() -> Any:
    spec = importlib.util.spec_from_file_location("gen_manifests", ROOT / "hack" / "gen_manifests.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _docs(*parts: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted(MANIFESTS.joinpath(*parts).glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [d] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return d


def test_generated_files_are_current() -> None:
    stale = _gen().stale()
    assert not stale, f"run `python hack/gen_manifests.py`: {[str(p) for p in stale]} differ"


def test_crd_copies_cover_every_crd() -> None:
    names = {p.name for p in (ROOT / "crds").glob("*.yaml")}
    listed = yaml.safe_load((MANIFESTS / "crds" / "kustomization.yaml").read_text())["resources"]
    assert names <= set(listed)


def test_rbac_has_no_wildcards_and_one_account_per_component() -> None:
    docs = _docs("base")
    roles = [d for d in docs if d["kind"] in ("ClusterRole", "Role")]
    assert {r["metadata"]["name"] for r in roles if r["kind"] == "ClusterRole"} == {
        "kvgpu-operator", "kvgpu-scheduler", "kvgpu-agent", "kvgpu-view", "kvgpu-edit"}
    for r in roles:
        for rule in r["rules"]:
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in rule.get(field, []), (r["metadata"]["name"], rule)
            assert "escalate" not in rule["verbs"] and "bind" not in rule["verbs"]
            assert "secrets" not in rule["resources"], "no component reads Secrets through the API"
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    assert accounts == {"kvgpu-operator", "kvgpu-scheduler", "kvgpu-agent"}
    kinds = ("StatefulSet", "Deployment", "DaemonSet")
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in kinds}
    for name, w in workloads.items():
        assert w["spec"]["template"]["spec"]["serviceAccountName"] == name


def _verbs(role: dict[str, Any], group: str, resource: str) -> set[str]:
    rules = [r for r in role["rules"] if group in r["apiGroups"] and resource in r["resources"]]
    return {v for r in rules for v in r["verbs"]}


def test_operator_role_covers_its_calls() -> None:
    role = _one(_docs("base"), "ClusterRole", "kvgpu-operator")
    assert {"get", "list", "watch", "patch"} <= _verbs(role, "", "pods")
    assert _verbs(role, "", "pods/binding") == {"create"}
    assert {"list", "watch", "patch"} <= _verbs(role, "", "nodes")
    assert {"create", "delete", "list", "watch", "get"} <= _verbs(role, "kvgpu.io", "vgpuclaims")
    assert _verbs(role, "kvgpu.io", "vgpuclaims/status") == {"patch"}
    assert _verbs(role, "kvgpu.io", "vgpupools/status") == {"patch"}
    assert _verbs(role, "", "resourcequotas") == {"list", "watch"}  # read only: KCM owns their status
    assert _verbs(role, "kvgpu.io", "vgpuquotas") == {"list", "watch"}
    assert _verbs(role, "kvgpu.io", "vgpuquotas/status") == {"patch"}
    lease = _one(_docs("base"), "Role", "kvgpu-operator-lease")
    assert any(r.get("resourceNames") == ["kvgpu-operator"] and set(r["verbs"]) == {"get", "update"}
               for r in lease["rules"])
    assert _verbs(role, "", "events") == {"create", "patch"}  # patch: a repeat's count
    # The operator never deletes pods nor writes nodes' spec/status or webhook configurations.
    assert "delete" not in _verbs(role, "", "pods")
    assert not _verbs(role, "admissionregistration.k8s.io", "mutatingwebhookconfigurations")


def test_scheduler_lease_is_scoped() -> None:
    docs = _docs("base")
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
    [ext] = cfg["extenders"]
    svc = _one(docs, "Service", "kvgpu-operator")
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "extender")
    assert ext["urlPrefix"] == f"https://kvgpu-operator.kvgpu-system.svc:{port}/scheduler"
    dep = _one(docs, "Deployment", "kvgpu-scheduler")
    [c] = dep["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "registry.k8s.io/kube-scheduler:v1.36.3"
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "config")
    assert f"--config={mount}/config.yaml" in c["command"]


def test_webhooks_point_at_the_webhook_service() -> None:
    docs = _docs("base")
    svc = _one(docs, "Service", "kvgpu-webhook")
    [port] = svc["spec"]["ports"]
    sts = _one(docs, "StatefulSet", "kvgpu-operator")
    [c] = sts["spec"]["template"]["spec"]["containers"]
    target = next(p["containerPort"] for p in c["ports"] if p["name"] == port["targetPort"])
    assert f"--webhook-port={target}" in c["args"]
    hooks = [h for d in docs if d["kind"].endswith("WebhookConfiguration") for h in d["webhooks"]]
    assert len(hooks) == 3
    for h in hooks:
        ref = h["clientConfig"]["service"]
        assert (ref["namespace"], ref["name"], ref["port"]) == ("kvgpu-system", "kvgpu-webhook", port["port"])
        assert h["failurePolicy"] == "Fail" and h["timeoutSeconds"] == 5
        [sel] = h["namespaceSelector"]["matchExpressions"]
        assert {"kube-system", "kvgpu-system"} <= set(sel["values"]) and sel["operator"] == "NotIn"
    # cert-manager's CA injector fills the bundle from the serving Certificate.
    comp = yaml.safe_load((MANIFESTS / "components" / "cert-manager" / "kustomization.yaml").read_text())
    assert {p["target"]["kind"] for p in comp["patches"]} == {
        "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"}
    certs = _docs("components", "cert-manager")
    cert = _one(certs, "Certificate", "kvgpu-webhook")
    assert "kvgpu-webhook.kvgpu-system.svc" in cert["spec"]["dnsNames"]
    volumes = sts["spec"]["template"]["spec"]["volumes"]
    secret = next(v["secret"]["secretName"] for v in volumes if "secret" in v)
    assert cert["spec"]["secretName"] == secret
    for p in comp["patches"]:
        assert "kvgpu-system/kvgpu-webhook" in p["patch"]


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def test_operator_arguments_parse_and_elect_a_leader() -> None:
    from kvgpu.cli.main import main

    sts = _one(_docs("base"), "StatefulSet", "kvgpu-operator")
    assert sts["spec"]["replicas"] == 2
    [c] = sts["spec"]["template"]["spec"]["containers"]
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
    """The Secret whose volume ``container`` mounts at the directory of ``path``."""
    directory = path.rsplit("/", 1)[0]
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    [vol] = [v for v in pod_spec["volumes"] if v["name"] == mount["name"]]
    return str(vol["secret"]["secretName"])


def test_extender_is_mutual_tls_end_to_end() -> None:
    """Issue 14: the operator serves the extender with cert-manager's serving certificate and
    trusts clients by the extender CA; kube-scheduler presents the client certificate whose CN
    the operator allows and trusts the same CA; probes and scrapes use the plain metrics port."""
    from kvgpu.cli.main import main

    docs, certs = _docs("base"), _docs("components", "cert-manager")
    sts = _one(docs, "StatefulSet", "kvgpu-operator")
    op_spec = sts["spec"]["template"]["spec"]
    [op] = op_spec["containers"]
    flags = dict(a.split("=", 1) for a in op["args"] if a.startswith("--") and "=" in a)
    assert "--extender-insecure" not in op["args"]
    serving = _one(certs, "Certificate", "kvgpu-extender")
    client = _one(certs, "Certificate", "kvgpu-scheduler-extender-client")
    for flag in ("--extender-cert", "--extender-key", "--extender-client-ca"):
        assert _mounted_secret(op_spec, op, flags[flag]) == serving["spec"]["secretName"]
    assert flags["--extender-client-ca"].endswith("/ca.crt")
    assert serving["spec"]["issuerRef"] == client["spec"]["issuerRef"] == {"kind": "Issuer",
                                                                          "name": "kvgpu-extender-ca"}
    assert "client auth" in client["spec"]["usages"] and "server auth" in serving["spec"]["usages"]
    assert "kvgpu-operator.kvgpu-system.svc" in serving["spec"]["dnsNames"]
    ctx = main.commands["operator"].make_context("operator", _strip_paths(op["args"][1:]))
    assert client["spec"]["commonName"] in ",".join(ctx.params["extender_allowed_clients"]).split(",")
    # kube-scheduler's side
    cfg = yaml.safe_load(_one(docs, "ConfigMap", "kvgpu-scheduler-config")["data"]["config.yaml"])
    [ext] = cfg["extenders"]
    assert ext["enableHTTPS"] is True and ext["urlPrefix"].startswith("https://")
    dep = _one(docs, "Deployment", "kvgpu-scheduler")
    dep_spec = dep["spec"]["template"]["spec"]
    [sched] = dep_spec["containers"]
    tls = ext["tlsConfig"]
    assert not tls.get("insecure")
    for key in ("certFile", "keyFile", "caFile"):
        assert _mounted_secret(dep_spec, sched, tls[key]) == client["spec"]["secretName"]
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
    docs = _docs("base")
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
    [op] = sts["spec"]["template"]["spec"]["containers"]
    assert set(by_port) == {p["name"] for p in op["ports"]}, "every container port has its rule"
    k = yaml.safe_load((MANIFESTS / "base" / "kustomization.yaml").read_text())
    assert "networkpolicy.yaml" in k["resources"]


def test_agent_daemonset() -> None:
    from kvgpu.core import keys

    ds = _one(_docs("base"), "DaemonSet", "kvgpu-agent")
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
    for p in (keys.HOST_SHIM_DIR, keys.HOST_PRELOAD_FILE, keys.HOST_REGION_ROOT):
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
        assert ctx.params["device_specs"] and ctx.params["mounts"] == "none"


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
    ds = _one(_docs("base"), "DaemonSet", "kvgpu-agent")
    [c] = ds["spec"]["template"]["spec"]["containers"]
    assert f"--shim-source={m.group(1)}" in c["args"]


def test_images_in_kustomization() -> None:
    k = yaml.safe_load((MANIFESTS / "base" / "kustomization.yaml").read_text())
    names = {i["name"] for i in k["images"]}
    used = {c["image"].rsplit(":", 1)[0] for d in _docs("base") if d["kind"] in ("StatefulSet", "DaemonSet")
            for c in d["spec"]["template"]["spec"]["containers"]}
    assert used == names


@pytest.mark.parametrize(("name", "aggregate"), [("kvgpu-view", "aggregate-to-view"),
                                                  ("kvgpu-edit", "aggregate-to-edit")])
def test_tenant_roles_read_claims_pools_and_quotas_only(name: str, aggregate: str) -> None:
    role = _one(_docs("base"), "ClusterRole", name)
    assert role["metadata"]["labels"][f"rbac.authorization.k8s.io/{aggregate}"] == "true"
    for resource in ("vgpuclaims", "vgpupools", "vgpuquotas"):
        assert _verbs(role, "kvgpu.io", resource) == {"get", "list", "watch"}
    assert {res for r in role["rules"] for res in r["resources"]} == {"vgpuclaims", "vgpupools", "vgpuquotas"}
    assert "rbac-tenants.yaml" in (MANIFESTS / "base" / "kustomization.yaml").read_text()
