"""The MPS backend's pure parts: pool mode, allocator accounting, the claim string, the daemon's
command line and env, the plan, the wanted and status files between the agent and the daemons'
owner, and the device plugin's Allocate for an mps card. The daemon
itself (with a fake ``nvidia-cuda-mps-control``) is in test_agent_mps.py."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
from allocator_helpers import c, node_of, pod
from kvgpu.agent import mps
from kvgpu.agent.deviceplugin import DevicePlugin, PluginConfig, PluginError, device_list, replica_id
from kvgpu.agent.podidentity import KubeletPod, PodIdentifier
from kvgpu.agent.proto import pb2
from kvgpu.allocator import Ledger
from kvgpu.api.models import Mode, VGPUPool
from kvgpu.api.pools import MPS_MAX_CLIENTS, slicing_of
from kvgpu.core import claimstr, keys
from kvgpu.core.inventory import Card, NodeInventory, Slicing
from kvgpu.extender.binder import allocation_annotations
from podhelpers import GPU, ctr
from podhelpers import pod as kpod

U0 = "GPU-00000000-0000-0000-0000-000000000000"
MPS = Slicing("inference", split_count=8, mode="mps")


def test_pool_mode_mps_is_served_with_at_most_48_slots():
    pool = VGPUPool.model_validate({"apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool",
                                    "metadata": {"name": "inf"}, "spec": {"mode": "mps", "splitCount": 100}})
    assert pool.spec.mode is Mode.MPS
    assert slicing_of(pool) == Slicing("inf", split_count=48, mode="mps")
    card = Card(U0, 0, "NVIDIA H200", 143771, 132, 0, slicing=MPS)
    assert len(device_list(NodeInventory("n", (card,)), PluginConfig())) == 8
    assert mps.MAX_CLIENTS == MPS_MAX_CLIENTS == 48


def test_allocator_accounts_an_mps_card_like_hami_core():
    led = Ledger()
    led.set_node(node_of("a", {"slicing": MPS}, {"slicing": MPS}))
    a = led.allocate(pod(c(memory_mib=3000, cores=30)), "a")
    (dev,) = a.containers[0].devices
    assert (dev.memory_mib, dev.cores, dev.mode) == (3000, 30, "mps")
    feasible, reasons = led.filter(pod(c(cards=2, memory_mib=100), uid="y"))
    assert feasible == [] and "mps mode (one card per container)" in reasons["a"], reasons
    led.bind(pod(c(memory_mib=3000, cores=100), uid="x"), "a")  # cores 100: an exclusive client
    led.bind(pod(c(memory_mib=3000, cores=70), uid="z"), "a")
    assert led.filter(pod(c(memory_mib=100, cores=30), uid="w"))[0] == ["a"]
    feasible, reasons = led.filter(pod(c(memory_mib=100, cores=40), uid="w"))
    assert feasible == [] and "most free cores 30 %" in reasons["a"], reasons


def test_the_claim_string_says_mps():
    led = Ledger()
    led.set_node(node_of("a", {"slicing": MPS}))
    alloc = led.allocate(pod(c(memory_mib=3000, cores=30)), "a")
    ann = allocation_annotations("team", {"metadata": {"name": "p", "uid": "u1"}}, alloc)
    text = ann[keys.claim_annotation("main")]
    assert text.endswith(";mode=mps")
    cs = claimstr.decode(text)
    assert cs.mode == "mps" and cs.devices[0].cores == 30
    assert claimstr.decode(cs.encode()) == cs
    assert claimstr.decode("v1;claim=a/b;priority=1;dev=GPU-1,10,0").mode == "hami-core"
    for bad in ("mode=mig", "mode=mps;mode=mps"):
        with pytest.raises(claimstr.ClaimStringError):
            claimstr.decode(f"v1;claim=a/b;priority=1;dev=GPU-1,10,0;{bad}")


def test_daemon_command_line_and_env():
    env = mps.daemon_env("/var/run/kvgpu/mps", U0, {"PATH": "/bin", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "5"})
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": U0,
                   "CUDA_MPS_PIPE_DIRECTORY": f"/var/run/kvgpu/mps/{U0}/pipe",
                   "CUDA_MPS_LOG_DIRECTORY": f"/var/run/kvgpu/mps/{U0}/log"}
    assert mps.start_argv("/usr/local/nvidia/bin/nvidia-cuda-mps-control") == [
        "/usr/local/nvidia/bin/nvidia-cuda-mps-control", "-d"]
    assert (mps.QUERY, mps.QUIT) == ("get_server_list\n", "quit\n")


def test_plan_starts_dead_and_missing_daemons_and_stops_cards_that_left():
    p = mps.plan(["A", "B", "C"], {"A": True, "B": False, "D": True, "E": False})
    assert p == mps.Plan(start=("B", "C"), stop=("D",), keep=("A",))
    cards = [Card("GPU-a", 0, "m", 1, 1, slicing=MPS), Card("GPU-b", 1, "m", 1, 1, slicing=Slicing("p")),
             Card("GPU-c", 2, "m", 1, 1, mig_mode=True, slicing=MPS), Card("GPU-d", 3, "m", 1, 1)]
    assert mps.mps_cards(cards) == ["GPU-a"]


def test_claim_to_thread_percentage_and_pinned_memory():
    cs = claimstr.decode(f"v1;claim=a/b;priority=1;dev={U0},3000,30;mode=mps")
    assert mps.client_env(cs) == {"CUDA_MPS_PIPE_DIRECTORY": "/var/run/kvgpu-mps",
                                  "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
                                  "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3000M"}
    assert [mps.thread_percentage(x) for x in (0, 1, 99, 100)] == [100, 1, 99, 100]


# --------------------------------------------------------------------------- Allocate


@pytest.fixture
def node(tmp_path):
    shim = tmp_path / "lib"
    shim.mkdir()
    (shim / "libvgpu.so.0.1.0").write_bytes(b"\x7fELF")
    os.symlink("libvgpu.so.0.1.0", shim / "libvgpu.so")
    sock = Path(tempfile.mkdtemp(prefix="kmps", dir="/tmp"))
    yield tmp_path, shim, sock
    shutil.rmtree(sock, ignore_errors=True)


def _plugin(node, claim_text):
    tmp, shim, sock = node
    p = kpod("a", [ctr("main", 1)], claims={"main": [U0]})
    p["metadata"]["annotations"][keys.claim_annotation("main")] = claim_text

    async def lookup(ns, name):
        return KubeletPod()

    cfg = PluginConfig(socket_dir=str(sock), host_shim_dir=str(shim), mps_root=str(tmp / "mps"))
    inv = NodeInventory("gpu-0", (Card(U0, 0, "NVIDIA H200", 143771, 132, 0, slicing=MPS),))
    return DevicePlugin(cfg, inv, identifier=PodIdentifier("gpu-0", GPU, cached=lambda: [p], lookup=lookup))


def _request():
    return pb2.AllocateRequest(container_requests=[pb2.ContainerAllocateRequest(devices_ids=[replica_id(U0, 0)])])


def _daemon_up(root: Path, alive: bool = True, age_s: float = 0.0) -> Path:
    """What the owner leaves when card U0's daemon answers: its socket and a status report."""
    pipe = mps.pipe_dir(root, U0)
    pipe.mkdir(parents=True, exist_ok=True)
    (pipe / "control").write_text("")  # stands for the daemon's socket
    (root / mps.STATUS_FILE).write_text(mps.status_text(mps.Status(time.time() - age_s, 5.0, {U0: alive})))
    return pipe


