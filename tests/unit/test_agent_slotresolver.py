"""The agent's slot resolution (kvgpu.agent.slotresolver) over a fake ``/proc`` tree.

Fake: a directory shaped like ``/proc`` (``<pid>/status``, ``<pid>/stat``, ``<pid>/ns/pid``), since
the races and unreadable cases cannot be staged with real processes here. A PID namespace is a
file: processes of one namespace hard-link the same file, so ``os.stat`` gives them the same
``(st_dev, st_ino)``, as nsfs does. The region is a real region file laid out by
:mod:`kvgpu.shimregion` (the structures tests/shim/test_region_layout.py checks against vgpu.h).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
from kvgpu import shimregion
from kvgpu.agent import slotresolver


class FakeProc:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        (root / "self").mkdir()

    def namespace(self, name: str) -> tuple[int, int]:
        f = self.root.parent / f"ns-{name}"
        f.touch()
        st = os.stat(f)
        return st.st_dev, st.st_ino

    def process(self, host_pid: int, ns: str, nspid: list[int], start: int, state: str = "S") -> None:
        d = self.root / str(host_pid)
        (d / "ns").mkdir(parents=True)
        os.link(self.root.parent / f"ns-{ns}", d / "ns" / "pid")
        (d / "status").write_text(f"Name:\tpython\nState:\t{state} (x)\nNSpid:\t{host_pid}\t" +
                                  "\t".join(map(str, nspid)) + "\n")
        fields = [state, *["0"] * 18, str(start), "0"]
        (d / "stat").write_text(f"{host_pid} (py th) " + " ".join(fields) + "\n")


def region(path: Path, slots: list[tuple[int, int, tuple[int, int]]]) -> Path:
    """A valid region file whose slots 0.. hold (pid, start time, namespace)."""
    r = shimregion.Region()
    r.magic, r.version, r.size = shimregion.MAGIC, shimregion.VERSION, shimregion.REGION_SIZE
    r.max_slots, r.ndev = shimregion.MAX_SLOTS, 1
    for i, (pid, start, ns) in enumerate(slots):
        s = r.slot[i]
        s.pid, s.start_time, s.pidns_dev, s.pidns_ino = pid, start, ns[0], ns[1]
    path.write_bytes(bytes(r))
    return path


def slots(path: Path) -> dict[int, shimregion.SlotIdentity]:
    return {s.index: s for s in shimregion.slot_identities(path)}


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


def test_live_processes_get_their_host_pid_and_stay(proc: FakeProc, tmp_path: Path) -> None:
    a, b = proc.namespace("a"), proc.namespace("b")
    proc.process(501, "a", [1], 1000)
    proc.process(601, "b", [1], 2000)
    proc.process(602, "b", [7], 2100)
    f = region(tmp_path / "r", [(1, 1000, a), (1, 2000, b), (7, 2100, b)])
    p = slotresolver.resolve([f], proc.root)
    assert (p.host_pids_written, p.marked_dead, p.unresolved) == (3, 0, 0)
    assert {i: (s.host_pid, s.dead) for i, s in slots(f).items()} == {0: (501, False), 1: (601, False),
                                                                     2: (602, False)}
    assert slotresolver.resolve([f], proc.root).host_pids_written == 0  # already there


def test_a_process_named_with_bytes_that_are_not_utf8_is_resolved(proc: FakeProc, tmp_path: Path) -> None:
    a = proc.namespace("a")
    proc.process(501, "a", [1], 1000)
    for name in ("status", "stat"):  # the tenant wrote b"\xff\xfe" to /proc/self/comm
        f = proc.root / "501" / name
        f.write_bytes(f.read_bytes().replace(b"python", b"\xff\xfe").replace(b"py th", b"\xff\xfe"))
    f = region(tmp_path / "r", [(1, 1000, a)])
    assert slotresolver.resolve([f], proc.root).host_pids_written == 1
    assert slots(f)[0].host_pid == 501


def test_gone_pid_in_a_live_namespace_and_a_namespace_without_processes(proc: FakeProc, tmp_path: Path) -> None:
    a, b, c = proc.namespace("a"), proc.namespace("b"), proc.namespace("c")
    proc.process(501, "a", [1], 1000)
    proc.process(601, "b", [1], 2000)
    f = region(tmp_path / "r", [(1, 1000, a), (9, 2050, b), (1, 999, b), (1, 3000, c)])
    p = slotresolver.resolve([f], proc.root)
    assert (p.marked_dead, p.host_pids_written) == (3, 1)  # 9 gone; 1 reused (start differs); c empty
    assert {i for i, s in slots(f).items() if s.dead} == {1, 2, 3}
    raw = shimregion.Region.from_buffer_copy(f.read_bytes())
    assert raw.slot[1].dead_key == shimregion.slot_key(9, 2050)


def test_zombie_counts_as_gone(proc: FakeProc, tmp_path: Path) -> None:
    a = proc.namespace("a")
    proc.process(501, "a", [1], 1000)
    proc.process(502, "a", [5], 1100, state="Z")
    f = region(tmp_path / "r", [(5, 1100, a)])
    assert slotresolver.resolve([f], proc.root).marked_dead == 1


def test_unknown_namespace_and_unreadable_process_stay_charged(proc: FakeProc, tmp_path: Path) -> None:
    a = proc.namespace("a")
    proc.process(501, "a", [1], 1000)
    proc.process(502, "a", [2], 1001)
    (proc.root / "502" / "status").unlink()
    (proc.root / "502" / "status").mkdir()  # read fails with an error other than "gone"
    f = region(tmp_path / "r", [(3, 5, a), (4, 6, (0, 0))])
    p = slotresolver.resolve([f], proc.root)
    assert (p.marked_dead, p.unresolved) == (0, 2)
    assert not any(s.dead for s in slots(f).values())


def test_process_of_unreadable_namespace_with_the_slots_identity_spares_it(proc: FakeProc, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    a = proc.namespace("a")
    proc.process(501, "a", [1], 1000)
    proc.process(700, "a", [3], 5)  # its ns/pid cannot be stat'ed (no ptrace access)
    real_stat = os.stat

    def stat(path, *args, **kw):  # type: ignore[no-untyped-def]
        if str(path).endswith("/700/ns/pid"):
            raise PermissionError(13, "Permission denied")
        return real_stat(path, *args, **kw)

    monkeypatch.setattr(slotresolver.os, "stat", stat)
    f = region(tmp_path / "r", [(3, 5, a), (4, 6, a)])
    p = slotresolver.resolve([f], proc.root)
    assert p.marked_dead == 1 and p.unresolved == 1
    assert {i for i, s in slots(f).items() if s.dead} == {1}


def test_a_late_mark_does_not_hit_the_slots_next_holder(tmp_path: Path) -> None:
    f = region(tmp_path / "r", [(9, 2050, (1, 2))])
    fd = os.open(f, os.O_RDWR)
    with mmap.mmap(fd, shimregion.REGION_SIZE) as mm:  # another process took slot 0 meanwhile
        r = shimregion.Region.from_buffer(mm)
        r.slot[0].start_time = 2051
        del r
    os.close(fd)
    assert not shimregion.mark_slot_dead(f, 0, 9, 2050)
    assert not shimregion.set_slot_host_pid(f, 0, 9, 2050, 77)
    assert slots(f)[0].dead is False and slots(f)[0].host_pid == 0


def test_missing_and_foreign_files_are_skipped(proc: FakeProc, tmp_path: Path) -> None:
    (tmp_path / "junk").write_bytes(b"x" * 10)
    p = slotresolver.resolve([tmp_path / "none", tmp_path / "junk"], proc.root)
    assert (p.host_pids_written, p.marked_dead, p.unresolved) == (0, 0, 0)
