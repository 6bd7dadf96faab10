"""The device plugin's settings (:class:`PluginConfig`) and its one error (:class:`PluginError`),
shared by the plugin's server (:mod:`kvgpu.agent.deviceplugin`) and what it answers a container
(:mod:`kvgpu.agent.allocation`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvgpu.core import keys

MOUNT_MODES = ("dir", "pinned")


class PluginError(RuntimeError):
    """Registration with the kubelet failed, or the plugin cannot serve."""


@dataclass(frozen=True)
class PluginConfig:
    """Device plugin settings.

    ``split_count``: replicas per card; ``None`` = the card's pool ``splitCount`` (cards no pool
    covers get ``uncovered_split_count``, default 0 = not advertised). ``mounts``: how the shim is
    mounted, ``dir`` (the shim directory) | ``pinned`` (the file ``libvgpu.so`` resolves to now; see
    :mod:`kvgpu.agent.deviceplugin`). ``require_shim``: fail ``Allocate`` while the shim is not
    installed.
    ``visible_devices_from_ids``: containers without a kvgpu claim get the cards of the replica IDs
    (``NVIDIA_VISIBLE_DEVICES``, device nodes) instead of being refused — only for clusters without
    kvgpu's webhook; the claim is the source of truth otherwise.
    ``device_specs``: hand the container its device nodes (under ``dev_root``, which is
    ``host_dev_root`` on the host; ``None`` = the same path) and the driver's
    files (from ``driver_root``, already resolved: ``None`` = no driver mounts) — off where the
    NVIDIA container toolkit does it. ``ld_library_path``: with driver mounts, set
    ``LD_LIBRARY_PATH=/usr/local/nvidia/lib64``. ``stub_driver_env``: simulated node (the agent's
    ``--simulated``), whose driver is the stub: tell it the claimed cards (:func:`stub_driver_env`).
    ``region_root``: where the containers' region directories are on the host; ``Allocate`` creates
    the admitted container's, owned by its user (:func:`~kvgpu.agent.usage.prepare_region_dir`),
    and mounts it (that one only) in the container. ``sched_dir``: the host's compute-schedule
    directory, mounted read-only in every claimed container (``None``: not mounted).
    ``mps_root``: the host folder of the cards' MPS daemons (:mod:`kvgpu.agent.mps`); a claim with
    ``mode=mps`` gets its card's pipe folder and the MPS client env.
    """

    resource_name: str = "nvidia.com/gpu"
    socket_dir: str = "/var/lib/kubelet/device-plugins"
    endpoint: str = "kvgpu-nvidia-gpu.sock"
    kubelet_socket: str = "kubelet.sock"
    split_count: int | None = None
    uncovered_split_count: int = 0
    mounts: str = "dir"
    require_shim: bool = True
    host_shim_dir: str = keys.HOST_SHIM_DIR
    host_preload_file: str = keys.HOST_PRELOAD_FILE
    container_shim_dir: str = keys.CONTAINER_SHIM_DIR
    container_shim_lib: str = keys.CONTAINER_SHIM_LIB
    container_preload_file: str = "/etc/ld.so.preload"
    topology: bool = True
    preferred_allocation: bool = True
    visible_devices_from_ids: bool = False
    device_specs: bool = True
    dev_root: str = "/dev"
    host_dev_root: str | None = None
    driver_root: str | None = None
    ld_library_path: bool = True
    stub_driver_env: bool = False
    region_root: str | None = None
    sched_dir: str | None = None
    mps_root: str = keys.HOST_MPS_ROOT
    watch_interval_s: float = 1.0
