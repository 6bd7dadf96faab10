"""The MIG device plugins (NVIDIA's mixed strategy, extender mode) against the harness that plays the
kubelet over real unix-socket gRPC (tests/unit/agent_helpers.py), from a simulated H200 in MIG
mode: no MIG card can be used here (the lent H200's MIG settings must not change)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from agent_helpers import kubelet
from grpc import aio
from kvgpu.admission.handlers import MUTATE_ID, VALIDATE_ID, review
from kvgpu.agent.deviceplugin import PluginConfig, device_list
from kvgpu.agent.migplugin import MigPlugins, mig_profiles, simulated_node_resources
from kvgpu.agent.proto import pb2, pb2_grpc
from kvgpu.api.podshape import wants_slices
from kvgpu.core.inventory import NodeInventory, Slicing, parse_simulated

EXT = Slicing(pool="default", split_count=4)


def inventory(slicing: Slicing | None = EXT) -> NodeInventory:
    (sim,) = parse_simulated({"nodes": [{"name": "gpu-0", "cards": [
        {"model": "NVIDIA H200", "numa": 0},
        {"model": "NVIDIA H200", "numa": 1,
         "migInstances": [{"profile": "3g.71gb"}, {"profile": "1g.18gb", "count": 2}]}]}]})
    inv = sim.inventory()
    return inv.with_slicing({c.uuid: slicing for c in inv.cards})


@pytest.fixture
def sock_dir():
    d = Path(tempfile.mkdtemp(prefix="kmig", dir="/tmp"))  # unix socket paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def dev_root(tmp_path):
    """A /dev with the parent's node, the control nodes and every cap of the MIG card."""
    dev = tmp_path / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    for n in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / n).touch()
    for m in inventory().cards[1].mig_instances:
        (dev / "nvidia-caps" / f"nvidia-cap{m.gi_cap_minor}").touch()
        (dev / "nvidia-caps" / f"nvidia-cap{m.ci_cap_minor}").touch()
    for n in (1, 2):  # mig config / monitor: never handed out
        (dev / "nvidia-caps" / f"nvidia-cap{n}").touch()
    return dev


def test_a_mig_card_offers_its_profiles_not_shim_slices():
    inv = inventory()
    assert mig_profiles(inv) == ["1g.18gb", "3g.71gb"]
    assert len(device_list(inv, PluginConfig())) == 4  # nvidia.com/gpu: the whole card's 4 replicas only
    assert mig_profiles(inventory(replace(EXT, allocation="dra"))) == []  # DRA publishes them instead
    assert mig_profiles(inventory(None)) == []  # no pool covers the card


@contextlib.asynccontextmanager
async def serving(sock_dir: Path, inv: NodeInventory, **kw):
    async with kubelet(sock_dir) as fk:
        plugins = MigPlugins(PluginConfig(socket_dir=str(sock_dir), watch_interval_s=0.05, **kw), inv)
        task = asyncio.create_task(plugins.run())
        try:
            for _ in range(100):
                if len(fk.requests) >= 2:
                    break
                await asyncio.sleep(0.05)
            yield fk, plugins
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_each_profile_registers_its_resource_and_lists_its_instances(sock_dir):
    inv = inventory()
    async with serving(sock_dir, inv) as (fk, plugins):
        assert sorted(r.resource_name for r in fk.requests) == ["nvidia.com/mig-1g.18gb", "nvidia.com/mig-3g.71gb"]
        req = next(r for r in fk.requests if r.resource_name == "nvidia.com/mig-1g.18gb")
        assert req.endpoint == "kvgpu-mig-1g.18gb.sock" and not req.options.get_preferred_allocation_available
        small = [m.uuid for m in inv.cards[1].mig_instances if m.profile == "1g.18gb"]
        async with aio.insecure_channel(f"unix://{sock_dir / req.endpoint}") as ch:
            stream = pb2_grpc.DevicePluginStub(ch).ListAndWatch(pb2.Empty())
            first = await asyncio.wait_for(stream.read(), 5)
            assert [d.ID for d in first.devices] == small
            assert {d.health for d in first.devices} == {"Healthy"}
            assert [n.ID for n in first.devices[0].topology.nodes] == [1]
            # the parent card turns unhealthy: its instances do
            sick = replace(inv, cards=(inv.cards[0], replace(inv.cards[1], healthy=False, reason="XID 79")))
            await plugins.update(sick)
            again = await asyncio.wait_for(stream.read(), 5)
            assert {d.health for d in again.devices} == {"Unhealthy"}


