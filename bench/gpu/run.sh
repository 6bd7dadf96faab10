#!/usr/bin/env bash
# kvgpu shim on a real GPU: every check side by side with native, in one call.
#
#   bench/gpu/run.sh            (from the repository root; writes to $OUT or bench/results/raw)
#
# Builds shim/_build/libvgpu.so with plain gcc (shim/build.py --plain-gcc) and the driver
# client tests/shim/prog/cuprog.c against the machine's libcuda.so.1, then runs:
#   discovery   nvidia-smi -q and the uuid/index/name/memory/pci csv (for the inventory)
#   memory      torch 256 MiB blocks under 3000 MiB, 64 MiB blocks, 300 MiB, cudaMallocAsync,
#               expandable segments (VMM), every C allocation path, NULL pointers, nvidia-smi
#   compute     4096^2 fp32 matmul at 10/30/50/70/90 % and a 30+70 pair (node schedule dir)
#   overhead    empty-kernel launch, 2 MiB alloc+free, cuMemGetInfo: native / shim off / on
#   startup     first CUDA call in torch, native vs shim, 5 runs each, interleaved
#   seed        if bench/gpu/seed-claim.env exists: nvidia-smi and the torch OOM check under it
# PARTS (default all: "memory cpaths compute overhead startup seed") selects parts; SECS sets the
# compute run length (default 8), BENCH_N the micro-benchmark count, ROUNDS the start-up rounds.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/raw}
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
PY=${PY:-python3}
SECS=${SECS:-8}
PARTS=${PARTS:-"memory cpaths compute overhead startup seed"}
hdr() { echo; echo "=== $* ==="; }
want() { [[ " $PARTS " == *" $1 "* ]]; }
# Never `wait` without a PID here: bash would also wait for the tee process substitution.

hdr "DISCOVERY $(date -u +%FT%TZ)"
nvidia-smi -q > "$OUT/nvidia-smi-q.txt" 2>&1
nvidia-smi --query-gpu=uuid,index,name,memory.total,pci.bus_id --format=csv > "$OUT/nvidia-smi-query.csv" 2>&1
cat "$OUT/nvidia-smi-query.csv"
grep -E "Driver Version|CUDA Version|Product Name" "$OUT/nvidia-smi-q.txt" | head -5
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
uname -r; nproc

hdr BUILD
$PY shim/build.py --plain-gcc || exit 1
$PY shim/build.py --print-cmd
LIB=$PWD/shim/_build/libvgpu.so
LIBCUDA=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')
echo "libcuda: $LIBCUDA"
gcc -O2 -o shim/_build/cuprog tests/shim/prog/cuprog.c -ldl "$LIBCUDA" || exit 1
CUPROG=$PWD/shim/_build/cuprog
strings "$LIB" | grep -m1 "^kvgpu-shim [0-9]"
SCHED=$(mktemp -d)

# shim ID MEM_MIB CORES cmd...  -> run cmd under the shim with a fresh region
shim() {
    local id=$1 mem=$2 cores=$3; shift 3
    env LD_PRELOAD="$LIB" KVGPU_REGION_DIR="$(mktemp -d)" KVGPU_SCHED_DIR="$SCHED" \
        KVGPU_CLAIM="v1;claim=bench/$id;priority=1;dev=$UUID,$mem,$cores" "$@"
}

if want memory; then
hdr "MEMORY: NULL pointers and totals (C, driver API)"
echo -n "native null: "; $CUPROG null
echo -n "shim   null: "; shim null 3000 0 $CUPROG null
echo -n "native info: "; $CUPROG info
echo -n "shim   info: "; shim info 3000 0 $CUPROG info
echo -n "shim info limit>physical: "; shim big 200000 0 $CUPROG info

