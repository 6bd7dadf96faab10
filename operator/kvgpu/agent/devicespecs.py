"""What ``Allocate`` hands a container so the GPU reaches it without the NVIDIA container toolkit.

- Device nodes (``DeviceSpec``): ``/dev/nvidia<minor>`` of each claimed card, plus the control
  nodes that exist under the dev root: ``nvidiactl``, ``nvidia-uvm``, ``nvidia-uvm-tools``,
  ``nvidia-modeset``; no ``nvidia-caps/*`` node (a whole card needs none, as the NVIDIA container
  toolkit gives none; they are MIG's: the config and monitor caps and each instance's access, so
  only a MIG container gets its own instance's, :func:`mig_device_specs`). Host path
  ``<host dev root>/<name>``, container path ``/dev/<name>``, permissions ``rw``.
- Driver user-space files (read-only ``Mount``), GKE's layout: ``<driver root>/lib64`` on
  ``/usr/local/nvidia/lib64`` and ``<driver root>/bin`` on ``/usr/local/nvidia/bin``
  (CUDA base images already have ``/usr/local/nvidia/lib64`` in ``LD_LIBRARY_PATH``; the plugin
  sets it too unless told not to).

Host paths are the paths the agent sees: run it with the dev and driver roots mounted at their
host paths (charts/kvgpu/templates/agent.yaml).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvgpu.core.inventory import Card

from .proto import pb2

CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
CONTAINER_DRIVER_ROOT = "/usr/local/nvidia"
DEFAULT_DRIVER_ROOT = "/usr/local/nvidia"
LD_LIBRARY_PATH = f"{CONTAINER_DRIVER_ROOT}/lib64"


def resolve_driver_root(value: str | None) -> str | None:
    """``--driver-root``: ``"auto"``/``None`` = :data:`DEFAULT_DRIVER_ROOT` if it has ``lib64``, else
    no driver mounts; ``""``/``"none"`` = none; anything else is taken as given."""
    if value is None or value == "auto":
        return DEFAULT_DRIVER_ROOT if Path(DEFAULT_DRIVER_ROOT, "lib64").is_dir() else None
    if value in ("", "none"):
        return None
    return value


def card_minor(card: Card) -> int:
    """The card's device-node minor (NVML's, else its index: simulated cards)."""
    return card.minor if card.minor is not None else card.index


def device_specs(cards: Iterable[Card], dev_root: str, host_dev_root: str | None = None) -> list[Any]:
    """``DeviceSpec``s of ``cards`` and the control nodes present under ``dev_root`` (no ``nvidia-caps``).

    ``host_dev_root``: where ``dev_root`` is on the host (default: the same path), for an agent
    that sees the host's ``/dev`` elsewhere (the DaemonSet mounts it on ``/host/dev``).

    A card's node is listed even when missing under ``dev_root`` (the runtime then fails the
    container: better than a container that silently has no GPU)."""
    root = Path(dev_root)
    host = Path(host_dev_root or dev_root)
    names = [f"nvidia{card_minor(c)}" for c in cards]
    names += [n for n in CONTROL_NODES if (root / n).exists()]
    return [
        pb2.DeviceSpec(container_path=f"/dev/{n}", host_path=str(host / n), permissions="rw")
        for n in dict.fromkeys(names)
    ]


def driver_mounts(driver_root: str | None) -> list[Any]:
    """Read-only ``Mount``s of the driver's ``lib64`` and ``bin`` folders, each as one directory on
    ``/usr/local/nvidia/{lib64,bin}`` (none without a driver root).

    Whole folders, not file by file: a driver folder holds each library under several names
    (``libcuda.so``, ``.so.1``, ``.so.580.x``: links to one file), and where the image already
    has those links (an image with the host's ``/usr``), runc resolves a file mount's target
    through them, so the one real file would be mounted once per name."""
    if not driver_root:
        return []
    root = Path(driver_root)
    return [pb2.Mount(container_path=f"{CONTAINER_DRIVER_ROOT}/{sub}", host_path=str(root / sub), read_only=True)
            for sub in ("lib64", "bin") if (root / sub).is_dir()]


def mig_device_specs(nodes: Iterable[str], dev_root: str, host_dev_root: str | None = None) -> list[Any]:
    """``DeviceSpec``s of MIG devices: ``nodes`` (``/dev/...`` paths: the parents' ``nvidia<minor>``
    and the instances' ``nvidia-caps/nvidia-cap<N>``, :func:`kvgpu.dra.mig.mig_container_edits`) and
    the control nodes present under ``dev_root`` — and **no other** ``nvidia-caps`` node: another
    instance's cap would open that instance."""
    root = Path(dev_root)
    host = Path(host_dev_root or dev_root)
    names = [n.removeprefix("/dev/") for n in nodes]
    names += [n for n in CONTROL_NODES if (root / n).exists()]
    return [
        pb2.DeviceSpec(container_path=f"/dev/{n}", host_path=str(host / n), permissions="rw")
        for n in dict.fromkeys(names)
    ]
