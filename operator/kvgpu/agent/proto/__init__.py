"""Generated gRPC stubs of the kubelet device plugin API (``deviceplugin.proto``).

``make install`` (``hack/gen_proto.py``) generates ``deviceplugin_pb2.py`` and
``deviceplugin_pb2_grpc.py`` here. When they are missing (a source checkout that skipped it) they
are generated on first import if grpcio-tools is installed. protoc's gRPC module imports its
message module as a top-level ``deviceplugin_pb2``; that name is aliased to this package's module.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

_here = Path(__file__).resolve().parent


def _generate() -> None:
    try:
        from grpc_tools import protoc
    except ImportError as e:
        raise ImportError("deviceplugin_pb2 is not generated: run `make install` (hack/gen_proto.py)") from e
    rc = protoc.main(
        [
            "protoc",
            f"-I{_here}",
            f"--python_out={_here}",
            f"--grpc_python_out={_here}",
            str(_here / "deviceplugin.proto"),
        ]
    )
    if rc != 0:
        raise ImportError("protoc failed on deviceplugin.proto")


if not (_here / "deviceplugin_pb2.py").exists() or not (_here / "deviceplugin_pb2_grpc.py").exists():
    _generate()

pb2: Any = importlib.import_module(f"{__name__}.deviceplugin_pb2")
sys.modules.setdefault("deviceplugin_pb2", pb2)
pb2_grpc: Any = importlib.import_module(f"{__name__}.deviceplugin_pb2_grpc")

__all__ = ["pb2", "pb2_grpc"]
