#!/usr/bin/env python3
"""Build the kvgpu shim.

Outputs (in ``shim/_build/``, git-ignored):

* ``libvgpu.so`` - the LD_PRELOAD library. Plain C (gnu11), ``-O2``, ``-fvisibility=hidden``
  so only the hooked CUDA/NVML names, ``dlsym`` and ``kvgpu_shim_version`` are exported; no
  libpython and no CUDA headers or libraries at build time (libcuda.so.1 and
  libnvidia-ml.so.1 are dlopen'ed at run time). Built with the C compiler directly (``$CC``,
  default ``gcc``): a cffi extension would pull in the Python C API.
* ``_vgpucore*.so`` - a cffi (API mode) Python extension over the pure units
  (vgpu_config.c, vgpu_region.c, vgpu_compute.c), imported by ``kvgpu.shimcore`` and the
  tests in ``tests/shim``.

Usage::

    python shim/build.py             # both
    python shim/build.py --plain-gcc # libvgpu.so only, no cffi needed (GPU machines)
    python shim/build.py --print-cmd # the compiler command for libvgpu.so
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "_build"
VERSION = "0.1.0"
LIB_SOURCES = [
    "libvgpu.c",
    "vgpu_config.c",
    "vgpu_region.c",
    "vgpu_compute.c",
    "vgpu_symbols.c",
    "vgpu_cuda.c",
    "vgpu_nvml.c",
]
CORE_SOURCES = ["vgpu_config.c", "vgpu_region.c", "vgpu_compute.c", "vgpu_pycore.c"]
CFLAGS = [
    "-std=gnu11",
    "-O2",
    "-fPIC",
    "-fvisibility=hidden",
    "-D_GNU_SOURCE",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    "-pthread",
]


def git_version() -> str:
    try:
        rev = subprocess.run(
            ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        return f"{VERSION}+g{rev}"
    except (OSError, subprocess.CalledProcessError):
        return VERSION


def lib_command(out: Path) -> list[str]:
    cc = os.environ.get("CC", "gcc")
    return [
        cc, *CFLAGS, f'-DVGPU_VERSION="{git_version()}"', "-shared",
        "-Wl,-soname,libvgpu.so", "-Wl,--as-needed",
        "-o", str(out), *[str(HERE / s) for s in LIB_SOURCES], "-ldl",
    ]


def build_lib() -> Path:
    OUT.mkdir(exist_ok=True)
    out = OUT / "libvgpu.so"
    tmp = OUT / "libvgpu.so.tmp"
    subprocess.run(lib_command(tmp), check=True)
    tmp.replace(out)  # atomic: a running test never sees half a library
    return out


CDEF = r"""
struct vgpu_dev_cfg { char uuid[96]; uint64_t mem_limit; int cores; };
struct vgpu_config {
    int source; int broken; char error[256]; char claim[320]; int priority; int ndev;
    struct vgpu_dev_cfg dev[16]; int policy; int log_level; int disabled; int oom_killer;
    char region_path[512]; char sched_dir[512]; uint64_t period_ns;
};
int vgpu_claim_parse(const char *text, struct vgpu_config *cfg);
int vgpu_parse_mem(const char *text, uint64_t *out);
void vgpu_py_config_load(struct vgpu_config *cfg, const char *envblock);

struct vgpu_region_dev { char uuid[96]; uint64_t limit; uint32_t cores; uint32_t sm_util; ...; };
struct vgpu_slot { int32_t pid; int32_t host_pid; uint64_t start_time; uint64_t data[16];
                   uint64_t overhead[16]; ...; };
struct vgpu_region { uint32_t magic; uint32_t version; uint32_t size; uint32_t ndev;
                     uint32_t max_slots; uint32_t priority; uint64_t generation; char claim[320];
                     struct vgpu_region_dev dev[16]; struct vgpu_slot slot[128]; ...; };
struct vgpu_region_handle { struct vgpu_region *r; int fd; int slot; int private_map; };
int vgpu_region_open(struct vgpu_region_handle *h, const char *path, const struct vgpu_config *cfg);
int vgpu_region_attach(struct vgpu_region_handle *h, const char *path);
void vgpu_region_close(struct vgpu_region_handle *h);
int vgpu_region_lock(struct vgpu_region *r);
void vgpu_region_unlock(struct vgpu_region *r);
int vgpu_region_join(struct vgpu_region_handle *h, int32_t pid, uint64_t start_time);
void vgpu_region_leave(struct vgpu_region_handle *h);
int vgpu_region_reserve(struct vgpu_region_handle *h, int d, uint64_t bytes);
void vgpu_region_release(struct vgpu_region_handle *h, int d, uint64_t bytes);
uint64_t vgpu_region_set_overhead(struct vgpu_region_handle *h, int d, uint64_t bytes);
uint64_t vgpu_region_used(struct vgpu_region *r, int d);
uint64_t vgpu_proc_start_time(int32_t pid);
size_t vgpu_py_region_size(void);

struct vgpu_gate { int active; uint64_t period_ns; uint64_t offset_ns; uint64_t len_ns;
                   uint64_t kernel_ns_est; uint64_t debt_ns; uint64_t win_start;
                   uint64_t win_budget; uint64_t last_ws; uint64_t throttles; ...; };
void vgpu_gate_init(struct vgpu_gate *g, int cores, uint64_t period_ns);
int vgpu_gate_fast(struct vgpu_gate *g, uint64_t now);
int vgpu_gate_fast_coarse(struct vgpu_gate *g, uint64_t coarse_now, uint64_t margin);
uint64_t vgpu_coarse_margin(void);
void vgpu_gate_close(struct vgpu_gate *g, uint64_t t_det, uint64_t drained);
uint64_t vgpu_gate_plan(struct vgpu_gate *g, uint64_t now);
void vgpu_sched_layout(const uint32_t *share_pm, const uint32_t *prio, const uint64_t *joined,
                       int n, int self, uint32_t *offset_pm, uint32_t *len_pm);
int vgpu_sched_update(const char *dir, const char *uuid, const char *key, uint32_t share_pm,
                      uint32_t prio, uint32_t *offset_pm, uint32_t *len_pm);
uint64_t vgpu_now_ns(void);
"""


def build_core() -> Path:
    import cffi  # only needed for the test module

    OUT.mkdir(exist_ok=True)
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        "_vgpucore",
        '#include "vgpu.h"\n'
        "void vgpu_py_config_load(struct vgpu_config *cfg, const char *envblock);\n"
        "size_t vgpu_py_region_size(void);\n",
        sources=[str(HERE / s) for s in CORE_SOURCES],
        include_dirs=[str(HERE)],
        extra_compile_args=[f for f in CFLAGS if f != "-fvisibility=hidden"] + ["-Wno-unused-function"],
        extra_link_args=["-pthread"],
    )
    return Path(ffi.compile(tmpdir=str(OUT), verbose=False))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plain-gcc", action="store_true", help="build libvgpu.so only (no cffi)")
    ap.add_argument("--print-cmd", action="store_true", help="print the libvgpu.so command")
    args = ap.parse_args(argv)
    if args.print_cmd:
        print(shlex.join(lib_command(OUT / "libvgpu.so")))
        return 0
    print(f"built {build_lib()}")
    if not args.plain_gcc:
        print(f"built {build_core()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
