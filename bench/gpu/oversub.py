"""The oversubscription contract on a real card (issue 16 item 2): two tenants of a
memoryScaling 2 pool, each with a virtual limit that together exceed the card's memory.

    python3 bench/gpu/oversub.py LIBVGPU UUID [LIMIT_MIB] [HOLD_MIB]

Tenant A (its own region, claim LIMIT_MIB) holds HOLD_MIB of tensors with a known pattern;
tenant B (LIMIT_MIB too) then allocates 256 MiB blocks until it fails. Printed as JSON lines:
B's view before (torch.cuda.mem_get_info, nvidia-smi in its process), where B stopped and with
which error, whether A's data is intact, and whether B can allocate again after A frees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

TENANT = r'''
import json, os, sys, time, torch
role, hold_mib, go, done = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
def out(**kw): print(json.dumps({"tenant": role, **kw}), flush=True)
torch.zeros(1, device="cuda")
free, total = torch.cuda.mem_get_info()
out(event="start", free_mib=free >> 20, total_mib=total >> 20)
if role == "A":
    blocks = []
    for i in range(hold_mib // 1024):
        blocks.append(torch.full((256 << 20,), i, dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    out(event="holding", mib=len(blocks) * 1024)
    open(go, "w").close()
    t0 = time.time()
    while not os.path.exists(done) and time.time() - t0 < 90:
        time.sleep(0.05)
    # sampled, in 1 Mi-element slices: a whole-block check would need GiB of temporaries on a full card
    step = 1 << 20
    ok = all(bool((b[j:j + step] == i).all()) for i, b in enumerate(blocks) for j in range(0, b.numel(), 64 * step))
    out(event="verified", intact=ok)
    del blocks
    torch.cuda.empty_cache()
    open(done + ".freed", "w").close()
else:
    import subprocess as sp
    q = sp.run(["nvidia-smi", "--query-gpu=memory.total,memory.used,memory.free", "--format=csv,noheader"],
                capture_output=True, text=True).stdout.strip()
    out(event="view", nvidia_smi=q)
    got, err = [], ""
    while True:
        try:
            got.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError as e:
            err = str(e).splitlines()[0][:300]
            break
    free, total = torch.cuda.mem_get_info()
    out(event="stopped", granted_mib=len(got) * 256, error=err, free_mib=free >> 20, total_mib=total >> 20)
    open(done, "w").close()
    t0 = time.time()
    while not os.path.exists(done + ".freed") and time.time() - t0 < 30:
        time.sleep(0.05)
    time.sleep(0.5)
    more = 0
    try:
        for _ in range(8):
            got.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
            more += 256
    except torch.OutOfMemoryError:
        pass
    out(event="after_free", more_mib=more)
'''


def main() -> None:
    lib, uuid = sys.argv[1], sys.argv[2]
    limit = int(sys.argv[3]) if len(sys.argv) > 3 else 100000
    hold = int(sys.argv[4]) if len(sys.argv) > 4 else 90112
    d = tempfile.mkdtemp(prefix="oversub-")
    go, done = os.path.join(d, "go"), os.path.join(d, "done")
    procs = {}
    for role in ("A", "B"):
        env = {**os.environ, "LD_PRELOAD": lib, "KVGPU_REGION_DIR": tempfile.mkdtemp(dir=d),
               "KVGPU_CLAIM": f"v1;claim=bench/oversub-{role.lower()};priority=1;dev={uuid},{limit},0"}
        if role == "B":
            t0 = time.time()
            while not os.path.exists(go) and time.time() - t0 < 120:
                time.sleep(0.05)
        procs[role] = subprocess.Popen([sys.executable, "-c", TENANT, role, str(hold), go, done], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for role, p in procs.items():
        try:
            text, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        for line in text.splitlines():
            print(line if line.startswith("{") else json.dumps({"tenant": role, "log": line[:300]}))
        print(json.dumps({"tenant": role, "rc": p.returncode}))


if __name__ == "__main__":
    main()
