#!/usr/bin/env python3
"""Build the kvgpu shim.

Outputs (in ``shim/_build/``, git-ignored):

* ``libvgpu.so`` - the LD_PRELOAD library. Plain C (gnu11), ``-O2``, ``-fvisibility=hidden``
  so only the hooked CUDA/NVML names, ``dlsym`` and ``kvgpu_shim_version`` are exported; no
  libpython and no CUDA headers or libraries at build time (libcuda.so.1 and
  libnvidia-ml.so.1 are dlopen'ed at run time). Built with the C compiler directly (``$CC``,
  default ``gcc``): a cffi extension would pull in the Python C API.
* ``_vgpucore*.so`` - a cffi (API mode) Python extension over the pure units
  (vgpu_config.c, vgpu_region.c, vgpu_compute.c, vgpu_calibrate.c, vgpu_sched.c), imported by
  ``kvgpu.shimcore`` and the tests in ``tests/shim``.

Usage::

    python shim/build.py             # both
    python shim/build.py --plain-gcc # libvgpu.so only, no cffi needed (GPU machines)
    python shim/build.py --print-cmd # the compiler command for libvgpu.so
    python shim/build.py --sanitize address   # shim/_build/asan/libvgpu.so (make check-sanitize)
    python shim/build.py --sanitize thread    # shim/_build/tsan/libvgpu.so
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
    "vgpu_calibrate.c",
    "vgpu_sched.c",
    "vgpu_symbols.c",
    "vgpu_cuda.c",
    "vgpu_cuda_mem.c",
    "vgpu_mem_table.c",
    "vgpu_mem_array.c",
    "vgpu_mem_vmm.c",
    "vgpu_mem_graph.c",
    "vgpu_mem_ctx.c",
    "vgpu_mem_module.c",
    "vgpu_launch.c",
    "vgpu_gate_inputs.c",
    "vgpu_waits.c",
    "vgpu_measure.c",
    "vgpu_track.c",
    "vgpu_nvml.c",
]
CORE_SOURCES = ["vgpu_config.c", "vgpu_region.c", "vgpu_compute.c", "vgpu_calibrate.c", "vgpu_sched.c",
                "vgpu_pycore.c"]
CFLAGS = [
    "-std=gnu11",
    "-O2",
    "-fPIC",
    "-fvisibility=hidden",
    "-D_GNU_SOURCE",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    "-Werror=shadow",  # a macro's local must never take the name of the hook parameter it is given
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
        cc, *CFLAGS, *os.environ.get("VGPU_CFLAGS", "").split(), f'-DVGPU_VERSION="{git_version()}"', "-shared",
        "-Wl,-soname,libvgpu.so", "-Wl,--as-needed",
        "-o", str(out), *[str(HERE / s) for s in LIB_SOURCES], "-ldl",
    ]


# ------------------------------------------------------------------ old glibc
#
# libvgpu.so is loaded through /etc/ld.so.preload into every dynamic program of the image, so
# a symbol version the image's glibc lacks kills every program before main. Linked normally
# on a glibc >= 2.34 machine it needs GLIBC_2.34 (dlopen, pthread_once ... moved into libc).
# Pinning references with .symver to old versions is not enough: ld records the pin against
# libc.so.6 (where the build glibc has them), and a glibc < 2.34 loader that reaches libc.so.6
# without finding the symbol reports "not defined in file libc.so.6 with link time reference"
# instead of looking further (libdl.so.2, libpthread.so.0 on those systems).
#
# So the final link is against generated *unversioned* stubs with the real sonames
# (libc.so.6 defining every libc symbol the library uses; empty libdl.so.2 and
# libpthread.so.0 kept as DT_NEEDED): the references carry no version, and every glibc binds
# them the way it binds an old unversioned program, to the oldest version of the symbol in
# whichever loaded object defines it (libc.so.6, or libdl/libpthread before 2.34). What the
# code may call is then limited by what glibc 2.17 has: `glibc_requirements` checks that every
# symbol we take from glibc existed in 2.17 on this architecture (the plain link's versions),
# and the build fails naming the symbol otherwise (fstat, for instance, is a GLIBC_2.33
# symbol: the shim uses lseek for file sizes). tests/shim/test_symbols.py reads the result.

GLIBC_MAX = (2, 17)
GLIBC_LIBS = {"libc.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1"}


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("_", 1)[1].split("."))


def glibc_imports(so: Path) -> list[tuple[str, str, str]]:
    """(name, kind 'F'|'O', GLIBC version) of the glibc symbols `so` imports."""
    out = subprocess.run(["objdump", "-T", str(so)], capture_output=True, text=True, check=True).stdout
    got = []
    for line in out.splitlines():
        parts = line.split()
        if "*UND*" not in parts or len(parts) < 6:
            continue
        ver, name = parts[-2].strip("()"), parts[-1]
        if ver.startswith("GLIBC_"):
            got.append((name, "F" if "DF" in parts else "O", ver))
    return got


def _write_stubs(imports: list[tuple[str, str, str]]) -> Path:
    d = OUT / "glibc-stubs"
    d.mkdir(parents=True, exist_ok=True)
    cc = os.environ.get("CC", "gcc")
    src = d / "libc_stub.c"
    lines = ["/* generated by shim/build.py: link-time stand-in, never loaded */"]
    for name, kind, _ in sorted(set(imports)):
        lines.append(f"void {name}(void) {{}}" if kind == "F" else f"char {name}[64];")
    src.write_text("\n".join(lines) + "\n")
    empty = d / "empty.c"
    empty.write_text("/* generated by shim/build.py */\n")
    for soname, source in (("libc.so.6", src), ("libdl.so.2", empty), ("libpthread.so.0", empty)):
        subprocess.run([cc, "-shared", "-fPIC", "-nostdlib", "-fno-builtin", f"-Wl,-soname,{soname}",
                        "-o", str(d / soname), str(source)], check=True)
    return d


def glibc_requirements(imports: list[tuple[str, str, str]]) -> list[str]:
    """Symbols whose oldest version on the build machine is newer than GLIBC_MAX."""
    oldest: dict[str, tuple[int, ...]] = {}
    for name, _, ver in imports:
        oldest[name] = min(oldest.get(name, (99,)), _version(ver))
    libc = subprocess.run([os.environ.get("CC", "gcc"), "-print-file-name=libc.so.6"],
                          capture_output=True, text=True).stdout.strip()
    if os.path.isabs(libc) and os.path.exists(libc):
        # the plain link shows the default version only: ask libc for its older ones
        out = subprocess.run(["objdump", "-T", libc], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[-1] in oldest and parts[-2].strip("()").startswith("GLIBC_"):
                oldest[parts[-1]] = min(oldest[parts[-1]], _version(parts[-2].strip("()")))
    return sorted(n for n, v in oldest.items() if v > GLIBC_MAX)


def build_lib() -> Path:
    OUT.mkdir(exist_ok=True)
    out = OUT / "libvgpu.so"
    tmp = OUT / "libvgpu.so.tmp"
    plain = OUT / "libvgpu.plain.so"
    subprocess.run(lib_command(plain), check=True)  # the normal link: which glibc symbols we use
    imports = glibc_imports(plain)
    too_new = glibc_requirements(imports)
    if too_new:
        raise SystemExit(f"libvgpu.so uses glibc symbols newer than GLIBC_{'.'.join(map(str, GLIBC_MAX))}: "
                         f"{', '.join(too_new)} (images with an older glibc could not start any program)")
    subprocess.run(final_command(tmp, _write_stubs(imports)), check=True)
    plain.unlink()
    tmp.replace(out)  # atomic: a running test never sees half a library
    return out


def final_command(out: Path, stubs: Path) -> list[str]:
    """The release link: same objects, against the unversioned glibc stubs (see above)."""
    cmd = lib_command(out)
    cmd = [c for c in cmd if c not in ("-ldl", "-Wl,--as-needed")]
    # libc_nonshared.a: the static part of -lc (atexit, pthread_atfork -> __cxa_atexit, ...)
    nonshared = subprocess.run([os.environ.get("CC", "gcc"), "-print-file-name=libc_nonshared.a"],
                               capture_output=True, text=True).stdout.strip() or "libc_nonshared.a"
    return [*cmd, "-nodefaultlibs", "-Wl,--no-as-needed", str(stubs / "libdl.so.2"),
            str(stubs / "libpthread.so.0"), str(stubs / "libc.so.6"), nonshared, "-lgcc",
            "-Wl,-z,defs"]


CDEF = r"""
struct vgpu_dev_cfg { char uuid[96]; uint64_t mem_limit; int cores; };
struct vgpu_config {
    int source; int broken; char error[256]; char claim[320]; int priority; int ndev;
    struct vgpu_dev_cfg dev[16]; int policy; int log_level; int disabled; int oom_killer;
    char region_path[512]; char sched_dir[512]; uint64_t period_ns; int container; int env_ignored;
    int mps;
};
int vgpu_claim_parse(const char *text, struct vgpu_config *cfg);
int vgpu_parse_mem(const char *text, uint64_t *out);
void vgpu_py_config_load(struct vgpu_config *cfg, const char *envblock);

