"""The KubeSchedulerConfiguration of the kvgpu scheduler instance (dev cluster and manifests).

One profile, ``kvgpu-scheduler`` (the mutating webhook points slice-requesting pods at it),
with our extender for filter/prioritize/bind. Everything else is upstream kube-scheduler:
its own plugins filter cpu, memory, affinity, taints and spread as usual; for GPU pods the
extender's filter answers one node, so they score only pods with soft preferences
(:mod:`kvgpu.extender.choice`, ``--node-choice``).

- two extender entries on the same server: filter and prioritize, then bind
  (:func:`extender_entries`). kube-scheduler gives each entry its own HTTP client, so its own
  pool of kept-alive connections (two idle ones: Go's default, not configurable). Filter calls
  come one at a time from the scheduling cycle and keep reusing one warm connection; binds
  run many at a time in the binding cycle and would otherwise take those connections, so a
  filter had to open a new one (a TLS handshake inside the serial cycle);
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
  nudges it (capacity freed), not minutes later;
- soft preferences first (issue 22): the score plugins that weigh a soft preference
  (:data:`PREFERENCE_PLUGINS`: preferred node affinity, preferred pod affinity and anti-affinity,
  ``ScheduleAnyway`` spread, ``PreferNoSchedule`` taints, DRA ``firstAvailable``) run with
  kube-scheduler's default weights times :data:`PREFERENCE_SCALE`, so whenever kube-scheduler
  scores a GPU pod, its preferences decide and kvgpu's prioritize (binpack/spread) decides only
  among the nodes they leave equal, ahead of the remaining plugins (least-allocated cpu and
  memory, image locality). The arithmetic (``prioritizeNodes`` in
  ``pkg/scheduler/schedule_one.go``, v1.36.3): a node's total is the sum of each score plugin's
  normalised 0..100 score times its weight, plus each extender's 0..10 score times
  ``MaxNodeScore / MaxExtenderPriority`` (10) times the extender's weight. With the defaults
  a whole preference (100 x weight 2 = 200 points) lost to binpack's 0..500 (weight 5); now the
  smallest step of a preference score (1 x 2000) is larger than everything else together
  (:func:`check_preferences_first`). kube-scheduler's cluster-default topology spreading
  (``defaultingType: System``: pods of a Service or ReplicaSet spread over hosts and zones) is
  off in this profile: at this weight it would override the GPU node policy for every replica;
  a pod that wants spreading states its own ``topologySpreadConstraints``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgpu.core import keys
from kvgpu.extender.protocol import MAX_EXTENDER_PRIORITY

#: kube-scheduler's score plugins that weigh soft preferences, with their default weights
#: (pkg/scheduler/apis/config/v1/default_plugins.go, v1.36.3; DynamicResources with the DRA gate).
PREFERENCE_PLUGINS = {
    "TaintToleration": 3,  # PreferNoSchedule taints the pod does not tolerate
    "NodeAffinity": 2,  # preferredDuringSchedulingIgnoredDuringExecution node affinity
    "PodTopologySpread": 2,  # whenUnsatisfiable: ScheduleAnyway
    "InterPodAffinity": 2,  # preferred pod affinity/anti-affinity (the pod's, and other pods' towards it)
    "DynamicResources": 2,  # a claim's firstAvailable alternatives
}
#: The other score plugins kube-scheduler may run, with their default weights (VolumeBinding
#: scores only with StorageCapacityScoring, PodGroupPodsCount only with its alpha gate).
OTHER_SCORE_PLUGINS = {
    "NodeResourcesFit": 1,
    "NodeResourcesBalancedAllocation": 1,
    "ImageLocality": 1,
    "VolumeBinding": 1,
    "PodGroupPodsCount": 1,
}
#: The extender's weight: its 0..10 prioritize answer counts 0..500 points.
EXTENDER_WEIGHT = 5
#: Factor on :data:`PREFERENCE_PLUGINS`' weights in the kvgpu profile.
PREFERENCE_SCALE = 1000
MAX_NODE_SCORE = 100  # kube-scheduler's fwk.MaxNodeScore
EXTENDER_SCORE_FACTOR = 10  # MaxNodeScore / extenderv1.MaxExtenderPriority


def preference_weights() -> dict[str, int]:
    """The kvgpu profile's weights of the preference plugins."""
    return {name: w * PREFERENCE_SCALE for name, w in PREFERENCE_PLUGINS.items()}


