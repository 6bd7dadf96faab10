"""Kubelet device plugins for MIG instances in extender mode: NVIDIA's ``mixed`` strategy.

A card already in MIG mode (the agent never changes a card's mode or instances) covered by a pool
of ``allocation: extender`` offers no ``nvidia.com/gpu`` replicas (:func:`~kvgpu.agent.deviceplugin.
replicas_for`); each of its MIG instances is one whole device of the extended resource
``nvidia.com/mig-<profile>`` (``nvidia.com/mig-1g.18gb`` ...), one plugin per profile, like the NVIDIA
device plugin's and HAMi's ``migStrategy: mixed``. Device ID = the instance's UUID (``MIG-...``);
health = the parent card's; topology = its NUMA node.

``Allocate`` needs no claim and no pod identity: kube-scheduler counts these resources itself (the
kvgpu webhook and extender leave such pods alone), and the device IDs the kubelet picked are the
instances the container gets: ``NVIDIA_VISIBLE_DEVICES`` = their ``MIG-`` UUIDs and (with
``device_specs``) the parents' ``/dev/nvidia<minor>``, each instance's GPU- and compute-instance
``/dev/nvidia-caps`` node, the control nodes and the driver mounts. No shim, no ``ld.so.preload``, no
region: a MIG instance is isolated in hardware. The mapping is :func:`kvgpu.dra.mig.mig_container_edits`,
shared with DRA mode.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from kvgpu.core.inventory import Card, MigInstance, NodeInventory
from kvgpu.dra.mig import MigCapsUnknown, mig_container_edits

from . import devicespecs
from .allocation import add_driver_mounts
from .deviceplugin import HEALTHY, UNHEALTHY, DevicePlugin, device_list
from .pluginconfig import PluginConfig, PluginError
from .proto import pb2

log = logging.getLogger(__name__)

MIG_RESOURCE_PREFIX = "nvidia.com/mig-"


def mig_resource_name(profile: str) -> str:
    """The extended resource of MIG ``profile``: ``nvidia.com/mig-1g.18gb``."""
    return f"{MIG_RESOURCE_PREFIX}{profile}"


def extender_mig_cards(inv: NodeInventory) -> list[Card]:
    """The cards whose MIG instances are served here: in MIG mode, covered by an ``extender`` pool."""
    return [c for c in inv.cards if c.mig_mode and c.slicing is not None and c.slicing.allocation == "extender"]


def mig_profiles(inv: NodeInventory) -> list[str]:
    """The MIG profiles ``inv`` serves, sorted."""
    return sorted({m.profile for c in extender_mig_cards(inv) for m in c.mig_instances if m.profile})


def mig_device_list(inv: NodeInventory, profile: str, topology: bool = True) -> list[Any]:
    """The ``ListAndWatch`` list of ``profile``: its instances (ID = MIG UUID), the parent's health
    and NUMA node."""
    out = []
    for c in extender_mig_cards(inv):
        for m in c.mig_instances:
            if m.profile != profile:
                continue
            d = pb2.Device(ID=m.uuid, health=HEALTHY if c.healthy else UNHEALTHY)
            if topology and c.numa is not None:
                d.topology.CopyFrom(pb2.TopologyInfo(nodes=[pb2.NUMANode(ID=c.numa)]))
            out.append(d)
    return out


def mig_plugin_config(base: PluginConfig, profile: str) -> PluginConfig:
    """``base`` for the plugin of ``profile``: its resource name and socket, no preferred allocation."""
    return replace(base, resource_name=mig_resource_name(profile), endpoint=f"kvgpu-mig-{profile}.sock",
                   preferred_allocation=False)


def mig_container_response(cfg: PluginConfig, pairs: Iterable[tuple[Card, MigInstance]]) -> Any:
    """The ``ContainerAllocateResponse`` of a container given ``pairs`` (card, instance). Raises
    :class:`PluginError` when an instance's ``/dev/nvidia-caps`` minors are unknown."""
    resp = pb2.ContainerAllocateResponse()
    resp.envs["KVGPU_DEVICE_PLUGIN"] = cfg.resource_name
    nodes: list[str] = []
    uuids: list[str] = []
    for card, inst in pairs:
        try:
            edits = mig_container_edits(card, inst)
        except MigCapsUnknown as e:
            raise PluginError(str(e)) from e
        nodes += edits.device_nodes
        uuids.append(inst.uuid)
    resp.envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(uuids)
    if cfg.device_specs:
        resp.devices.extend(devicespecs.mig_device_specs(nodes, cfg.dev_root, cfg.host_dev_root))
        add_driver_mounts(cfg, resp)
    return resp


