"""Python view of the shim's pure core (``shim/_build/_vgpucore``, built by ``shim/build.py``) for
the tests: they drive the claim parser, the region and the compute gate through :func:`core`.

The node agent does not need it: it reads and annotates regions through :mod:`kvgpu.shimregion`
(plain Python over the documented layout), whose records and reader are re-exported here.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from kvgpu import shimregion
from kvgpu.shimregion import DeviceUsage, ProcessUsage, RegionUsage

__all__ = ["DeviceUsage", "ProcessUsage", "RegionUsage", "ShimCoreUnavailable", "core", "read_region"]

_BUILD = Path(__file__).resolve().parents[2] / "shim" / "_build"
_core: ModuleType | None = None


class ShimCoreUnavailable(ImportError):
    """The cffi module is not built and cannot be built here (no shim sources or compiler)."""


def core() -> ModuleType:
    """Return the cffi module (``.ffi``, ``.lib``), building it from ``shim/`` if needed."""
    global _core
    if _core is not None:
        return _core
    try:
        _core = importlib.import_module("_vgpucore")
        return _core
    except ImportError:
        pass
    if str(_BUILD) not in sys.path:
        sys.path.insert(0, str(_BUILD))
    try:
        _core = importlib.import_module("_vgpucore")
        return _core
    except ImportError:
        build = _BUILD.parent / "build.py"
        if not build.exists():
            raise ShimCoreUnavailable("kvgpu shim core module _vgpucore is not built") from None
        subprocess.run([sys.executable, str(build)], check=True, capture_output=True)
        importlib.invalidate_caches()
        _core = importlib.import_module("_vgpucore")
        return _core


def read_region(path: str | Path) -> RegionUsage:
    """:func:`kvgpu.shimregion.read_region` (plain Python; kept here for the tests' callers)."""
    return shimregion.read_region(path)
