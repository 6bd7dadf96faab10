"""The agent's DRA driver ``gpu.kvgpu.io`` assembled: the kubelet plugin
(:mod:`kvgpu.agent.draplugin`), the ResourceSlice publisher and its watch
(:mod:`kvgpu.agent.drapublish`), started as tasks of the agent's task group."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvgpu.core.inventory import NodeInventory

from .draplugin import DraConfig, DraPlugin
from .drapublish import SlicePublisher
from .pluginconfig import PluginConfig


def claim_reader(api_client: Any) -> Callable[[str, str], Any]:
    """``get_claim(namespace, name)``: the ``resource.k8s.io/v1`` ResourceClaim as a dict (raises
    the API's errors)."""
    from kubernetes_asyncio import client

    custom = client.CustomObjectsApi(api_client)

    async def get_claim(namespace: str, name: str) -> Any:
        return await custom.get_namespaced_custom_object("resource.k8s.io", "v1", namespace, "resourceclaims", name)

    return get_claim


def start_dra_driver(tg: asyncio.TaskGroup, node: str, cfg: DraConfig, plugin_cfg: PluginConfig, api_client: Any,
                     inventory: Callable[[], NodeInventory | None],
                     kick: Callable[[], None]) -> tuple[DraPlugin, SlicePublisher]:
    """Start the plugin (serving what the device plugin would: ``plugin_cfg``) and the slice
    watch (``kick()`` asks the agent for a new inventory, after which it calls
    :meth:`SlicePublisher.publish`). Returns both."""
    slices = SlicePublisher(node, api_client)
    plugin = DraPlugin(node, cfg, plugin_cfg, claim_reader(api_client), inventory)
    tg.create_task(plugin.run(), name="dra-plugin")
    tg.create_task(slices.watch(api_client, kick), name="resourceslice-watch")
    return plugin, slices