struct vgpu_region_dev { char uuid[96]; uint64_t limit; uint32_t cores; uint32_t unused;
                         uint64_t credit_vt; uint64_t ctx_bytes; uint64_t sched_joined_ns; uint64_t sched_heartbeat_ns;
                         uint64_t sched_busy_pm; ...; };
struct vgpu_slot { int32_t pid; int32_t host_pid; uint64_t start_time; uint64_t data[16];
                   uint64_t overhead[16]; uint64_t pidns_dev; uint64_t pidns_ino; uint64_t dead_key; ...; };
struct vgpu_pidns { uint64_t dev; uint64_t ino; };
struct vgpu_pidns vgpu_pidns_self(void);
int vgpu_region_reap(struct vgpu_region *r);
int vgpu_region_oom_victim(struct vgpu_region *r, int d, uint64_t slack, int32_t *pid,
                           uint64_t *start_time, uint64_t *bytes);
struct vgpu_region { uint32_t magic; uint32_t version; uint32_t size; uint32_t ndev;
                     uint32_t max_slots; uint32_t priority; uint64_t generation; char claim[320];
                     uint64_t oom_kills; int32_t oom_last_pid; uint32_t oom_last_dev;
                     uint64_t oom_last_bytes; uint64_t oom_last_used;
                     struct vgpu_region_dev dev[16]; struct vgpu_slot slot[128]; ...; };
