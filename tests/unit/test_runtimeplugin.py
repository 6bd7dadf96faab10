"""The real node's stand-in for the NVIDIA runtime (kvgpu.devcluster.runtimeplugin)."""

from __future__ import annotations

from pathlib import Path

from kvgpu.devcluster.runtimeplugin import runtime_device_specs


def test_every_card_and_control_node_no_caps(tmp_path: Path) -> None:
    for n in ("nvidia10", "nvidia1", "nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-x"):
        (tmp_path / n).touch()
    (tmp_path / "nvidia-caps").mkdir()
    specs = runtime_device_specs(tmp_path)
    assert [s.container_path for s in specs] == ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia10", "/dev/nvidiactl",
                                                 "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert {s.permissions for s in specs} == {"rw"} and specs[0].host_path == str(tmp_path / "nvidia0")
