#!/usr/bin/env bash
# Device call, from the repository root, alone on the card: module globals under the shim
# (vgpu_mem_module.c). The driver-API loads of tests/shim/prog/memprog.c (PTX with a __device__
# array) natively and under a 2000 MiB claim, then a cudart program with a 1 GiB __device__ array
# (bench/gpu/module_probe.cu; 2 GiB of host shadow overflowed the link's relocations) with lazy
# and eager module loading, natively and under a 1200 MiB claim.
#   bash bench/gpu/module_probe.sh > $OUT/module-probe.log 2>&1
set -u
cd "$(dirname "$0")/../.."
B=$(mktemp -d)
gcc -O2 -o "$B/memprog" tests/shim/prog/memprog.c -ldl -l:libcuda.so.1 || exit 1
nvcc -O2 -arch=sm_90 -cudart shared -DBIG_MIB=1024 -o "$B/module_probe" bench/gpu/module_probe.cu || echo "nvcc failed"
python3 shim/build.py --plain-gcc >/dev/null 2>&1 || { echo "shim build failed"; exit 1; }
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
CHUNK=$((64 << 20))
shim() { KVGPU_REGION_DIR=$(mktemp -d) KVGPU_CLAIM="v1;claim=a/b;priority=1;dev=$UUID,2000,0" \
    LD_PRELOAD=shim/_build/libvgpu.so "$@"; }
echo "== native: one 2048 MiB module"
"$B/memprog" module data 1 2048 $CHUNK
for how in data dataex file lib libfile; do
    echo "== shim 2000 MiB, $how: two of 300 MiB, then one of 2048 MiB"
    shim "$B/memprog" module $how 2 300 $CHUNK
    shim "$B/memprog" module $how 1 2048 $CHUNK
done
echo "== shim 2000 MiB, twenty modules of 60 MiB"
shim "$B/memprog" module data 20 60 $CHUNK
for m in LAZY EAGER; do
    echo "== shim 2000 MiB, CUDA_MODULE_LOADING=$m, libget: two of 300 MiB"
    CUDA_MODULE_LOADING=$m shim "$B/memprog" module libget 2 300 $CHUNK
done
[ -x "$B/module_probe" ] || exit 0
for m in LAZY EAGER; do
    echo "== cudart, 1 GiB __device__ array, CUDA_MODULE_LOADING=$m: native"
    CUDA_MODULE_LOADING=$m timeout 60 "$B/module_probe"
    echo "== ... under a 1200 MiB claim"
    CUDA_MODULE_LOADING=$m timeout 60 env KVGPU_REGION_DIR=$(mktemp -d) \
        KVGPU_CLAIM="v1;claim=a/b;priority=1;dev=$UUID,1200,0" LD_PRELOAD=shim/_build/libvgpu.so "$B/module_probe"
done
echo "== cudart, lazy loading, under a 1200 MiB claim with ACTIVE_OOM_KILLER=true"
timeout 60 env KVGPU_REGION_DIR=$(mktemp -d) ACTIVE_OOM_KILLER=true \
    KVGPU_CLAIM="v1;claim=a/b;priority=1;dev=$UUID,1200,0" LD_PRELOAD=shim/_build/libvgpu.so "$B/module_probe"
echo "exit $?"
# What the hooks cost a torch start (its libraries' loads): the first matmul's answer, three
# times each, this tree's shim against MODULE_BASE_TAR's (a `git archive` of shim/ without them).
[ -n "${MODULE_BASE_TAR:-}" ] || exit 0
mkdir -p "$B/base" && tar -xJf "$MODULE_BASE_TAR" -C "$B/base" &&
    (cd "$B/base" && python3 shim/build.py --plain-gcc >/dev/null 2>&1) || { echo "base shim build failed"; exit 0; }
T='import time, torch; t = time.time(); x = torch.randn(1024, 1024, device="cuda"); (x @ x).sum().item(); print(round(time.time() - t, 3))'
for i in 1 2 3; do
    for lib in shim/_build/libvgpu.so "$B/base/shim/_build/libvgpu.so"; do
        echo "torch first matmul, $lib: $(KVGPU_REGION_DIR=$(mktemp -d) KVGPU_CLAIM="v1;claim=a/b;priority=1;dev=$UUID,8000,0" \
            LD_PRELOAD=$lib python3 -c "$T" 2>&1 | tail -1)"
    done
done