struct vgpu_region_handle { struct vgpu_region *r; int fd; int slot; int private_map; uint64_t reaped_ns; };
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
struct vgpu_nvml_proc { uint32_t pid; uint64_t used; };
void vgpu_region_counted(const struct vgpu_region *r, int d, uint64_t *out);
#define VGPU_RECON_OWN 1
#define VGPU_RECON_MOVED 2
int vgpu_region_reconcile(struct vgpu_region_handle *h, int d, const uint64_t *before,
                          const struct vgpu_nvml_proc *procs, unsigned n, struct vgpu_pidns self);
void vgpu_region_to_overhead(struct vgpu_region_handle *h, int d, uint64_t bytes);
void vgpu_region_oom_record(struct vgpu_region *r, int d, int32_t pid, uint64_t bytes);
uint64_t vgpu_proc_start_time(int32_t pid);
size_t vgpu_py_region_size(void);

struct vgpu_batch { void *ev_open; void *stream; uintptr_t pt_owner; ...; };
struct vgpu_gate { int active; int measure_only; int cotenants; int bursting; uint64_t burst_v0;
                   uint64_t period_ns;
                   uint64_t share_ns; uint64_t offset_ns; uint64_t len_ns; uint64_t burst_ns;
                   uint64_t batch_ns; uint64_t est_ns; uint64_t vt_cost; uint64_t local_vt;
                   uint64_t open_until; uint64_t batch_n; uint32_t busy_pm;
                   uint64_t throttles; uint64_t kern_ns; uint64_t queued_ns; uint32_t gap_pm;
                   uint32_t cal_pm; int cal_container; int cal_cont_moved; uint64_t cal_last_ns;
                   uint64_t cal_card_busy; uint64_t cal_own_busy; uint64_t cal_total_ns; struct vgpu_batch cur; ...; };
