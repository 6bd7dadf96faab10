"""Prepared DRA claims as tenants of the agent's compute schedule, usage exporter and OOM reporter
(kvgpu.agent.draregions wired in kvgpu.agent.main).

The claims are prepared by the agent's real DRA plugin code (``DraPlugin.prepare``: claim file,
region directory, checkpoint, CDI spec in a temp state dir); the ResourceClaims come from a dict
instead of the API server, and the pods from the agent's pod cache filled by hand. The regions
are the shim's own (its C code through kvgpu.shimcore); the schedule heartbeat the shim's gate
stamps while a kernel waits (vgpu_launch.c) is stamped here through the region's layout
(kvgpu.shimregion), since no kernel runs in a unit test.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import time
from pathlib import Path
from typing import Any

import pytest
from kvgpu import shimregion
from kvgpu.agent.draclaimfiles import CHECKPOINT, REGION_DIR
from kvgpu.agent.draplugin import DraConfig, DraPlugin
from kvgpu.agent.draregions import bound_containers, consuming_containers, prepared_tenants
from kvgpu.agent.exporter import UsageCollector, default_reader, make_registry
from kvgpu.agent.main import Agent, AgentConfig
from kvgpu.agent.pluginconfig import PluginConfig
from kvgpu.agent.schedule import decode
from kvgpu.core import claimstr
from kvgpu.core.inventory import Card, NodeInventory, Slicing
from kvgpu.dra.slices import DRIVER
from prometheus_client import generate_latest

NODE = "gpu-0"
MIB = 1 << 20
U1 = "GPU-11111111-1111-1111-1111-111111111111"
INV = NodeInventory(NODE, (Card("GPU-00000000-0000-0000-0000-000000000000", 0, "NVIDIA H200", 143771, 132, 0,
                                slicing=Slicing("q")),
                           Card(U1, 1, "NVIDIA H200", 143771, 132, 0,
                                slicing=Slicing("p", split_count=4, allocation="dra"), minor=1)))


def rclaim(name: str, uid: str, cores: str, priority: int | None = None) -> dict[str, Any]:
    res = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-1", "shareID": f"s-{uid}",
           "consumedCapacity": {"memory": "3000Mi", "cores": cores, "shares": "1"}}
    alloc: dict[str, Any] = {"devices": {"results": [res]}}
    if priority is not None:
        alloc["devices"]["config"] = [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "gpu.kvgpu.io/v1alpha1", "kind": "SliceConfig", "priority": priority}}}]
    return {"metadata": {"namespace": "team-a", "name": name, "uid": uid}, "status": {"allocation": alloc}}


def pod(name: str, uid: str, claim: str, *, template: bool = True, namespace: str = "team-a",
        phase: str = "Running") -> dict[str, Any]:
    ref = {"name": "gpu", "resourceClaimTemplateName": "t"} if template else {"name": "gpu", "resourceClaimName": claim}
    containers = [{"name": "main", "resources": {"claims": [{"name": "gpu"}]}}, {"name": "sidecar"}]
    st: dict[str, Any] = {"phase": phase}
    if template:
        st["resourceClaimStatuses"] = [{"name": "gpu", "resourceClaimName": claim}]
    return {"metadata": {"namespace": namespace, "name": name, "uid": uid},
            "spec": {"nodeName": NODE, "resourceClaims": [ref], "containers": containers,
                     "initContainers": [{"name": "warm", "resources": {"claims": [{"name": "gpu"}]}}]},
            "status": st}


def value(line: str) -> float:
    return float(line.split()[-1])


class Api:
    """The agent's API as far as these tests reach it: pod Events, recorded."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, str, str]] = []

    async def pod_event(self, namespace: str, pod: str, uid: str, reason: str, message: str,
                        type_: str = "Warning") -> None:
        self.events.append((namespace, pod, uid, reason, message))


def agent_with_dra(tmp: Path, claims: dict[str, dict[str, Any]]) -> tuple[Agent, Api]:
    sim = tmp / "sim.json"
    sim.write_text(json.dumps({"nodes": [{"name": NODE, "cards": [{"count": 2}]}]}))
    (tmp / "shim").mkdir()
    (tmp / "shim" / "libvgpu-1.so").write_text("elf")
    (tmp / "shim" / "libvgpu.so").symlink_to("libvgpu-1.so")
    api = Api()
    cfg = AgentConfig(node=NODE, simulated=str(sim), region_root=str(tmp / "regions"), sched_dir=str(tmp / "sched"))
    agent = Agent(cfg, api)  # type: ignore[arg-type]
    pcfg = PluginConfig(host_shim_dir=str(tmp / "shim"), device_specs=False, sched_dir=str(tmp / "sched"))
    dcfg = DraConfig(registry_dir=str(tmp / "reg"), plugin_dir=str(tmp / "plug"), cdi_dir=str(tmp / "cdi"),
                     state_dir=str(tmp / "state"))

    async def get_claim(ns: str, name: str) -> dict[str, Any]:
        return claims[name]

    agent.dra = DraPlugin(NODE, dcfg, pcfg, get_claim, lambda: INV)
    agent.registrar.last_raw = INV
    return agent, api


