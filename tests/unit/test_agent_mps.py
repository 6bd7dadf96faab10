"""The MPS daemons and their owner against a fake ``nvidia-cuda-mps-control`` on ``PATH``: a
Python script that, with ``-d``, forks a daemon serving a unix socket ``control`` in
``$CUDA_MPS_PIPE_DIRECTORY`` (answers ``get_server_list``, ends on ``quit``), and without
arguments sends its stdin to that socket like the real control client (exit 1: no daemon)."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from kvgpu.agent import mps
from kvgpu.agent.mps import MpsDaemons, MpsOwner, pipe_dir
from kvgpu.core.inventory import Card, Slicing

FAKE = r'''#!PYTHON
import os, socket, sys
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
path = os.path.join(pipe, "control")
if sys.argv[1:] == ["-d"]:
    if os.fork():
        sys.exit(0)
    os.setsid()
    if os.fork():
        os._exit(0)
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.listen()
    with open(os.path.join(os.environ["CUDA_MPS_LOG_DIRECTORY"], "control.log"), "a") as log:
        log.write(f"{os.getpid()} {os.environ['CUDA_VISIBLE_DEVICES']}\n")
    while True:
        c, _ = s.accept()
        try:  # a client that gave up (timed out) is gone: the daemon goes on, as the real one does
            cmd = c.recv(100).decode().strip()
            c.sendall(b"" if cmd == "get_server_list" else b"ok")
        except OSError:
            cmd = ""
        c.close()
        if cmd == "quit":
            os.unlink(path)
            os._exit(0)
try:
    c = socket.socket(socket.AF_UNIX)
    c.connect(path)
except OSError:
    print("Cannot find MPS control daemon process", file=sys.stderr)
    sys.exit(1)
c.sendall(sys.stdin.read().encode())
print(c.recv(100).decode())
'''

A, B = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"
MPS = Slicing("inf", mode="mps")


@pytest.fixture
def fake(monkeypatch):
    d = Path(tempfile.mkdtemp(prefix="kmps", dir="/tmp"))  # unix socket paths must stay short
    prog = d / "bin" / "nvidia-cuda-mps-control"
    prog.parent.mkdir()
    prog.write_text(FAKE.replace("PYTHON", sys.executable))
    prog.chmod(prog.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{prog.parent}{os.pathsep}{os.environ['PATH']}")
    yield d / "mps"
    for log in (d / "mps").glob("*/log/control.log"):  # never leave a daemon behind
        for line in log.read_text().split("\n"):
            if line:
                try:
                    os.kill(int(line.split()[0]), signal.SIGKILL)
                except ProcessLookupError:
                    pass
    shutil.rmtree(d, ignore_errors=True)


def cards(*modes: Slicing | None) -> list[Card]:
    return [Card(u, i, "NVIDIA H200", 143771, 132, slicing=m)
            for i, (u, m) in enumerate(zip((A, B), modes, strict=False))]


def pid_of(root: Path, uuid: str) -> int:
    return int((root / uuid / "log" / "control.log").read_text().split()[-2])


def test_starts_one_daemon_per_mps_card_and_reuses_it_after_an_agent_restart(fake):
    d = MpsDaemons(str(fake))
    p = d.sync(cards(MPS, Slicing("p")))
    assert p.start == (A,) and d.alive(A) and not d.alive(B)
    assert (fake / A / "log" / "control.log").read_text().split()[1] == A  # CUDA_VISIBLE_DEVICES
    first = pid_of(fake, A)
    restarted = MpsDaemons(str(fake))  # a new agent process: finds the daemon through its pipe
    p = restarted.sync(cards(MPS, Slicing("p")))
    assert p.keep == (A,) and p.start == () and restarted.started == {}
    assert pid_of(fake, A) == first


def test_a_dead_daemon_is_started_again(fake):
    d = MpsDaemons(str(fake))
    d.sync(cards(MPS))
    os.kill(pid_of(fake, A), signal.SIGKILL)
    time.sleep(0.1)
    assert not d.alive(A)  # its socket is left behind, nobody answers
    p = d.sync(cards(MPS))
    assert p.start == (A,) and d.alive(A) and d.started[A] == 2


def test_a_card_that_leaves_the_mps_pool_gets_quit(fake):
    d = MpsDaemons(str(fake))
    d.sync(cards(MPS, MPS))
    assert d.alive(A) and d.alive(B)
    p = d.sync(cards(MPS, Slicing("p")))
    assert p.stop == (B,) and d.stopped == [B]
    assert not (pipe_dir(fake, B) / "control").exists() and d.alive(A)
    d.stop_all()
    assert not d.alive(A)


def test_no_mps_card_runs_nothing(fake, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # the control program is never needed
    assert MpsDaemons(str(fake)).sync(cards(Slicing("p"), None)) == MpsDaemons(str(fake)).sync([])


# ----------------------------------------------------------------- the owner (kvgpu mps-daemons)


def status_of(root: Path) -> mps.Status:
    st = mps.read_status(root)
    assert st is not None
    return st


def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_owner_follows_the_agents_wanted_file_and_reports_for_allocate(fake):
    owner = MpsOwner(MpsDaemons(str(fake)), interval_s=5.0)
    assert mps.write_wanted(fake, [A]) and not mps.write_wanted(fake, [A])  # written only on change
    assert owner.round().start == (A,)
    assert status_of(fake).alive == {A: True} and mps.check_ready(fake, A) is None
    assert mps.check_ready(fake, B) == "its MPS control daemon is not running"
    mps.write_wanted(fake, [B])  # A left the mps pool, B joined
    p = owner.round()
    assert (p.start, p.stop) == ((B,), (A,))
    assert status_of(fake).alive == {A: False, B: True}
    assert mps.check_ready(fake, A) is not None and mps.check_ready(fake, B) is None
    owner.daemons.stop_all()


def test_without_a_wanted_file_the_owner_starts_and_quits_nothing(fake):
    MpsDaemons(str(fake)).sync(cards(MPS))  # a daemon from an earlier owner
    owner = MpsOwner(MpsDaemons(str(fake)))
    p = owner.round()
    assert p == mps.Plan(keep=(A,)) and owner.daemons.started == {} and owner.daemons.stopped == []
    assert status_of(fake).alive == {A: True}
    (fake / mps.WANTED_FILE).write_text('{"version":99,"cards":[]}')  # a format it does not know
    assert owner.round() == mps.Plan(keep=(A,)) and owner.daemons.stopped == []
    owner.daemons.stop_all()


def test_one_owner_at_a_time(fake):
    mps.write_wanted(fake, [A])
    first, second = MpsOwner(MpsDaemons(str(fake))), MpsOwner(MpsDaemons(str(fake)))
    assert first.round() is not None
    assert second.round() is None and second.daemons.started == {}  # standing by: owner.lock is held
    first.release()  # the first owner ended
    assert second.round() == mps.Plan(keep=(A,)) and second.daemons.started == {}
    second.daemons.stop_all()


def owner_process(root: Path) -> subprocess.Popen:
    """``kvgpu mps-daemons`` as its own process, as in the chart's kvgpu-mps pod."""
    return subprocess.Popen([sys.executable, "-m", "kvgpu.cli.main", "mps-daemons", f"--root={root}",
                             "--interval=0.2"], env={**os.environ, "KVGPU_LOG_LEVEL": "WARNING"})