void vgpu_gate_init(struct vgpu_gate *g, int cores, uint64_t period_ns);
void vgpu_gate_set_window(struct vgpu_gate *g, uint64_t offset_ns, uint64_t len_ns, int cotenants);
int vgpu_gate_fast(struct vgpu_gate *g, uint64_t now_lo, uint64_t now_hi, void *stream);
int vgpu_gate_measures(struct vgpu_gate *g, void *stream);
uintptr_t vgpu_thread_token(void);
void vgpu_gate_clamp(struct vgpu_gate *g, uint64_t now_hi);
uint64_t vgpu_gate_decide(struct vgpu_gate *g, uint64_t now);
uint64_t vgpu_gate_settle(struct vgpu_gate *g, uint64_t launches, uint64_t prov_ns, uint64_t span_ns, uint64_t twice_ns,
                          int measured);
void vgpu_gate_tracked(struct vgpu_gate *g, uint64_t busy_ns, uint64_t span_ns, uint32_t weight);
uint32_t vgpu_gate_track_every(const struct vgpu_gate *g, uint64_t hi);
void vgpu_gate_sample(struct vgpu_gate *g, uint64_t kern_ns);
uint32_t vgpu_gate_busy(struct vgpu_gate *g, uint64_t now);
int vgpu_gate_busy_rise(struct vgpu_gate *g, uint64_t now);
void vgpu_gate_cal_note(struct vgpu_gate *g, uint64_t now);
uint64_t vgpu_gate_cal_own(const struct vgpu_gate *g, uint64_t t0, uint64_t t1);
void vgpu_gate_calibrate(struct vgpu_gate *g, uint64_t t0, uint64_t t1, uint64_t card_busy_ns, int alone);
void vgpu_gate_calibrate_container(struct vgpu_gate *g, uint64_t t0, uint64_t t1, uint64_t card_busy_ns,
                                   unsigned procs, uint64_t waited_ns);
void vgpu_gate_seg_overhead(struct vgpu_gate *g, uint64_t busy_ns, uint64_t ovh_ns);
uint32_t vgpu_gate_cal_raise(const struct vgpu_gate *g);
uint64_t vgpu_coarse_margin(void);
void vgpu_sched_layout(const uint32_t *share_pm, const uint32_t *prio, const uint64_t *joined,
                       int n, int self, uint32_t *offset_pm, uint32_t *len_pm);
int vgpu_sched_read(const char *dir, const char *uuid, const char *key, uint32_t *offset_pm,
                    uint32_t *len_pm, uint32_t *count);
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


SANITIZERS = {"address": "asan", "thread": "tsan"}


def sanitize_command(kind: str, out: Path) -> list[str]:
    """A test build with -fsanitize=<kind>: the normal link against the sanitizer runtime (not
    the unversioned-glibc release link, which the runtime cannot go with). Never shipped."""
    cmd = [c for c in lib_command(out) if c not in ("-O2", "-Wl,--as-needed")]
    return [cmd[0], f"-fsanitize={kind}", "-fno-omit-frame-pointer", "-g", "-O1", *cmd[1:]]


def build_sanitized(kind: str) -> Path:
    d = OUT / SANITIZERS[kind]
    d.mkdir(parents=True, exist_ok=True)
    out = d / "libvgpu.so"
    subprocess.run(sanitize_command(kind, out), check=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plain-gcc", action="store_true", help="build libvgpu.so only (no cffi)")
    ap.add_argument("--print-cmd", action="store_true", help="print the libvgpu.so command")
    ap.add_argument("--sanitize", choices=sorted(SANITIZERS),
                    help="build only a sanitizer test build of libvgpu.so in shim/_build/<asan|tsan>/")
    args = ap.parse_args(argv)
    if args.sanitize:
        print(f"built {build_sanitized(args.sanitize)}")
        return 0
    if args.print_cmd:
        print(shlex.join(lib_command(OUT / "libvgpu.plain.so")), "# which glibc symbols")
        print(shlex.join(final_command(OUT / "libvgpu.so", OUT / "glibc-stubs")), "# the release link")
        return 0
    print(f"built {build_lib()}")
    if not args.plain_gcc:
        print(f"built {build_core()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
