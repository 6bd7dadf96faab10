"""The region directory the device plugin prepares for a container before the kubelet mounts it:
owned by the container's user (pod spec), writable by it, never outside the region root."""

from __future__ import annotations

import os
import stat

import pytest
from kvgpu.agent.podidentity import run_as_of
from kvgpu.agent.usage import prepare_region_dir


def _pod(pod_sc: dict | None = None, ctr_sc: dict | None = None, name: str = "main") -> dict:
    c: dict = {"name": name}
    if ctr_sc is not None:
        c["securityContext"] = ctr_sc
    return {"spec": {"securityContext": pod_sc or {}, "containers": [{"name": "other"}, c]}}


def test_run_as_comes_from_the_container_over_the_pod():
    assert run_as_of(_pod(), "main") == (None, None)
    assert run_as_of(_pod({"runAsUser": 1000, "fsGroup": 2000}), "main") == (1000, 2000)
    assert run_as_of(_pod({"runAsUser": 1000, "runAsGroup": 3000, "fsGroup": 2000}), "main") == (1000, 3000)
    assert run_as_of(_pod({"runAsUser": 1000}, {"runAsUser": 1001, "runAsGroup": 7}), "main") == (1001, 7)
    init = {"spec": {"initContainers": [{"name": "prep", "securityContext": {"runAsUser": 5}}], "containers": []}}
    assert run_as_of(init, "prep") == (5, None)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_known_user_owns_the_directory(tmp_path):
    d = prepare_region_dir(tmp_path, "uid-1", "main", (1000, 1000))
    st = d.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1000, 1000, 0o770)
    assert d == tmp_path / "uid-1" / "main"


def test_an_image_chosen_user_gets_a_directory_it_can_write(tmp_path):
    d = prepare_region_dir(tmp_path, "uid-1", "main", (None, None))
    assert stat.S_IMODE(d.stat().st_mode) == 0o777
    again = prepare_region_dir(tmp_path, "uid-1", "main", (None, None))  # idempotent (a kubelet retry)
    assert again == d


@pytest.mark.parametrize("uid,ctr", [("..", "main"), ("uid", "../x"), ("", "main"), ("uid", "a/b")])
def test_names_that_would_leave_the_root_are_refused(tmp_path, uid, ctr):
    with pytest.raises(ValueError):
        prepare_region_dir(tmp_path / "root", uid, ctr, (None, None))
    assert not (tmp_path / "x").exists()
