"""Generated gRPC stubs of the kubelet's device plugin API (``deviceplugin.proto``, v1beta1) and
PodResources API (``podresources.proto``, v1), DRA plugin API (``dra.proto``, v1) and plugin
registration API (``pluginregistration.proto``, v1).

``make install`` (``hack/gen_proto.py``) generates ``<name>_pb2.py`` and ``<name>_pb2_grpc.py``
here. When they are missing (a source checkout that skipped it) they are generated on first import
if grpcio-tools is installed. protoc's gRPC modules import their message module as a top-level
``<name>_pb2``; those names are aliased to this package's modules.

Exports: ``pb2``/``pb2_grpc`` (device plugin), ``pr_pb2``/``pr_pb2_grpc`` (PodResources),
``dra_pb2``/``dra_pb2_grpc`` (DRA kubelet plugin), ``reg_pb2``/``reg_pb2_grpc`` (plugin registration).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

_here = Path(__file__).resolve().parent


def _generate(name: str) -> None:
    try:
        from grpc_tools import protoc
    except ImportError as e:
        raise ImportError(f"{name}_pb2 is not generated: run `make install` (hack/gen_proto.py)") from e
    rc = protoc.main(
        [
            "protoc",
            f"-I{_here}",
            f"--python_out={_here}",
            f"--grpc_python_out={_here}",
            str(_here / f"{name}.proto"),
        ]
    )
    if rc != 0:
        raise ImportError(f"protoc failed on {name}.proto")


def _load(name: str) -> tuple[Any, Any]:
    if not (_here / f"{name}_pb2.py").exists() or not (_here / f"{name}_pb2_grpc.py").exists():
        _generate(name)
    msgs = importlib.import_module(f"{__name__}.{name}_pb2")
    sys.modules.setdefault(f"{name}_pb2", msgs)
    return msgs, importlib.import_module(f"{__name__}.{name}_pb2_grpc")


pb2, pb2_grpc = _load("deviceplugin")
pr_pb2, pr_pb2_grpc = _load("podresources")
dra_pb2, dra_pb2_grpc = _load("dra")
reg_pb2, reg_pb2_grpc = _load("pluginregistration")

__all__ = ["dra_pb2", "dra_pb2_grpc", "pb2", "pb2_grpc", "pr_pb2", "pr_pb2_grpc", "reg_pb2", "reg_pb2_grpc"]
