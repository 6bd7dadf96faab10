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
- back-off 1 s: a pod rejected for lack of GPU capacity is retried right after the operator
  nudges it (capacity freed), not minutes later.
"""

from __future__ import annotations

from typing import Any

from kvgpu.core import keys

IGNORED_RESOURCES = (
    "nvidia.com/gpumem",
    "nvidia.com/gpumem-percentage",
    "nvidia.com/gpucores",
    "nvidia.com/priority",
)


def extender_entry(url_prefix: str, *, http_timeout_s: int = 30, weight: int = 5) -> dict[str, Any]:
    """One extender entry. ``http_timeout_s``: binds run in kube-scheduler's binding goroutines,
    so a long timeout costs no throughput, while a short one makes a burst's queued binds time
    out and be retried towards other nodes although the first attempt still completes (at 10 s,
    a 2,000-pod burst on 2 cores retried about every second bind)."""
    return {
        "urlPrefix": url_prefix,
        "filterVerb": "filter",
        "prioritizeVerb": "prioritize",
        "bindVerb": "bind",
        "weight": weight,
        "nodeCacheCapable": True,
        "enableHTTPS": url_prefix.startswith("https:"),
        "httpTimeout": f"{http_timeout_s}s",
        "ignorable": False,
    }


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
        "extenders": [extender_entry(url_prefix)],
    }
    if kubeconfig:
        cfg["clientConnection"]["kubeconfig"] = kubeconfig
    return cfg
