"""The node agent's settings (:class:`AgentConfig`): what ``kvgpu agent``'s options become, and
what :func:`kvgpu.agent.main.run` takes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvgpu import __version__
from kvgpu.core import keys

from .draplugin import DraConfig
from .pluginconfig import PluginConfig
from .podresources import DEFAULT_SOCKET as POD_RESOURCES_SOCKET
from .schedule import INTERVAL_S as SCHEDULE_INTERVAL_S


@dataclass
class AgentConfig:
    """Everything the agent takes. Durations in seconds; ``metrics_port`` 0 disables the exporter.

    ``node``: this node's name (``--node``, default env ``NODE_NAME``). ``simulated``: path of the
    simulated inventory config (no NVML). ``kubeconfig``: a kubeconfig file; ``None`` = in-cluster
    service account. ``simulated_health``: JSON file ``{"<uuid|index>": "<reason>"}`` of faulty
    cards (simulated mode). ``shim_source``: the built ``libvgpu.so`` to install (``None`` = do not
    install). ``device_plugin``: serve the kubelet plugin (``False`` for fake nodes).
    ``pod_resources_socket``: the kubelet's PodResources socket (which pod the kubelet admits).
    ``dra``: the DRA kubelet plugin's paths (with the device plugin and an API client: the plugin
    and the node's ResourceSlice publisher run); ``None`` = no DRA.
    """

    node: str = field(default_factory=lambda: os.environ.get("NODE_NAME", ""))
    simulated: str | None = None
    kubeconfig: str | None = None
    interval_s: float = 30.0
    health: bool = True
    simulated_health: str | None = None
    health_probe_s: float = 10.0
    recovery_s: float = 60.0
    extra_ignored_xids: tuple[int, ...] = ()
    device_plugin: bool = True
    #: simulated mode without a kubelet: patch the Node's capacity/allocatable of the plugin's
    #: resource as the kubelet would from ListAndWatch (all replicas / healthy replicas)
    simulated_capacity: bool = True
    plugin: PluginConfig = field(default_factory=PluginConfig)
    pod_resources_socket: str = POD_RESOURCES_SOCKET
    shim_source: str | None = None
    shim_version: str = __version__
    host_shim_dir: str = keys.HOST_SHIM_DIR
    host_preload_file: str = keys.HOST_PRELOAD_FILE
    shim_keep: int = 3
    metrics_port: int = 9394
    metrics_addr: str = "0.0.0.0"
    hami_metrics: bool = True
    region_root: str = keys.HOST_REGION_ROOT
    region_gc_s: float = 300.0
    enforcement_s: float = 5.0  # NVML process check + host-PID filling period; 0 disables (off simulated)
    #: a process of a claimed container that runs outside the shim: "kill" it once it has been
    #: seen so for ``unenforced_grace_s`` (kvgpu.agent.escapes), or only "report" it (Event, metric)
    unenforced: str = "kill"
    unenforced_grace_s: float = 10.0
    #: a claimed container whose processes hold more of a card than its limit (NVML) plus
    #: ``over_limit_slack_mib`` for ``unenforced_grace_s``: "kill" its largest, or only "report"
    over_limit: str = "kill"
    over_limit_slack_mib: int = 64
    #: a claimed container whose processes used more of a card's SMs than its cores (NVML) plus
    #: ``over_cores_slack_pts`` points, on average over ``over_cores_grace_s``: "kill" the busiest,
    #: or only "report" (metric kvgpu_container_sm_utilization_percent)
    over_cores: str = "kill"
    over_cores_slack_pts: float = 20.0
    over_cores_grace_s: float = 30.0
    #: how often the regions' ``oom_kills`` (the shim's ACTIVE_OOM_KILLER) are read for pod Events
    oom_report_s: float = 5.0
    #: the node-wide compute schedule (one file per card) this agent alone writes; 0 disables.
    #: Runs with the device plugin (a real kubelet's containers), not on fake nodes.
    sched_dir: str = keys.HOST_SCHED_DIR
    sched_interval_s: float = SCHEDULE_INTERVAL_S
    #: the MPS backend (with the device plugin): the mps cards written to ``<mps_root>/wanted.json``
    #: after each inventory and every ``mps_interval_s`` (0 disables); with ``mps_daemons="agent"``
    #: the agent also owns the daemons itself (kvgpu.agent.mps.MpsOwner rounds), with ``"separate"``
    #: another process does (``kvgpu mps-daemons``: the chart's kvgpu-mps DaemonSet).
    mps_root: str = keys.HOST_MPS_ROOT
    mps_control: str = "nvidia-cuda-mps-control"
    mps_interval_s: float = 10.0
    mps_daemons: str = "agent"
    dra: DraConfig | None = field(default_factory=DraConfig)
