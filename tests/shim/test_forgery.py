"""Issue 14 end to end on the stub driver: a hostile process inside a sliced container.

Each test runs ``cuprog`` (the real ``libvgpu.so`` preloaded) in a private mount namespace
that looks like a kvgpu container: the container's claim read-only at ``/etc/kvgpu/claim``
(an overlay over ``/etc`` makes room for it) and the region directory at ``/var/run/kvgpu``.
Nothing outside the namespace changes. The grant is 1000 MiB on a 4096 MiB stub card; every
forgery must still end at 1000 MiB (14 chunks of 64 MiB after the 64 MiB context). Before the
fix each one was obeyed (the forged claims ask for 3000 MiB).
"""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest

from .conftest import MIB, claim

CHUNK = str(64 * MIB)
GRANTED = claim((0, 1000, 0), name="team-a/job-main")
FORGED = claim((0, 3000, 0), name="team-a/job-main", priority=0)
SIBLING = claim((0, 3000, 0), name="team-a/job-trainer", priority=0)

NS_SCRIPT = r"""
set -e
mount -t overlay overlay -o lowerdir=/etc,upperdir="$T/etc-up",workdir="$T/etc-work" /etc
mkdir -p /etc/kvgpu
mount --bind "$T/claims" /etc/kvgpu
mount -o remount,bind,ro /etc/kvgpu
run=$(readlink -f /var/run)
mount -t overlay overlay -o lowerdir="$run",upperdir="$T/run-up",workdir="$T/run-work" "$run"
mkdir -p "$run/kvgpu"
mount --bind "$T/region" "$run/kvgpu"
exec "$@"
"""


def _unshare() -> list[str] | None:
    for cmd in (["unshare", "-m"], ["unshare", "-Urm"]):
        try:
            if subprocess.run([*cmd, "true"], capture_output=True, timeout=10).returncode == 0:
                return cmd
        except (OSError, subprocess.TimeoutExpired):
            return None
    return None


@pytest.fixture
def container(box):
    """Run a command as a process of a kvgpu container whose claim is GRANTED."""
    unshare = _unshare()
    if unshare is None:
        pytest.skip("needs a private mount namespace (unshare -m)")
    t = box.dir
    for d in ("etc-up", "etc-work", "run-up", "run-work", "claims"):
        (t / d).mkdir()
    (t / "claims" / "claim").write_text(GRANTED)
    # the old layout: a sibling container's (bigger) claim in the same volume
    (t / "claims" / "trainer").write_text(SIBLING)

    def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        e = box.env(GRANTED)
        e.pop("KVGPU_REGION_DIR")  # the container's region is the mount at /var/run/kvgpu
        e.update(env)
        script = NS_SCRIPT.replace("$T", shlex.quote(str(t)))
        cmd = [*unshare, "sh", "-c", script, "sh", str(box.kit.cuprog), *args]
        return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=60)

    return run


def first_json(p: subprocess.CompletedProcess[str]) -> dict:
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert lines, (p.returncode, p.stdout, p.stderr)
    return lines[0]


def assert_granted(p: subprocess.CompletedProcess[str]) -> None:
    out = first_json(p)
    assert out.get("total") == 1000 * MIB, (out, p.stderr)
    assert out["n"] == 14 and out["rc"] == 2, (out, p.stderr)  # 14 x 64 MiB + context = 1000


def test_the_granted_claim_holds_in_the_container(container) -> None:
    assert_granted(container("fill", "alloc", CHUNK))


def test_forged_env_claim_is_not_obeyed(container) -> None:
    p = container("fill", "alloc", CHUNK, KVGPU_CLAIM=FORGED)
    assert_granted(p)
    assert "ignoring KVGPU_CLAIM" in p.stderr  # logged, never obeyed


def test_forged_claim_file_is_not_obeyed(container, box) -> None:
    forged = box.dir / "forged"
    forged.write_text(FORGED)
    assert_granted(container("fill", "alloc", CHUNK, KVGPU_CLAIM_FILE=str(forged), KVGPU_CLAIM=FORGED))


def test_sibling_claim_file_is_not_obeyed(container) -> None:
    assert_granted(container("fill", "alloc", CHUNK, KVGPU_CLAIM_FILE="/etc/kvgpu/trainer",
                             KVGPU_CLAIM=SIBLING))


def test_own_region_dir_does_not_give_a_second_quota(container, box) -> None:
    """KVGPU_REGION_DIR=/tmp/mine would have given each process a fresh 1000 MiB."""
    (box.dir / "mine").mkdir()
    p = container("fill", "alloc", CHUNK, "20", KVGPU_REGION_DIR=str(box.dir / "mine"))
    first_json(p)
    assert not (box.dir / "mine" / "vgpu.region").exists()
    assert (box.dir / "region" / "vgpu.region").exists()


def test_disable_control_does_not_lift_the_container_claim(container) -> None:
    assert_granted(container("fill", "alloc", CHUNK, CUDA_DISABLE_CONTROL="true",
                             CUDA_DEVICE_MEMORY_LIMIT="100g"))


def test_region_refuses_a_process_with_another_claim(box) -> None:
    """Without a container file (host mode): the first claim fixes the region; a process of
    the same region presenting a bigger claim fails CUDA init instead of lifting the limit of
    every process ("latest claim wins" before)."""
    assert box.json("fill", "alloc", CHUNK, env=box.env(GRANTED))[0]["total"] == 1000 * MIB
    p = box.run("fill", "alloc", CHUNK, env=box.env(FORGED), check=False)
    assert p.returncode == 3 and '"init_rc": 3' in p.stdout, (p.stdout, p.stderr)
    assert "belongs to another claim" in p.stderr
    # the granted claim still works, with its own limit
    assert box.json("fill", "alloc", CHUNK, env=box.env(GRANTED))[0]["n"] == 14

