"""Generate the kubelet gRPC stubs (device plugin v1beta1, PodResources v1) from
operator/kvgpu/agent/proto/*.proto (if any).

``podresources.proto`` is the upstream file of k8s.io/kubelet (see its header); to refresh it, copy
``$(go env GOMODCACHE)/k8s.io/kubelet@<version>/pkg/apis/podresources/v1/api.proto`` over it and
keep the header.
"""

from __future__ import annotations

import pathlib
import sys

root = pathlib.Path(__file__).resolve().parent.parent
proto_dir = root / "operator" / "kvgpu" / "agent" / "proto"
protos = sorted(proto_dir.glob("*.proto")) if proto_dir.exists() else []
if not protos:
    sys.exit(0)
from grpc_tools import protoc  # noqa: E402

for p in protos:
    rc = protoc.main(
        ["protoc", f"-I{proto_dir}", f"--python_out={proto_dir}", f"--grpc_python_out={proto_dir}", str(p)]
    )
    if rc != 0:
        sys.exit(f"protoc failed on {p.name}")
print(f"gen_proto: {len(protos)} proto file(s) compiled")