async def test_allocate_gives_the_instance_and_no_shim(sock_dir, dev_root):
    inv = inventory()
    card = inv.cards[1]
    mine, other = [m for m in card.mig_instances if m.profile == "1g.18gb"]
    async with serving(sock_dir, inv, dev_root=str(dev_root), host_dev_root="/host/dev") as (_, _plugins):
        async with aio.insecure_channel(f"unix://{sock_dir / 'kvgpu-mig-1g.18gb.sock'}") as ch:
            stub = pb2_grpc.DevicePluginStub(ch)
            resp = await stub.Allocate(pb2.AllocateRequest(container_requests=[
                pb2.ContainerAllocateRequest(devices_ids=[mine.uuid])]), timeout=5)
            (c,) = resp.container_responses
            assert c.envs["NVIDIA_VISIBLE_DEVICES"] == mine.uuid
            assert "KVGPU_CLAIM" not in c.envs and "KVGPU_SHIM_FILE" not in c.envs
            assert not [m for m in c.mounts if "kvgpu" in m.host_path or "ld.so.preload" in m.container_path]
            paths = sorted(d.container_path for d in c.devices)
            assert paths == sorted(["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm",
                                    f"/dev/nvidia-caps/nvidia-cap{mine.gi_cap_minor}",
                                    f"/dev/nvidia-caps/nvidia-cap{mine.ci_cap_minor}"])
            assert f"/dev/nvidia-caps/nvidia-cap{other.gi_cap_minor}" not in paths  # not the other instance's
            assert {d.host_path for d in c.devices} >= {"/host/dev/nvidia1"}
            # an ID that is no instance of this profile is refused
            big = next(m for m in card.mig_instances if m.profile == "3g.71gb")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Allocate(pb2.AllocateRequest(container_requests=[
                    pb2.ContainerAllocateRequest(devices_ids=[big.uuid])]), timeout=5)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "no healthy MIG device" in (e.value.details() or "")


async def test_a_profile_appearing_later_gets_its_plugin(sock_dir):
    inv = inventory()
    only_big = replace(inv, cards=(inv.cards[0], replace(inv.cards[1], mig_instances=inv.cards[1].mig_instances[:1])))
    async with kubelet(sock_dir) as fk:
        plugins = MigPlugins(PluginConfig(socket_dir=str(sock_dir), watch_interval_s=0.05), only_big)
        task = asyncio.create_task(plugins.run())
        try:
            await asyncio.wait_for(fk.registered.wait(), 5)
            assert [r.resource_name for r in fk.requests] == ["nvidia.com/mig-3g.71gb"]
            await plugins.update(inv)
            for _ in range(100):
                if len(fk.requests) == 2:
                    break
                await asyncio.sleep(0.05)
            assert fk.requests[1].resource_name == "nvidia.com/mig-1g.18gb"
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def test_a_mig_pod_is_no_kvgpu_slice_pod():
    """A pod asking for nvidia.com/mig-1g.18gb is a plain extended-resource pod: kvgpu's webhook does not
    send it to the kvgpu scheduler, and kube-scheduler counts the resource."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns"},
           "spec": {"containers": [{"name": "main", "image": "cuda",
                                    "resources": {"limits": {"nvidia.com/mig-1g.18gb": "1"}}}]}}
    assert not wants_slices(pod)
    for webhook in (MUTATE_ID, VALIDATE_ID):
        d = review(webhook, {"operation": "CREATE", "object": pod, "userInfo": {"username": "u"}}, set())
        assert d.allowed and not d.warnings, webhook
        # no schedulerName, no shim: at most the admission marker, naming no sliced container
        assert all(op["path"].startswith("/metadata/annotations") for op in d.patch), (webhook, d.patch)
        assert all(set((op["value"] if isinstance(op["value"], dict) else {"v": op["value"]}).values()) <= {""}
                   for op in d.patch), (webhook, d.patch)


def test_a_simulated_node_reports_each_profile_and_zeroes_a_vanished_one():
    inv = inventory()
    got = simulated_node_resources(inv, PluginConfig())
    assert got == {"nvidia.com/gpu": (4, 4), "nvidia.com/mig-1g.18gb": (2, 2), "nvidia.com/mig-3g.71gb": (1, 1)}
    sick = replace(inv, cards=(inv.cards[0], replace(inv.cards[1], healthy=False,
                                                      mig_instances=inv.cards[1].mig_instances[:1])))
    again = simulated_node_resources(sick, PluginConfig(), before=got)
    assert again == {"nvidia.com/gpu": (4, 4), "nvidia.com/mig-1g.18gb": (0, 0), "nvidia.com/mig-3g.71gb": (1, 0)}
