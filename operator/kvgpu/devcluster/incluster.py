"""The kvgpu system installed *as pods* on the real node: ``helm install`` of charts/kvgpu from
the product images, with the dev cluster's differences applied by a Helm post-renderer.

:func:`install_on_real_node` runs ``helm install`` (``helm upgrade --install`` with
``upgrade=True``: :func:`upgrade_on_real_node`) with :func:`chart_values` and ``--post-renderer``
= this module (``python -m kvgpu.devcluster.incluster post-render VALUES.json``:
:func:`adapt_for_real_node` over the rendered objects), waits for the rollout, and
:func:`uninstall_from_real_node` runs ``helm uninstall``. The release is Helm's own: ``helm
list``, ``helm history`` and ``helm upgrade`` work on it as on any cluster.

What the real node lacks and how the values stand in (chart values where the chart has one):

- **No kube-proxy, no cluster DNS.** ``host_network`` (``*.hostNetwork``): the operator, the agent
  and kvgpu's kube-scheduler run in the host's network namespace; they reach the API server at
  ``KUBERNETES_SERVICE_HOST/PORT`` = ``api_host:api_port`` (set by the post-renderer in each
  container, overriding the Service IP the kubelet would inject), kube-scheduler reaches the
  extender at ``extender_url`` (``scheduler.extenderURL``: ``https://127.0.0.1:<port>/scheduler``;
  the chart adds its host to the extender certificate's names), and the API server reaches the
  webhook Service through its endpoints (``kube-apiserver --enable-aggregator-routing=true``,
  which :class:`~kvgpu.devcluster.cluster.Cluster` sets: the endpoint is the operator pod's IP,
  the node IP with ``hostNetwork``; TLS still names ``kvgpu-webhook.kvgpu-system.svc``).
- **Host ports.** With ``hostNetwork`` every port is the host's: ``extender_port``,
  ``metrics_port``, ``webhook_port`` (``operator.ports.*``), ``agent_metrics_port``
  (``devicePlugin.metricsPort``), ``scheduler_port`` (post-rendered ``--secure-port``) are free
  ports chosen per install (the defaults may be taken on a shared machine).
- **Certificates**: the chart's own (the operator pod's ``kvgpu certs`` init container and
  sidecar issue them into Secrets and patch the webhook configurations' ``caBundle``); no
  cert-manager.
- **No ServiceAccount admission plugin** (the dev API server runs without it): each pod gets the
  projected token volume the plugin would add (token, the API CA from ConfigMap
  ``kvgpu-dev-api-ca``, rendered into the release, and the namespace), init containers too.
- **No registry, no NVIDIA runtime, a simulated node.** Images are ``kvgpu.local/...`` with
  ``pull_policy`` ``Never``; ``devicePlugin.runtimeClassName`` empty; the agent gets
  ``agent_args`` (``--simulated``, ``--driver-root``, ``--dev-root`` of the node) and
  ``agent_host_paths`` (mounted read-only at the same path); one replica each (``replicas``) and
  no CPU/memory requests (a 2-core node); the node's pool is the test fixture's
  (``pool.create=false``).

Errors: :class:`InClusterError` with the failing command's output and, for a rollout, the pods'
states and the last log lines.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvgpu.devcluster.cluster import REPO_ROOT, Cluster, free_port
from kvgpu.dra.slices import device_classes

NAMESPACE = "kvgpu-system"
RELEASE = "kvgpu"
CHART = REPO_ROOT / "charts" / "kvgpu"
HELM_BUILD = REPO_ROOT / "hack" / "helm" / "build.sh"
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


# ----- the chart -------------------------------------------------------------------------------
@functools.cache
def helm_binary() -> Path:
    """The helm binary: ``$KVGPU_HELM``, else the cached build of hack/helm/build.sh (built on the
    first call: Go and the module proxy). Raises :class:`InClusterError` when the build fails."""
    env = os.environ.get("KVGPU_HELM")
    if env:
        return Path(env)
    proc = subprocess.run([str(HELM_BUILD)], stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise InClusterError(f"hack/helm/build.sh failed (exit {proc.returncode}); see its output above")
    return Path(proc.stdout.strip().splitlines()[-1])


def _image(ref: str, pull_policy: str) -> dict[str, str]:
    """A chart image value from ``registry/repository:tag``."""
    name, tag = ref.rsplit(":", 1)
    registry, repository = name.split("/", 1)
    return {"registry": registry, "repository": repository, "tag": tag, "pullPolicy": pull_policy}


def chart_values(v: InClusterValues) -> dict[str, Any]:
    """The chart's values for an install on the dev cluster's real node (the rest is post-rendered)."""
    sched_repo, sched_tag = v.scheduler_image.rsplit(":", 1)
    return {
        "operator": {"image": _image(v.operator_image, v.pull_policy), "replicas": v.replicas,
                     "hostNetwork": v.host_network,
                     "ports": {"extender": v.extender_port, "metrics": v.metrics_port, "webhook": v.webhook_port}},
        "scheduler": {"replicas": v.replicas, "hostNetwork": v.host_network, "extenderURL": v.extender_url,
                      "kubeScheduler": {"image": sched_repo, "imageTag": sched_tag,
                                        "imagePullPolicy": v.pull_policy}},
        "devicePlugin": {"image": _image(v.agent_image, v.pull_policy), "hostNetwork": v.host_network,
                         "runtimeClassName": "", "metricsPort": v.agent_metrics_port},
        "pool": {"create": False},
        "rbac": {"simulatedAgent": True},
    }


def _find(docs: Iterable[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for d in docs:
        if d.get("kind") == kind and d.get("metadata", {}).get("name") == name:
            return d
    raise InClusterError(f"the rendered manifests have no {kind} {name}")


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
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
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
    for side in [*spec.get("initContainers", []), *spec["containers"]]:  # the certs containers too
        side["image"] = v.operator_image
    c = next(c for c in spec["containers"] if c["name"] == "operator")
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


def _mps(doc: dict[str, Any], v: InClusterValues) -> None:
    """The MPS daemons' owner: the agent's image, no runtime class, the simulated node's driver
    folder (``--driver-root`` of ``agent_args``, its control program) and host paths; rolled out
    like the others."""
    doc["spec"]["updateStrategy"] = {"type": "RollingUpdate"}  # OnDelete has no rollout status
    spec = doc["spec"]["template"]["spec"]
    spec.pop("runtimeClassName", None)
    [c] = spec["containers"]
    c["image"] = v.agent_image
    c["imagePullPolicy"] = v.pull_policy
    c["args"] = [*c["args"], *(a for a in v.agent_args if a.startswith("--driver-root="))]
    for i, p in enumerate(v.agent_host_paths):
        spec["volumes"].append({"name": f"node-{i}", "hostPath": {"path": p, "type": "Directory"}})
        c["volumeMounts"].append({"name": f"node-{i}", "mountPath": p, "readOnly": True})
    if v.strip_requests and "resources" in c:
        c["resources"].pop("requests", None)


def _scheduler_config(doc: dict[str, Any], v: InClusterValues) -> None:
    cfg = yaml.safe_load(doc["data"]["config.yaml"])
    for e in cfg.get("extenders", []):
        e["urlPrefix"] = v.extender_url
    doc["data"]["config.yaml"] = yaml.safe_dump(cfg, sort_keys=False)


def adapt_for_real_node(docs: Sequence[dict[str, Any]], v: InClusterValues, api_ca: bytes) -> list[dict[str, Any]]:
    """A copy of ``docs`` (the chart rendered with :func:`chart_values`) set up with ``v`` for the
    dev cluster's real node, plus the ConfigMap with ``api_ca`` (the API server's CA, PEM) first.
    Raises :class:`InClusterError` if an expected object is missing."""
    out = [copy.deepcopy(d) for d in docs if d]
    _operator(_find(out, "StatefulSet", "kvgpu-operator"), v)
    _scheduler(_find(out, "Deployment", "kvgpu-scheduler"), v)
    _agent(_find(out, "DaemonSet", "kvgpu-agent"), v)
    mps = [d for d in out if d.get("kind") == "DaemonSet" and d["metadata"]["name"] == "kvgpu-mps"]
    for d in mps:  # absent with devicePlugin.mps.enabled=false
        _mps(d, v)
    _scheduler_config(_find(out, "ConfigMap", "kvgpu-scheduler-config"), v)
    ca = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": API_CA_CONFIGMAP, "namespace": NAMESPACE},
          "data": {"ca.crt": api_ca.decode()}}
    return [ca, *out]


def post_render(values_file: Path, text: str) -> str:
    """The post-renderer's work: ``text`` (Helm's rendered stream) adapted with the
    :class:`InClusterValues` and API CA saved in ``values_file`` (:func:`_save_values`)."""
    saved = json.loads(values_file.read_text())
    fields: dict[str, Any] = {k: tuple(x) if isinstance(x, list) else x for k, x in saved["values"].items()}
    v = InClusterValues(**fields)
    docs = [d for d in yaml.safe_load_all(text) if d]
    return yaml.safe_dump_all(adapt_for_real_node(docs, v, saved["api_ca"].encode()), sort_keys=False)


def _save_values(path: Path, v: InClusterValues, api_ca: bytes) -> None:
    path.write_text(json.dumps({"values": asdict(v), "api_ca": api_ca.decode()}))


def _post_renderer(run_dir: Path) -> Path:
    """An executable Helm can run as ``--post-renderer``: this module under this interpreter."""
    script = run_dir / "incluster-post-render"
    cmd = f"exec {shlex.quote(sys.executable)} -m kvgpu.devcluster.incluster post-render"
    script.write_text(f'#!/bin/sh\n{cmd} "$@"\n')
    script.chmod(0o755)
    return script


def helm(cluster: Cluster, *args: str, timeout: float = 300) -> str:
    """Run helm against ``cluster`` (its kubeconfig); stdout. Raises :class:`InClusterError` with
    helm's stderr on failure or timeout."""
    cmd = [str(helm_binary()), f"--kubeconfig={cluster.kubeconfig}", *args]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise InClusterError(f"helm {' '.join(args)} timed out after {timeout:.0f} s\n{diagnose(cluster)}") from e
    if p.returncode != 0:
        raise InClusterError(f"helm {' '.join(args)} failed: {p.stderr.strip()[-3000:]}\n{diagnose(cluster)}")
    return p.stdout


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
    every = cluster.kubectl("get", "pods", "-A", "-o", "json", check=False).stdout
    held = host_ports(json.loads(every or '{"items": []}')["items"])
    return "\n".join([*out, "events:", *ev.strip().splitlines()[-15:], "host ports held, every namespace:",
                      *(f"- {pod}: {ports}" for pod, ports in held.items())])


