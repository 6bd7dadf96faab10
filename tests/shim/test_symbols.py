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


def test_ptds_launch_through_getprocaddress_is_gated(box) -> None:
    box.base_env["STUB_KERNEL_US"] = "2000"
    native = box.json("launch", "ptsz", "1", "20", env=box.env(shim=False))[0]["rate"]
    got = box.json("launch", "ptsz", "1.5", "20", env=box.env(claim((0, 1000, 25))))[0]["rate"]
    assert 0.15 <= got / native <= 0.35
