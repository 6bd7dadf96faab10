"""Symbol resolution under the preload: dlsym(RTLD_NEXT) keeps its meaning for other
interposers, and cuGetProcAddress honours the per-thread-default-stream flag."""

from __future__ import annotations

import subprocess

from .conftest import claim

INTERPOSER = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <unistd.h>
/* Another interposer loaded after libvgpu: its RTLD_NEXT lookup must reach libc, not itself. */
pid_t getppid(void)
{
    static pid_t (*next)(void);
    static int depth;
    if (!next)
        next = (pid_t (*)(void))dlsym(RTLD_NEXT, "getppid");
    if (depth++ > 3)
        _exit(42); /* recursion: RTLD_NEXT returned ourselves */
    pid_t p = next ? next() : -1;
    depth--;
    return p;
}
"""

MAIN = r"""
#include <stdio.h>
#include <unistd.h>
int main(void) { printf("%d\n", (int)getppid() > 0); return 0; }
"""


def test_rtld_next_of_a_later_interposer(box, tmp_path) -> None:
    (tmp_path / "i.c").write_text(INTERPOSER)
    (tmp_path / "m.c").write_text(MAIN)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "i.so"), str(tmp_path / "i.c"), "-ldl"],
                   check=True)
    subprocess.run(["gcc", "-o", str(tmp_path / "m"), str(tmp_path / "m.c")], check=True)
    env = box.env(claim((0, 100, 0)))
    env["LD_PRELOAD"] = f"{box.kit.lib} {tmp_path / 'i.so'}"
    p = subprocess.run([str(tmp_path / "m")], env=env, capture_output=True, text=True, timeout=20)
    assert p.returncode == 0 and p.stdout.strip() == "1", (p.returncode, p.stderr)


LATER = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
/* A library loaded after libvgpu: RTLD_NEXT from here reaches the driver's definitions. */
void *next_of(const char *name) { return dlsym(RTLD_NEXT, name); }
"""

NEXT_MAIN = r"""
#include <dlfcn.h>
#include <stdio.h>
int main(int argc, char **argv)
{
    if (argc < 2 || !dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL))
        return 3;
    void *(*next_of)(const char *) = (void *(*)(const char *))dlsym(RTLD_DEFAULT, "next_of");
    void *shim = dlopen(argv[1], RTLD_NOW | RTLD_NOLOAD);
    if (!next_of || !shim)
        return 4;
    void *launch = next_of("cuLaunchKernel"), *other = next_of("getppid");
    printf("%d %d %d\n", launch == dlsym(shim, "cuLaunchKernel"), launch != NULL, other != NULL);
    return 0;
}
"""


def test_rtld_next_from_a_later_library_gets_the_launch_wrapper(box, tmp_path) -> None:
    """A library loaded behind the shim asking dlsym(RTLD_NEXT, "cuLaunchKernel") found the
    driver's own function, a launch that never passed the gate; it gets the wrapper, and other
    names still resolve as RTLD_NEXT says."""
    (tmp_path / "l.c").write_text(LATER)
    (tmp_path / "m.c").write_text(NEXT_MAIN)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "l.so"), str(tmp_path / "l.c"), "-ldl"],
                   check=True)
    subprocess.run(["gcc", "-o", str(tmp_path / "m"), str(tmp_path / "m.c"), "-ldl"], check=True)
    env = box.env(claim((0, 1000, 25)))
    env["LD_PRELOAD"] = f"{box.kit.lib} {tmp_path / 'l.so'}"
    p = subprocess.run([str(tmp_path / "m"), str(box.kit.lib)], env=env, capture_output=True, text=True, timeout=20)
    assert p.returncode == 0 and p.stdout.split() == ["1", "1", "1"], (p.returncode, p.stdout, p.stderr)


def test_ptds_launch_through_getprocaddress_is_gated(box) -> None:
    box.base_env["STUB_KERNEL_US"] = "2000"
    native = box.json("launch", "ptsz", "1", "20", env=box.env(shim=False))[0]["rate"]
    got = box.json("launch", "ptsz", "1.5", "20", env=box.env(claim((0, 1000, 25))))[0]["rate"]
    assert 0.15 <= got / native <= 0.35