@pytest.fixture
def core() -> Any:
    from kvgpu import shimcore

    try:
        return shimcore.core()
    except Exception as e:  # no compiler / shim sources here
        pytest.skip(f"shim core unavailable: {e}")


def open_region(core: Any, region_dir: Path, used_mib: int = 0) -> Any:
    """The shim's region in ``region_dir`` for the claim string the plugin wrote next to it, this
    process joined (what the shim does in a container of the claim); returns the handle."""
    ffi, lib = core.ffi, core.lib
    text = (region_dir.parent / "claim").read_text()
    cfg = ffi.new("struct vgpu_config *")
    assert lib.vgpu_claim_parse(text.encode(), cfg) == 0
    h = ffi.new("struct vgpu_region_handle *")
    assert lib.vgpu_region_open(h, str(region_dir / "vgpu.region").encode(), cfg) == 0
    assert lib.vgpu_region_join(h, os.getpid(), lib.vgpu_proc_start_time(os.getpid())) >= 0
    if used_mib:
        assert lib.vgpu_region_reserve(h, 0, used_mib * MIB) == 0
    return h


def close_region(core: Any, h: Any) -> None:
    core.lib.vgpu_region_leave(h)
    core.lib.vgpu_region_close(h)


def stamp_heartbeat(region_file: Path) -> None:
    """What the shim's gate stamps on card 0 of the region while its kernels are gated."""
    fd = os.open(region_file, os.O_RDWR)
    try:
        with mmap.mmap(fd, shimregion.REGION_SIZE) as mm:
            r = shimregion.Region.from_buffer(mm)
            now = time.monotonic_ns()
            r.dev[0].sched_joined_ns = now
            r.dev[0].sched_heartbeat_ns = now
            del r
    finally:
        os.close(fd)


async def prepare(agent: Agent, *names_uids: tuple[str, str]) -> list[Path]:
    assert agent.dra is not None
    dirs = []
    for name, uid in names_uids:
        resp = await agent.dra.prepare("team-a", name, uid)
        assert not resp.error, resp.error
        dirs.append(agent.dra.files.dir(uid) / REGION_DIR)
    return dirs


async def test_two_dra_claims_on_one_card_get_disjoint_windows(tmp_path: Path, core: Any) -> None:
    claims = {"a": rclaim("a", "uid-a", "30"), "b": rclaim("b", "uid-b", "40", priority=0)}
    agent, _ = agent_with_dra(tmp_path, claims)
    ra, rb = await prepare(agent, ("a", "uid-a"), ("b", "uid-b"))
    ha, hb = open_region(core, ra), open_region(core, rb)
    try:
        sched = agent._make_scheduler()
        sched.tick()
        assert decode((tmp_path / "sched" / f"{U1}.sched").read_bytes()) == []  # nobody active yet
        stamp_heartbeat(ra / "vgpu.region")
        stamp_heartbeat(rb / "vgpu.region")
        sched.tick()
        ws = decode((tmp_path / "sched" / f"{U1}.sched").read_bytes())
    finally:
        close_region(core, ha)
        close_region(core, hb)
    # b is priority 0 (its SliceConfig), so it comes first; the windows follow each other
    assert [(w.key, w.offset_pm, w.len_pm) for w in ws] == [("team-a/b", 0, 400), ("team-a/a", 400, 300)]
    # the other card (not a DRA card, no tenants) gets an empty schedule
    assert decode((tmp_path / "sched" / f"{INV.cards[0].uuid}.sched").read_bytes()) == []


