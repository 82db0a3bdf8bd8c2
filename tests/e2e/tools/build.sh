#!/usr/bin/env bash
# Build the e2e runtime tier's tools into tests/e2e/tools/bin/ (git-ignored):
#   bin/cnitool                  libcni driver (Go, GOPATH mode, Debian's libcni sources)
#   bin/cri/cri_v1_pb2{,_grpc}.py  CRI client generated from cri/cri_v1.proto
#   bin/pause                    static pause binary
#   bin/rootfs.tar               busybox + pause rootfs (podman import)
#   bin/pause-oci.tar            OCI layout of the same (ctr images import); name in bin/image-ref
# The pause binary and the images come from the labs' image builder (lab/kubernetes/images.py,
# cached under /var/cache/tabby/kubernetes/images), so the Kubernetes lab and this tier share
# one definition of them.
# Needs what install-deps.sh installs. PYTHON selects the interpreter with grpcio-tools.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
BIN="$HERE/bin"
PYTHON="${PYTHON:-python3}"
mkdir -p "$BIN/cri"

echo "build: cnitool"
gopath="$BIN/.gopath"
mkdir -p "$gopath" "$BIN/.gocache"
(
    cd "$HERE/cnitool"
    GO111MODULE=off GOPATH="/usr/share/gocode:$gopath" GOCACHE="$BIN/.gocache" GOFLAGS= \
        CGO_ENABLED=0 go build -trimpath -o "$BIN/cnitool" .
)

echo "build: CRI client"
"$PYTHON" -m grpc_tools.protoc -I "$HERE/cri" \
    --python_out="$BIN/cri" --grpc_python_out="$BIN/cri" "$HERE/cri/cri_v1.proto"

echo "build: pause + image (lab.kubernetes.images)"
(cd "$REPO" && "$PYTHON" -m lab.kubernetes.images --e2e "$BIN")

echo "build: ok ($BIN)"
