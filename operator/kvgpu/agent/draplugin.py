"""kvgpu's DRA kubelet plugin for driver ``gpu.kvgpu.io`` (kubelet DRA API v1).

Two gRPC servers on Unix sockets:

- ``<registry_dir>/gpu.kvgpu.io-reg.sock``: the plugin watcher's ``Registration`` service
  (pluginregistration v1). ``GetInfo`` answers type ``DRAPlugin``, name ``gpu.kvgpu.io``, the
  endpoint ``<plugin_dir>/dra.sock`` and the one gRPC service it serves,
  ``v1.DRAPlugin`` (the kubelet 1.36 reads "supported versions" as the names of the gRPC services
  a plugin serves, k8s.io/kubelet's ``DRAPluginService``; the service itself is the proto's
  ``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin``);
- ``<plugin_dir>/dra.sock``: the ``DRAPlugin`` service. ``NodePrepareResources`` reads each
  ResourceClaim from the API server, checks its UID and turns its allocation into the claim
  string (:func:`kvgpu.dra.claims.prepare_claim`) and the files of :class:`ClaimFiles`: the
  claim file, the claim's region directory, a checkpoint, and a CDI spec (:mod:`kvgpu.dra.cdi`)
  giving the container what the device plugin's ``Allocate`` gives (card and control nodes,
  driver folder, the shim, ``/etc/ld.so.preload``, the claim file on ``/etc/kvgpu/claim``
  read-only, the region read-write, the schedule read-only, an MPS client's pipe folder); a claim
  of MIG devices gets each instance's nodes, the control nodes and the driver, and no shim.
  ``NodeUnprepareResources`` removes them. Both are idempotent and answer per claim: a bad
  claim gets its own error, the others are prepared.

The kubelet wipes neither socket on restart; the plugin re-creates a removed socket (watched
every ``watch_interval_s``), and the kubelet's watcher registers it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpc import aio

from kvgpu.core.inventory import NodeInventory
from kvgpu.dra.claims import DraClaimError, prepare_claim
from kvgpu.dra.slices import DRIVER

from .draclaimfiles import ClaimFiles, ClaimSource
from .pluginconfig import PluginConfig, PluginError
from .proto import dra_pb2, dra_pb2_grpc, reg_pb2, reg_pb2_grpc

log = logging.getLogger(__name__)

DRA_SERVICE = "v1.DRAPlugin"
PLUGIN_TYPE = "DRAPlugin"


@dataclass(frozen=True)
class DraConfig:
    """Where the DRA plugin lives. ``registry_dir``: the kubelet's plugin watcher directory;
    ``plugin_dir``: the plugin's own socket directory; ``cdi_dir``: where containerd reads CDI
    specs (its ``cdi_spec_dirs``); ``state_dir``: per-claim claim files, regions and
    checkpoints."""

    registry_dir: str = "/var/lib/kubelet/plugins_registry"
    plugin_dir: str = f"/var/lib/kubelet/plugins/{DRIVER}"
    cdi_dir: str = "/var/run/cdi"
    state_dir: str = "/var/lib/kvgpu/dra"
    watch_interval_s: float = 1.0

    @property
    def registration_socket(self) -> Path:
        return Path(self.registry_dir) / f"{DRIVER}-reg.sock"

    @property
    def endpoint(self) -> Path:
        return Path(self.plugin_dir) / "dra.sock"


class _Registration(reg_pb2_grpc.RegistrationServicer):
    def __init__(self, plugin: DraPlugin) -> None:
        self.p = plugin

    async def GetInfo(self, request, context):
        return reg_pb2.PluginInfo(type=PLUGIN_TYPE, name=DRIVER, endpoint=str(self.p.cfg.endpoint),
                                  supported_versions=[DRA_SERVICE])

    async def NotifyRegistrationStatus(self, request, context):
        if request.plugin_registered:
            self.p.registrations += 1
            log.info("DRA plugin %s registered with the kubelet", DRIVER)
        else:
            log.error("the kubelet refused the DRA plugin %s: %s", DRIVER, request.error)
        return reg_pb2.RegistrationStatusResponse()


class _Dra(dra_pb2_grpc.DRAPluginServicer):
    def __init__(self, plugin: DraPlugin) -> None:
        self.p = plugin

    async def NodePrepareResources(self, request, context):
        out = dra_pb2.NodePrepareResourcesResponse()
        for c in request.claims:
            out.claims[c.uid].CopyFrom(await self.p.prepare(c.namespace, c.name, c.uid))
        return out

    async def NodeUnprepareResources(self, request, context):
        out = dra_pb2.NodeUnprepareResourcesResponse()
        for c in request.claims:
            out.claims[c.uid].CopyFrom(await self.p.unprepare(c.uid))
        return out


class DraPlugin:
    """The DRA kubelet plugin of ``node``. ``get_claim(namespace, name)`` reads a ResourceClaim
    (a dict; raises on API errors); ``inventory()`` is the node's current inventory (cards with
    slicing and health); ``plugin_cfg``: the device plugin's settings, for what a container gets
    (shim, device nodes, driver, region root, schedule). Counters: ``prepared``, ``registrations``."""

    def __init__(self, node: str, cfg: DraConfig, plugin_cfg: PluginConfig,
                 get_claim: Callable[[str, str], Any], inventory: Callable[[], NodeInventory | None]) -> None:
        self.node, self.cfg = node, cfg
        self.get_claim = get_claim
        self.inventory = inventory
        self.files = ClaimFiles(cfg.state_dir, cfg.cdi_dir, plugin_cfg)
        self.prepared = 0
        self.registrations = 0
        self._servers: list[aio.Server] = []
        self._lock = asyncio.Lock()

    async def prepare(self, namespace: str, name: str, uid: str) -> Any:
        """One claim's ``NodePrepareResourceResponse``: its devices, or an error naming the reason."""
        async with self._lock:  # one claim's files at a time: the kubelet may retry concurrently
            try:
                done = await asyncio.to_thread(self.files.load, uid)
                if done is None:
                    claim = await self._read(namespace, name)
                    inv = self.inventory()
                    if inv is None:
                        raise DraClaimError("the node's inventory is not known yet")
                    prepared = prepare_claim(claim, uid, self.node, inv.cards)
                    done = await asyncio.to_thread(self.files.write, prepared)
                    self.prepared += 1
                    log.info("prepared ResourceClaim %s/%s (%s): %s", namespace, name, uid, done.claim)
            except (DraClaimError, PluginError, ValueError, OSError) as e:
                log.warning("cannot prepare ResourceClaim %s/%s (%s): %s", namespace, name, uid, e)
                return dra_pb2.NodePrepareResourceResponse(error=str(e))
        return dra_pb2.NodePrepareResourceResponse(devices=[_device(d) for d in done.devices])

    async def _read(self, namespace: str, name: str) -> Any:
        """The ResourceClaim; any error of the API read becomes a :class:`DraClaimError` (the
        kubelet retries the prepare)."""
        try:
            return await self.get_claim(namespace, name)
        except Exception as e:  # ApiException, connection errors: the message says which
            raise DraClaimError(f"cannot read ResourceClaim {namespace}/{name}: {e}") from e

    async def unprepare(self, uid: str) -> Any:
        """One claim's ``NodeUnprepareResourceResponse`` (its files removed; nothing to do is fine)."""
        async with self._lock:
            try:
                removed = await asyncio.to_thread(self.files.remove, uid)
            except OSError as e:
                return dra_pb2.NodeUnprepareResourceResponse(error=f"cannot remove the files of claim {uid}: {e}")
        if removed:
            log.info("unprepared ResourceClaim %s", uid)
        return dra_pb2.NodeUnprepareResourceResponse()

    async def _serve(self, path: Path, add: Callable[[aio.Server], None]) -> aio.Server:
        _fresh_socket(path)
        server = aio.server()
        add(server)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        return server

    async def start(self) -> None:
        """Serve the DRA service, then the registration socket (the kubelet's watcher sees it)."""
        self._servers.append(await self._serve(
            self.cfg.endpoint, lambda s: dra_pb2_grpc.add_DRAPluginServicer_to_server(_Dra(self), s)))
        self._servers.append(await self._serve(
            self.cfg.registration_socket,
            lambda s: reg_pb2_grpc.add_RegistrationServicer_to_server(_Registration(self), s)))

    async def stop(self) -> None:
        for s in self._servers:
            await s.stop(0.5)
        self._servers.clear()
        for p in (self.cfg.registration_socket, self.cfg.endpoint):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    async def run(self) -> None:
        """Serve until cancelled; restart both servers when a socket vanished (a kubelet that
        cleaned its directories)."""
        try:
            while True:
                await self.start()
                while self.cfg.endpoint.exists() and self.cfg.registration_socket.exists():  # noqa: ASYNC110
                    await asyncio.sleep(self.cfg.watch_interval_s)
                log.info("a DRA plugin socket was removed: serving again")
                await self.stop()
        finally:
            await self.stop()


def _fresh_socket(path: Path) -> None:
    """Make ``path``'s directory and remove a stale socket there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _device(d: ClaimSource) -> Any:
    msg = dra_pb2.Device(request_names=list(d.requests), pool_name=d.pool, device_name=d.device,
                         cdi_device_ids=list(d.cdi_ids))
    if d.share_id:
        msg.share_id = d.share_id
    return msg
