"""Generate the kubelet gRPC stubs (device plugin v1beta1, PodResources v1, DRA v1, plugin registration v1) from
operator/kvgpu/agent/proto/*.proto (if any), next to them or, with ``--out DIR``, into DIR (the
wheel's build hook, hatch_build.py).

``podresources.proto`` is the upstream file of k8s.io/kubelet (see its header); to refresh it, copy
``$(go env GOMODCACHE)/k8s.io/kubelet@<version>/pkg/apis/podresources/v1/api.proto`` over it and
keep the header. ``dra.proto`` and ``pluginregistration.proto`` are likewise
``pkg/apis/dra/v1/api.proto`` and ``pkg/apis/pluginregistration/v1/api.proto`` of k8s.io/kubelet.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

root = pathlib.Path(__file__).resolve().parent.parent
proto_dir = root / "operator" / "kvgpu" / "agent" / "proto"
ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--out", type=pathlib.Path, default=proto_dir, help="directory for the stubs (default: the protos')")
out_dir = ap.parse_args().out
protos = sorted(proto_dir.glob("*.proto")) if proto_dir.exists() else []
if not protos:
    sys.exit(0)
from grpc_tools import protoc  # noqa: E402

for p in protos:
    rc = protoc.main(
        ["protoc", f"-I{proto_dir}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", str(p)]
    )
    if rc != 0:
        sys.exit(f"protoc failed on {p.name}")
print(f"gen_proto: {len(protos)} proto file(s) compiled")
