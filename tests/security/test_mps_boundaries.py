"""The MPS backend's boundaries that hold, tried from a client container on a real kubelet.

Two cards of the simulated node form an ``mode: mps`` pool; their control daemons are the unit
tests' fake ``nvidia-cuda-mps-control`` (a unix socket named ``control`` in each card's pipe
folder), run by the session's host agent, which owns the daemons itself (``--mps-daemons=agent``)
and writes ``wanted.json`` and ``status.json``. From inside a sliced pod on one card a tenant:

- cannot create, remove or rename anything in its pipe folder (``/var/run/kvgpu-mps``, mounted
  read-only), and sees there only the daemon's socket: not the owner's ``wanted.json`` or
  ``status.json``, not the MPS root;
- sees no other card's pipe folder: its one MPS mount is its own card's;
- that sets ``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` itself (in the pod spec, and again in its process) runs
  with its claim's values once CUDA starts (the shim sets them from the claim file);
- gets no container at all on a card whose daemon does not answer (``Allocate`` refuses: CUDA
  would otherwise run outside MPS, with no SM limit).

Not here: what a client can send the daemon through the socket it must reach (``quit``...):
that hole is documented (docs/agent.md, "What an MPS client can do to the daemon").
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvgpu.agent import mps
from kvgpu.api.request_keys import HAMI_USE_UUID
from kvgpu.core import keys
from kvgpu.core.inventory import NodeInventory
from kvgpu.devcluster.realnode import RealNode
from realnode.conftest import RealPods
from realnode.gpupods import claim_of, container, exec_in, gpu_pod, hami_limits, uuids_of, wait_for

from tests.shim.test_mps import PROBE  # the client's MPS variables after cuInit

pytestmark = pytest.mark.realnode

MPS_CARDS = (2, 3)  # the indexes of the node's cards in the test's mps pool
ROOT = Path(keys.HOST_MPS_ROOT)
PIPE = keys.CONTAINER_MPS_DIR
FORGED = {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/mine", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
          "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=100G"}


@pytest.fixture(scope="module")
def mps_cards(real_node: RealNode) -> Iterator[dict[int, str]]:
    """A VGPUPool with ``mode: mps`` over two of the node's cards, the fake control program in the
    node's driver folder (where the host agent looks for it); index -> UUID once both daemons
    answer and the agent's status says so."""
    from unit.test_agent_mps import FAKE

    bin_dir = real_node.driver_root / "bin"
    made_bin = not bin_dir.exists()
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / mps.CONTROL
    fake.write_text(FAKE.replace("#!PYTHON", f"#!{sys.executable}"))
    fake.chmod(0o755)
    pool = f"{real_node.pool_name}-mps-sec"
    labels = {"kvgpu.io/gpu-node": "true", "kubernetes.io/hostname": real_node.name}
    real_node.cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": pool},
        "spec": {"nodeSelector": {"matchLabels": labels}, "devices": {"indexes": list(MPS_CARDS)},
                 "splitCount": 4, "mode": "mps"}}))
    uuids: dict[int, str] = {}
    try:
        def cards() -> dict[int, str] | None:
            ann = ((real_node.node() or {}).get("metadata", {}).get("annotations") or {}).get(keys.NODE_INVENTORY)
            inv = NodeInventory.loads(ann) if ann else None
            got = {c.index: c.uuid for c in (inv.cards if inv else ()) if c.index in MPS_CARDS and c.slicing
                   and c.slicing.mode == "mps"}
            return got if len(got) == len(MPS_CARDS) else None

        uuids = wait_for(cards, 60, f"cards {MPS_CARDS} in the mps pool")
        wait_for(lambda: all(mps.check_ready(ROOT, u) is None for u in uuids.values()), 60,
                 "both cards' daemons answering in the agent's fresh status")
        yield uuids
    finally:
        real_node.cluster.kubectl("delete", "vgpupool", pool, "--ignore-not-found")
        wait_for(lambda: not any(mps.check_ready(ROOT, u) is None for u in uuids.values()), 60,
                 "the daemons quit once the cards left the pool")
        fake.unlink()
        if made_bin:
            bin_dir.rmdir()


def _client(rp: RealPods, name: str, uuid: str, env: dict[str, str] | None = None) -> dict:
    ctr = container("main", hami_limits(1, 1000, 30))
    if env:
        ctr["env"] = [{"name": k, "value": v} for k, v in env.items()]
    rp.apply(gpu_pod(rp, name, containers=[ctr], annotations={HAMI_USE_UUID: uuid}))
    pod = rp.wait_running(name, timeout=120)
    assert uuids_of(pod, "main") == [uuid] and claim_of(pod, "main").endswith(";mode=mps"), pod["metadata"]
    return pod


def _mps_mounts(rp: RealPods, pod: str) -> list[list[str]]:
    """The container's mountinfo lines (split) whose mount point is the MPS pipe folder."""
    out = exec_in(rp, pod, "main", "cat /proc/self/mountinfo")
    return [ln.split() for ln in out.splitlines() if ln.split()[4] == PIPE]