def check_preferences_first(extender_weight: int = EXTENDER_WEIGHT) -> None:
    """Raise ``ValueError`` unless one point of any preference plugin's normalised score outweighs
    the widest spread the extender and every other score plugin can add together (so kvgpu's
    score only orders nodes the preferences score equal)."""
    step = min(preference_weights().values())
    rest = (MAX_NODE_SCORE * sum(OTHER_SCORE_PLUGINS.values())
            + MAX_EXTENDER_PRIORITY * EXTENDER_SCORE_FACTOR * extender_weight)
    if step <= rest:
        raise ValueError(f"a preference step of {step} points does not outweigh the other scores' {rest}")


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


# Where the chart mounts the kvgpu-scheduler's client certificate (Secret
# kvgpu-scheduler-extender-client, from `kvgpu certs` or cert-manager: tls.crt, tls.key and
# ca.crt, the extender CA that also signed
# the operator's serving certificate).
MANIFEST_CLIENT_DIR = "/etc/kvgpu/extender-client"
MANIFEST_TLS = ExtenderTLS(cert_file=f"{MANIFEST_CLIENT_DIR}/tls.crt", key_file=f"{MANIFEST_CLIENT_DIR}/tls.key",
                           ca_file=f"{MANIFEST_CLIENT_DIR}/ca.crt")


def extender_entries(url_prefix: str, *, tls: ExtenderTLS | None = None, http_timeout_s: int = 30,
                     weight: int = EXTENDER_WEIGHT) -> list[dict[str, Any]]:
    """The two extender entries, both at ``url_prefix``: filter + prioritize (the scheduling
    cycle), then bind (the binding cycle), so that each has its own connection pool in
    kube-scheduler. ``http_timeout_s``: binds run in kube-scheduler's binding goroutines,
    so a long timeout costs no throughput, while a short one makes a burst's queued binds time
    out and be retried towards other nodes although the first attempt still completes (at 10 s,
    a 2,000-pod burst on 2 cores retried about every second bind).

    ``tls``: required for an ``https://`` URL (the extender answers only kube-scheduler's
    client certificate); not allowed with ``http://`` (``--extender-insecure``). Raises
    ``ValueError`` for a mismatch, or when ``weight`` lets kvgpu's score outweigh a soft
    preference (:func:`check_preferences_first`)."""
    check_preferences_first(weight)
    https = url_prefix.startswith("https:")
    if https != (tls is not None):
        raise ValueError("an https:// extender URL needs tls (client certificate and CA), http:// none")
    def entry(**verbs: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"urlPrefix": url_prefix, "enableHTTPS": https,
                               "httpTimeout": f"{http_timeout_s}s", "ignorable": False}
        if tls is not None:
            out["tlsConfig"] = tls.config()  # a dict per entry: no YAML anchor in the manifests
        return {**out, **verbs}

    return [entry(filterVerb="filter", prioritizeVerb="prioritize", weight=weight, nodeCacheCapable=True),
            entry(bindVerb="bind")]


def profile(scheduler_name: str = keys.SCHEDULER_NAME) -> dict[str, Any]:
    return {
        "schedulerName": scheduler_name,
        # score.enabled overrides the weight of a default (MultiPoint) plugin
        "plugins": {"score": {"enabled": [{"name": n, "weight": w} for n, w in preference_weights().items()]}},
        "pluginConfig": [{
            "name": "NodeResourcesFit",
            "args": {
                "apiVersion": "kubescheduler.config.k8s.io/v1",
                "kind": "NodeResourcesFitArgs",
                "ignoredResources": list(IGNORED_RESOURCES),
                "scoringStrategy": {"type": "LeastAllocated",
                                    "resources": [{"name": "cpu", "weight": 1}, {"name": "memory", "weight": 1}]},
            },
        }, {
            "name": "PodTopologySpread",
            "args": {
                "apiVersion": "kubescheduler.config.k8s.io/v1",
                "kind": "PodTopologySpreadArgs",
                "defaultingType": "List",  # no defaultConstraints: only the pod's own constraints
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
        "extenders": extender_entries(url_prefix, tls=tls),
    }
    if kubeconfig:
        cfg["clientConnection"]["kubeconfig"] = kubeconfig
    return cfg
