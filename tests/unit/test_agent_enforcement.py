"""NVML processes reconciled with claims and regions: enforced / unenforced / foreign."""

from __future__ import annotations

from types import SimpleNamespace

from kvgpu.agent.enforcement import (
    Attribution,
    EnforcementMonitor,
    GpuProcess,
    attribute,
    classify,
    nvml_processes,
    proc_start_time,
)
from kvgpu.agent.exporter import BoundContainer, BoundDevice, DeviceUsage, UsageCollector, make_registry
from kvgpu.core.inventory import Card, NodeInventory
from prometheus_client import generate_latest

U0, U1 = "GPU-a", "GPU-b"
POD = "0a1b2c3d-1111-2222-3333-444455556666"
CID = "ab" * 32
MAIN = BoundContainer("team", "nb", POD, "main", "team/nb-main", 1, (BoundDevice(U0, 3000, 30),), True, CID)


def write_proc(root, pid, cgroup, nspid):
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(cgroup)
    (d / "status").write_text(f"Name:\tpython\nNSpid:\t{pid}\t{nspid}\n")


def test_attribute_cgroup_layouts(tmp_path):
    systemd = (
        "0::/kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n"
    )
    write_proc(tmp_path, 100, systemd, 7)
    assert attribute(100, str(tmp_path)) == Attribution(POD, CID, 7)
    cgroupfs = f"12:memory:/kubepods/besteffort/pod{POD}/{CID}\n11:cpu:/kubepods/besteffort/pod{POD}/{CID}\n"
    write_proc(tmp_path, 101, cgroupfs, 9)
    assert attribute(101, str(tmp_path)) == Attribution(POD, CID, 9)
    write_proc(tmp_path, 102, "0::/system.slice/sshd.service\n", 102)
    assert attribute(102, str(tmp_path)) == Attribution("", "", 102)
    assert attribute(999, str(tmp_path)) == Attribution()


def test_attribute_reads_names_that_are_not_utf8_and_cgroups_made_below_the_container(tmp_path):
    """A hostile tenant names its process (comm) and, where cgroupfs is writable, a child cgroup
    with bytes that are not UTF-8, or a child cgroup named like a sibling container."""
    other = "cd" * 32
    base = f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD.replace('-', '_')}.slice"
    d = tmp_path / "100"
    d.mkdir()
    (d / "cgroup").write_bytes(f"{base}/cri-containerd-{CID}.scope/".encode() + b"\xff\xfe\n")
    (d / "status").write_bytes(b"Name:\t\xff\xfe\nState:\tR (running)\nNSpid:\t100\t8\n")
    (d / "stat").write_bytes(b"100 (\xff) ) R " + b" ".join(b"0" for _ in range(18)) + b" 4242 0\n")
    assert attribute(100, str(tmp_path)) == Attribution(POD, CID, 8, start_time=4242)
    assert proc_start_time(100, str(tmp_path)) == 4242
    write_proc(tmp_path, 101, f"{base}/cri-containerd-{CID}.scope/cri-containerd-{other}.scope\n", 9)
    assert attribute(101, str(tmp_path)) == Attribution(POD, CID, 9)  # the runtime's cgroup, not the child


def test_classify():
    attrs = {
        1: Attribution(POD, CID, 7),  # attached to the region
        2: Attribution(POD, CID, 8),  # same container, not attached
        3: Attribution("other-pod", "c" * 64, 1),  # pod without slices
        4: Attribution("", "", 4),  # host process
    }
    procs = [
        GpuProcess(U0, 1, 100),
        GpuProcess(U0, 2, 200),
        GpuProcess(U0, 3, 300),
        GpuProcess(U0, 4, 400),
        GpuProcess(U1, 1, 50),  # a card the claim does not name
    ]
    regions = {(POD, "main"): [DeviceUsage(U0, 3000, 0.1, (7,))]}
    views = classify(procs, [MAIN], regions, attrs.__getitem__)
    states = [(v.process.host_pid, v.process.uuid, v.state) for v in views]
    assert states == [
        (1, U0, "enforced"),
        (2, U0, "unenforced"),
        (3, U0, "foreign"),
        (4, U0, "foreign"),
        (1, U1, "unenforced"),
    ]
    assert "not attached" in views[1].reason and "does not name" in views[4].reason
    # No region at all: the shim is not loaded.
    (v,) = classify([GpuProcess(U0, 1, 1)], [MAIN], {(POD, "main"): None}, attrs.__getitem__)
    assert v.state == "unenforced" and "not loaded" in v.reason
    # A region without PID lists cannot accuse anyone.
    (v,) = classify(
        [GpuProcess(U0, 2, 1)], [MAIN], {(POD, "main"): [DeviceUsage(U0, 3000, 0)]}, attrs.__getitem__
    )
    assert v.state == "enforced"


def test_nvml_processes():
    class Nv:
        def nvmlDeviceGetHandleByUUID(self, u):
            if u == "GPU-lost":
                raise RuntimeError("GPU is lost")
            return u

        def nvmlDeviceGetComputeRunningProcesses(self, h):
            return [
                SimpleNamespace(pid=10, usedGpuMemory=1 << 20),
                SimpleNamespace(pid=11, usedGpuMemory=None),
            ]

        def nvmlDeviceGetGraphicsRunningProcesses(self, h):
            # a Vulkan tenant, and process 10 listed again for its graphics context
            return [SimpleNamespace(pid=12, usedGpuMemory=3 << 30), SimpleNamespace(pid=10, usedGpuMemory=1 << 20)]

    got = nvml_processes(Nv(), [U0, "GPU-lost"])
    assert got == [GpuProcess(U0, 10, 1 << 20), GpuProcess(U0, 11, 0), GpuProcess(U0, 12, 3 << 30, compute=False)]

    class NoGraphics(Nv):
        def nvmlDeviceGetGraphicsRunningProcesses(self, h):
            raise RuntimeError("Not Supported")

    assert nvml_processes(NoGraphics(), [U0]) == [GpuProcess(U0, 10, 1 << 20), GpuProcess(U0, 11, 0)]