def host_ports(pods: Iterable[dict[str, Any]]) -> dict[str, list[int]]:
    """``namespace/name`` of each pod (JSON objects) that holds host ports in the scheduler's view
    (a hostNetwork pod's container ports, any pod's hostPorts), with those ports, sorted."""
    held = {}
    for pod in pods:
        spec = pod.get("spec", {})
        net = spec.get("hostNetwork", False)
        ports = sorted({(p.get("hostPort") or p["containerPort"]) if net else p.get("hostPort", 0)
                        for c in [*spec.get("initContainers", []), *spec.get("containers", [])]
                        for p in c.get("ports", [])} - {0})
        if ports:
            held[f"{pod['metadata'].get('namespace')}/{pod['metadata']['name']}"] = ports
    return held


# ----- the real node -----------------------------------------------------------------------------
@dataclass
class InstalledSystem:
    """A Helm release of the chart on the real node: its name, chart and values."""

    values: InClusterValues
    chart: Path = CHART
    release: str = RELEASE

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


def _helm_deploy(node: Any, verb: tuple[str, ...], system: InstalledSystem, extra: dict[str, Any] | None,
                 timeout: float) -> None:
    cluster = node.cluster
    api_ca = (cluster.run_dir / "pki" / "ca.crt").read_bytes()
    vfile = cluster.run_dir / "incluster-values.json"
    _save_values(vfile, system.values, api_ca)
    chart_vals = cluster.run_dir / "incluster-chart-values.json"
    chart_vals.write_text(json.dumps(chart_values(system.values)))
    extra_args: list[str] = []
    if extra:
        extra_file = cluster.run_dir / "incluster-extra-values.json"
        extra_file.write_text(json.dumps(extra))
        extra_args = ["-f", str(extra_file)]
    helm(cluster, *verb, system.release, str(system.chart), "-n", NAMESPACE, "-f", str(chart_vals), *extra_args,
         "--post-renderer", str(_post_renderer(cluster.run_dir)), "--post-renderer-args", str(vfile),
         "--wait", f"--timeout={int(timeout)}s", timeout=timeout + 60)


