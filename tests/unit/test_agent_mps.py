"""The agent's MPS daemons against a fake ``nvidia-cuda-mps-control`` on ``PATH``: a Python
script that, with ``-d``, forks a daemon serving a unix socket ``control`` in
``$CUDA_MPS_PIPE_DIRECTORY`` (answers ``get_server_list``, ends on ``quit``), and without
arguments sends its stdin to that socket like the real control client (exit 1: no daemon)."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from pathlib import Path

import pytest
from kvgpu.agent.mps import MpsDaemons, pipe_dir
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
        cmd = c.recv(100).decode().strip()
        c.sendall(b"" if cmd == "get_server_list" else b"ok")
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
