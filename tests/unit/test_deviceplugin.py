"""The device plugin against a harness that plays the kubelet over real unix-socket gRPC.

The harness serves the kubelet's Registration service on ``<dir>/kubelet.sock``; the plugin
registers there; the harness then dials the plugin's socket exactly like the kubelet does and
calls GetDevicePluginOptions, ListAndWatch, GetPreferredAllocation, Allocate and
PreStartContainer. Which pods the kubelet knows (PodResources) is played by
:func:`identifier`'s dict; the real kubelet is exercised by tests/realnode.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from agent_helpers import kubelet
from grpc import aio
from kvgpu.agent.deviceplugin import (
    DevicePlugin,
    PluginConfig,
    card_of,
    preferred,
    replica_id,
)
from kvgpu.agent.podidentity import KubeletPod, PodIdentifier
from kvgpu.agent.proto import pb2, pb2_grpc
from kvgpu.agent.shiminstall import atomic_symlink, prune_shims
from kvgpu.core.inventory import Card, NodeInventory, Slicing
from podhelpers import GPU, ctr, pod

U0 = "GPU-00000000-0000-0000-0000-000000000000"
U1 = "GPU-11111111-1111-1111-1111-111111111111"


def inventory(split=3, healthy1=True):
    sl = Slicing("default", split_count=split)
    return NodeInventory(
        "gpu-0",
        (
            Card(U0, 0, "NVIDIA H200", 143771, 132, 0, slicing=sl),
            Card(
                U1,
                1,
                "NVIDIA H200",
                143771,
                132,
                1,
                healthy=healthy1,
                reason="" if healthy1 else "XID 79",
                slicing=sl,
            ),
        ),
        "simulated",
    )


def identifier(pods, known=None):
    """A PodIdentifier over ``pods``; the kubelet knows ``known`` (names; default: all)."""
    names = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in pods} if known is None else known

    async def lookup(ns, name):
        return KubeletPod() if (ns, name) in names else None

    return PodIdentifier("gpu-0", GPU, cached=lambda: pods, lookup=lookup)


@pytest.fixture
def sock_dir():
    d = Path(tempfile.mkdtemp(prefix="kdp", dir="/tmp"))  # unix socket paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shim_dir(tmp_path):
    d = tmp_path / "lib"
    d.mkdir()
    (d / "libvgpu.so.0.1.0").write_bytes(b"\x7fELF")
    os.symlink("libvgpu.so.0.1.0", d / "libvgpu.so")
    (tmp_path / "ld.so.preload").write_text("/usr/local/kvgpu/lib/libvgpu.so\n")
    return d


def config(sock_dir: Path, shim_dir: Path, **kw) -> PluginConfig:
    return PluginConfig(
        socket_dir=str(sock_dir),
        host_shim_dir=str(shim_dir),
        host_preload_file=str(shim_dir.parent / "ld.so.preload"),
        watch_interval_s=0.05,
        **kw,
    )


async def test_register_list_allocate(sock_dir, shim_dir):
    async with kubelet(sock_dir) as fk:
        pods = [
            pod("a", [ctr("main", 1)], claims={"main": [U0]}, created="2026-12-01T10:00:00Z"),
            pod("b", [ctr("main", 2)], claims={"main": [U0, U1]}, created="2026-12-01T10:00:01Z"),
        ]
        plugin = DevicePlugin(
            config(sock_dir, shim_dir, mounts="pinned", device_specs=False), inventory(), identifier=identifier(pods)
        )
        task = asyncio.create_task(plugin.run())
        await asyncio.wait_for(fk.registered.wait(), 5)
        req = fk.requests[0]
        assert (req.version, req.endpoint, req.resource_name) == (
            "v1beta1",
            "kvgpu-nvidia-gpu.sock",
            "nvidia.com/gpu",
        )
        assert req.options.get_preferred_allocation_available

        async with aio.insecure_channel(f"unix://{sock_dir / req.endpoint}") as ch:
            stub = pb2_grpc.DevicePluginStub(ch)
            opts = await stub.GetDevicePluginOptions(pb2.Empty(), timeout=5)
            assert not opts.pre_start_required and opts.get_preferred_allocation_available

            stream = stub.ListAndWatch(pb2.Empty())
            first = await asyncio.wait_for(stream.read(), 5)
            ids = [d.ID for d in first.devices]
            assert ids == [replica_id(U0, n) for n in range(3)] + [replica_id(U1, n) for n in range(3)]
            assert {d.health for d in first.devices} == {"Healthy"}
            assert [n.ID for n in first.devices[3].topology.nodes] == [1]

            # Health change: the kubelet gets a new list with card 1's replicas unhealthy.
            await plugin.update(inventory(healthy1=False))
            second = await asyncio.wait_for(stream.read(), 5)
            health = {d.ID: d.health for d in second.devices}
            assert health[replica_id(U1, 0)] == "Unhealthy" and health[replica_id(U0, 0)] == "Healthy"
            # Pool change: split count 3 -> 5 gives 10 devices.
            await plugin.update(inventory(split=5, healthy1=False))
            third = await asyncio.wait_for(stream.read(), 5)
            assert len(third.devices) == 10

            # Preferred allocation: 2 cards -> one replica of each, healthy first.
            pref = await stub.GetPreferredAllocation(
                pb2.PreferredAllocationRequest(
                    container_requests=[
                        pb2.ContainerPreferredAllocationRequest(
                            available_deviceIDs=ids, must_include_deviceIDs=[], allocation_size=2
                        )
                    ]
                ),
                timeout=5,
            )
            got = list(pref.container_responses[0].deviceIDs)
            assert {card_of(d) for d in got} == {U0, U1}  # pod b's claim (and the fallback's pick)

            resp = await stub.Allocate(
                pb2.AllocateRequest(
                    container_requests=[
                        pb2.ContainerAllocateRequest(devices_ids=[replica_id(U0, 1)]),
                        pb2.ContainerAllocateRequest(devices_ids=[replica_id(U0, 2), replica_id(U1, 0)]),
                    ]
                ),
                timeout=5,
            )
            assert len(resp.container_responses) == 2
            for c in resp.container_responses:
                mounts = {m.container_path: m for m in c.mounts}
                lib = mounts["/usr/local/kvgpu/lib/libvgpu.so"]
                # The resolved version-named file, not the switchable symlink; read-only.
                assert lib.host_path == str(shim_dir / "libvgpu.so.0.1.0") and lib.read_only
                pre = mounts["/etc/ld.so.preload"]
                assert pre.read_only and pre.host_path.endswith("ld.so.preload")
                assert c.envs["KVGPU_SHIM_FILE"] == "libvgpu.so.0.1.0"
                assert not c.devices  # device_specs off
            # Identities come from the claims (pods a then b), never from the replica IDs.
            assert [c.envs["NVIDIA_VISIBLE_DEVICES"] for c in resp.container_responses] == [U0, f"{U0},{U1}"]

            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.Allocate(
                    pb2.AllocateRequest(
                        container_requests=[pb2.ContainerAllocateRequest(devices_ids=["GPU-nope::0"])]
                    ),
                    timeout=5,
                )
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION

            await stub.PreStartContainer(pb2.PreStartContainerRequest(devices_ids=ids[:1]), timeout=5)
            stream.cancel()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert not plugin.socket_path.exists()


async def test_allocate_fails_closed_without_shim(sock_dir, tmp_path):
    empty = tmp_path / "nolib"
    empty.mkdir()
    plugin = DevicePlugin(config(sock_dir, empty), inventory())
    await plugin.start()
    try:
        async with aio.insecure_channel(f"unix://{plugin.socket_path}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await pb2_grpc.DevicePluginStub(ch).Allocate(
                    pb2.AllocateRequest(
                        container_requests=[pb2.ContainerAllocateRequest(devices_ids=[replica_id(U0, 0)])]
                    ),
                    timeout=5,
                )
            assert "shim is not installed" in ei.value.details()
    finally:
        await plugin.stop()


async def test_visible_devices_opt_in(sock_dir, shim_dir):
    plugin = DevicePlugin(
        config(sock_dir, shim_dir, visible_devices_from_ids=True, device_specs=False, region_root="/nonexistent",
               sched_dir="/nonexistent"), inventory()
    )
    resp = await plugin.allocate(
        pb2.AllocateRequest(
            container_requests=[
                pb2.ContainerAllocateRequest(devices_ids=[replica_id(U1, 0), replica_id(U1, 2)])
            ]
        )
    )
    c = resp.container_responses[0]
    assert c.envs["NVIDIA_VISIBLE_DEVICES"] == U1
    # No claim, so no region or schedule: only the shim and ld.so.preload.
    assert {m.container_path for m in c.mounts} == {"/usr/local/kvgpu/lib", "/etc/ld.so.preload"}


async def test_reregisters_after_kubelet_restart(sock_dir, shim_dir):
    plugin = DevicePlugin(config(sock_dir, shim_dir), inventory())
    task = asyncio.create_task(plugin.run(retry_s=0.05))
    try:
        async with kubelet(sock_dir) as fk:
            await asyncio.wait_for(fk.registered.wait(), 5)
        # Kubelet restart: its socket comes back and (like the kubelet) wipes plugin sockets.
        plugin.socket_path.unlink(missing_ok=True)
        async with kubelet(sock_dir) as fk2:
            await asyncio.wait_for(fk2.registered.wait(), 5)
            for _ in range(500):  # the plugin counts after the kubelet answered (10 s: a loaded CI machine)
                if plugin.registrations >= 2:
                    break
                await asyncio.sleep(0.02)
            assert plugin.registrations >= 2
            async with aio.insecure_channel(f"unix://{plugin.socket_path}") as ch:
                opts = await pb2_grpc.DevicePluginStub(ch).GetDevicePluginOptions(pb2.Empty(), timeout=5)
                assert opts.get_preferred_allocation_available
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_registration_refused_is_retried(sock_dir, shim_dir):
    # The kubelet refuses twice, then accepts: the plugin must have tried three times and be
    # registered once, still running. Without the retry the task ends at the first refusal.
    plugin = DevicePlugin(config(sock_dir, shim_dir), inventory())
    async with kubelet(sock_dir, refuse="resource name taken", refuse_times=2) as fk:
        task = asyncio.create_task(plugin.run(retry_s=0.05))
        try:
            await asyncio.wait_for(fk.registered.wait(), 5)
            assert fk.refusals == 2
            assert len(fk.requests) == 1
            for _ in range(500):  # the plugin counts after the kubelet answered (10 s: a loaded CI machine)
                if plugin.registrations:
                    break
                await asyncio.sleep(0.02)
            assert plugin.registrations == 1
            assert not task.done()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_registration_refused_forever_keeps_retrying(sock_dir, shim_dir):
    plugin = DevicePlugin(config(sock_dir, shim_dir), inventory())
    async with kubelet(sock_dir, refuse="resource name taken") as fk:
        task = asyncio.create_task(plugin.run(retry_s=0.05))
        try:
            for _ in range(100):
                if fk.refusals >= 3:
                    break
                await asyncio.sleep(0.02)
            assert fk.refusals >= 3, "the plugin did not retry a refused registration"
            assert plugin.registrations == 0
            assert not task.done()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def test_split_count_override_and_uncovered():
    inv = inventory()
    inv2 = replace(inv, cards=(replace(inv.cards[0], slicing=None), inv.cards[1]))
    from kvgpu.agent.deviceplugin import device_list

    assert len(device_list(inv2, PluginConfig())) == 3
    assert len(device_list(inv2, PluginConfig(split_count=4))) == 8
    excl = replace(inv, cards=tuple(replace(c, slicing=Slicing("x", mode="exclusive")) for c in inv.cards))
    assert len(device_list(excl, PluginConfig())) == 2
    mig = replace(inv, cards=(replace(inv.cards[0], mig_mode=True), inv.cards[1]))
    assert len(device_list(mig, PluginConfig())) == 3  # the MIG-enabled card offers no shim slices


def test_preferred_policy():
    ids = [replica_id(u, n) for u in (U0, U1, "GPU-2") for n in range(3)]
    healthy = {U0, U1, "GPU-2"}
    # Distinct cards first.
    assert len({card_of(d) for d in preferred(ids, [], 3, healthy)}) == 3
    # must_include is kept; the other pick is on a different card.
    got = preferred(ids, [replica_id(U1, 2)], 2, healthy)
    assert got[0] == replica_id(U1, 2) and card_of(got[1]) != U1
    # A unique hint for that size wins.
    got = preferred(ids, [], 2, healthy, hint=[["GPU-2", U1], [U0]])
    assert {card_of(d) for d in got} == {"GPU-2", U1}
    # Ambiguous hints are ignored (no guessing between two pending claims).
    got = preferred(ids, [], 1, {U0}, hint=[["GPU-2"], [U1]])
    assert card_of(got[0]) == U0
    # More than the cards: replicas of used cards fill up.
    assert len(preferred(ids[:4], [], 4, healthy)) == 4
    # Least-used card first: U1 has more free replicas.
    few = [replica_id(U0, 0), replica_id(U1, 0), replica_id(U1, 1)]
    assert card_of(preferred(few, [], 1, {U0, U1})[0]) == U1


async def test_dir_mounts_the_shim_directory_and_preload(sock_dir, shim_dir):
    cfg = config(sock_dir, shim_dir, mounts="dir", visible_devices_from_ids=True, device_specs=False)
    plugin = DevicePlugin(cfg, inventory())
    resp = await plugin.allocate(
        pb2.AllocateRequest(
            container_requests=[pb2.ContainerAllocateRequest(devices_ids=[replica_id(U0, 0)])]
        )
    )
    mounts = {m.container_path: (m.host_path, m.read_only) for m in resp.container_responses[0].mounts}
    assert mounts == {
        "/usr/local/kvgpu/lib": (str(shim_dir), True),
        "/etc/ld.so.preload": (str(shim_dir.parent / "ld.so.preload"), True),
    }
    from kvgpu.admission import mutate

    # The webhook mounts none of these targets (one mount per target: no stacking).
    hook = {m["mountPath"] for m in mutate.injected_mounts("main")}
    assert not hook & set(mounts)
    assert set(mounts) <= set(mutate.DEVICE_PLUGIN_TARGETS)


def test_default_mounts_dir_and_no_none(sock_dir, shim_dir):
    from kvgpu.agent.allocation import installed_shim
    from kvgpu.agent.deviceplugin import PluginError

    assert PluginConfig().mounts == "dir"  # the webhook mounts no shim: Allocate always does
    with pytest.raises(PluginError, match=r"mounts='none' is not one of \('dir', 'pinned'\)"):
        installed_shim(config(sock_dir, shim_dir, mounts="none"))


async def test_allocate_mounts_each_container_its_own_region_only(sock_dir, shim_dir, tmp_path):
    """Two sliced containers of one pod and one of another: each gets ``<root>/<uid>/<container>``
    read-write on /var/run/kvgpu (never the root, never a sibling's), the schedule read-only."""
    pods = [pod("a", [ctr("main", 1), ctr("side", 1)], claims={"main": [U0], "side": [U1]}),
            pod("b", [ctr("main", 1)], claims={"main": [U1]}, created="2026-12-01T10:00:01Z")]
    root, sched = tmp_path / "regions", tmp_path / "sched"
    cfg = config(sock_dir, shim_dir, device_specs=False, region_root=str(root), sched_dir=str(sched))
    plugin = DevicePlugin(cfg, inventory(), identifier=identifier(pods))
    got = []
    for ids in ([replica_id(U0, 0)], [replica_id(U1, 0)]):  # pod a: main, then side (spec order)
        resp = await plugin.allocate(pb2.AllocateRequest(container_requests=[
            pb2.ContainerAllocateRequest(devices_ids=ids)]))
        got.append(resp.container_responses[0])
    resp = await plugin.allocate(pb2.AllocateRequest(container_requests=[
        pb2.ContainerAllocateRequest(devices_ids=[replica_id(U1, 1)])]))
    got.append(resp.container_responses[0])
    want = [root / "uid-a" / "main", root / "uid-a" / "side", root / "uid-b" / "main"]
    for c, region in zip(got, want, strict=True):
        mounts = {m.container_path: (m.host_path, m.read_only) for m in c.mounts}
        assert mounts["/var/run/kvgpu"] == (str(region), False)
        assert mounts["/var/run/kvgpu-sched"] == (str(sched), True)
        assert region.is_dir()
        # Nothing else of the region root is mounted.
        assert [h for h, _ in mounts.values() if h.startswith(str(root))] == [str(region)]
    assert sched.is_dir() and sched.stat().st_mode & 0o777 == 0o755


async def test_allocate_fails_when_the_region_cannot_be_prepared(sock_dir, shim_dir, tmp_path):
    from kvgpu.agent.deviceplugin import PluginError

    (tmp_path / "file").write_text("")
    pods = [pod("a", [ctr("main", 1)], claims={"main": [U0]})]
    cfg = config(sock_dir, shim_dir, device_specs=False, region_root=str(tmp_path / "file"))
    with pytest.raises(PluginError, match="cannot prepare the region directory of pod default/a container main"):
        await DevicePlugin(cfg, inventory(), identifier=identifier(pods)).allocate(pb2.AllocateRequest(
            container_requests=[pb2.ContainerAllocateRequest(devices_ids=[replica_id(U0, 0)])]))


@pytest.fixture
def node_files(tmp_path):
    dev = tmp_path / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    for n in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-caps/nvidia-cap1"):
        (dev / n).write_text("")
    drv = tmp_path / "nvidia"
    (drv / "lib64").mkdir(parents=True)
    (drv / "bin").mkdir()
    (drv / "lib64" / "libcuda.so.580.159.04").write_bytes(b"x")
    os.symlink("libcuda.so.580.159.04", drv / "lib64" / "libcuda.so.1")
    os.symlink("gone", drv / "lib64" / "libdangling.so.1")
    (drv / "lib64" / "README").write_text("")
    (drv / "bin" / "nvidia-smi").write_bytes(b"x")
    return dev, drv


async def test_allocate_answers_the_claim_when_the_kubelet_picked_another_card(sock_dir, shim_dir, node_files):
    dev, drv = node_files
    inv = inventory()
    inv = replace(inv, cards=(inv.cards[0], replace(inv.cards[1], minor=7)))  # NVML minor wins over the index
    pods = [pod("a", [ctr("main", 1)], claims={"main": [U1]})]
    cfg = config(sock_dir, shim_dir, dev_root=str(dev), driver_root=str(drv))
    host = await DevicePlugin(replace(cfg, host_dev_root="/dev"), inv, identifier=identifier(pods)).allocate(
        pb2.AllocateRequest(container_requests=[pb2.ContainerAllocateRequest(devices_ids=[replica_id(U0, 0)])])
    )
    assert host.container_responses[0].devices[0].host_path == "/dev/nvidia7"
    plugin = DevicePlugin(cfg, inv, identifier=identifier(pods))
    resp = await plugin.allocate(
        pb2.AllocateRequest(container_requests=[pb2.ContainerAllocateRequest(devices_ids=[replica_id(U0, 0)])])
    )
    c = resp.container_responses[0]
    assert [(d.container_path, d.host_path, d.permissions) for d in c.devices] == [
        ("/dev/nvidia7", str(dev / "nvidia7"), "rw"),  # the claim's card U1, not the kubelet's U0
        ("/dev/nvidiactl", str(dev / "nvidiactl"), "rw"),
        ("/dev/nvidia-uvm", str(dev / "nvidia-uvm"), "rw"),
        ("/dev/nvidia-uvm-tools", str(dev / "nvidia-uvm-tools"), "rw"),
    ]  # no nvidia-caps node: MIG's config cap (present here) is no whole card's business
    assert [(m.container_path, m.host_path, m.read_only) for m in c.mounts] == [
        ("/usr/local/kvgpu/lib", str(shim_dir), True),
        ("/etc/ld.so.preload", str(shim_dir.parent / "ld.so.preload"), True),
        ("/usr/local/nvidia/lib64", str(drv / "lib64"), True),
        ("/usr/local/nvidia/bin", str(drv / "bin"), True),
    ]  # one mount per folder (a library's names are links to one file); no region_root: no region
    assert c.envs["NVIDIA_VISIBLE_DEVICES"] == U1
    assert c.envs["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"
    assert plugin.identifier is not None and ("uid-a", "main") in plugin.identifier.served


async def test_allocate_refuses_a_container_without_claim(sock_dir, shim_dir):
    pods = [pod("raw", [ctr("main", 1)], ns="excluded")]
    plugin = DevicePlugin(config(sock_dir, shim_dir), inventory(), identifier=identifier(pods))
    await plugin.start()
    try:
        async with aio.insecure_channel(f"unix://{plugin.socket_path}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await pb2_grpc.DevicePluginStub(ch).Allocate(
                    pb2.AllocateRequest(
                        container_requests=[pb2.ContainerAllocateRequest(devices_ids=[replica_id(U0, 0)])]
                    ),
                    timeout=5,
                )
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no kvgpu claim for pod excluded/raw container main" in ei.value.details()
        assert "must be admitted by kvgpu's webhook" in ei.value.details()
    finally:
        await plugin.stop()
    # Nothing identified at all (no identifier): refused too.
    with pytest.raises(Exception, match="no kvgpu claim"):
        await DevicePlugin(config(sock_dir, shim_dir), inventory()).allocate(
            pb2.AllocateRequest(container_requests=[pb2.ContainerAllocateRequest(devices_ids=[replica_id(U0, 0)])])
        )


async def test_preferred_allocation_names_the_admitted_claim_in_a_burst(sock_dir, shim_dir):
    # Three one-card pods pending; the kubelet has added only "second": its card is the answer,
    # although the fallback policy would pick the least-used card (U1 here).
    pods = [pod(f"p{i}", [ctr("main", 1)], claims={"main": [u]}) for i, u in enumerate((U1, U0, U1))]
    plugin = DevicePlugin(config(sock_dir, shim_dir), inventory(), identifier=identifier(pods, {("default", "p1")}))
    await plugin.start()
    try:
        async with aio.insecure_channel(f"unix://{plugin.socket_path}") as ch:
            avail = [replica_id(U0, 0), replica_id(U1, 0), replica_id(U1, 1)]
            pref = await pb2_grpc.DevicePluginStub(ch).GetPreferredAllocation(
                pb2.PreferredAllocationRequest(
                    container_requests=[
                        pb2.ContainerPreferredAllocationRequest(available_deviceIDs=avail, allocation_size=1)
                    ]
                ),
                timeout=5,
            )
        assert list(pref.container_responses[0].deviceIDs) == [replica_id(U0, 0)]
    finally:
        await plugin.stop()


async def test_registers_only_once_the_inventory_has_devices(sock_dir, shim_dir):
    raw = NodeInventory("gpu-0", tuple(replace(c, slicing=None) for c in inventory().cards), "simulated")
    plugin = DevicePlugin(config(sock_dir, shim_dir), raw)  # discovery's inventory: no pool yet, 0 devices
    async with kubelet(sock_dir) as fk:
        task = asyncio.create_task(plugin.run(retry_s=0.05))
        try:
            await asyncio.sleep(0.3)
            assert not fk.registered.is_set() and not plugin.socket_path.exists()
            await plugin.update(inventory())  # the first published inventory
            await asyncio.wait_for(fk.registered.wait(), 5)
            async with aio.insecure_channel(f"unix://{plugin.socket_path}") as ch:
                first = await asyncio.wait_for(pb2_grpc.DevicePluginStub(ch).ListAndWatch(pb2.Empty()).read(), 5)
            assert len(first.devices) == 6
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_simulated_node_tells_the_stub_driver_the_claimed_cards(sock_dir, shim_dir):
    inv = inventory()
    pods = [pod("a", [ctr("main", 1)], claims={"main": [U1]})]
    cfg = replace(config(sock_dir, shim_dir), stub_driver_env=True)
    resp = await DevicePlugin(cfg, inv, identifier=identifier(pods)).allocate(
        pb2.AllocateRequest(container_requests=[pb2.ContainerAllocateRequest(devices_ids=[replica_id(U0, 0)])])
    )
    envs = resp.container_responses[0].envs
    assert (envs["STUB_UUIDS"], envs["STUB_NDEV"]) == (U1, "1")
    assert envs["STUB_MEM_MIB"] == str(inv.cards[1].memory_mib)
    plain = await DevicePlugin(config(sock_dir, shim_dir), inv, identifier=identifier(pods)).allocate(
        pb2.AllocateRequest(container_requests=[pb2.ContainerAllocateRequest(devices_ids=[replica_id(U0, 0)])])
    )
    assert not [k for k in plain.container_responses[0].envs if k.startswith("STUB_")]


async def test_allocate_prepares_the_admitted_containers_region_dir(sock_dir, shim_dir, tmp_path):
    pods = [pod("a", [ctr("main", 1)], claims={"main": [U1]})]
    root = tmp_path / "regions"
    cfg = replace(config(sock_dir, shim_dir), region_root=str(root))
    await DevicePlugin(cfg, inventory(), identifier=identifier(pods)).allocate(
        pb2.AllocateRequest(container_requests=[pb2.ContainerAllocateRequest(devices_ids=[replica_id(U1, 0)])])
    )
    assert (root / "uid-a" / "main").is_dir()
    assert (root / "uid-a" / "main").stat().st_mode & 0o777 == 0o777  # no runAsUser: the image's user
    # the file it was served is recorded beside (outside its mount): the agent prunes no such file
    served = os.readlink(Path(cfg.host_shim_dir) / "libvgpu.so")
    assert (root / "uid-a" / "main.shim").read_text() == f"{served}\n"
    host = Path(cfg.host_shim_dir)
    (host / "libvgpu.so.0.0.9").write_bytes(b"old")  # served to nobody
    (host / "libvgpu.so.0.2.0").write_bytes(b"new")
    atomic_symlink(host / "libvgpu.so", "libvgpu.so.0.2.0")  # an upgrade: the served file is not current
    removed = prune_shims(host, keep=0, is_in_use=lambda p: False, region_root=root)
    assert [p.name for p in removed] == ["libvgpu.so.0.0.9"]
    assert (host / served).exists()
