#!/usr/bin/env bash
# Packs what bench/scale/run.py needs on a remote x86-64 machine that has no internet
# (Python 3.12 with a fixed set of packages, see REMOTE below) into two git-ignored folders:
#   .whl/         cp312 manylinux wheels of every runtime dependency the remote lacks
#   .ktp/ktp.xz   the control-plane binary (etcd, kube-apiserver, ... in one), xz-compressed
# Carry both to the remote and run bench/scale/device.sh there. Needs the .venv from
# `make install` (versions are pinned to it, so the remote runs the same code as CI).
#
# With --realnode (for bench/gpu/realnode.sh: a real kubelet + containerd node with the GPU), the
# wheels are unpacked into one xz tarball instead (a solid archive of the pure-Python packages is
# a third of their wheels), and the node's runtime is packed beside it:
#   .rn/site.tar.xz   the unpacked wheels (a site-packages folder)
#   .rn/rn.tar.xz     bin/{containerd,containerd-shim-runc-v2,ctr,runc} and cni/{bridge,host-local,loopback}
#   .rn/proto/        the agent's generated gRPC stubs (git-ignored here; no grpcio-tools there)
# protobuf is carried (not taken from the remote) so the stubs meet the runtime they were made for.
# Carry .ktp and .rn (not .whl).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
VPY=.venv/bin/python
LIMIT_MIB=60   # .whl + .ktp (or .rn + .ktp); the remote copy (work tree included) is capped at 64 MiB
REALNODE=0; [ "${1:-}" = "--realnode" ] && REALNODE=1
[ -x "$VPY" ] || { echo "device_bundle: $root/$VPY missing; run 'make install' first" >&2; exit 1; }

# Installed on the remote image already: neither carried nor followed into their dependencies.
REMOTE="aiohttp aiosignal frozenlist multidict yarl propcache attrs certifi charset-normalizer idna
 urllib3 requests six python-dateutil pyyaml psutil prometheus-client grpcio
 typing-extensions uvloop click numpy matplotlib hypothesis pytest packaging"
# Third-party imports of bench/scale beyond the kvgpu package's own dependencies.
BENCH="kubernetes-asyncio"

# a) The transitive closure of pyproject's [project] dependencies + BENCH, walked through the
#    metadata of the local venv (markers evaluated for CPython 3.12 on Linux x86-64, extras
#    skipped), one NAME==VERSION per distribution, pinned to the installed version.
pins=$("$VPY" - "$REMOTE" "$BENCH" <<'EOF'
import re, sys, tomllib
from importlib.metadata import PackageNotFoundError, distribution
from packaging.requirements import Requirement
from packaging.markers import default_environment

def canon(n): return re.sub(r"[-_.]+", "-", n).lower()
provided = {canon(n) for n in sys.argv[1].split()}
roots = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] + sys.argv[2].split()
env = default_environment() | {"python_version": "3.12", "python_full_version": "3.12.3",
       "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
pins, todo = {}, [Requirement(r) for r in roots]
while todo:
    req = todo.pop()
    name = canon(req.name)
    if name in provided or name in pins or (req.marker and not req.marker.evaluate(env)):
        continue
    try:
        dist = distribution(req.name)
    except PackageNotFoundError:
        sys.exit(f"device_bundle: {req} is needed on 3.12 but not installed in .venv")
    pins[name] = dist.version
    todo += [Requirement(r) for r in dist.requires or []]
print(" ".join(f"{n}=={v}" for n, v in sorted(pins.items())))
EOF
)
echo "device_bundle: $(wc -w <<<"$pins") wheels: $pins" >&2
rm -rf .whl && mkdir .whl   # wiped: exactly one version of each, nothing stale
# shellcheck disable=SC2086  # $pins is a word list on purpose
"$VPY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins
n=$(find .whl -type f -name '*.whl' | wc -l)
[ "$n" -eq "$(wc -w <<<"$pins")" ] || { echo "device_bundle: $n wheels for $(wc -w <<<"$pins") pins" >&2; exit 1; }

# b) The ktp binary (built or taken from its cache); recompressed only when the build changed,
#    since xz of ~134 MB takes a while. build.sh prints the bin directory on its last line.
bin=$(hack/ktp/build.sh | tail -n1)
mkdir -p .ktp
if [ "$(cat .ktp/source 2>/dev/null)" != "$bin" ] || [ ! -s .ktp/ktp.xz ]; then
  xz -T2 -6 -c "$bin/ktp" >.ktp/ktp.xz.tmp && mv .ktp/ktp.xz.tmp .ktp/ktp.xz
  echo "$bin" >.ktp/source
fi

# c) --realnode: the wheels unpacked into one solid archive, and the node's runtime: containerd
#    built by hack/realnode/build.sh, runc and the CNI plugins from the distribution's packages.
carried=".whl .ktp"
if [ "$REALNODE" = 1 ]; then
  stage=$(mktemp -d); trap 'rm -rf "$stage"' EXIT
  mkdir -p "$stage/site" "$stage/rn/bin" "$stage/rn/cni" .rn
  for w in .whl/*.whl; do "$VPY" -m zipfile -e "$w" "$stage/site"; done
  tar -C "$stage/site" -cf - . | xz -T2 -9 >.rn/site.tar.xz
  ctrd=$(hack/realnode/build.sh | tail -n1)
  cp "$ctrd"/{containerd,containerd-shim-runc-v2,ctr} "$(command -v runc)" "$stage/rn/bin/"
  for p in bridge host-local loopback; do cp "/usr/lib/cni/$p" "$stage/rn/cni/"; done
  if [ "$(cat .rn/source 2>/dev/null)" != "$ctrd" ] || [ ! -s .rn/rn.tar.xz ]; then
    tar -C "$stage/rn" -cf - . | xz -T2 -9 >.rn/rn.tar.xz
    echo "$ctrd" >.rn/source
  fi
  rm -rf .rn/proto && mkdir -p .rn/proto && cp operator/kvgpu/agent/proto/*_pb2*.py .rn/proto/
  carried=".rn .ktp"
fi

# d) Sizes: the carried folders must leave room for the work tree under the 64 MiB copy cap.
# shellcheck disable=SC2086  # $carried is a word list on purpose
du -h $carried | sort -h >&2
# shellcheck disable=SC2086
total=$(du -cb $carried | tail -n1 | cut -f1)
tree=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -n1 | cut -f1 || true)
echo "device_bundle: $carried = $((total >> 20)) MiB (limit $LIMIT_MIB); work tree $((tree >> 20)) MiB" >&2
[ "$total" -le $((LIMIT_MIB << 20)) ] || { echo "device_bundle: bundle above $LIMIT_MIB MiB" >&2; exit 1; }
