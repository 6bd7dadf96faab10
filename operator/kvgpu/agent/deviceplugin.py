"""Kubelet device plugin (API v1beta1) for HAMi's resource name ``nvidia.com/gpu``.

Each physical card covered by a VGPUPool is advertised as ``splitCount`` replicas (``exclusive``
mode: one), so node allocatable ``nvidia.com/gpu`` = cards x splitCount. Replica IDs are
``<card UUID>::<n>``. A replica's health is its card's; its topology is the card's NUMA node.

Identities come from the claim, not from the device IDs: the operator writes the container's
claim and card UUIDs into pod annotations at bind time. The API carries no pod identity, so the
plugin recovers which (pod, container) the kubelet is admitting (:mod:`kvgpu.agent.podidentity`:
the kubelet admits one pod at a time, containers in spec order; PodResources tells which pods it
knows and which containers hold devices) — deterministic, no node lock.

``GetPreferredAllocation`` answers one replica of each card of the identified container's claim,
so the kubelet's checkpoint (PodResources, DCGM) names the cards the container really uses. With
nothing identified it falls back to :func:`preferred`: replicas of distinct, healthy cards, the
least-used first, or exactly the one pending claim of that size when only one exists.

``Allocate`` identifies the container and answers from **its claim**, whatever replica IDs the
kubelet picked (a mismatch is logged): ``DeviceSpec``s for the claimed cards' ``/dev/nvidia<minor>``
and the control nodes, read-only mounts of the driver's files and ``LD_LIBRARY_PATH``
(:mod:`kvgpu.agent.devicespecs`; off with ``device_specs=False`` on nodes whose NVIDIA container
toolkit reads ``NVIDIA_VISIBLE_DEVICES``), ``NVIDIA_VISIBLE_DEVICES`` = the claimed cards, and the
shim mounts of :attr:`PluginConfig.mounts`:

- ``none`` (default): no shim mounts — the mutating webhook already mounts the shim directory and
  ``ld.so.preload`` (mounting them here too stacks a second mount on each target);
- ``dir``: the host shim directory on the container shim directory and ``ld.so.preload`` on
  ``/etc/ld.so.preload`` — the webhook's mounts, for clusters where the webhook does not mount;
- ``pinned``: the version-named file ``libvgpu.so`` resolves to *now* on the container's
  ``libvgpu.so`` path, plus ``ld.so.preload``: the container keeps that exact library for its
  life whatever is installed later (only Allocate can pin: it runs on the node).

A container without a kvgpu claim (or none identified) is refused with ``FAILED_PRECONDITION`` —
pods requesting ``nvidia.com/gpu`` must pass kvgpu's webhook — unless ``visible_devices_from_ids``
(clusters without the webhook: cards from the replica IDs). In every mode ``Allocate`` fails while
the shim is not installed (fail closed: a container must never start unenforced).

Lifecycle (:meth:`DevicePlugin.run`): wait until the device list is non-empty (the first published
inventory: no 0-device window), serve on ``<socket_dir>/<endpoint>``, register with the kubelet
on ``<socket_dir>/kubelet.sock``, then watch both sockets; when the kubelet restarts
(its socket is recreated, plugin sockets are wiped) the plugin restarts its server and
registers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from kvgpu.core import claimstr, keys
from kvgpu.core.inventory import Card, NodeInventory

from . import devicespecs, mps
from .podidentity import Admitted, NotIdentified, PodIdentifier
from .podresources import PodResourcesError
from .preferred import ID_SEP, HintProvider, card_of, preferred
from .proto import pb2, pb2_grpc
from .usage import prepare_region_dir

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
MOUNT_MODES = ("dir", "pinned", "none")


class PluginError(RuntimeError):
    """Registration with the kubelet failed, or the plugin cannot serve."""


@dataclass(frozen=True)
class PluginConfig:
    """Device plugin settings.

    ``split_count``: replicas per card; ``None`` = the card's pool ``splitCount`` (cards no pool
    covers get ``uncovered_split_count``, default 0 = not advertised). ``mounts``: ``dir`` |
    ``pinned`` | ``none`` (see the module docstring). ``require_shim``: fail ``Allocate`` while
    the shim is not installed.
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
    the admitted container's, owned by its user (:func:`~kvgpu.agent.usage.prepare_region_dir`).
    ``mps_root``: the host folder of the cards' MPS daemons (:mod:`kvgpu.agent.mps`); a claim with
    ``mode=mps`` gets its card's pipe folder and the MPS client env.
    """

    resource_name: str = "nvidia.com/gpu"
    socket_dir: str = "/var/lib/kubelet/device-plugins"
    endpoint: str = "kvgpu-nvidia-gpu.sock"
    kubelet_socket: str = "kubelet.sock"
    split_count: int | None = None
    uncovered_split_count: int = 0
    mounts: str = "none"
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
    mps_root: str = keys.HOST_MPS_ROOT
    watch_interval_s: float = 1.0


def stub_driver_env(cards: Sequence[Card]) -> dict[str, str]:
    """Env for the stub driver (tests/shim/stub) that plays a simulated node's driver: it reports
    exactly ``cards`` (their UUIDs and memory), as the real driver reports the cards whose device
    nodes the container has."""
    return {"STUB_UUIDS": ",".join(c.uuid for c in cards), "STUB_NDEV": str(len(cards)),
            "STUB_MEM_MIB": str(max((c.memory_mib for c in cards), default=1024))}


def replica_id(uuid: str, n: int) -> str:
    """Device ID of replica ``n`` of card ``uuid``."""
    return f"{uuid}{ID_SEP}{n}"


def replicas_for(card: Card, cfg: PluginConfig) -> int:
    if card.mig_mode:
        return 0  # a MIG-enabled card cannot be sliced by the shim (MIG devices are another resource)
    if cfg.split_count is not None:
        return cfg.split_count
    if card.slicing is None:
        return cfg.uncovered_split_count
    if card.slicing.mode == "exclusive":
        return 1
    if card.slicing.mode == "mps":
        return min(card.slicing.split_count, mps.MAX_CLIENTS)  # clients of one MPS server
    if card.slicing.mode != "hami-core":
        return 0  # mig is not served by this resource
    return card.slicing.split_count


def device_list(inv: NodeInventory, cfg: PluginConfig) -> list[Any]:
    """The ``ListAndWatch`` list for an inventory (cards x replicas, health, NUMA)."""
    out = []
    for c in inv.cards:
        topo = None
        if cfg.topology and c.numa is not None:
            topo = pb2.TopologyInfo(nodes=[pb2.NUMANode(ID=c.numa)])
        for n in range(replicas_for(c, cfg)):
            d = pb2.Device(ID=replica_id(c.uuid, n), health=HEALTHY if c.healthy else UNHEALTHY)
            if topo is not None:
                d.topology.CopyFrom(topo)
            out.append(d)
    return out


def resolve_shim(host_shim_dir: str) -> Path | None:
    """The version-named file ``<dir>/libvgpu.so`` points at now, or ``None`` if not installed."""
    link = Path(host_shim_dir) / "libvgpu.so"
    try:
        target = link.resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    return target if target.is_file() else None


class _Servicer(pb2_grpc.DevicePluginServicer):
    def __init__(self, plugin: DevicePlugin) -> None:
        self.p = plugin

    async def GetDevicePluginOptions(self, request, context):
        return pb2.DevicePluginOptions(
            pre_start_required=False,
            get_preferred_allocation_available=self.p.cfg.preferred_allocation,
        )

    async def ListAndWatch(self, request, context) -> AsyncIterator[Any]:
        async for devices in self.p.watch_devices():
            yield pb2.ListAndWatchResponse(devices=devices)

    async def GetPreferredAllocation(self, request, context):
        healthy = {c.uuid for c in self.p.inventory.cards if c.healthy}
        out = []
        for req in request.container_requests:
            size = int(req.allocation_size)
            hint: Sequence[Sequence[str]] = ()
            admitted = await self.p.identify(size)
            if admitted is not None and admitted.uuids:
                hint = [list(admitted.uuids)]
            elif self.p.hints is not None:
                try:
                    hint = self.p.hints(size)
                except Exception:  # a hint is advisory; never fail the kubelet over it
                    log.exception("preferred-allocation hint provider failed")
            ids = preferred(
                list(req.available_deviceIDs), list(req.must_include_deviceIDs), size, healthy, hint
            )
            out.append(pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb2.PreferredAllocationResponse(container_responses=out)

    async def Allocate(self, request, context):
        try:
            return await self.p.allocate(request)
        except PluginError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    async def PreStartContainer(self, request, context):
        return pb2.PreStartContainerResponse()


@dataclass
class DevicePlugin:
    """One kubelet device plugin serving ``cfg.resource_name`` from an inventory.

    Call :meth:`update` with every new inventory (health, pools, cards); ``ListAndWatch``
    streams re-send the list when it changed. ``identifier`` tells which container the kubelet is
    admitting (``None``: nothing is ever identified, so ``Allocate`` refuses unless
    ``visible_devices_from_ids``). ``hints`` is an optional :data:`HintProvider` for
    ``GetPreferredAllocation`` when nothing is identified.
    """

    cfg: PluginConfig
    inventory: NodeInventory
    hints: HintProvider | None = None
    identifier: PodIdentifier | None = None
    allocations: int = 0
    registrations: int = 0
    _cond: asyncio.Condition = field(default_factory=asyncio.Condition, init=False, repr=False)
    _generation: int = field(default=0, init=False)
    _server: aio.Server | None = field(default=None, init=False, repr=False)
    _stopping: bool = field(default=False, init=False)

    # ------------------------------------------------------------------ state

    @property
    def socket_path(self) -> Path:
        return Path(self.cfg.socket_dir) / self.cfg.endpoint

    @property
    def kubelet_socket_path(self) -> Path:
        return Path(self.cfg.socket_dir) / self.cfg.kubelet_socket

    def devices(self) -> list[Any]:
        return device_list(self.inventory, self.cfg)

    async def update(self, inv: NodeInventory) -> None:
        """Replace the inventory; wakes ``ListAndWatch`` streams if the device list changed."""
        changed = device_list(inv, self.cfg) != self.devices()
        self.inventory = inv
        if changed:
            async with self._cond:
                self._generation += 1
                self._cond.notify_all()

    async def watch_devices(self) -> AsyncIterator[list[Any]]:
        """Yield the device list now and after every change, until the plugin stops."""
        seen = -1
        while not self._stopping:
            async with self._cond:
                await self._cond.wait_for(lambda: self._generation != seen or self._stopping)  # noqa: B023
                if self._stopping:
                    return
                seen = self._generation
            yield self.devices()

    async def identify(self, size: int) -> Admitted | None:
        """The container being admitted for ``size`` devices, or ``None`` (logged) if unknown."""
        if self.identifier is None:
            return None
        try:
            return await self.identifier.identify(size)
        except NotIdentified as e:
            log.warning("%s", e)
        except PodResourcesError as e:
            log.warning("cannot tell which pod is being admitted: %s", e)
        return None

    def _shim(self) -> Path | None:
        if self.cfg.mounts not in MOUNT_MODES:
            raise PluginError(f"mounts={self.cfg.mounts!r} is not one of {MOUNT_MODES}")
        shim = resolve_shim(self.cfg.host_shim_dir)
        if shim is None and (self.cfg.require_shim or self.cfg.mounts == "pinned"):
            raise PluginError(
                f"kvgpu shim is not installed on this node ({self.cfg.host_shim_dir}/libvgpu.so missing); "
                "refusing to start a container without enforcement"
            )
        return shim

    def _cards(self, admitted: Admitted | None, ids: Sequence[str], known: dict[str, Card]) -> list[Card]:
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
        if self.cfg.visible_devices_from_ids:
            return [known[u] for u in from_ids]
        who = str(admitted) if admitted is not None else "the container being admitted (no pod identified)"
        raise PluginError(
            f"no kvgpu claim for {who}: pods that request {self.cfg.resource_name} "
            "must be admitted by kvgpu's webhook"
        )

    def _shim_mounts(self, shim: Path | None) -> list[Any]:
        out = []
        if self.cfg.mounts == "pinned" and shim is not None:
            out.append(pb2.Mount(container_path=self.cfg.container_shim_lib, host_path=str(shim), read_only=True))
        elif self.cfg.mounts == "dir":
            out.append(
                pb2.Mount(
                    container_path=self.cfg.container_shim_dir, host_path=self.cfg.host_shim_dir, read_only=True
                )
            )
        if self.cfg.mounts != "none":
            out.append(
                pb2.Mount(
                    container_path=self.cfg.container_preload_file,
                    host_path=self.cfg.host_preload_file,
                    read_only=True,
                )
            )
        return out

    def _mps_client(self, admitted: Admitted, resp: Any) -> None:
        """A claim with ``mode=mps``: its card's MPS pipe folder (read-only) and the client env."""
        try:
            cs = claimstr.decode(admitted.claim or "")
        except claimstr.ClaimStringError:
            return  # the shim refuses it; nothing to add
        if cs.mode != "mps":
            return
        uuid = cs.devices[0].uuid
        pipe = mps.pipe_dir(self.cfg.mps_root, uuid)
        if not (pipe / "control").exists():
            raise PluginError(f"the MPS control daemon of card {uuid} is not running ({pipe}); "
                              f"{admitted} is an MPS client of it")
        resp.envs.update(mps.client_env(cs))
        resp.mounts.append(pb2.Mount(container_path=keys.CONTAINER_MPS_DIR, host_path=str(pipe), read_only=True))

    async def allocate(self, request: Any) -> Any:
        """Answer ``Allocate``: per container, from its claim, the device nodes, driver and shim
        mounts and env (module docstring). Raises :class:`PluginError` (shim missing, no claim,
        unknown cards)."""
        known = {c.uuid: c for c in self.inventory.cards}
        shim = self._shim()
        out = []
        served: list[Admitted] = []  # marked at once: the next request of this call is another container
        try:
            for creq in request.container_requests:
                out.append(await self._allocate_one(list(creq.devices_ids), known, shim, served))
        except BaseException:
            if self.identifier is not None:
                for a in served:
                    self.identifier.served.pop(a.key, None)
            raise
        self.allocations += 1
        return pb2.AllocateResponse(container_responses=out)

    async def _allocate_one(
        self, ids: list[str], known: dict[str, Card], shim: Path | None, served: list[Admitted]
    ) -> Any:
        admitted = await self.identify(len(ids))
        cards = self._cards(admitted, ids, known)
        resp = pb2.ContainerAllocateResponse()
        resp.envs["KVGPU_DEVICE_PLUGIN"] = self.cfg.resource_name
        if shim is not None:
            resp.envs["KVGPU_SHIM_FILE"] = shim.name
        resp.envs[keys.ENV_VISIBLE] = ",".join(c.uuid for c in cards)
        resp.mounts.extend(self._shim_mounts(shim))
        if self.cfg.device_specs:
            resp.devices.extend(devicespecs.device_specs(cards, self.cfg.dev_root, self.cfg.host_dev_root))
            driver = devicespecs.driver_mounts(self.cfg.driver_root)
            resp.mounts.extend(driver)
            if driver and self.cfg.ld_library_path:
                resp.envs["LD_LIBRARY_PATH"] = devicespecs.LD_LIBRARY_PATH
        if self.cfg.stub_driver_env:
            resp.envs.update(stub_driver_env(cards))
        if admitted is not None and admitted.claim is not None:
            self._mps_client(admitted, resp)
        if admitted is not None and admitted.claim is not None and self.cfg.region_root:
            try:
                prepare_region_dir(self.cfg.region_root, admitted.uid, admitted.container, admitted.run_as)
            except (OSError, ValueError) as e:
                raise PluginError(f"cannot prepare the region directory of {admitted}: {e}") from e
        if admitted is not None and self.identifier is not None:
            served.append(admitted)
            self.identifier.mark_served(admitted)
            log.info("allocated %s: cards %s", admitted, [c.uuid for c in cards])
        return resp

    # ------------------------------------------------------------------ serving

    async def start(self) -> None:
        """Serve the DevicePlugin service on :attr:`socket_path` (a stale file is removed)."""
        self._stopping = False
        path = self.socket_path
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        server = aio.server()
        pb2_grpc.add_DevicePluginServicer_to_server(_Servicer(self), server)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        self._server = server

    async def stop(self, grace: float = 0.5) -> None:
        """Stop serving (ends ``ListAndWatch`` streams) and remove the socket."""
        self._stopping = True
        async with self._cond:
            self._cond.notify_all()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    async def register(self, rpc_timeout_s: float = 5.0) -> None:
        """Register with the kubelet. Raises :class:`PluginError` if it refuses or is unreachable."""
        req = pb2.RegisterRequest(
            version=API_VERSION,
            endpoint=self.cfg.endpoint,
            resource_name=self.cfg.resource_name,
            options=pb2.DevicePluginOptions(
                pre_start_required=False,
                get_preferred_allocation_available=self.cfg.preferred_allocation,
            ),
        )
        try:
            async with aio.insecure_channel(f"unix://{self.kubelet_socket_path}") as ch:
                await pb2_grpc.RegistrationStub(ch).Register(req, timeout=rpc_timeout_s)
        except grpc.RpcError as e:
            raise PluginError(f"kubelet registration failed: {e.code().name}: {e.details()}") from e
        self.registrations += 1
        log.info("registered %s with the kubelet (%d devices)", self.cfg.resource_name, len(self.devices()))

    def _identity(self, p: Path) -> tuple[int, int] | None:
        try:
            st = os.stat(p)
        except OSError:
            return None
        return (st.st_ino, int(st.st_ctime_ns))

    async def run(self, retry_s: float = 5.0) -> None:
        """Wait for a non-empty device list, then serve, register, and re-register after kubelet
        restarts, until cancelled."""
        async with self._cond:
            await self._cond.wait_for(lambda: bool(self.devices()))
        try:
            while True:
                kubelet_id = self._identity(self.kubelet_socket_path)
                if kubelet_id is None:
                    await asyncio.sleep(self.cfg.watch_interval_s)
                    continue
                await self.start()
                try:
                    await self.register()
                except PluginError as e:
                    log.warning("%s; retrying in %.0fs", e, retry_s)
                    await self.stop()
                    await asyncio.sleep(retry_s)
                    continue
                own = self._identity(self.socket_path)
                while (  # noqa: ASYNC110 (polling two files is the point)
                    self._identity(self.kubelet_socket_path) == kubelet_id
                    and self._identity(self.socket_path) == own
                ):
                    await asyncio.sleep(self.cfg.watch_interval_s)
                log.info("kubelet restarted or plugin socket removed: re-registering")
                await self.stop()
        finally:
            await self.stop()


def plugin_ids(devices: Iterable[Any]) -> list[str]:
    """IDs of a device list (test helper)."""
    return [d.ID for d in devices]


__all__ = [
    "DevicePlugin",
    "HintProvider",
    "PluginConfig",
    "PluginError",
    "card_of",
    "device_list",
    "preferred",
    "replica_id",
]