def install_on_real_node(node: Any, values: InClusterValues | None = None, chart: Path = CHART,
                         extra: dict[str, Any] | None = None, timeout: float = 240) -> InstalledSystem:
    """``helm install`` ``chart`` on ``node``'s cluster from the images built here (``--wait``:
    every workload rolled out). The caller stops any kvgpu system that runs as host processes
    first (same webhook configuration names, same scheduler name). ``extra``: more chart values.
    Raises :class:`InClusterError` (after uninstalling what was installed)."""
    cluster = node.cluster
    system = InstalledSystem(values or real_node_values(node), chart)
    # The host-process operator's webhook configurations and claim and pod policies (same names; it
    # applies them again when it starts) and the dev system's DeviceClass
    # (KvgpuSystem.install_device_classes) are not Helm's: Helm would refuse to adopt them.
    for kind, name in (("MutatingWebhookConfiguration", "kvgpu-mutate"),
                       ("ValidatingWebhookConfiguration", "kvgpu-validate"),
                       ("ValidatingAdmissionPolicy", "vgpuclaims.kvgpu.io"),
                       ("ValidatingAdmissionPolicyBinding", "vgpuclaims.kvgpu.io"),
                       ("ValidatingAdmissionPolicy", "pods.kvgpu.io"),
                       ("ValidatingAdmissionPolicyBinding", "pods.kvgpu.io"),
                       *(("DeviceClass", dc["metadata"]["name"]) for dc in device_classes())):
        cluster.kubectl("delete", kind, name, "--ignore-not-found", check=False)
    try:
        _helm_deploy(node, ("install", "--create-namespace"), system, extra, timeout)
    except BaseException:
        uninstall_from_real_node(cluster, system)
        raise
    return system