def test_daemons_outlive_the_agent_and_their_owner_process_and_are_reused(fake):
    """The agent only writes wanted.json and reads status.json, so its restart touches no daemon;
    a restarted owner process finds the running daemon through its pipe and keeps it."""
    mps.write_wanted(fake, [A])  # the agent (this test) decided
    owner = owner_process(fake)
    try:
        wait_until(lambda: mps.check_ready(fake, A) is None)
        first = pid_of(fake, A)
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(10) == 0
        assert MpsDaemons(str(fake)).alive(A)  # left running
        owner = owner_process(fake)
        t = status_of(fake).time
        wait_until(lambda: status_of(fake).time > t)
        assert status_of(fake).alive == {A: True} and pid_of(fake, A) == first  # reused, not restarted
        os.kill(first, signal.SIGKILL)  # the daemon dies: the next round starts it again
        wait_until(lambda: (fake / A / "log" / "control.log").read_text().count("\n") == 2)
        wait_until(lambda: mps.check_ready(fake, A) is None)
        assert pid_of(fake, A) != first
    finally:
        owner.kill()
        owner.wait()


def test_a_tenant_can_send_control_commands_through_its_read_only_pipe_folder(fake, tmp_path):
    """What a client container gets: the card's pipe folder bind-mounted read-only. Files cannot
    be created in it, but connect(2) on the daemon's socket needs no write access to the mount, so
    a tenant reaches the control daemon and can make it quit (the hole docs/agent.md describes);
    the owner's next round starts it again."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a private read-only bind mount")
    mps.write_wanted(fake, [A])
    owner = MpsOwner(MpsDaemons(str(fake)))
    owner.round()
    first = pid_of(fake, A)
    seen = tmp_path / "kvgpu-mps"  # the client's /var/run/kvgpu-mps
    seen.mkdir()
    tenant = (f"mount --bind {pipe_dir(fake, A)} {seen} && mount -o remount,bind,ro {seen} && "
              f"! touch {seen}/x 2>/dev/null && "
              f"{sys.executable} -c \"import socket; s = socket.socket(socket.AF_UNIX); "
              f"s.connect('{seen}/control'); s.sendall(b'quit'); print(s.recv(10).decode())\"")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", tenant],
                       capture_output=True, text=True, timeout=30, check=False)
    if r.returncode != 0 and "Operation not permitted" in r.stderr:
        pytest.skip(f"no mount namespace here: {r.stderr.strip()}")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    wait_until(lambda: not MpsDaemons(str(fake)).alive(A))  # the tenant's quit ended the daemon
    assert owner.round().start == (A,) and pid_of(fake, A) != first
    owner.daemons.stop_all()


def test_the_owner_reaps_its_dead_children():
    """As a container's PID 1 the owner inherits the daemons ``-d`` detached; dead ones are reaped."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    wait_until(lambda: open(f"/proc/{pid}/stat").read().split()[2] == "Z")
    assert mps.reap_children() >= 1 and not os.path.exists(f"/proc/{pid}")
    assert mps.reap_children() == 0


