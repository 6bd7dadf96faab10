"""The kvgpu system installed *as pods* on the real node, from rendered YAML and the product images.

The objects come from rendered manifests — today ``kubectl kustomize manifests/base``
(:func:`render_kustomize`); later ``helm template charts/kvgpu`` — adapted to the dev cluster by
:func:`adapt_for_real_node` with explicit :class:`InClusterValues`, then applied, rolled out and
torn down by :func:`install` / :func:`uninstall`, which take any list of manifests.

What the real node lacks and how the values stand in (each maps to a chart value):

- **No kube-proxy, no cluster DNS.** ``host_network``: the operator, the agent and kvgpu's
  kube-scheduler run in the host's network namespace; they reach the API server at
  ``KUBERNETES_SERVICE_HOST/PORT`` = ``api_host:api_port`` (set in each container, overriding the
  Service IP the kubelet would inject), kube-scheduler reaches the extender at ``extender_url``
  (``https://127.0.0.1:<extender_port>/scheduler``, a SAN of the extender's certificate), and the
  API server reaches the webhook Service through its endpoints (``kube-apiserver
  --enable-aggregator-routing=true``, which :class:`~kvgpu.devcluster.cluster.Cluster` sets: the
  endpoint is the operator pod's IP, the node IP with ``hostNetwork``; TLS still names
  ``kvgpu-webhook.kvgpu-system.svc``).
- **Host ports.** With ``hostNetwork`` every port is the host's: ``extender_port``,
  ``metrics_port``, ``webhook_port``, ``agent_metrics_port``, ``scheduler_port`` are free ports
  chosen per install (the manifests' 8888/9090/9443/9394/10259 may be taken on a shared machine).
- **No cert-manager.** :func:`dev_certificates` issues the three Secrets the base expects
  (``kvgpu-webhook-tls``, ``kvgpu-extender-tls``, ``kvgpu-scheduler-extender-client``) and the
  webhook configurations' ``caBundle``.
- **No ServiceAccount admission plugin** (the dev API server runs without it): each pod gets the
  projected token volume the plugin would add (token, the API CA from ConfigMap
  ``kvgpu-dev-api-ca``, namespace).
- **No registry, no NVIDIA runtime, a simulated node.** Images are ``kvgpu.local/...`` with
  ``pull_policy`` ``Never``; the agent drops ``runtimeClassName: nvidia`` and gets
  ``agent_args`` (``--simulated``, ``--driver-root``, ``--dev-root`` of the node) and
  ``agent_host_paths`` (mounted read-only at the same path); one replica each
  (``replicas``) and no CPU/memory requests (a 2-core node).

Errors: :class:`InClusterError` with the failing command's output and, for a rollout, the pods'
states and the last log lines.
"""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvgpu.devcluster import pki as devpki
from kvgpu.devcluster.cluster import REPO_ROOT, Cluster, free_port

NAMESPACE = "kvgpu-system"
MANIFESTS = REPO_ROOT / "manifests"
API_CA_CONFIGMAP = "kvgpu-dev-api-ca"
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")


class InClusterError(RuntimeError):
    """Rendering, applying or rolling out the in-cluster system failed."""


@dataclass(frozen=True)
class InClusterValues:
    """The knobs of an in-cluster install (the chart's values of the same meaning)."""

    operator_image: str
    agent_image: str
    scheduler_image: str
    api_port: int
    api_host: str = "127.0.0.1"
    pull_policy: str = "Never"
    host_network: bool = True
    replicas: int = 1
    extender_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    webhook_port: int = field(default_factory=free_port)
    agent_metrics_port: int = field(default_factory=free_port)
    scheduler_port: int = field(default_factory=free_port)
    agent_args: tuple[str, ...] = ()
    agent_host_paths: tuple[str, ...] = ()
    strip_requests: bool = True

    @property
    def extender_url(self) -> str:
        return f"https://127.0.0.1:{self.extender_port}/scheduler"


