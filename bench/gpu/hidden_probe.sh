#!/usr/bin/env bash
# Device call, from the repository root, alone on the card: the driver's behaviour behind the
# shim's rules for memory the hooks do not see (bench/gpu/hidden_probe.c, no shim), then two
# processes of one container under the shim (claim 4000 MiB): the first leaves 3000 MiB the
# hooks do not count (a graph allocation past its executable graph; POOLCACHE=1: a pool's cache)
# and idles, the second starts and allocates: the container must be charged with the first's.
#   bash bench/gpu/hidden_probe.sh > $OUT/hidden-probe.log 2>&1
set -u
cd "$(dirname "$0")/../.."
B=$(mktemp -d)
gcc -O2 -o "$B/hidden_probe" bench/gpu/hidden_probe.c -l:libcuda.so.1 &&
    gcc -O2 -o "$B/graph_leak" bench/gpu/graph_leak.c -ldl -l:libcuda.so.1 || exit 1
echo "== probes"; timeout 120 "$B/hidden_probe"
python3 shim/build.py --plain-gcc >/dev/null 2>&1 || echo "shim build failed"
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
for v in graph pool; do
    echo "== shim, two processes of one container: $v, claim 4000 MiB"
    export KVGPU_REGION_DIR=$(mktemp -d) KVGPU_CLAIM="v1;claim=a/b;priority=1;dev=$UUID,4000,0"
    E=""; [ $v = pool ] && E="POOLCACHE=1"
    env $E LD_PRELOAD=shim/_build/libvgpu.so "$B/graph_leak" 3000 0 25 & A=$!
    sleep 6
    LD_PRELOAD=shim/_build/libvgpu.so "$B/graph_leak" 0 64 8 & C=$!
    sleep 5; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
    nvidia-smi --query-gpu=memory.used --format=csv,noheader
    kill $A $C; wait 2>/dev/null
done