async def test_dra_claims_have_usage_series_labelled_with_claim_and_pod(tmp_path: Path, core: Any) -> None:
    agent, _ = agent_with_dra(tmp_path, {"a": rclaim("a", "uid-a", "30"), "b": rclaim("b", "uid-b", "40")})
    ra, _rb = await prepare(agent, ("a", "uid-a"), ("b", "uid-b"))
    agent.pods.set_pod(pod("trainer", "pod-1", "a"))
    h = open_region(core, ra, used_mib=1024)
    try:
        col = UsageCollector(NODE, agent._claimed_containers, lambda: INV, reader=default_reader(),
                             region_root=str(tmp_path / "regions"))
        text = generate_latest(make_registry(col)).decode()
    finally:
        close_region(core, h)
    used = [x for x in text.splitlines() if x.startswith("kvgpu_container_memory_used_bytes{")]
    mine = next(x for x in used if 'claim="team-a/a"' in x)
    assert 'pod="trainer"' in mine and 'container="warm,main"' in mine and 'namespace="team-a"' in mine
    assert value(mine) == 1024 * MIB
    # b is prepared but no pod consumes it yet: its limit shows, with no pod
    lim = next(x for x in text.splitlines() if x.startswith("kvgpu_container_memory_limit_bytes{")
               and 'claim="team-a/b"' in x)
    assert 'pod=""' in lim and value(lim) == 3000 * MIB
    hami = next(x for x in text.splitlines() if x.startswith("vGPU_device_memory_usage_in_bytes{")
                and 'podname="trainer"' in x)
    assert value(hami) == 1024 * MIB


async def test_a_dra_claims_oom_kill_is_an_event_on_its_pod(tmp_path: Path, core: Any) -> None:
    agent, api = agent_with_dra(tmp_path, {"a": rclaim("a", "uid-a", "30")})
    (ra,) = await prepare(agent, ("a", "uid-a"))
    agent.pods.set_pod(pod("trainer", "pod-1", "a"))
    h = open_region(core, ra, used_mib=100)
    try:
        rep = agent._make_oom_reporter()
        assert await rep.check() == []  # the first round takes the counts as seen
        core.lib.vgpu_region_oom_record(h.r, 0, 4242, 704 * MIB)
        found = await rep.check()
        await asyncio.sleep(0)
    finally:
        close_region(core, h)
    assert len(found) == 1 and rep.reported == 1
    ((ns, name, uid, reason, msg),) = api.events
    assert (ns, name, uid, reason) == ("team-a", "trainer", "pod-1", "GPUOOMKilled")
    assert msg.startswith("ResourceClaim team-a/a (container(s) warm,main): process 4242 ended")


def consumer(name: str, uid: str, cid: str) -> dict[str, Any]:
    """A pod using claim ``a`` by name, its ``main`` container created (runtime ID ``cid``)."""
    p = pod(name, uid, "a", template=False)
    p["status"]["containerStatuses"] = [{"name": "main", "containerID": f"containerd://{cid}"}]
    return p