# ----- rendering -------------------------------------------------------------------------------
def render_kustomize(cluster: Cluster, path: Path = MANIFESTS / "base") -> list[dict[str, Any]]:
    """``kubectl kustomize <path>`` as a list of objects. Raises :class:`InClusterError`."""
    p = cluster.kubectl("kustomize", str(path), check=False)
    if p.returncode != 0:
        raise InClusterError(f"kubectl kustomize {path} failed: {p.stderr.strip()}")
    return [d for d in yaml.safe_load_all(p.stdout) if d]


def _find(docs: Iterable[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for d in docs:
        if d.get("kind") == kind and d.get("metadata", {}).get("name") == name:
            return d
    raise InClusterError(f"the rendered manifests have no {kind} {name}")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def dev_certificates(d: Path, node_ip: str) -> list[dict[str, Any]]:
    """Issue, in ``d``, a webhook CA and serving certificate (``kvgpu-webhook.kvgpu-system.svc``)
    and the extender CA with its serving certificate (the Service names, ``127.0.0.1`` and
    ``node_ip``) and kube-scheduler's client certificate (``CN=kvgpu-scheduler``); returns the
    three TLS Secrets the base manifests mount, each with its CA as ``ca.crt``."""
    devpki.make_ca(d, "webhook-ca", "kvgpu-webhook-dev-ca")
    devpki.issue_leaf(d, "webhook", "webhook-ca", "kvgpu-webhook", server=True,
                      dns=(f"kvgpu-webhook.{NAMESPACE}.svc", f"kvgpu-webhook.{NAMESPACE}.svc.cluster.local"))
    devpki.make_ca(d, "extender-ca", "kvgpu-extender-dev-ca")
    devpki.issue_leaf(d, "extender", "extender-ca", "kvgpu-extender", server=True, dns=devpki.EXTENDER_DNS,
                      ips=("127.0.0.1", node_ip))
    devpki.issue_leaf(d, "extender-client", "extender-ca", devpki.EXTENDER_CLIENT_CN)

    def secret(name: str, stem: str, ca: str | None) -> dict[str, Any]:
        data = {"tls.crt": _b64((d / f"{stem}.crt").read_bytes()),
                "tls.key": _b64((d / f"{stem}.key").read_bytes())}
        if ca:
            data["ca.crt"] = _b64((d / f"{ca}.crt").read_bytes())
        return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                "metadata": {"name": name, "namespace": NAMESPACE}, "data": data}

    return [secret("kvgpu-webhook-tls", "webhook", "webhook-ca"),
            secret("kvgpu-extender-tls", "extender", "extender-ca"),
            secret("kvgpu-scheduler-extender-client", "extender-client", "extender-ca")]


# ----- adapting --------------------------------------------------------------------------------
def _pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return dict(doc["spec"]["template"]["spec"])


def _set_arg(args: list[str], flag: str, value: str | None) -> list[str]:
    """``args`` with every ``flag=...`` replaced by ``flag=value`` (appended if absent; removed
    for ``None``)."""
    out = [a for a in args if not (a == flag or a.startswith(flag + "="))]
    return out if value is None else [*out, f"{flag}={value}"]


def _common(spec: dict[str, Any], v: InClusterValues) -> None:
    """hostNetwork, API endpoint env, the projected token volume, pull policy, requests."""
    spec["hostNetwork"] = v.host_network
    if v.host_network:
        spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    spec["automountServiceAccountToken"] = False
    spec.setdefault("volumes", []).append({"name": "kube-api-access", "projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
        {"configMap": {"name": API_CA_CONFIGMAP, "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
    ]}})
    for c in spec["containers"]:
        c["imagePullPolicy"] = v.pull_policy
        c.setdefault("env", []).extend([{"name": "KUBERNETES_SERVICE_HOST", "value": v.api_host},
                                        {"name": "KUBERNETES_SERVICE_PORT", "value": str(v.api_port)}])
        c.setdefault("volumeMounts", []).append({"name": "kube-api-access", "mountPath": SA_MOUNT, "readOnly": True})
        if v.strip_requests and "resources" in c:
            c["resources"].pop("requests", None)


def _ports(c: dict[str, Any], ports: dict[str, int]) -> None:
    for p in c.get("ports", []):
        if p["name"] in ports:
            p["containerPort"] = ports[p["name"]]


def _operator(doc: dict[str, Any], v: InClusterValues) -> None:
    doc["spec"]["replicas"] = v.replicas
    spec = doc["spec"]["template"]["spec"]
    [c] = spec["containers"]
    c["image"] = v.operator_image
    args = list(c["args"])
    args = _set_arg(args, "--extender-address", f"0.0.0.0:{v.extender_port}")
    args = _set_arg(args, "--metrics-address", f"0.0.0.0:{v.metrics_port}")
    args = _set_arg(args, "--webhook-port", str(v.webhook_port))
    c["args"] = args
    _ports(c, {"extender": v.extender_port, "metrics": v.metrics_port, "webhooks": v.webhook_port})
    _common(spec, v)


def _scheduler(doc: dict[str, Any], v: InClusterValues) -> None:
    doc["spec"]["replicas"] = v.replicas
    spec = doc["spec"]["template"]["spec"]
    [c] = spec["containers"]
    c["image"] = v.scheduler_image
    c["command"] = _set_arg(list(c["command"]), "--secure-port", str(v.scheduler_port))
    _ports(c, {"https": v.scheduler_port})
    _common(spec, v)


def _agent(doc: dict[str, Any], v: InClusterValues) -> None:
    spec = doc["spec"]["template"]["spec"]
    spec.pop("runtimeClassName", None)
    [c] = spec["containers"]
    c["image"] = v.agent_image
    args = [a for a in c["args"] if not a.startswith(("--dev-root", "--host-dev-root"))]
    c["args"] = [*args, f"--metrics-port={v.agent_metrics_port}", *v.agent_args]
    _ports(c, {"metrics": v.agent_metrics_port})
    for i, p in enumerate(v.agent_host_paths):
        spec["volumes"].append({"name": f"node-{i}", "hostPath": {"path": p, "type": "Directory"}})
        c["volumeMounts"].append({"name": f"node-{i}", "mountPath": p, "readOnly": True})
    _common(spec, v)


def _scheduler_config(doc: dict[str, Any], v: InClusterValues) -> None:
    cfg = yaml.safe_load(doc["data"]["config.yaml"])
    for e in cfg.get("extenders", []):
        e["urlPrefix"] = v.extender_url
    doc["data"]["config.yaml"] = yaml.safe_dump(cfg, sort_keys=False)


def adapt_for_real_node(docs: Sequence[dict[str, Any]], v: InClusterValues, certs: Sequence[dict[str, Any]],
                        api_ca: bytes) -> list[dict[str, Any]]:
    """A copy of ``docs`` (the rendered base) set up with ``v`` for the dev cluster's real node,
    plus ``certs`` (:func:`dev_certificates`) and the ConfigMap with ``api_ca`` (the API server's
    CA, PEM). The webhook configurations get the webhook CA of ``certs`` as ``caBundle``.
    Raises :class:`InClusterError` if an expected object is missing."""
    out = [copy.deepcopy(d) for d in docs]
    _operator(_find(out, "StatefulSet", "kvgpu-operator"), v)
    _scheduler(_find(out, "Deployment", "kvgpu-scheduler"), v)
    _agent(_find(out, "DaemonSet", "kvgpu-agent"), v)
    _scheduler_config(_find(out, "ConfigMap", "kvgpu-scheduler-config"), v)
    ca_pem = _b64(_webhook_ca_of(certs))
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        for d in out:
            if d["kind"] == kind:
                for w in d.get("webhooks", []):
                    w["clientConfig"]["caBundle"] = ca_pem
    extra = [*certs, {"apiVersion": "v1", "kind": "ConfigMap",
                      "metadata": {"name": API_CA_CONFIGMAP, "namespace": NAMESPACE},
                      "data": {"ca.crt": api_ca.decode()}}]
    # after the Namespace, before the workloads
    ns_at = next((i for i, d in enumerate(out) if d["kind"] == "Namespace"), -1)
    return [*out[: ns_at + 1], *extra, *out[ns_at + 1:]]


def _webhook_ca_of(certs: Sequence[dict[str, Any]]) -> bytes:
    """The CA of the webhook's certificate: ``ca.crt`` of the ``kvgpu-webhook-tls`` Secret."""
    for s in certs:
        if s["metadata"]["name"] == "kvgpu-webhook-tls" and "ca.crt" in s.get("data", {}):
            return base64.b64decode(s["data"]["ca.crt"])
    raise InClusterError("the kvgpu-webhook-tls Secret carries no ca.crt")


# ----- applying --------------------------------------------------------------------------------
def _kubectl(cluster: Cluster, *args: str, input: str | None = None, timeout: float = 120) -> str:
    try:
        p = cluster.kubectl(*args, input=input, check=False, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise InClusterError(f"kubectl {' '.join(args)} timed out after {timeout:.0f} s") from e
    if p.returncode != 0:
        raise InClusterError(f"kubectl {' '.join(args)} failed: {p.stderr.strip()[-3000:]}")
    return str(p.stdout)


def install(cluster: Cluster, docs: Sequence[dict[str, Any]], timeout: float = 180) -> None:
    """Apply ``docs`` (server-side; CRDs first and waited for) and wait until every Deployment,
    StatefulSet and DaemonSet among them has rolled out. Raises :class:`InClusterError` with the
    pods' states and log tails when one does not within ``timeout`` seconds."""
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    rest = [d for d in docs if d["kind"] != "CustomResourceDefinition"]
    if crds:
        _kubectl(cluster, "apply", "--server-side", "--force-conflicts", "-f", "-",
                 input=json.dumps({"apiVersion": "v1", "kind": "List", "items": crds}))
        _kubectl(cluster, "wait", "--for=condition=Established", "crd",
                 *[d["metadata"]["name"] for d in crds], "--timeout=60s")
    _kubectl(cluster, "apply", "--server-side", "--force-conflicts", "-f", "-",
             input=json.dumps({"apiVersion": "v1", "kind": "List", "items": rest}))
    wait_rollout(cluster, docs, timeout)


def wait_rollout(cluster: Cluster, docs: Sequence[dict[str, Any]], timeout: float = 180) -> None:
    """``kubectl rollout status`` of every workload in ``docs``, within ``timeout`` in all."""
    deadline = time.monotonic() + timeout
    for d in docs:
        if d["kind"] not in WORKLOADS:
            continue
        ref = f"{d['kind'].lower()}/{d['metadata']['name']}"
        left = max(1.0, deadline - time.monotonic())
        p = cluster.kubectl("rollout", "status", ref, "-n", d["metadata"].get("namespace", "default"),
                            f"--timeout={int(left)}s", check=False, timeout=left + 30)
        if p.returncode != 0:
            raise InClusterError(f"{ref} did not roll out: {p.stderr.strip()}\n{diagnose(cluster)}")


def diagnose(cluster: Cluster, namespace: str = NAMESPACE, lines: int = 15) -> str:
    """The pods of ``namespace`` with their phase and container states, and each one's last log lines."""
    p = cluster.kubectl("get", "pods", "-n", namespace, "-o", "json", check=False)
    out = []
    for pod in json.loads(p.stdout or '{"items": []}')["items"]:
        name = pod["metadata"]["name"]
        states = [(c["name"], c.get("state"), c.get("restartCount"))
                  for c in pod["status"].get("containerStatuses", [])]
        out.append(f"- {name}: {pod['status'].get('phase')} {states} {pod['status'].get('conditions')}")
        logs = cluster.kubectl("logs", name, "-n", namespace, "--all-containers", f"--tail={lines}", check=False)
        out.append("  " + (logs.stdout or logs.stderr).strip().replace("\n", "\n  "))
    ev = cluster.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False).stdout
    return "\n".join([*out, "events:", *ev.strip().splitlines()[-15:]])


def uninstall(cluster: Cluster, docs: Sequence[dict[str, Any]], timeout: float = 120) -> None:
    """Delete ``docs`` in reverse order and wait for them to go; CRDs stay (deleting them would
    delete every pool and claim of the cluster). Missing objects are not an error."""
    rest = [d for d in reversed(docs) if d["kind"] != "CustomResourceDefinition"]
    cluster.kubectl("delete", "--ignore-not-found", "--wait=true", f"--timeout={int(timeout)}s", "-f", "-",
                    input=json.dumps({"apiVersion": "v1", "kind": "List", "items": rest}), check=False,
                    timeout=timeout + 30)


# ----- the real node -----------------------------------------------------------------------------
@dataclass
class InstalledSystem:
    """What :func:`install_on_real_node` applied: the objects (for :func:`uninstall`) and the values."""

    docs: list[dict[str, Any]]
    values: InClusterValues

    @property
    def agent_metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.values.agent_metrics_port}/metrics"

    @property
    def operator_metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.values.metrics_port}"


