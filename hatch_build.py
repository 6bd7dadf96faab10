"""Hatchling build hook: the kubelet gRPC stubs go into every wheel.

The stubs (``operator/kvgpu/agent/proto/*_pb2*.py``) are generated, not committed (and
git-ignored, which hatchling honours), so a wheel built from a checkout or an sdist would lack
them. For a regular wheel this hook runs ``hack/gen_proto.py --out <tmp>`` (grpcio-tools comes
from ``[build-system] requires``) and force-includes what it wrote. Editable installs skip it:
``make install`` generates the stubs in the source tree.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PACKAGE_PROTO = "kvgpu/agent/proto"


def runtime_floor(stubs: list[Path]) -> list[str]:
    """``grpcio>=X`` and ``protobuf>=Y`` for what the generated ``stubs`` check at import."""
    grpc: set[str] = set()
    pb: set[tuple[int, int, int]] = set()
    for f in stubs:
        text = f.read_text()
        grpc.update(re.findall(r"GRPC_GENERATED_VERSION = '([\d.]+)'", text))
        m = re.search(r"ValidateProtobufRuntimeVersion\(\s*[\w.]+,\s*(\d+),\s*(\d+),\s*(\d+),", text)
        if m:
            pb.add((int(m[1]), int(m[2]), int(m[3])))
    out = []
    if grpc:
        out.append(f"grpcio>={max(grpc, key=lambda v: tuple(map(int, v.split('.'))))}")
    if pb:
        out.append("protobuf>={}.{}.{}".format(*max(pb)))
    return out


class ProtoStubsHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable":
            return
        self._tmp = Path(tempfile.mkdtemp(prefix="kvgpu-proto-"))
        root = Path(self.root)
        p = subprocess.run([sys.executable, str(root / "hack" / "gen_proto.py"), "--out", str(self._tmp)],
                           capture_output=True, text=True, check=False)
        if p.returncode != 0:
            raise RuntimeError(f"hack/gen_proto.py failed ({p.returncode}): {p.stdout}{p.stderr}")
        stubs = sorted(self._tmp.glob("*_pb2*.py"))
        if not stubs:
            raise RuntimeError(f"hack/gen_proto.py wrote no stubs into {self._tmp}")
        for f in stubs:
            build_data["force_include"][str(f)] = f"{PACKAGE_PROTO}/{f.name}"
        build_data.setdefault("dependencies", []).extend(runtime_floor(stubs))

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        tmp = getattr(self, "_tmp", None)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