async def test_a_dra_claims_containers_are_judged_by_the_backstop_on_the_claims_limit(tmp_path: Path,
                                                                                     core: Any) -> None:
    """Each container consuming a prepared claim is in the enforcement check with its own runtime
    ID: its process outside the shim is unenforced and killed, also when its PID is one attached
    in another pod's PID namespace (the region records each slot's namespace and start time);
    the claim's memory
    is judged over every consumer, 1800 + 1500 MiB in two pods against the claim's 3000 MiB,
    though each pod alone is under it."""
    from kvgpu.agent.enforcement import Attribution, EnforcementMonitor, GpuProcess, proc_start_time

    agent, api = agent_with_dra(tmp_path, {"a": rclaim("a", "uid-a", "30")})
    (ra,) = await prepare(agent, ("a", "uid-a"))
    c1, c2 = "ab" * 32, "cd" * 32
    agent.pods.set_pod(consumer("trainer", "pod-1", c1))
    agent.pods.set_pod(consumer("server", "pod-2", c2))
    me = os.getpid()  # the process that joined the claim's region, as the shim would in main
    st = os.stat("/proc/self/ns/pid")
    ns, other_ns = (st.st_dev, st.st_ino), (st.st_dev, st.st_ino + 1)
    start = proc_start_time(me)
    assert start is not None
    attrs = {101: Attribution("pod-1", c1, me, ns, start), 102: Attribution("pod-2", c2, me, ns, start),
             103: Attribution("pod-1", c1, 4321, ns, start),  # PID 4321 of trainer/main: not in the region
             # server's own PID `me`, not the attached one: another namespace, or (an agent without
             # ptrace access, the namespace unknown) another start time
             104: Attribution("pod-2", c2, me, other_ns, start), 105: Attribution("pod-2", c2, me, (0, 0), start + 1)}
    nvml = [GpuProcess(U1, 101, 1800 * MIB), GpuProcess(U1, 102, 1500 * MIB), GpuProcess(U1, 103, 10 * MIB),
            GpuProcess(U1, 104, 10 * MIB), GpuProcess(U1, 105, 10 * MIB)]
    signalled: list[int] = []
    end = agent._make_escapes()
    assert end is not None and agent.backstop is not None
    agent.backstop.grace_s = 0.0
    agent.backstop.attribute_fn = attrs.__getitem__
    agent.backstop.start_time = lambda pid: 1000 + pid
    agent.backstop.killer = lambda pid, start: signalled.append(pid) is None
    h = open_region(core, ra)
    try:
        mon = EnforcementMonitor(processes=lambda: nvml, containers=agent._enforced_containers,
                                 read_region=agent._read_region, read_dir=agent._read_dir,
                                 attribute_fn=attrs.__getitem__, start_time_fn=lambda pid: 1000 + pid,
                                 end_escapes=end, on_killed=agent._killed_event)
        views = await mon.check()
    finally:
        close_region(core, h)
    assert {v.process.host_pid: (v.state, v.container.pod if v.container else None) for v in views} == {
        101: ("enforced", "trainer"), 102: ("enforced", "server"), 103: ("unenforced", "trainer"),
        104: ("unenforced", "server"), 105: ("unenforced", "server")}  # the same PID, another process
    assert signalled == [103, 104, 105, 101]  # the escaped processes, then the claim's largest
    assert [(e[1], e[3]) for e in api.events] == [("trainer", "GPUUnenforcedKilled"), ("server", "GPUUnenforcedKilled"),
                                                  ("server", "GPUUnenforcedKilled"), ("trainer", "GPUOverLimitKilled")]
    assert "held 3300 MiB of card" in api.events[3][4]
    # the claim's series per consuming pod add up its containers' figures
    col = UsageCollector(NODE, agent._claimed_containers, lambda: INV, reader=default_reader(),
                         region_root=str(tmp_path / "regions"), processes=lambda: views,
                         backstop=agent.backstop.counts)
    lines = generate_latest(make_registry(col)).decode().splitlines()

    def series(name: str, pod: str) -> float:
        return value(next(x for x in lines if x.startswith(name + "{") and f'pod="{pod}"' in x))

    assert series("kvgpu_container_nvml_memory_bytes", "trainer") == 1810 * MIB
    assert series("kvgpu_container_unenforced_processes", "server") == 2
    assert series("kvgpu_container_unenforced_kills_total", "trainer") == 1
    assert series("kvgpu_container_over_limit_kills_total", "trainer") == 1


def test_a_container_with_two_claims_is_judged_on_each_card_by_its_claim() -> None:
    """A container consuming two claims (two cards, two regions) has an entry per claim: each
    process is judged by the claim naming its card, not flagged for a card "its claim" lacks."""
    from kvgpu.agent.draregions import DraTenant, enforced_containers
    from kvgpu.agent.enforcement import Attribution, GpuProcess, classify
    from kvgpu.agent.usage import DeviceUsage, limit_holder

    u0 = INV.cards[0].uuid
    ta = DraTenant("uid-a", claimstr.decode(f"v1;claim=team-a/a;priority=1;dev={U1},3000,30"), Path("/c/a/region"))
    tb = DraTenant("uid-b", claimstr.decode(f"v1;claim=team-a/b;priority=1;dev={u0},2000,20"), Path("/c/b/region"))
    p = consumer("trainer", "pod-1", "ab" * 32)
    p["spec"]["resourceClaims"].append({"name": "gpu2", "resourceClaimName": "b"})
    p["spec"]["containers"][0]["resources"]["claims"].append({"name": "gpu2"})
    cs = [c for c in enforced_containers([ta, tb], [p]) if c.container == "main"]
    assert [c.claim for c in cs] == ["team-a/a", "team-a/b"]
    regions = {limit_holder(cs[0]): [DeviceUsage(U1, 3000, 1.0, (7,))],
               limit_holder(cs[1]): [DeviceUsage(u0, 2000, 1.0, (7,))]}
    views = classify([GpuProcess(U1, 11, MIB), GpuProcess(u0, 12, MIB)], cs, regions,
                     lambda pid: Attribution("pod-1", "ab" * 32, 7))
    assert [(v.state, v.container.claim if v.container else None) for v in views] == [
        ("enforced", "team-a/a"), ("enforced", "team-a/b")]


