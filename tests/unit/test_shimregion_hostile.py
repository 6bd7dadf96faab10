"""The agent's region I/O (kvgpu.shimregion) against a container that owns its region file: it can
truncate it while the agent reads, or replace it with a FIFO or a symlink. None of these may kill,
hang or misdirect the agent: a read raises ValueError, a write stores nothing."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from kvgpu import shimregion as sr

UUID = "GPU-aaaaaaaa-0000-0000-0000-000000000000"


def region_bytes() -> bytes:
    r = sr.Region()
    r.magic, r.version, r.size, r.max_slots, r.ndev = sr.MAGIC, sr.VERSION, sr.REGION_SIZE, sr.MAX_SLOTS, 1
    r.dev[0].uuid, r.dev[0].limit, r.dev[0].cores = UUID.encode(), 1000 << 20, 30
    r.slot[0].pid, r.slot[0].start_time = 8, 1234
    return bytes(r)


@pytest.fixture
def region(tmp_path: Path) -> Path:
    p = tmp_path / "vgpu.region"
    p.write_bytes(region_bytes())
    return p


def test_a_well_formed_region_is_read_and_written(region: Path) -> None:
    assert sr.read_region(region).devices[0].uuid == UUID
    assert sr.set_host_pid(region, 8, 4242, 1234)
    assert [s.host_pid for s in sr.slot_identities(region)] == [4242]


def test_a_truncated_region_is_refused_not_read_past_its_end(region: Path) -> None:
    os.truncate(region, 100)
    with pytest.raises(ValueError, match="smaller than"):
        sr.read_region(region)
    assert not sr.set_host_pid(region, 8, 4242, 1234)
    assert region.stat().st_size == 100  # nothing written


def test_truncating_the_file_under_the_reader_never_kills_it(region: Path) -> None:
    """The container shrinks and regrows its file while the agent reads and writes it (with a
    mapping, a read in that window was SIGBUS: the whole agent died)."""
    code = f"""
import os, sys, threading
sys.path.insert(0, {str(Path(sr.__file__).parents[1])!r})
from kvgpu import shimregion as sr
path, stop = {str(region)!r}, []
def shrink():
    fd = os.open(path, os.O_RDWR)
    while not stop:
        os.ftruncate(fd, 0)
        os.ftruncate(fd, sr.REGION_SIZE)
t = threading.Thread(target=shrink)
t.start()
for _ in range(3000):
    try:
        sr.read_region(path)
        sr.set_host_pid(path, 8, 4242, 1234)
    except ValueError:
        pass
stop.append(1)
t.join()
print("survived")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "survived", (p.returncode, p.stderr[-500:])


def test_a_fifo_in_place_of_the_region_does_not_block(region: Path) -> None:
    region.unlink()
    os.mkfifo(region)
    done: list[object] = []

    def attempt() -> None:
        try:
            sr.read_region(region)
        except ValueError as e:
            done.append(e)
        done.append(sr.set_host_pid(region, 8, 4242, 1234))

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "the agent blocked on a FIFO"
    assert isinstance(done[0], ValueError) and "not a regular file" in str(done[0]) and done[1] is False


def test_a_symlink_in_place_of_the_region_is_not_followed(region: Path, tmp_path: Path) -> None:
    target = tmp_path / "agent-owned"
    target.write_bytes(region_bytes())
    region.unlink()
    region.symlink_to(target)
    with pytest.raises(ValueError, match="not a kvgpu region"):
        sr.read_region(region)
    assert not sr.set_host_pid(region, 8, 4242, 1234)
    assert sr.Region.from_buffer_copy(target.read_bytes()).slot[0].host_pid == 0  # untouched


def test_a_region_file_of_another_layout_is_refused(region: Path) -> None:
    raw = bytearray(region_bytes())
    ctypes.c_uint32.from_buffer(raw, sr.Region.version.offset).value = sr.VERSION + 1
    region.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="version"):
        sr.read_region(region)
    assert not sr.set_host_pid(region, 8, 4242, 1234)