def upgrade_on_real_node(node: Any, system: InstalledSystem, chart: Path = CHART,
                         extra: dict[str, Any] | None = None, timeout: float = 240) -> InstalledSystem:
    """``helm upgrade`` the release of ``system`` to ``chart`` with ``extra`` values (``--wait``).
    Raises :class:`InClusterError`."""
    upgraded = InstalledSystem(system.values, chart, system.release)
    _helm_deploy(node, ("upgrade",), upgraded, extra, timeout)
    return upgraded


def uninstall_from_real_node(cluster: Cluster, system: InstalledSystem, timeout: float = 120) -> None:
    """``helm uninstall`` (``--wait``) and the certificate Secrets the operator issued (kept by
    Helm on purpose in production: docs/operations.md); CRDs stay. Never raises for a release
    that is already gone."""
    subprocess.run([str(helm_binary()), f"--kubeconfig={cluster.kubeconfig}", "uninstall", system.release,
                    "-n", NAMESPACE, "--wait", f"--timeout={int(timeout)}s", "--ignore-not-found"],
                   capture_output=True, text=True, check=False, timeout=timeout + 60)
    cluster.kubectl("delete", "secrets", "-n", NAMESPACE, "-l", "app.kubernetes.io/part-of=kvgpu",
                    "--ignore-not-found", check=False)


def main(argv: Sequence[str]) -> int:
    """``post-render VALUES.json``: Helm's rendered stream on stdin, the adapted one on stdout."""
    if len(argv) != 2 or argv[0] != "post-render":
        print("usage: python -m kvgpu.devcluster.incluster post-render VALUES.json", file=sys.stderr)
        return 2
    sys.stdout.write(post_render(Path(argv[1]), sys.stdin.read()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