def test_a_client_cannot_write_its_pipe_folder_nor_reach_the_owners_files(
        real_pods: RealPods, mps_cards: dict[int, str]) -> None:
    uuid = mps_cards[MPS_CARDS[0]]
    _client(real_pods, "mps-ro", uuid)
    wanted = (ROOT / mps.WANTED_FILE).read_bytes()
    # the folder holds the daemon's socket and nothing of the owner's
    assert exec_in(real_pods, "mps-ro", "main", f"ls -A {PIPE}").split() == ["control"]
    for attempt in (f"touch {PIPE}/x", f"mkdir {PIPE}/d", f"rm -f {PIPE}/control", f"mv {PIPE}/control {PIPE}/c2",
                    f"ln -s /tmp {PIPE}/l", f"echo x > {PIPE}/control"):
        out = exec_in(real_pods, "mps-ro", "main", f"{attempt} 2>&1; echo rc=$?", check=False)
        assert "rc=0" not in out, (attempt, out)
    assert exec_in(real_pods, "mps-ro", "main", f"ls -A {PIPE}").split() == ["control"]
    [mount] = _mps_mounts(real_pods, "mps-ro")
    assert "ro" in mount[5].split(","), mount  # per-mount options
    assert mount[3].endswith(f"/{uuid}/pipe"), mount  # the mount's root: this card's pipe folder only
    found = exec_in(real_pods, "mps-ro", "main",
                    f"ls -A {PIPE}/.. /var/run 2>/dev/null; cat /var/run/kvgpu/mps/{mps.STATUS_FILE} 2>&1", check=False)
    assert mps.STATUS_FILE not in found.split() and mps.WANTED_FILE not in found.split(), found
    assert (ROOT / mps.WANTED_FILE).read_bytes() == wanted
    assert mps.check_ready(ROOT, uuid) is None  # the daemon and the owner's status are untouched


def test_a_client_sees_only_its_own_cards_pipe(real_pods: RealPods, mps_cards: dict[int, str]) -> None:
    mine, other = mps_cards[MPS_CARDS[0]], mps_cards[MPS_CARDS[1]]
    _client(real_pods, "mps-one", mine)
    info = exec_in(real_pods, "mps-one", "main", "cat /proc/self/mountinfo")
    assert other not in info, info
    assert [m[3].rsplit("/", 2)[-2] for m in _mps_mounts(real_pods, "mps-one")] == [mine]
    # the other card's daemon socket is nowhere to connect to: the pipe folder is this card's
    assert exec_in(real_pods, "mps-one", "main", f"ls -A {PIPE}").split() == ["control"]
    assert (mps.pipe_dir(ROOT, other) / "control").exists()  # while that daemon does run


def test_a_tenant_that_sets_the_mps_env_runs_with_its_claims(real_pods: RealPods, mps_cards: dict[int, str]) -> None:
    _client(real_pods, "mps-env", mps_cards[MPS_CARDS[0]], env=FORGED)
    # the tenant's own folder with a socket-named file, to be taken for a daemon
    exec_in(real_pods, "mps-env", "main", "mkdir -p /tmp/mine && touch /tmp/mine/control")
    started = exec_in(real_pods, "mps-env", "main", "env | grep CUDA_MPS_ | sort")
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100" in started, started  # the pod's env reached the process
    forged = " ".join(f"{k}={v}" for k, v in FORGED.items())
    for prefix in ("", forged + " "):
        out = exec_in(real_pods, "mps-env", "main", f"{prefix}python3 -c '{PROBE}'")
        assert json.loads(out.strip().splitlines()[-1]) == {
            "rc": 0, "CUDA_MPS_PIPE_DIRECTORY": PIPE, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1000M"}, (prefix, out)


def test_no_client_container_on_a_card_whose_daemon_does_not_answer(
        real_node: RealNode, real_pods: RealPods, mps_cards: dict[int, str]) -> None:
    uuid = mps_cards[MPS_CARDS[1]]
    fake = real_node.driver_root / "bin" / mps.CONTROL
    text = fake.read_text()
    fake.unlink()  # the owner cannot start it again
    try:
        with socket.socket(socket.AF_UNIX) as s:  # the daemon ends (as the host's admin would end it)
            s.connect(str(mps.pipe_dir(ROOT, uuid) / "control"))
            s.sendall(b"quit")
            s.recv(10)
        wait_for(lambda: mps.check_ready(ROOT, uuid) is not None, 60, "the owner's status: the daemon is down")
        ctr = container("main", hami_limits(1, 1000, 30))
        real_pods.apply(gpu_pod(real_pods, "mps-down", containers=[ctr], annotations={HAMI_USE_UUID: uuid}))
        pod = wait_for(lambda: (p := real_pods.get("mps-down"))["status"].get("phase") == "Failed" and p, 120,
                       "the pod refused at admission")
        assert pod["status"].get("reason") == "UnexpectedAdmissionError", pod["status"]
        assert "MPS" in pod["status"].get("message", ""), pod["status"]
        assert not pod["status"].get("containerStatuses", [{}])[0].get("containerID"), pod["status"]
    finally:
        fake.write_text(text)
        fake.chmod(0o755)
    wait_for(lambda: mps.check_ready(ROOT, uuid) is None, 60, "the daemon started again by the owner")