hdr "MEMORY: torch 256 MiB blocks"
echo -n "native: "; $PY bench/gpu/memtest.py 256
echo -n "shim 3000: "; shim m3000 3000 0 env KVGPU_LOG_LEVEL=3 $PY bench/gpu/memtest.py 256 --smi 2> "$OUT/shim-torch-stderr.txt"
grep -m3 -E "cuGetProcAddress|error|warning" "$OUT/shim-torch-stderr.txt"
hdr "MEMORY: torch 64 MiB blocks under 3000"
echo -n "shim 3000/64: "; shim m3000b 3000 0 $PY bench/gpu/memtest.py 64
hdr "MEMORY: 300 MiB limit, 16 MiB blocks"
echo -n "shim 300/16: "; shim m300 300 0 $PY bench/gpu/memtest.py 16 --smi
hdr "MEMORY: cudaMallocAsync backend"
echo -n "native async 256: "; PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync $PY bench/gpu/memtest.py 256
echo -n "shim async 3000/256: "; shim masync 3000 0 env PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync $PY bench/gpu/memtest.py 256
hdr "MEMORY: expandable segments (VMM: cuMemCreate/cuMemMap)"
echo -n "shim vmm 3000/256: "; shim mvmm 3000 0 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True $PY bench/gpu/memtest.py 256
fi
if want cpaths; then
hdr "MEMORY: every C path under 3000 MiB, 64 MiB chunks (NVML per-process while holding)"
# vmmarray(unmap): a VMM handle mapped into a sparse array's tiles, released at once (the array's
# mapping holds it; freed by the array's destroy or by unmapping the tiles); sparse, deferred,
# sparsemip: arrays whose memory is mapped in later, none of their own (60 of them: 3840 MiB if
# they were charged as dense arrays); the second line: cuMemGetInfo after freeing.
for p in alloc pitch async pool vmm vmmarray vmmarrayunmap array array3d mipmap sparse deferred sparsemip gpa gpa_v1 dlsym; do
    maxn=0
    case $p in sparse|deferred|sparsemip) maxn=60 ;; esac
    shim "c${p//_/-}" 3000 0 timeout -k 2 20 $CUPROG fill $p 67108864 $maxn 1.5 > "$OUT/c.txt" &
    pid=$!
    sleep 1.2
    used=$(timeout -k 2 10 nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')
    wait $pid
    echo "$p: $(tr '\n' ' ' < "$OUT/c.txt") nvml=[$used]"
done
echo -n "standalone nvidia-smi under a 3000 MiB claim: "
shim smi 3000 0 nvidia-smi --query-gpu=memory.total,memory.used,memory.free --format=csv,noheader

fi
if want compute; then
hdr "COMPUTE: 4096^2 fp32 matmul, ${SECS}s each"
$PY bench/gpu/matmul.py "$SECS" native
for c in 10 30 50 70 90; do shim "k$c" 140000 "$c" $PY bench/gpu/matmul.py "$SECS" "limit$c"; done
hdr "COMPUTE: two processes at once"
$PY bench/gpu/matmul.py "$SECS" pairA-native & p1=$!; $PY bench/gpu/matmul.py "$SECS" pairB-native; wait $p1
shim pa 70000 30 $PY bench/gpu/matmul.py "$SECS" pairA-30 & p1=$!; shim pb 70000 70 $PY bench/gpu/matmul.py "$SECS" pairB-70; wait $p1
fi
if want overhead; then
N=${BENCH_N:-200000}
hdr "OVERHEAD: cuprog bench $N (ns), 3 rounds"
for r in 1 2 3; do
    echo -n "native:      "; $CUPROG bench $N
    echo -n "shim off:    "; env LD_PRELOAD="$LIB" $CUPROG bench $N
    echo -n "shim mem:    "; shim o1 100000 0 $CUPROG bench $N
    echo -n "shim mem+99: "; shim o2 100000 99 $CUPROG bench $N
    # the gate's per-launch cost alone: limit on, but one 9.9 s window covers the whole run
    echo -n "shim mem+99 P=10s: "; shim o3 100000 99 env KVGPU_COMPUTE_PERIOD_MS=10000 $CUPROG bench $N
done
fi

if want startup; then
ROUNDS=${ROUNDS:-5}
hdr "STARTUP: first CUDA call (s), torch, $ROUNDS rounds"
for r in $(seq "$ROUNDS"); do
    echo "native $($PY bench/gpu/startup.py)  shim $(shim st 3000 30 $PY bench/gpu/startup.py)"
done
fi

if want seed && [ -f bench/gpu/seed-claim.env ]; then
    hdr "SEED WALK-THROUGH"
    cat bench/gpu/seed-claim.env
    set -a; . bench/gpu/seed-claim.env; set +a
    # Each fresh device machine has another card UUID: map the claim's first UUID to this card.
    CU=$(echo "$KVGPU_CLAIM" | sed -n 's/.*dev=\([^,]*\),.*/\1/p' | head -1)
    if [ -n "$CU" ] && [ "$CU" != "$UUID" ]; then
        echo "NOTE: the claim names $CU, this machine's card is $UUID: substituted"
        KVGPU_CLAIM=${KVGPU_CLAIM//$CU/$UUID}; NVIDIA_VISIBLE_DEVICES=${NVIDIA_VISIBLE_DEVICES//$CU/$UUID}
        echo "KVGPU_CLAIM=$KVGPU_CLAIM"
    fi
    RD=$(mktemp -d)
    echo "--- nvidia-smi under the seed claim"
    env LD_PRELOAD="$LIB" KVGPU_REGION_DIR="$RD" timeout -k 2 30 nvidia-smi
    echo "--- torch 256 MiB blocks under the seed claim"
    env LD_PRELOAD="$LIB" KVGPU_REGION_DIR="$RD" timeout -k 2 60 $PY bench/gpu/memtest.py 256 --smi
fi
hdr "DONE $(date -u +%FT%TZ)"