GPA = r"""
import ctypes, json, sys
cu = ctypes.CDLL("libcuda.so.1")
shim = ctypes.CDLL(sys.argv[1])
def gpa(name, ver, flags=0):
    p, st = ctypes.c_void_p(), ctypes.c_int(-1)
    fl = ctypes.c_ulonglong(flags)
    rc = cu.cuGetProcAddress_v2(name.encode(), ctypes.byref(p), ver, fl, ctypes.byref(st))
    return rc, p.value
addr = lambda lib, n: ctypes.cast(getattr(lib, n), ctypes.c_void_p).value
real = ctypes.CDLL(sys.argv[2])  # the stub itself, by path: its own symbols
print(json.dumps({
    "v2_is_hook": gpa("cuMemAlloc", 12000)[1] == addr(shim, "cuMemAlloc_v2"),
    "v1_is_v1_hook": gpa("cuMemAlloc", 3010)[1] == addr(shim, "cuMemAlloc"),
    "ptsz_is_hook": gpa("cuLaunchKernel", 12000, 2)[1] == addr(shim, "cuLaunchKernel_ptsz"),
    "plain_is_hook": gpa("cuLaunchKernel", 12000, 0)[1] == addr(shim, "cuLaunchKernel"),
    "unhooked_is_real": gpa("cuDeviceGet", 12000)[1] == addr(real, "cuDeviceGet"),
    "gpa_is_hook": gpa("cuGetProcAddress", 12000)[1] == addr(shim, "cuGetProcAddress_v2"),
}))
"""


def test_getprocaddress_honours_version_and_flags(box) -> None:
    """The ABI the caller asked for: cuMemAlloc at 3010 is our wrapper of the 32-bit v1 entry
    (never the _v2 one); at 12000 our cuMemAlloc_v2; the PTDS flag gives our _ptsz wrapper."""
    import json
    import sys

    stub = str(box.kit.stubdir / "libcuda.so.1")
    out = box.run(sys.executable, "-c", GPA, str(box.kit.lib), stub, env=box.env(claim((0, 100, 0))))
    assert json.loads(out.stdout) == {k: True for k in ("v2_is_hook", "v1_is_v1_hook", "ptsz_is_hook",
                                                       "plain_is_hook", "unhooked_is_real", "gpa_is_hook")}


def test_loads_with_glibc_2_17() -> None:
    """Images with glibc < 2.34 (Ubuntu 20.04, UBI 8, CentOS 7, CUDA 11 images) load the
    shim through /etc/ld.so.preload into every program: one symbol version they lack and no
    program starts. No such image can be fetched here, so this is a static check of the built
    library: it requires no GLIBC version newer than 2.17, and keeps libdl.so.2 and
    libpthread.so.0 as dependencies (before 2.34 dlopen and the robust-mutex calls live there).
    """
    import re
    import shutil

    from .conftest import LIB

    if not shutil.which("readelf"):
        import pytest

        pytest.skip("readelf (binutils) not installed")
    needs = subprocess.run(["readelf", "-V", "-W", str(LIB)], capture_output=True, text=True,
                           check=True).stdout
    versions = {tuple(int(x) for x in v.split(".")) for v in re.findall(r"Name: GLIBC_([0-9.]+)", needs)}
    assert all(v <= (2, 17) for v in versions), sorted(versions)
    syms = subprocess.run(["readelf", "--dyn-syms", "-W", str(LIB)], capture_output=True, text=True,
                          check=True).stdout
    newer = [line for line in syms.splitlines() if re.search(r"@GLIBC_(2\.(1[89]|[2-9][0-9])|[3-9])", line)]
    assert not newer, newer
    dynamic = subprocess.run(["readelf", "-d", "-W", str(LIB)], capture_output=True, text=True,
                             check=True).stdout
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic))
    assert needed == {"libc.so.6", "libdl.so.2", "libpthread.so.0"}, needed


def test_a_driver_calling_its_own_exports_does_not_hang_the_binding(box, tmp_path) -> None:
    """The real node's stub driver was built without -Bsymbolic: its cuGetProcAddress reaches its
    own cuGetProcAddress_v2 through the PLT, i.e. our wrapper, while the shim binds the driver
    inside pthread_once. The wrapper waited for that once: `cuprog info` hung in every container
    (the demo's `kubectl exec cuda-slice -- cuprog info` timed out)."""
    from .conftest import STUB

    lib = tmp_path / "plt"
    lib.mkdir()
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-pthread", f"-I{STUB}", "-o", str(lib / "libcuda.so.1"),
                    str(STUB / "libcuda_stub.c")], check=True)
    env = box.env(claim((0, 3000, 30)))
    env["LD_LIBRARY_PATH"] = f"{lib}:{env['LD_LIBRARY_PATH']}"
    p = box.run("info", env=env, timeout=20)
    out = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert out and '"rc": 0' in out[0] and '"total": 3145728000' in out[0], (p.stdout, p.stderr)