@pytest.mark.parametrize("who", ["separate", "agent"])
def test_the_agent_names_the_mps_cards_and_owns_the_daemons_only_when_told(fake, tmp_path, who):
    from kvgpu.agent.main import Agent, AgentConfig
    from kvgpu.core.inventory import NodeInventory

    sim = tmp_path / "sim.json"
    sim.write_text('{"nodes": []}')
    agent = Agent(AgentConfig(node="gpu-0", simulated=str(sim), mps_root=str(fake), mps_daemons=who), None)  # type: ignore[arg-type]
    agent.mps = agent._make_mps()  # as run() does
    assert (agent.mps is None) is (who == "separate")
    agent._mps_round(NodeInventory("gpu-0", tuple(cards(Slicing("p")))))
    assert not fake.exists(), "a node without mps cards gets no files"
    agent._mps_round(NodeInventory("gpu-0", tuple(cards(MPS, Slicing("p")))))
    assert mps.parse_wanted((fake / mps.WANTED_FILE).read_text()) == [A]
    assert MpsDaemons(str(fake)).alive(A) is (who == "agent")
    agent._mps_round(NodeInventory("gpu-0", tuple(cards(Slicing("p")))))  # A left the mps pool
    assert mps.parse_wanted((fake / mps.WANTED_FILE).read_text()) == []
    assert not MpsDaemons(str(fake)).alive(A)
    if agent.mps is not None:
        agent.mps.release()


def test_a_control_program_that_appears_later_is_found(fake, tmp_path, monkeypatch):
    """The owner may start before the driver's programs are in place (a driver container, the
    simulated node's folder): the control program is looked up at each use, the driver's bin/ first."""
    real = shutil.which("nvidia-cuda-mps-control")
    monkeypatch.setenv("PATH", "/nonexistent")
    owner = MpsOwner(MpsDaemons(str(fake), driver_root=str(tmp_path / "driver")))
    mps.write_wanted(fake, [A])
    assert owner.round().start == (A,) and mps.check_ready(fake, A) is not None  # nothing to run yet
    (tmp_path / "driver" / "bin").mkdir(parents=True)
    shutil.copy(real, tmp_path / "driver" / "bin" / "nvidia-cuda-mps-control")
    assert owner.round().start == (A,) and mps.check_ready(fake, A) is None
    owner.daemons.stop_all()


def test_a_daemon_slow_to_answer_is_not_replaced_by_a_second_one(fake):
    d = MpsDaemons(str(fake), timeout_s=0.5)
    d.sync(cards(MPS))
    first = pid_of(fake, A)
    os.kill(first, signal.SIGSTOP)  # accepts connections (the kernel's backlog) but answers nothing
    try:
        assert not d.alive(A)
        p = d.sync(cards(MPS))
        assert p.start == (A,) and d.last[A] is False and d.started[A] == 1
        assert (fake / A / "pipe" / "control").exists()
    finally:
        os.kill(first, signal.SIGCONT)
    assert d.alive(A) and pid_of(fake, A) == first
    assert len((fake / A / "log" / "control.log").read_text().split("\n")) == 2  # one daemon ever
