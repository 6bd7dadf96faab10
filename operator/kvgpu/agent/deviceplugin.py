"""Kubelet device plugin (API v1beta1) for HAMi's resource name ``nvidia.com/gpu``.

Each physical card covered by a VGPUPool with ``allocation: extender`` is advertised as
``splitCount`` replicas (``exclusive`` mode: one), so node allocatable ``nvidia.com/gpu`` = cards
x splitCount; cards of ``allocation: dra`` pools are DRA devices (:mod:`kvgpu.agent.draplugin`)
and not advertised here. Replica IDs are
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

``Allocate`` (:mod:`kvgpu.agent.allocation`; the settings: :mod:`kvgpu.agent.pluginconfig`)
identifies the container and answers from **its claim**, whatever replica IDs the kubelet
picked (a mismatch is logged): ``DeviceSpec``s for the claimed cards' ``/dev/nvidia<minor>``
and the control nodes, read-only mounts of the driver's files and ``LD_LIBRARY_PATH``
(:mod:`kvgpu.agent.devicespecs`; off with ``device_specs=False`` on nodes whose NVIDIA container
toolkit reads ``NVIDIA_VISIBLE_DEVICES``), ``NVIDIA_VISIBLE_DEVICES`` = the claimed cards, and
every host path the container needs — the webhook mounts none, so GPU pods run in PodSecurity
``baseline`` and ``restricted`` namespaces (the kubelet applies these mounts, PodSecurity never
sees them):

- the shim, by :attr:`PluginConfig.mounts`: ``dir`` (default) the host shim directory on the
  container's, read-only; ``pinned`` the version-named file ``libvgpu.so`` resolves to *now* on the
  container's ``libvgpu.so`` path: the container keeps that exact library for its life whatever
  is installed later;
- the host's ``ld.so.preload`` on ``/etc/ld.so.preload``, read-only;
- the container's own region directory ``<region_root>/<pod UID>/<container>`` (prepared for
  its user) on ``/var/run/kvgpu``, read-write: it sees no other container's region;
- the node's compute-schedule directory on ``/var/run/kvgpu-sched``, read-only (the agent alone
  writes it);
- an MPS client's pipe folder (``mode=mps`` claims).

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

from kvgpu.core.inventory import Card, NodeInventory

from . import mps
from .allocation import claim_cards, container_response, installed_shim
from .pluginconfig import PluginConfig, PluginError
from .podidentity import Admitted, NotIdentified, PodIdentifier
from .podresources import PodResourcesError
from .preferred import ID_SEP, HintProvider, card_of, preferred
from .proto import pb2, pb2_grpc

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


def replica_id(uuid: str, n: int) -> str:
    """Device ID of replica ``n`` of card ``uuid``."""
    return f"{uuid}{ID_SEP}{n}"


def replicas_for(card: Card, cfg: PluginConfig) -> int:
    if card.mig_mode:
        return 0  # a MIG-enabled card cannot be sliced by the shim (MIG devices are another resource)
    if card.slicing is not None and card.slicing.allocation == "dra":
        return 0  # a DRA device (kvgpu.agent.draplugin), not this resource
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

    async def allocate(self, request: Any) -> Any:
        """Answer ``Allocate``: per container, from its claim, the device nodes, driver and shim
        mounts and env (module docstring). Raises :class:`PluginError` (shim missing, no claim,
        unknown cards)."""
        known = {c.uuid: c for c in self.inventory.cards}
        shim = installed_shim(self.cfg)
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
        cards = claim_cards(self.cfg, admitted, ids, known)
        resp = container_response(self.cfg, admitted, cards, shim)
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
