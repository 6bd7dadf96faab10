"""The DRA kubelet plugin over real unix-socket gRPC, dialled as the kubelet dials it: the
registration socket's GetInfo, then NodePrepareResources / NodeUnprepareResources on the
endpoint it names. The ResourceClaims come from a dict (``get_claim``) instead of the API server,
and the files go to a temporary directory; the real kubelet and containerd are exercised by
tests/realnode/test_dra.py."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from grpc import aio
from kvgpu.agent.deviceplugin import device_list
from kvgpu.agent.draplugin import DRA_SERVICE, DraConfig, DraPlugin
from kvgpu.agent.pluginconfig import PluginConfig
from kvgpu.agent.proto import dra_pb2, dra_pb2_grpc, reg_pb2, reg_pb2_grpc
from kvgpu.core import keys
from kvgpu.core.inventory import Card, MigInstance, NodeInventory, Slicing
from kvgpu.dra.slices import DRIVER

NODE = "n1"


def inventory(healthy: bool = True) -> NodeInventory:
    dra = Slicing("p", split_count=4, allocation="dra")
    return NodeInventory(NODE, (Card("GPU-0", 0, "NVIDIA H200", 143771, 132, 0, slicing=Slicing("q")),
                                Card("GPU-1", 1, "NVIDIA H200", 143771, 132, 0, slicing=dra, healthy=healthy,
                                     reason="" if healthy else "XID 79", minor=5)))


def claim(name: str, uid: str, device: str = "gpu-1") -> dict[str, Any]:
    res = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device, "shareID": f"share-{uid}",
           "consumedCapacity": {"memory": "3000Mi", "cores": "30", "shares": "1"}}
    return {"metadata": {"namespace": "team-a", "name": name, "uid": uid},
            "status": {"allocation": {"devices": {"results": [res]}}}}


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kdra", dir="/tmp"))  # unix socket paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def make(root: Path, claims: dict[tuple[str, str], dict[str, Any]], inv: NodeInventory | None = None,
         shim: bool = True) -> DraPlugin:
    shim_dir = root / "shim"
    shim_dir.mkdir(exist_ok=True)
    if shim:
        (shim_dir / "libvgpu-1.so").write_text("elf")
        if not (shim_dir / "libvgpu.so").exists():
            (shim_dir / "libvgpu.so").symlink_to("libvgpu-1.so")
    dev = root / "dev"
    dev.mkdir(exist_ok=True)
    for n in ("nvidia0", "nvidia5", "nvidiactl", "nvidia-uvm"):
        (dev / n).touch()
    pcfg = PluginConfig(host_shim_dir=str(shim_dir), dev_root=str(dev), driver_root=None,
                        sched_dir=str(root / "sched"), stub_driver_env=True)
    cfg = DraConfig(registry_dir=str(root / "reg"), plugin_dir=str(root / "plug"), cdi_dir=str(root / "cdi"),
                    state_dir=str(root / "state"), watch_interval_s=0.05)
    calls: list[tuple[str, str]] = []

    async def get_claim(ns: str, name: str) -> dict[str, Any]:
        calls.append((ns, name))
        if (ns, name) not in claims:
            raise RuntimeError(f"resourceclaims {name} not found")
        return claims[(ns, name)]

    inv = inv or inventory()
    p = DraPlugin(NODE, cfg, pcfg, get_claim, lambda: inv)
    p.calls = calls  # type: ignore[attr-defined]
    return p


async def _dial(plugin: DraPlugin) -> tuple[Any, aio.Channel]:
    """As the kubelet: GetInfo on the registration socket, then a channel to its endpoint."""
    async with aio.insecure_channel(f"unix://{plugin.cfg.registration_socket}") as ch:
        info = await reg_pb2_grpc.RegistrationStub(ch).GetInfo(reg_pb2.InfoRequest(), timeout=5)
        await reg_pb2_grpc.RegistrationStub(ch).NotifyRegistrationStatus(
            reg_pb2.RegistrationStatus(plugin_registered=True), timeout=5)
    return info, aio.insecure_channel(f"unix://{info.endpoint}")


def _claims(*triples: tuple[str, str, str]) -> list[Any]:
    return [dra_pb2.Claim(namespace=ns, name=n, uid=u) for ns, n, u in triples]


async def _serving(plugin: DraPlugin) -> asyncio.Task[None]:
    task = asyncio.create_task(plugin.run())
    for _ in range(100):
        if plugin.cfg.registration_socket.exists():
            break
        await asyncio.sleep(0.02)
    return task


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_registration_prepare_and_the_cdi_spec(root: Path) -> None:
    async def go() -> None:
        plugin = make(root, {("team-a", "seed"): claim("seed", "u-1")})
        task = await _serving(plugin)
        info, ch = await _dial(plugin)
        assert (info.type, info.name, list(info.supported_versions)) == ("DRAPlugin", DRIVER, [DRA_SERVICE])
        assert info.endpoint == str(root / "plug" / "dra.sock") and plugin.registrations == 1
        stub = dra_pb2_grpc.DRAPluginStub(ch)
        resp = await stub.NodePrepareResources(dra_pb2.NodePrepareResourcesRequest(
            claims=_claims(("team-a", "seed", "u-1"))), timeout=5)
        (dev,) = resp.claims["u-1"].devices
        assert resp.claims["u-1"].error == ""
        assert (list(dev.request_names), dev.pool_name, dev.device_name, dev.share_id) == (
            ["gpu"], NODE, "gpu-1", "share-u-1")
        assert list(dev.cdi_device_ids) == ["gpu.kvgpu.io/claim=u-1-gpu-1"]
        claim_file = root / "state" / "claims" / "u-1" / "claim"
        assert claim_file.read_text() == "v1;claim=team-a/seed;priority=1;dev=GPU-1,3000,30"
        assert claim_file.stat().st_mode & 0o777 == 0o444
        spec = json.loads((root / "cdi" / "gpu.kvgpu.io-u-1.json").read_text())
        assert spec["kind"] == "gpu.kvgpu.io/claim" and spec["cdiVersion"] == "0.6.0"
        (d,) = spec["devices"]
        assert d == {"name": "u-1-gpu-1", "containerEdits": {"deviceNodes": [
            {"path": "/dev/nvidia5", "hostPath": str(root / "dev" / "nvidia5"), "permissions": "rw"}]}}
        edits = spec["containerEdits"]
        mounts = {m["containerPath"]: m for m in edits["mounts"]}
        assert mounts[keys.CONTAINER_CLAIM_FILE]["hostPath"] == str(claim_file)
        assert "ro" in mounts[keys.CONTAINER_CLAIM_FILE]["options"]
        assert mounts[keys.CONTAINER_REGION_DIR]["hostPath"] == str(root / "state" / "claims" / "u-1" / "region")
        assert "rw" in mounts[keys.CONTAINER_REGION_DIR]["options"]
        assert "ro" in mounts[keys.CONTAINER_SCHED_DIR]["options"]
        assert mounts[keys.CONTAINER_SHIM_DIR]["hostPath"] == str(root / "shim")
        assert "/etc/ld.so.preload" in mounts
        assert {n["path"] for n in edits["deviceNodes"]} == {"/dev/nvidiactl", "/dev/nvidia-uvm"}  # no other card
        env = dict(e.split("=", 1) for e in edits["env"])
        assert env[keys.ENV_VISIBLE] == "GPU-1" and env["STUB_UUIDS"] == "GPU-1"
        # prepared again (a kubelet retry): the same answer from the checkpoint, no API read
        again = await stub.NodePrepareResources(dra_pb2.NodePrepareResourcesRequest(
            claims=_claims(("team-a", "seed", "u-1"))), timeout=5)
        assert again == resp and plugin.calls == [("team-a", "seed")]  # type: ignore[attr-defined]
        await ch.close()
        await _stop(task)

    asyncio.run(go())


def test_unprepare_after_a_restart_removes_the_files(root: Path) -> None:
    async def go() -> None:
        claims = {("team-a", "seed"): claim("seed", "u-1")}
        first = make(root, claims)
        await first.prepare("team-a", "seed", "u-1")
        files = [root / "state" / "claims" / "u-1", root / "cdi" / "gpu.kvgpu.io-u-1.json"]
        assert all(p.exists() for p in files)
        restarted = make(root, {})  # a new agent: the claim is no longer readable, the checkpoint is
        task = await _serving(restarted)
        _, ch = await _dial(restarted)
        stub = dra_pb2_grpc.DRAPluginStub(ch)
        req = dra_pb2.NodeUnprepareResourcesRequest(claims=_claims(("team-a", "seed", "u-1")))
        assert (await stub.NodeUnprepareResources(req, timeout=5)).claims["u-1"].error == ""
        assert not any(p.exists() for p in files)
        assert (await stub.NodeUnprepareResources(req, timeout=5)).claims["u-1"].error == ""  # idempotent
        await ch.close()
        await _stop(task)

    asyncio.run(go())


def test_a_bad_claim_gets_its_own_error_and_no_files(root: Path) -> None:
    async def go() -> None:
        claims = {("team-a", "good"): claim("good", "u-1"), ("team-a", "far"): claim("far", "u-2", "gpu-0"),
                  ("team-a", "re"): claim("re", "u-other")}
        plugin = make(root, claims)
        out = {}
        for name, uid in (("good", "u-1"), ("far", "u-2"), ("re", "u-3"), ("gone", "u-4")):
            out[uid] = await plugin.prepare("team-a", name, uid)
        assert out["u-1"].error == "" and len(out["u-1"].devices) == 1
        assert "device 'gpu-0' is not a gpu.kvgpu.io device of node n1" in out["u-2"].error  # an extender card
        assert "has UID 'u-other', the kubelet asked for 'u-3'" in out["u-3"].error
        assert "cannot read ResourceClaim team-a/gone" in out["u-4"].error
        assert sorted(p.name for p in (root / "cdi").iterdir()) == ["gpu.kvgpu.io-u-1.json"]
        assert plugin.files.prepared_uids() == ["u-1"]

    asyncio.run(go())


def test_unhealthy_card_or_missing_shim_prepares_nothing(root: Path) -> None:
    async def go() -> None:
        claims = {("team-a", "seed"): claim("seed", "u-1")}
        sick = await make(root, claims, inventory(healthy=False)).prepare("team-a", "seed", "u-1")
        assert "is unhealthy: XID 79" in sick.error
        other = root / "noshim"
        other.mkdir()
        noshim = await make(other, claims, shim=False).prepare("team-a", "seed", "u-1")
        assert "shim is not installed" in noshim.error
        for r in (root, other):
            assert not (r / "cdi").exists() or not any((r / "cdi").iterdir())
            assert not (r / "state" / "claims").exists() or not any((r / "state" / "claims").iterdir())

    asyncio.run(go())


def test_the_device_plugin_does_not_offer_dra_cards() -> None:
    ids = [d.ID for d in device_list(inventory(), PluginConfig())]
    assert ids and all(i.startswith("GPU-0::") for i in ids)
    assert [d.ID for d in device_list(inventory(), PluginConfig(split_count=2))] == ["GPU-0::0", "GPU-0::1"]


def test_pool_policies_from_the_pools_defaults() -> None:
    from kvgpu.agent.drapublish import pool_policies
    from kvgpu.dra.slices import DevicePolicy

    pools = [{"metadata": {"name": "a"}, "spec": {"defaults": {"gpumem": 3000, "gpucores": 30}, "minSliceMemory": 512}},
             {"metadata": {"name": "b"}, "spec": {}},
             {"metadata": {"name": "c"}, "spec": {"defaults": {"gpumem": "lots"}}}]
    assert pool_policies(pools) == {"a": DevicePolicy(3000, 30, 512), "b": DevicePolicy(), "c": DevicePolicy()}


def test_slice_events_that_ask_for_a_sync() -> None:
    from kvgpu.agent.drapublish import SPEC_HASH, SlicePublisher

    pub = SlicePublisher.__new__(SlicePublisher)  # no API client: only the event rule is exercised
    pub.node, pub.written = NODE, {"n1-gpu.kvgpu.io": "h1"}
    kicks: list[int] = []

    def ev(etype: str, name: str = "n1-gpu.kvgpu.io", h: str | None = "h1") -> int:
        before = len(kicks)
        obj = {"metadata": {"name": name, "annotations": {SPEC_HASH: h} if h else {}}}
        pub.on_slice_event(lambda: kicks.append(1), etype, obj)
        return len(kicks) - before

    assert ev("MODIFIED") == 0                      # what the agent wrote
    assert ev("DELETED") == 1                       # the kubelet wiped it
    assert ev("MODIFIED", h="other") == 1           # edited by someone else
    assert ev("MODIFIED", h=None) == 1
    assert ev("ADDED", name="n1-counters-gpu.kvgpu.io", h=None) == 1   # a slice of ours it did not write
    assert ev("ADDED", name="n2-gpu.kvgpu.io", h=None) == 0            # another node's
    assert ev("DELETED", name="n1-other-driver") == 0


def mig_inventory() -> NodeInventory:
    inst = MigInstance("MIG-7", 0, "1g.18gb", 16384, 16, 7, 0, 31, 32)
    mig = Card("GPU-2", 2, "NVIDIA H200", 143771, 132, 0, slicing=Slicing("p", split_count=4, allocation="dra"),
               minor=6, mig_mode=True, mig_instances=(inst,))
    return NodeInventory(NODE, (*inventory().cards, mig))


def mig_claim(name: str, uid: str) -> dict[str, Any]:
    res = {"request": "mig", "driver": DRIVER, "pool": NODE, "device": "gpu-2-mig-7-0"}
    return {"metadata": {"namespace": "team-a", "name": name, "uid": uid},
            "status": {"allocation": {"devices": {"results": [res]}}}}


def test_a_mig_claim_gets_its_instance_nodes_and_no_shim(root: Path) -> None:
    async def go() -> None:
        plugin = make(root, {("team-a", "m"): mig_claim("m", "u-9")}, mig_inventory())
        resp = await plugin.prepare("team-a", "m", "u-9")
        assert resp.error == ""
        (dev,) = resp.devices
        assert (dev.device_name, dev.share_id, list(dev.cdi_device_ids)) == (
            "gpu-2-mig-7-0", "", ["gpu.kvgpu.io/claim=u-9-gpu-2-mig-7-0"])
        spec = json.loads((root / "cdi" / "gpu.kvgpu.io-u-9.json").read_text())
        (d,) = spec["devices"]
        assert d["name"] == "u-9-gpu-2-mig-7-0"
        assert [(n["path"], n["hostPath"]) for n in d["containerEdits"]["deviceNodes"]] == [
            ("/dev/nvidia6", str(root / "dev" / "nvidia6")),
            ("/dev/nvidia-caps/nvidia-cap31", str(root / "dev" / "nvidia-caps" / "nvidia-cap31")),
            ("/dev/nvidia-caps/nvidia-cap32", str(root / "dev" / "nvidia-caps" / "nvidia-cap32"))]
        edits = spec["containerEdits"]
        assert {n["path"] for n in edits["deviceNodes"]} == {"/dev/nvidiactl", "/dev/nvidia-uvm"}
        assert edits["mounts"] == []  # no shim, no ld.so.preload, no claim file, no region, no schedule
        env = dict(e.split("=", 1) for e in edits["env"])
        assert env == {"NVIDIA_VISIBLE_DEVICES": "MIG-7", "KVGPU_DRA_CLAIM": "team-a/m"}
        d9 = root / "state" / "claims" / "u-9"
        assert sorted(p.name for p in d9.iterdir()) == ["prepared.json"]
        again = await plugin.prepare("team-a", "m", "u-9")  # a retry: from the checkpoint, no API read
        assert again == resp and plugin.calls == [("team-a", "m")]  # type: ignore[attr-defined]
        assert (await plugin.unprepare("u-9")).error == ""
        assert not d9.exists() and not (root / "cdi" / "gpu.kvgpu.io-u-9.json").exists()

    asyncio.run(go())


def test_a_mig_instance_with_unknown_caps_fails_its_prepare(root: Path) -> None:
    async def go() -> None:
        inv = mig_inventory()
        (inst,) = inv.cards[2].mig_instances
        nocaps = replace(inv.cards[2], mig_instances=(replace(inst, gi_cap_minor=None),))
        plugin = make(root, {("team-a", "m"): mig_claim("m", "u-9")}, NodeInventory(NODE, (*inv.cards[:2], nocaps)))
        resp = await plugin.prepare("team-a", "m", "u-9")
        assert "the minors of its /dev/nvidia-caps nodes are unknown" in resp.error and not resp.devices
        assert plugin.files.prepared_uids() == [] and not (root / "cdi" / "gpu.kvgpu.io-u-9.json").exists()

    asyncio.run(go())