async def test_allocate_makes_an_mps_client(node):
    tmp = node[0]
    pipe = _daemon_up(tmp / "mps")
    plugin = _plugin(node, f"v1;claim=default/a-main;priority=1;dev={U0},3000,30;mode=mps")
    r = (await plugin.allocate(_request())).container_responses[0]
    assert r.envs["CUDA_MPS_PIPE_DIRECTORY"] == keys.CONTAINER_MPS_DIR
    assert r.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert r.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3000M"
    assert [(m.container_path, m.host_path, m.read_only) for m in r.mounts
            if m.container_path == keys.CONTAINER_MPS_DIR] == [(keys.CONTAINER_MPS_DIR, str(pipe), True)]


async def test_allocate_refuses_an_mps_client_without_its_daemon(node):
    plugin = _plugin(node, f"v1;claim=default/a-main;priority=1;dev={U0},3000,30;mode=mps")
    with pytest.raises(PluginError, match=r"MPS control daemon of card .* no MPS daemon owner has reported"):
        await plugin.allocate(_request())


@pytest.mark.parametrize(("alive", "age_s", "why"), [
    (False, 0.0, "its MPS control daemon is not running"),
    (True, 600.0, "the MPS daemon owner's last report is 600 s old"),  # the owner is gone
])
async def test_allocate_refuses_an_mps_client_the_owner_does_not_vouch_for(node, alive, age_s, why):
    _daemon_up(node[0] / "mps", alive=alive, age_s=age_s)  # the socket alone is not enough
    plugin = _plugin(node, f"v1;claim=default/a-main;priority=1;dev={U0},3000,30;mode=mps")
    with pytest.raises(PluginError, match=why):
        await plugin.allocate(_request())


def test_wanted_and_status_files_round_trip_and_refuse_what_they_do_not_know():
    text = mps.wanted_text(["GPU-b", "GPU-a", "GPU-b"])
    assert text == '{"version":1,"cards":["GPU-a","GPU-b"]}\n'
    assert mps.parse_wanted(text) == ["GPU-a", "GPU-b"]
    for bad in ("", "{", "[]", '{"version":2,"cards":[]}', '{"version":1,"cards":"GPU-a"}',
                '{"version":1,"cards":["../etc"]}', '{"version":1}'):
        assert mps.parse_wanted(bad) is None, bad  # the owner then changes nothing
    st = mps.Status(1000.0, 5.0, {"GPU-a": True, "GPU-b": False})
    assert mps.parse_status(mps.status_text(st)) == st
    assert mps.parse_status('{"version":2}') is None and mps.parse_status("x") is None


def test_not_ready_needs_a_fresh_report_of_a_live_daemon():
    st = mps.Status(1000.0, 5.0, {"GPU-a": True, "GPU-b": False})
    assert mps.not_ready(st, "GPU-a", 1020.0) is None
    assert mps.not_ready(st, "GPU-a", 1026.0) == "the MPS daemon owner's last report is 26 s old"  # 3 × 5 + 10
    assert mps.not_ready(st, "GPU-b", 1000.0) == "its MPS control daemon is not running"
    assert mps.not_ready(st, "GPU-c", 1000.0) == "its MPS control daemon is not running"
    assert mps.not_ready(None, "GPU-a", 1000.0).startswith("no MPS daemon owner has reported")


async def test_allocate_of_a_hami_core_claim_has_no_mps_env(node):
    plugin = _plugin(node, f"v1;claim=default/a-main;priority=1;dev={U0},3000,30")
    r = (await replace_plugin(plugin).allocate(_request())).container_responses[0]
    assert not [k for k in r.envs if k.startswith("CUDA_MPS_")]
    assert keys.CONTAINER_MPS_DIR not in [m.container_path for m in r.mounts]


def replace_plugin(p: DevicePlugin) -> DevicePlugin:
    return DevicePlugin(replace(p.cfg), p.inventory, identifier=p.identifier)
