"""The KubeSchedulerConfiguration of the kvgpu scheduler instance (dev cluster and manifests).

One profile, ``kvgpu-scheduler`` (the mutating webhook points slice-requesting pods at it),
with our extender for filter/prioritize/bind. Everything else is upstream kube-scheduler:
its own plugins filter cpu, memory, affinity, taints and spread as usual; for GPU pods the
extender's filter answers one node, so they score only pods with soft preferences
(:mod:`kvgpu.extender.choice`, ``--node-choice``).

- ``nodeCacheCapable: true``: the scheduler sends node names, not Node objects;
- no ``managedResources``: every pod of this profile goes to the extender (annotation-form
  pods admitted before the webhook added ``nvidia.com/gpu`` to them request none);
- ``NodeResourcesFit.ignoredResources``: HAMi's per-card amounts (``nvidia.com/gpumem`` …) are
  not node resources; the extender accounts them. ``nvidia.com/gpu`` stays a counted resource
  (both forms request it, one replica per card; allocatable = cards x splitCount);
- mutual TLS (issue 14): an ``https://`` URL gets ``enableHTTPS: true`` and a ``tlsConfig``
  (v1 ``ExtenderTLSConfig``: ``certFile``/``keyFile``, kube-scheduler's client certificate the
  extender checks, and ``caFile``, the CA that signed the extender's serving certificate);
- back-off 1 s: a pod rejected for lack of GPU capacity is retried right after the operator
  nudges it (capacity freed), not minutes later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgpu.core import keys

IGNORED_RESOURCES = (
    "nvidia.com/gpumem",
    "nvidia.com/gpumem-percentage",
    "nvidia.com/gpucores",
    "nvidia.com/priority",
)


@dataclass(frozen=True)
class ExtenderTLS:
    """Files kube-scheduler uses to reach the extender over mutual TLS (paths as it sees them)."""

    cert_file: str  # its client certificate (identity in --extender-allowed-clients)
    key_file: str
    ca_file: str  # the CA of the extender's serving certificate
    server_name: str = ""  # only when the URL's host is not in the serving certificate

    def config(self) -> dict[str, Any]:
        out = {"certFile": self.cert_file, "keyFile": self.key_file, "caFile": self.ca_file}
        if self.server_name:
            out["serverName"] = self.server_name
        return out


# Where the manifests mount the kvgpu-scheduler's client certificate (cert-manager Secret
# kvgpu-scheduler-extender-client: tls.crt, tls.key and ca.crt, the extender CA that also signed
# the operator's serving certificate).
MANIFEST_CLIENT_DIR = "/etc/kvgpu/extender-client"
MANIFEST_TLS = ExtenderTLS(cert_file=f"{MANIFEST_CLIENT_DIR}/tls.crt", key_file=f"{MANIFEST_CLIENT_DIR}/tls.key",
                           ca_file=f"{MANIFEST_CLIENT_DIR}/ca.crt")


def extender_entry(url_prefix: str, *, tls: ExtenderTLS | None = None, http_timeout_s: int = 30,
                   weight: int = 5) -> dict[str, Any]:
    """One extender entry. ``http_timeout_s``: binds run in kube-scheduler's binding goroutines,
    so a long timeout costs no throughput, while a short one makes a burst's queued binds time
    out and be retried towards other nodes although the first attempt still completes (at 10 s,
    a 2,000-pod burst on 2 cores retried about every second bind).

    ``tls``: required for an ``https://`` URL (the extender answers only kube-scheduler's
    client certificate); not allowed with ``http://`` (``--extender-insecure``)."""
    https = url_prefix.startswith("https:")
    if https != (tls is not None):
        raise ValueError("an https:// extender URL needs tls (client certificate and CA), http:// none")
    entry: dict[str, Any] = {
        "urlPrefix": url_prefix,
        "filterVerb": "filter",
        "prioritizeVerb": "prioritize",
        "bindVerb": "bind",
        "weight": weight,
        "nodeCacheCapable": True,
        "enableHTTPS": https,
        "httpTimeout": f"{http_timeout_s}s",
        "ignorable": False,
    }
    if tls is not None:
        entry["tlsConfig"] = tls.config()
    return entry


def profile(scheduler_name: str = keys.SCHEDULER_NAME) -> dict[str, Any]:
    return {
        "schedulerName": scheduler_name,
        "pluginConfig": [{
            "name": "NodeResourcesFit",
            "args": {
                "apiVersion": "kubescheduler.config.k8s.io/v1",
                "kind": "NodeResourcesFitArgs",
                "ignoredResources": list(IGNORED_RESOURCES),
                "scoringStrategy": {"type": "LeastAllocated",
                                    "resources": [{"name": "cpu", "weight": 1}, {"name": "memory", "weight": 1}]},
            },
        }],
    }


def scheduler_configuration(
    url_prefix: str,
    *,
    tls: ExtenderTLS | None = None,
    kubeconfig: str | None = None,
    leader_elect: bool = False,
    lease_namespace: str = "kube-system",
    qps: int = 500,
) -> dict[str, Any]:
    """A complete ``KubeSchedulerConfiguration`` (kubescheduler.config.k8s.io/v1) as a dict."""
    cfg: dict[str, Any] = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"qps": qps, "burst": qps * 2},
        "leaderElection": {"leaderElect": leader_elect, "resourceNamespace": lease_namespace,
                           "resourceName": keys.SCHEDULER_NAME},
        "parallelism": 16,
        "podInitialBackoffSeconds": 1,
        "podMaxBackoffSeconds": 1,
        "profiles": [profile()],
        "extenders": [extender_entry(url_prefix, tls=tls)],
    }
    if kubeconfig:
        cfg["clientConnection"]["kubeconfig"] = kubeconfig
    return cfg
