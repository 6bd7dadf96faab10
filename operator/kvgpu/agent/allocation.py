"""What ``Allocate`` hands one container (:mod:`kvgpu.agent.deviceplugin` says why): the cards of
its claim (:func:`claim_cards`; the replica IDs' only with ``visible_devices_from_ids``), and in
the response (:func:`container_response`) ``NVIDIA_VISIBLE_DEVICES``, the device nodes and driver
mounts (:mod:`kvgpu.agent.devicespecs`), the shim and ``ld.so.preload`` mounts of ``mounts``
(:func:`shim_mounts`), the stub driver's env on a simulated node, an MPS client's pipe folder and
env, and the mounts of a claimed container's own region directory and of the node's compute
schedule (:func:`usage_mounts`). These are every host path a GPU container gets: the webhook
mounts none, so PodSecurity ``baseline``/``restricted`` namespaces admit GPU pods. Every refusal
is a :class:`~kvgpu.agent.pluginconfig.PluginError`; nothing here serves gRPC or asks the kubelet.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgpu.core import claimstr, keys
from kvgpu.core.inventory import Card

from . import devicespecs, mps
from .pluginconfig import MOUNT_MODES, PluginConfig, PluginError
from .podidentity import Admitted
from .preferred import card_of
from .proto import pb2
from .shiminstall import record_shim_use
from .usage import prepare_region_dir

log = logging.getLogger(__name__)


def stub_driver_env(cards: Sequence[Card]) -> dict[str, str]:
    """Env for the stub driver (tests/shim/stub) that plays a simulated node's driver: it reports
    exactly ``cards`` (their UUIDs and memory), as the real driver reports the cards whose device
    nodes the container has."""
    return {"STUB_UUIDS": ",".join(c.uuid for c in cards), "STUB_NDEV": str(len(cards)),
            "STUB_MEM_MIB": str(max((c.memory_mib for c in cards), default=1024))}


def resolve_shim(host_shim_dir: str) -> Path | None:
    """The version-named file ``<dir>/libvgpu.so`` points at now, or ``None`` if not installed."""
    link = Path(host_shim_dir) / "libvgpu.so"
    try:
        target = link.resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    return target if target.is_file() else None


def installed_shim(cfg: PluginConfig) -> Path | None:
    """The shim file to serve (:func:`resolve_shim`); raises :class:`PluginError` when it is
    missing and required (``require_shim``, or ``mounts=pinned``) or ``mounts`` is unknown."""
    if cfg.mounts not in MOUNT_MODES:
        raise PluginError(f"mounts={cfg.mounts!r} is not one of {MOUNT_MODES}")
    shim = resolve_shim(cfg.host_shim_dir)
    if shim is None and (cfg.require_shim or cfg.mounts == "pinned"):
        raise PluginError(
            f"kvgpu shim is not installed on this node ({cfg.host_shim_dir}/libvgpu.so missing); "
            "refusing to start a container without enforcement"
        )
    return shim


def claim_cards(cfg: PluginConfig, admitted: Admitted | None, ids: Sequence[str],
                known: dict[str, Card]) -> list[Card]:
    """The container's cards: its claim's; the replica IDs' only in ``visible_devices_from_ids``."""
    from_ids = list(dict.fromkeys(card_of(d) for d in ids))
    unknown = [u for u in from_ids if u not in known]
    if unknown:
        raise PluginError(f"unknown device IDs {sorted(ids)} (cards {unknown} not on node)")
    if admitted is not None and admitted.claim is not None:
        missing = [u for u in admitted.uuids if u not in known]
        if missing or not admitted.uuids:
            raise PluginError(f"the kvgpu claim of {admitted} names cards not on this node: {missing}")
        if set(from_ids) != set(admitted.uuids):
            log.warning(
                "kubelet gave %s replicas of %s, its claim is on %s: serving the claim's cards",
                admitted, from_ids, list(admitted.uuids),
            )
        return [known[u] for u in admitted.uuids]
    if cfg.visible_devices_from_ids:
        return [known[u] for u in from_ids]
    who = str(admitted) if admitted is not None else "the container being admitted (no pod identified)"
    raise PluginError(
        f"no kvgpu claim for {who}: pods that request {cfg.resource_name} "
        "must be admitted by kvgpu's webhook"
    )


def shim_mounts(cfg: PluginConfig, shim: Path | None) -> list[Any]:
    """The read-only shim mounts of ``cfg.mounts`` (``dir``: the host shim directory on the
    container's; ``pinned``: the file ``shim`` on the container's ``libvgpu.so``) and the host's
    ``ld.so.preload`` on ``/etc/ld.so.preload``. ``pinned`` without a file mounts no library (only
    with ``require_shim=False``: :func:`installed_shim` refuses otherwise)."""
    out = []
    if cfg.mounts == "pinned" and shim is not None:
        out.append(pb2.Mount(container_path=cfg.container_shim_lib, host_path=str(shim), read_only=True))
    elif cfg.mounts == "dir":
        out.append(pb2.Mount(container_path=cfg.container_shim_dir, host_path=cfg.host_shim_dir, read_only=True))
    out.append(pb2.Mount(container_path=cfg.container_preload_file, host_path=cfg.host_preload_file,
                         read_only=True))
    return out


