"""The whole agent in simulated mode with a fake API and a fake kubelet: a health fault reaches
the kubelet as Unhealthy replicas, the inventory annotation and a Node Event; metrics are served."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import tempfile
import urllib.request
from pathlib import Path

from agent_helpers import FakeApi, kubelet, pool
from grpc import aio
from kvgpu.agent.deviceplugin import PluginConfig
from kvgpu.agent.main import Agent, AgentConfig
from kvgpu.agent.proto import pb2, pb2_grpc
from kvgpu.core import keys
from kvgpu.core.inventory import NodeInventory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_agent_end_to_end_simulated(tmp_path):
    sim = tmp_path / "sim.json"
    sim.write_text(json.dumps({"nodes": [{"name": "gpu-0", "cards": [{"count": 2, "numa": 0}]}]}))
    health = tmp_path / "health.json"
    health.write_text("{}")
    shim = tmp_path / "libvgpu-build.so"
    shim.write_bytes(b"\x7fELF shim")
    sock_dir = Path(tempfile.mkdtemp(prefix="kag", dir="/tmp"))
    port = free_port()
    cfg = AgentConfig(
        node="gpu-0",
        simulated=str(sim),
        interval_s=0.2,
        simulated_health=str(health),
        health_probe_s=0.05,
        recovery_s=0.0,
        shim_source=str(shim),
        shim_version="9.9.9",
        host_shim_dir=str(tmp_path / "lib"),
        host_preload_file=str(tmp_path / "ld.so.preload"),
        mps_root=str(tmp_path / "mps"),
        plugin=PluginConfig(socket_dir=str(sock_dir), watch_interval_s=0.05),
        metrics_port=port,
        metrics_addr="127.0.0.1",
        region_root=str(tmp_path / "regions"),
    )
    api = FakeApi()
    api.pools = [pool("default", split=3)]
    agent = Agent(cfg, api)
    try:
        async with kubelet(sock_dir) as fk:
            task = asyncio.create_task(agent.run())
            await asyncio.wait_for(fk.registered.wait(), 10)
            assert (tmp_path / "lib" / "libvgpu.so.9.9.9").exists()
            async with aio.insecure_channel(f"unix://{sock_dir / fk.requests[0].endpoint}") as ch:
                stream = pb2_grpc.DevicePluginStub(ch).ListAndWatch(pb2.Empty())

                async def next_list(pred):
                    while True:
                        msg = await asyncio.wait_for(stream.read(), 10)
                        if pred(msg.devices):
                            return msg.devices

                devs = await next_list(lambda d: len(d) == 6)
                assert {d.health for d in devs} == {"Healthy"}
                health.write_text(json.dumps({"0": "simulated: XID storm"}))
                devs = await next_list(lambda d: any(x.health == "Unhealthy" for x in d))
                inv = agent.registrar.inventory
                bad = {d.ID.split("::")[0] for d in devs if d.health == "Unhealthy"}
                assert bad == {inv.cards[0].uuid}
                stream.cancel()
            published = NodeInventory.loads(api.node["metadata"]["annotations"][keys.NODE_INVENTORY])
            assert not published.cards[0].healthy and published.cards[0].reason == "simulated: XID storm"
            shim_status = json.loads(api.node["metadata"]["annotations"][keys.NODE_SHIM])
            assert shim_status["file"] == "libvgpu.so.9.9.9" and shim_status["version"] == "9.9.9"
            assert shim_status["loadable"] is False and shim_status["error"], shim_status  # not a real ELF
            assert ("GPUUnhealthy", "Warning") in [(r, t) for r, t, _ in api.events]
            text = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            )
            assert "kvgpu_card_healthy" in text and 'device_index="1"' in text
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    finally:
        if agent.metrics_server is not None:
            agent.metrics_server[0].shutdown()
        shutil.rmtree(sock_dir, ignore_errors=True)
