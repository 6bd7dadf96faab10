#!/usr/bin/env bash
# The seed walk-through as a real pod on the H200 machine: the local control plane, a real
# kubelet + containerd node holding the real GPU, the agent with real NVML, the operator; then
# the seed's pod (1 card, 3000 MiB, 30 %) runs and is checked from inside with kubectl exec.
#
# Here (the development machine), once:   hack/device_bundle.sh --realnode
# Device call (carry [".ktp", ".rn"], from the repository root):
#   bash bench/gpu/realnode.sh            # output in $OUT (or bench/results/raw)
#   KVGPU_RN_PARTS=dra bash bench/gpu/realnode.sh   # DRA mode: the seed via a claim template
#   KVGPU_RN_PARTS=mps bash bench/gpu/realnode.sh   # MPS: the kvgpu-mps owner as a pod, two clients
#   KVGPU_RN_PARTS=backstop bash bench/gpu/realnode.sh  # two tenants past their limit, killed by the agent
#   KVGPU_RN_PARTS=workloads bash bench/gpu/realnode.sh # the suite's training, inference, co-tenants as pods
# The copy (work tree + .ktp + .rn) must stay under 64 MiB. If bench/results/ and docs/img/ take it
# over, leave them out of the index for the call (`git rm -r -q --cached bench/results docs/img`,
# both listed in .git/info/exclude) and put them back after it (`git reset -q HEAD -- bench/results
# docs/img`, the exclude lines removed): the files stay on disk throughout.
# The scenario itself is bench/gpu/realnode_run.py; this script only unpacks what was carried.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/raw}; mkdir -p "$OUT"
B=${KVGPU_RN_HOME:-$HOME/kvgpu-rn}
exec > >(tee "$OUT/realnode-h200.log") 2>&1
hdr() { echo; echo "=== $* ==="; }

hdr "REALNODE $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=uuid,index,name,memory.total,driver_version --format=csv
mkdir -p "$B/ktp" "$B/rn" "$B/site"
[ -x "$B/ktp/ktp" ] || xz -dc .ktp/ktp.xz >"$B/ktp/ktp" && chmod +x "$B/ktp/ktp"
for c in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet; do ln -sf ktp "$B/ktp/$c"; done
[ -x "$B/rn/bin/containerd" ] || xz -dc .rn/rn.tar.xz | tar -C "$B/rn" -xf -
rm -rf "$B/site" && mkdir -p "$B/site" && xz -dc .rn/site.tar.xz | tar -C "$B/site" -xf -
mkdir -p /opt/cni/bin && cp "$B"/rn/cni/* /opt/cni/bin/
cp .rn/proto/*.py operator/kvgpu/agent/proto/   # the generated gRPC stubs (no grpcio-tools here)
"$B/ktp/kubelet" --version; "$B/rn/bin/containerd" --version; "$B/rn/bin/runc" --version | head -1

hdr BUILD
python3 shim/build.py --plain-gcc || exit 1
mkdir -p bench/gpu/_build && gcc -O2 -Wall -o bench/gpu/_build/escape_direct bench/gpu/escape_direct.c -ldl || exit 1

export PATH="$B/rn/bin:$PATH" PYTHONPATH="$B/site:$PWD/operator" KVGPU_KTP_BIN="$B/ktp" \
       KVGPU_CONTAINERD_BIN="$B/rn/bin" PYTHONUNBUFFERED=1
timeout -k 10 480 python3 bench/gpu/realnode_run.py --run-dir "$B/run" --out "$OUT" \
  --parts "${KVGPU_RN_PARTS:-seed,isolation}"
echo "realnode_run exit $?"