def simulated_node_resources(inv: NodeInventory, cfg: PluginConfig,
                             before: Iterable[str] = ()) -> dict[str, tuple[int, int]]:
    """What a kubelet would report from the plugins' lists on a simulated node without one:
    ``{resource: (capacity, allocatable)}`` (all devices / healthy devices) for ``cfg.resource_name``
    and every MIG profile; a resource of ``before`` (reported earlier) that is gone reports ``(0, 0)``."""
    lists = {cfg.resource_name: device_list(inv, cfg)}
    lists |= {mig_resource_name(p): mig_device_list(inv, p) for p in mig_profiles(inv)}
    out = {r: (len(ds), sum(d.health == HEALTHY for d in ds)) for r, ds in lists.items()}
    return {r: (0, 0) for r in before} | out


@dataclass
class MigDevicePlugin(DevicePlugin):
    """The device plugin of one MIG ``profile`` (its :class:`PluginConfig` from
    :func:`mig_plugin_config`); serving, registration and kubelet restarts as :class:`DevicePlugin`."""

    profile: str = ""

    def devices(self) -> list[Any]:
        return mig_device_list(self.inventory, self.profile, self.cfg.topology)

    async def update(self, inv: NodeInventory) -> None:
        changed = mig_device_list(inv, self.profile, self.cfg.topology) != self.devices()
        self.inventory = inv
        if changed:
            async with self._cond:
                self._generation += 1
                self._cond.notify_all()

    async def allocate(self, request: Any) -> Any:
        """Per container: the instances of the device IDs the kubelet picked. Raises
        :class:`PluginError` for an ID that is no instance of this profile (or an unhealthy one)."""
        known = {m.uuid: (c, m) for c in extender_mig_cards(self.inventory) for m in c.mig_instances
                 if m.profile == self.profile}
        out = []
        for creq in request.container_requests:
            ids = list(creq.devices_ids)
            bad = [i for i in ids if i not in known or not known[i][0].healthy]
            if bad:
                raise PluginError(f"{self.cfg.resource_name}: {', '.join(bad)} is no healthy MIG device of this node")
            out.append(mig_container_response(self.cfg, [known[i] for i in ids]))
            log.info("allocated %s: %s", self.cfg.resource_name, ids)
        self.allocations += 1
        return pb2.AllocateResponse(container_responses=out)


@dataclass
class MigPlugins:
    """One :class:`MigDevicePlugin` per MIG profile of the inventory, started as profiles appear
    (a profile that disappears keeps its plugin, with no devices). :meth:`run` until cancelled."""

    cfg: PluginConfig
    inventory: NodeInventory
    plugins: dict[str, MigDevicePlugin] = field(default_factory=dict)
    _changed: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    async def update(self, inv: NodeInventory) -> None:
        """Take a new inventory: existing plugins update their lists, :meth:`run` starts new ones."""
        self.inventory = inv
        for p in self.plugins.values():
            await p.update(inv)
        self._changed.set()

    async def run(self) -> None:
        """Serve every profile's plugin until cancelled (a crashing plugin cancels the others)."""
        async with asyncio.TaskGroup() as tg:
            while True:
                for profile in mig_profiles(self.inventory):
                    if profile not in self.plugins:
                        plugin = MigDevicePlugin(mig_plugin_config(self.cfg, profile), self.inventory,
                                                 profile=profile)
                        self.plugins[profile] = plugin
                        tg.create_task(plugin.run(), name=f"mig-plugin-{profile}")
                self._changed.clear()
                await self._changed.wait()