def real_node_values(node: Any) -> InClusterValues:
    """Values for ``node`` (a started :class:`~kvgpu.devcluster.realnode.RealNode`): the product
    and kube-scheduler images built here and imported into its containerd, its API server port,
    and the simulated node's agent flags and host paths."""
    from kvgpu.devcluster import images, productimages

    op, ag = node.import_product_images()
    sched = productimages.build_scheduler_image(node.cluster.bin_dir)
    images.import_image([str(node.containerd_bin / "ctr"), f"--address={node.socket}"], sched.archive)
    agent_args: tuple[str, ...] = ("--interval=5", f"--driver-root={node.driver_root}",
                                   f"--dev-root={node.dev_root}")
    paths: tuple[str, ...] = (str(node.dir),)
    if not node.gpu:
        agent_args += (f"--simulated={node.sim_file}",)
    return InClusterValues(operator_image=op, agent_image=ag, scheduler_image=sched.refs[0],
                           api_port=node.cluster.api_port, agent_args=agent_args, agent_host_paths=paths)


def install_on_real_node(node: Any, docs: Sequence[dict[str, Any]] | None = None,
                         values: InClusterValues | None = None, timeout: float = 240) -> InstalledSystem:
    """Render (``docs`` default: :func:`render_kustomize` of manifests/base), adapt
    (:func:`adapt_for_real_node`) and :func:`install` the kvgpu system on ``node``'s cluster as
    pods. The caller stops any kvgpu system that runs as host processes first (same webhook
    configuration names, same scheduler name). Returns what to pass to :func:`uninstall`."""
    cluster = node.cluster
    v = values or real_node_values(node)
    rendered = list(docs) if docs is not None else render_kustomize(cluster)
    certs = dev_certificates(cluster.run_dir / "incluster-pki", node.node_ip)
    api_ca = (cluster.run_dir / "pki" / "ca.crt").read_bytes()
    adapted = adapt_for_real_node(rendered, v, certs, api_ca)
    installed = InstalledSystem(adapted, v)
    # The host-process operator's webhook configurations (same names, url clientConfig, another
    # field manager) would merge with these under server-side apply: replace them.
    for d in adapted:
        if d["kind"].endswith("WebhookConfiguration"):
            cluster.kubectl("delete", d["kind"], d["metadata"]["name"], "--ignore-not-found", check=False)
    try:
        install(cluster, adapted, timeout)
    except BaseException:
        uninstall(cluster, adapted)
        raise
    return installed