async def test_monitor_events_once_and_metrics():
    events = []

    async def on_unenforced(c, msg):
        events.append((c.pod, c.container, msg))

    mon = EnforcementMonitor(
        processes=lambda: [GpuProcess(U0, 2, 5 << 20), GpuProcess(U0, 3, 7 << 20)],
        containers=lambda: [MAIN],
        read_region=lambda uid, name: [DeviceUsage(U0, 3000, 1.0, (7,))],
        on_unenforced=on_unenforced,
        attribute_fn={2: Attribution(POD, CID, 8), 3: Attribution("x", "", 1)}.__getitem__,
    )
    await mon.check()
    await mon.check()
    assert len(events) == 1 and events[0][:2] == ("nb", "main") and "card GPU-a" in events[0][2]

    inv = NodeInventory("n", (Card(U0, 0, "NVIDIA H200", 143771, 132),), "nvml")
    col = UsageCollector(
        "n",
        lambda: [MAIN],
        lambda: inv,
        reader=lambda p: [DeviceUsage(U0, 3000, 1.0, (7,))],
        processes=lambda: mon.snapshot,
    )
    text = generate_latest(make_registry(col)).decode()
    assert 'kvgpu_container_unenforced_processes{claim="team/nb-main"' in text
    line = next(x for x in text.splitlines() if x.startswith("kvgpu_container_unenforced_processes{"))
    assert line.endswith(" 1.0")
    line = next(x for x in text.splitlines() if x.startswith("kvgpu_container_nvml_memory_bytes{"))
    assert float(line.split()[-1]) == 5 << 20
    line = next(x for x in text.splitlines() if x.startswith("kvgpu_card_foreign_memory_bytes{"))
    assert float(line.split()[-1]) == 7 << 20


def test_host_pid_from_region_and_shimcore_shapes():
    from kvgpu import shimcore
    from kvgpu.agent.exporter import adapt_region

    ru = shimcore.RegionUsage(
        path="x",
        claim="team/nb-main",
        priority=0,
        generation=1,
        devices=(
            shimcore.DeviceUsage(0, U0, 3000.0, 12.5, 30, (shimcore.ProcessUsage(7, 4242, 10.0, 2.5),)),
        ),
    )
    (row,) = adapt_region(ru)
    assert (row.uuid, row.limit_mib, row.used_mib, row.pids, row.host_pids) == (U0, 3000, 12.5, (7,), (4242,))
    # The agent-known host PID proves attachment even when the namespace PID is unknown.
    (v,) = classify(
        [GpuProcess(U0, 4242, 1)], [MAIN], {(POD, "main"): [row]}, lambda pid: Attribution(POD, CID, 0)
    )
    assert v.state == "enforced"


def test_a_slot_is_its_process_by_namespace_and_in_a_shared_region_by_start_time() -> None:
    """PID 7 is attached (slot: start time 500, namespace (3, 40)). Another namespace's PID 7 is
    not that process. A start time that differs is another process only in a region several pods
    write (a DRA claim's): in a container's own region it is what an honest process of a nested
    PID namespace without its own /proc records, so it is not held against it."""
    rows = [DeviceUsage(U0, 3000, 1.0, (7,), (), ((7, 500, (3, 40), 0),))]
    shared = BoundContainer("team", "nb", POD, "main", "team/c", 1, (BoundDevice(U0, 3000, 30),), True, CID,
                            region_dir="/claims/u/region")

    def state(a: Attribution, c: BoundContainer = MAIN) -> str:
        key = ("", c.region_dir) if c.region_dir else (POD, "main")
        return classify([GpuProcess(U0, 9, 1)], [c], {key: rows}, lambda pid: a)[0].state

    assert state(Attribution(POD, CID, 7, (3, 40), 500)) == "enforced"
    assert state(Attribution(POD, CID, 7, (3, 41), 500)) == "unenforced"  # another namespace's PID 7
    assert state(Attribution(POD, CID, 7, (0, 0), 501)) == "enforced"  # own region: start time not asked
    assert state(Attribution(POD, CID, 7, (0, 0), 501), shared) == "unenforced"
    assert state(Attribution(POD, CID, 7, (0, 0), 500), shared) == "enforced"
    assert state(Attribution(POD, CID, 7, (0, 0), 0), shared) == "enforced"  # unknown: the PID decides


def test_a_host_pid_left_in_a_slot_vouches_only_for_the_process_that_started_then() -> None:
    """A slot keeps host PID 9 of a process killed before its slot was freed; host PID 9 now
    belongs to a newcomer of the container that never loaded the shim (another start time, a
    PID the region does not list): unenforced. The process the slot was written for is enforced."""
    rows = [DeviceUsage(U0, 3000, 1.0, (7,), (9,), ((7, 500, (0, 0), 9),))]

    def state(a: Attribution) -> str:
        return classify([GpuProcess(U0, 9, 1)], [MAIN], {(POD, "main"): rows}, lambda pid: a)[0].state

    assert state(Attribution(POD, CID, 7, (0, 0), 500)) == "enforced"
    assert state(Attribution(POD, CID, 12, (0, 0), 900)) == "unenforced"
