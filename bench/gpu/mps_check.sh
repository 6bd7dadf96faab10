#!/usr/bin/env bash
# The MPS backend on a real card, in one call (docs/agent.md, "MPS"):
#   the agent's daemon code (kvgpu.agent.mps.MpsDaemons) starts one control daemon for card 0
#   under a private root, answers liveness through the pipe, is found again by a new instance,
#   is started again after a SIGKILL, and quits; clients: a torch matmul at 30 % / 100 % active
#   threads, the driver's pinned memory limit (OOM at it), the shim with a mode=mps claim (its
#   env forced over the tenant's, OOM at the claim), a client in a private mount namespace with
#   its own /dev/shm and the pipe folder mounted read-only (as a container gets it), and a
#   client whose pipe has no daemon (CUDA runs outside MPS: why the shim refuses that).
#   bench/gpu/mps_check.sh      (repository root; LIB=<libvgpu.so> or shim/_build/libvgpu.so)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/raw}
mkdir -p "$OUT"
exec > >(tee "$OUT/mps_check.log") 2>&1
export PYTHONUNBUFFERED=1 PATH=/usr/local/nvidia/bin:$PATH PYTHONPATH=$PWD/operator
LIB=${LIB:-$PWD/shim/_build/libvgpu.so}
[ -f "$LIB" ] || python3 shim/build.py --plain-gcc >/dev/null
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
ROOT=$(mktemp -d /tmp/kvmps.XXXX)
PIPE=$ROOT/$UUID/pipe
echo "card $UUID root $ROOT"; nvidia-smi --query-gpu=name,compute_mode,mig.mode.current --format=csv,noheader
daemons() {  # daemons ACTION: sync | alive | stop_all, through the agent's code
    python3 - "$ROOT" "$UUID" "$1" <<'PY'
import sys
from kvgpu.agent.mps import MpsDaemons
from kvgpu.core.inventory import Card, Slicing
root, uuid, action = sys.argv[1:]
d = MpsDaemons(root)
if action == "sync":
    print("plan", d.sync([Card(uuid, 0, "H200", 143771, 132, slicing=Slicing("p", mode="mps"))]), "started", d.started)
elif action == "stop_all":
    d.stop_all()
print("alive", d.alive(uuid))
PY
}
export TORCH=$(cat <<'PY'
import os, sys, time, torch
want = sys.argv[1]
x = torch.randn(8192, 8192, device="cuda")
torch.cuda.synchronize()
for _ in range(3): y = x @ x
torch.cuda.synchronize(); t = time.perf_counter(); n = 40
for _ in range(n): y = x @ x
torch.cuda.synchronize(); dt = time.perf_counter() - t
tf = 2 * 8192**3 * n / dt / 1e12
env = {k: os.environ.get(k) for k in ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")}
import ctypes; libc = ctypes.CDLL(None); libc.getenv.restype = ctypes.c_char_p
seen = {k: (libc.getenv(k.encode()) or b"").decode() for k in env}
free, total = torch.cuda.mem_get_info()
blocks = []
try:
    while len(blocks) < 400:
        blocks.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    oom = "none"
except torch.OutOfMemoryError as e:
    oom = str(e).split("\n")[0][:160]
print(f"RESULT {want}: matmul {tf:.1f} TFLOP/s, env at start {env}, env after init {seen}, "
      f"mem_get_info total {total >> 20} MiB, 256 MiB blocks before OOM {len(blocks)} ({len(blocks) * 256} MiB + tensors), oom: {oom}")
if os.environ.get("HOLD"):
    open(os.environ["HOLD"], "w").close()
    time.sleep(8)
PY
)
echo "=== daemon: start, liveness, reuse by a new instance"
daemons sync; daemons sync
echo "get_server_list:"; echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=$PIPE nvidia-cuda-mps-control; echo "rc=$?"
ls -la "$PIPE"
echo "=== native (no MPS) for reference"
env -u CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_PIPE_DIRECTORY=$ROOT/none python3 -c "$TORCH" native
echo "=== MPS client 100 % threads, no pinned limit"
CUDA_MPS_PIPE_DIRECTORY=$PIPE python3 -c "$TORCH" mps100
echo "=== MPS client 30 % threads, pinned limit 4096M"
CUDA_MPS_PIPE_DIRECTORY=$PIPE CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M \
    HOLD=$ROOT/holding python3 -c "$TORCH" mps30-pinned4096 &
CPID=$!
for _ in $(seq 60); do [ -e "$ROOT/holding" ] && break; sleep 0.5; done
echo "nvidia-smi while the client holds its memory:"; nvidia-smi --query-compute-apps=pid,used_memory,process_name --format=csv
echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=$PIPE nvidia-cuda-mps-control
wait $CPID
echo "=== the shim, claim mode=mps 3000 MiB / 30 %; the tenant sets 100 % and 0=100G itself"
REG=$(mktemp -d)
LD_PRELOAD=$LIB KVGPU_REGION_DIR=$REG KVGPU_CLAIM="v1;claim=bench/mps;priority=1;dev=$UUID,3000,30;mode=mps" \
    CUDA_MPS_PIPE_DIRECTORY=$PIPE CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=100G \
    python3 -c "$TORCH" shim-mps-3000-30
echo "=== a container-like client: private /dev/shm, pipe folder read-only on /var/run/kvgpu-mps"
unshare -m sh -c "mount --make-rprivate / && mount -t tmpfs tmpfs /dev/shm && mkdir -p /var/run/kvgpu-mps && \
    mount --bind $PIPE /var/run/kvgpu-mps && mount -o remount,bind,ro /var/run/kvgpu-mps && \
    CUDA_MPS_PIPE_DIRECTORY=/var/run/kvgpu-mps CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30 python3 -c \"\$TORCH\" ns-ro-privshm"
echo "rc=$?"
echo "=== the shim with mode=mps and no daemon behind the pipe (must refuse CUDA)"
mkdir -p "$ROOT/empty"
LD_PRELOAD=$LIB KVGPU_REGION_DIR=$(mktemp -d) KVGPU_CLAIM="v1;claim=bench/mps2;priority=1;dev=$UUID,3000,30;mode=mps" \
    CUDA_MPS_PIPE_DIRECTORY=$ROOT/empty python3 -c 'import torch; print("cuda available:", torch.cuda.is_available())' 2>&1 | tail -2
echo "=== a dead daemon is started again"
DPID=$(cat "$PIPE/nvidia-cuda-mps-control.pid" 2>/dev/null || true)
echo "daemon pid $DPID"; ps -o pid,sid,ppid,args -p "$DPID" 2>/dev/null
# quit first so no server is left without its daemon, then start, kill -9 the fresh daemon, sync
daemons stop_all; sleep 1; daemons sync
DPID=$(cat "$PIPE/nvidia-cuda-mps-control.pid" 2>/dev/null || true); echo "kill -9 $DPID"; [ -n "$DPID" ] && kill -9 "$DPID"; sleep 1
daemons alive; daemons sync
echo "=== stop"
daemons stop_all; sleep 2
echo "left over:"; pgrep -a -x nvidia-cuda-mps || echo none  # comm is cut to 15 characters
for p in $(pgrep -x nvidia-cuda-mps); do kill "$p"; done
ls "$ROOT/$UUID/log"; tail -5 "$ROOT/$UUID/log/control.log"
cp -r "$ROOT/$UUID/log" "$OUT/mps-logs" 2>/dev/null