def test_sm_use_of_a_claims_containers_is_summed_for_the_claim() -> None:
    """The cores rule judges a claim on the SM use of all its consumers: 20 + 25 % in two pods
    is 45 % of the claim (one entry), a device plugin container stays its own."""
    from kvgpu.agent.draregions import DraTenant, enforced_containers
    from kvgpu.agent.enforcement import _by_container
    from kvgpu.agent.usage import BoundContainer, BoundDevice

    t = DraTenant("uid-a", claimstr.decode(f"v1;claim=team-a/a;priority=1;dev={U1},3000,30"),
                  Path("/claims/uid-a/region"))
    cs = enforced_containers([t], [consumer("trainer", "pod-1", "ab" * 32), consumer("server", "pod-2", "cd" * 32)])
    assert [(c.pod, c.container, c.container_id[:2], c.region_dir) for c in cs] == [
        ("trainer", "warm", "", "/claims/uid-a/region"), ("trainer", "main", "ab", "/claims/uid-a/region"),
        ("server", "warm", "", "/claims/uid-a/region"), ("server", "main", "cd", "/claims/uid-a/region")]
    own = BoundContainer("team-a", "nb", "pod-3", "main", "team-a/nb-main", 1, (BoundDevice(U1, 1000, 30),),
                         True, "ef" * 32)
    means = {(U1, "pod-1", "ab" * 32): 20.0, (U1, "pod-2", "cd" * 32): 25.0, (U1, "pod-3", "ef" * 32): 10.0}
    out = {k: round(v, 1) for k, (_, v) in _by_container(means, [*cs, own]).items()}
    assert out == {("", "/claims/uid-a/region", U1): 45.0, ("pod-3", "main", U1): 10.0}


def test_consuming_containers_by_template_name_namespace_and_phase() -> None:
    assert consuming_containers(pod("p", "u", "a"), "team-a", "a") == ["warm", "main"]
    assert consuming_containers(pod("p", "u", "a", template=False), "team-a", "a") == ["warm", "main"]
    assert consuming_containers(pod("p", "u", "a"), "team-a", "other") == []
    assert consuming_containers(pod("p", "u", "a", namespace="team-b"), "team-a", "a") == []
    assert consuming_containers(pod("p", "u", "a", phase="Succeeded"), "team-a", "a") == []


async def test_tenants_skip_mig_claims_and_broken_checkpoints(tmp_path: Path) -> None:
    agent, _ = agent_with_dra(tmp_path, {"a": rclaim("a", "uid-a", "30"), "b": rclaim("b", "uid-b", "40")})
    await prepare(agent, ("a", "uid-a"), ("b", "uid-b"))
    assert agent.dra is not None
    files = agent.dra.files
    ts = prepared_tenants(files)
    assert [(t.uid, t.claim.claim, t.namespace, t.name) for t in ts] == [
        ("uid-a", "team-a/a", "team-a", "a"), ("uid-b", "team-a/b", "team-a", "b")]
    assert ts[0].claim.devices == (claimstr.ClaimDevice(U1, 3000, 30),)
    # the checkpoint is the trusted copy: a broken one drops the claim, and nothing else
    (files.dir("uid-b") / CHECKPOINT).write_text("{not json")
    assert [t.uid for t in prepared_tenants(files)] == ["uid-a"]
    # a MIG claim's checkpoint has no claim string: no region, no tenant
    ck = json.loads((files.dir("uid-a") / CHECKPOINT).read_text())
    (files.dir("uid-a") / CHECKPOINT).write_text(json.dumps(ck | {"claim": "", "mig": True}))
    assert prepared_tenants(files) == []
    # two pods sharing one claim: one entry each, both on the claim's one region
    entries = bound_containers(ts[:1], [pod("p1", "u1", "a"), pod("p2", "u2", "a", template=False)])
    assert [(e.pod, e.container, e.region_dir) for e in entries] == [
        ("p1", "warm,main", str(ts[0].region_dir)), ("p2", "warm,main", str(ts[0].region_dir))]


async def test_a_later_consumer_of_a_shared_claim_is_told_only_of_later_kills(tmp_path: Path, core: Any) -> None:
    agent, api = agent_with_dra(tmp_path, {"a": rclaim("a", "uid-a", "30")})
    (ra,) = await prepare(agent, ("a", "uid-a"))
    agent.pods.set_pod(pod("p1", "pod-1", "a", template=False))
    h = open_region(core, ra, used_mib=100)
    try:
        rep = agent._make_oom_reporter()
        await rep.check()
        core.lib.vgpu_region_oom_record(h.r, 0, 11, 10 * MIB)
        await rep.check()
        agent.pods.set_pod(pod("p2", "pod-2", "a", template=False))  # shares the claim from now on
        assert await rep.check() == []
        core.lib.vgpu_region_oom_record(h.r, 0, 12, 10 * MIB)
        await rep.check()
    finally:
        close_region(core, h)
    assert [(e[1], e[4].split(": ", 1)[1].split(" ended")[0]) for e in api.events] == [
        ("p1", "process 11"), ("p1", "process 12"), ("p2", "process 12")]