def usage_mounts(cfg: PluginConfig, admitted: Admitted, shim: Path | None = None) -> list[Any]:
    """The claimed container's usage mounts: its own region directory
    ``<region_root>/<pod UID>/<container>`` (created for its user, :func:`prepare_region_dir`)
    read-write on :data:`~kvgpu.core.keys.CONTAINER_REGION_DIR` — no other container's region is
    visible — and the node's compute-schedule directory ``sched_dir`` (created if missing, 0755),
    read-only on :data:`~kvgpu.core.keys.CONTAINER_SCHED_DIR`: the agent alone writes it.
    ``region_root``/``sched_dir`` ``None``: that mount is left out. Records the ``shim`` file the
    container was served beside its region directory (:func:`record_shim_use`: the agent prunes
    no file a live container was served). Raises :class:`PluginError` when a directory cannot be
    prepared."""
    out = []
    try:
        if cfg.region_root:
            region = prepare_region_dir(cfg.region_root, admitted.uid, admitted.container, admitted.run_as)
            if shim is not None:
                record_shim_use(cfg.region_root, admitted.uid, admitted.container, shim.name)
            out.append(pb2.Mount(container_path=keys.CONTAINER_REGION_DIR, host_path=str(region), read_only=False))
        if cfg.sched_dir:
            Path(cfg.sched_dir).mkdir(mode=0o755, parents=True, exist_ok=True)
            out.append(pb2.Mount(container_path=keys.CONTAINER_SCHED_DIR, host_path=cfg.sched_dir, read_only=True))
    except (OSError, ValueError) as e:
        raise PluginError(f"cannot prepare the region directory of {admitted}: {e}") from e
    return out


def add_mps_client(cfg: PluginConfig, admitted: Admitted, resp: Any) -> None:
    """A claim with ``mode=mps``: its card's MPS pipe folder (read-only) and the client env."""
    try:
        cs = claimstr.decode(admitted.claim or "")
    except claimstr.ClaimStringError:
        return  # the shim refuses it; nothing to add
    if cs.mode != "mps":
        return
    uuid = cs.devices[0].uuid
    pipe = mps.pipe_dir(cfg.mps_root, uuid)
    why = mps.check_ready(cfg.mps_root, uuid)
    if why is not None:
        raise PluginError(f"the MPS control daemon of card {uuid} is not ready: {why} ({cfg.mps_root}); "
                          f"{admitted} is an MPS client of it")
    resp.envs.update(mps.client_env(cs))
    resp.mounts.append(pb2.Mount(container_path=keys.CONTAINER_MPS_DIR, host_path=str(pipe), read_only=True))


def container_response(cfg: PluginConfig, admitted: Admitted | None, cards: Sequence[Card],
                       shim: Path | None) -> Any:
    """The ``ContainerAllocateResponse`` of a container that gets ``cards``: env, device nodes,
    driver and shim mounts, the MPS client's folder, and (with a claim) its region and the
    schedule (:func:`usage_mounts`)."""
    resp = pb2.ContainerAllocateResponse()
    resp.envs["KVGPU_DEVICE_PLUGIN"] = cfg.resource_name
    if shim is not None:
        resp.envs["KVGPU_SHIM_FILE"] = shim.name
    resp.envs[keys.ENV_VISIBLE] = ",".join(c.uuid for c in cards)
    resp.mounts.extend(shim_mounts(cfg, shim))
    if cfg.device_specs:
        resp.devices.extend(devicespecs.device_specs(cards, cfg.dev_root, cfg.host_dev_root))
        add_driver_mounts(cfg, resp)
    if cfg.stub_driver_env:
        resp.envs.update(stub_driver_env(cards))
    if admitted is not None and admitted.claim is not None:
        add_mps_client(cfg, admitted, resp)
    if admitted is not None and admitted.claim is not None:
        resp.mounts.extend(usage_mounts(cfg, admitted, shim))
    return resp


def add_driver_mounts(cfg: PluginConfig, resp: Any) -> None:
    """Add the driver folder's mounts to an Allocate response (``pb2.ContainerAllocateResponse``)
    and, when there are any and ``cfg.ld_library_path``, ``LD_LIBRARY_PATH`` for them."""
    driver = devicespecs.driver_mounts(cfg.driver_root)
    resp.mounts.extend(driver)
    if driver and cfg.ld_library_path:
        resp.envs["LD_LIBRARY_PATH"] = devicespecs.LD_LIBRARY_PATH
