#!/usr/bin/env bash
# Build, check and install tabby, then run the demo (the main job).
#
#   ./build.sh                 lint/type gate, freeze, install, smoke-test, run the cluster demo
#                              (`tabbyctl demo --nodes 3 --backend bird`)
#   ./build.sh --no-demo       same without the demo (CI, tests)
#   ./build.sh --no-checks     skip ruff/mypy (quick local rebuilds)
#   ./build.sh --bundle-dir D --cni-bin-dir C --bin-dir B   install elsewhere
#   ./build.sh --destdir D     stage the install under D (packaging); no smoke test, no demo
#   ./build.sh --image         then the container image: build/tabby-<tag>.oci.tar, a Debian
#                              root (mmdebstrap, cached in /var/cache/tabby/image-root) and
#                              the bundle; prints its reference, localhost/tabby:<version>
#                              (TABBY_IMAGE_NAME / TABBY_IMAGE_TAG choose another)
#
# Installed layout (defaults):
#   /opt/tabby/                  the frozen onedir bundle (one executable, role from argv[0])
#   /opt/cni/bin/tabby           -> /opt/tabby/tabby
#   /opt/cni/bin/tabby-ipam      -> /opt/tabby/tabby
#   /usr/local/bin/tabbyctl      -> /opt/tabby/tabby
#   /usr/local/bin/tabby-node    -> /opt/tabby/tabby
#   /usr/local/bin/tabby-kube-controllers -> /opt/tabby/tabby
#   /usr/local/bin/tabby-typha -> /opt/tabby/tabby
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")"

DEMO=1 CHECKS=1 IMAGE=0 DESTDIR="" BUNDLE_DIR=/opt/tabby CNI_BIN=/opt/cni/bin BIN_DIR=/usr/local/bin
while [ $# -gt 0 ]; do
  case "$1" in
    --no-demo) DEMO=0 ;;
    --no-checks) CHECKS=0 ;;
    --image) IMAGE=1 ;;
    --destdir) DESTDIR=$2; DEMO=0; shift ;;
    --bundle-dir) BUNDLE_DIR=$2; shift ;;
    --cni-bin-dir) CNI_BIN=$2; shift ;;
    --bin-dir) BIN_DIR=$2; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

say() { printf '\n==> %s\n' "$*"; }

# System packages the programs and the demo use at run time: iproute2 (netns), ping (the
# reachability proof), BIRD 2 (tabby-node's BGP backend), nftables (NetworkPolicy; its
# libnftables), etcd (the cluster datastore the demo runs). Only when missing, as root.
need=()
command -v ip >/dev/null || need+=(iproute2)
command -v ping >/dev/null || need+=(iputils-ping)
command -v bird >/dev/null || need+=(bird2)
command -v nft >/dev/null || need+=(nftables)
command -v etcd >/dev/null || need+=(etcd-server)
# The image's Debian root is made by mmdebstrap (packaging/image.py).
if [ "$IMAGE" = 1 ] && ! command -v mmdebstrap >/dev/null; then need+=(mmdebstrap); fi
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing ${need[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "build.sh: please install ${need[*]}" >&2
  fi
fi

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.11 python3; do
    if command -v "$c" >/dev/null; then PY=$(command -v "$c"); break; fi
  done
fi
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $PY"
  "$PY" -m venv .venv || {
    [ "$(id -u)" = 0 ] && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    "$PY" -m venv .venv
  }
fi
VPY=$PWD/.venv/bin/python
say "installing Python dependencies"
# (pip's warnings about this machine's extra index locations are noise: filtered out)
"$VPY" -m pip install -q --disable-pip-version-check -e '.[dev]' 2> >(grep -v "^WARNING: Location" >&2)

if [ "$CHECKS" = 1 ]; then
  say "lint and type gate (ruff, mypy --strict)"
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
  .venv/bin/mypy
fi

say "freezing with PyInstaller (onedir)"
.venv/bin/pyinstaller --noconfirm --clean --log-level WARN \
  --distpath build/dist --workpath build/work packaging/tabby.spec

say "installing into ${DESTDIR:-/}"
install -d -m 0755 "$DESTDIR$BUNDLE_DIR" "$DESTDIR$CNI_BIN" "$DESTDIR$BIN_DIR"
# Replace the bundle atomically enough: copy beside, then swap, so a runtime exec'ing the
# plugin during an upgrade sees either the old or the new bundle.
rm -rf "$DESTDIR$BUNDLE_DIR.new"
cp -a build/dist/tabby "$DESTDIR$BUNDLE_DIR.new"
rm -rf "$DESTDIR$BUNDLE_DIR.old"
[ -e "$DESTDIR$BUNDLE_DIR" ] && mv "$DESTDIR$BUNDLE_DIR" "$DESTDIR$BUNDLE_DIR.old"
mv "$DESTDIR$BUNDLE_DIR.new" "$DESTDIR$BUNDLE_DIR"
rm -rf "$DESTDIR$BUNDLE_DIR.old"
ln -sfn "$BUNDLE_DIR/tabby" "$DESTDIR$CNI_BIN/tabby"
ln -sfn "$BUNDLE_DIR/tabby" "$DESTDIR$CNI_BIN/tabby-ipam"
ln -sfn "$BUNDLE_DIR/tabby" "$DESTDIR$BIN_DIR/tabbyctl"
ln -sfn "$BUNDLE_DIR/tabby" "$DESTDIR$BIN_DIR/tabby-node"
ln -sfn "$BUNDLE_DIR/tabby" "$DESTDIR$BIN_DIR/tabby-kube-controllers"
ln -sfn "$BUNDLE_DIR/tabby" "$DESTDIR$BIN_DIR/tabby-typha"

# The container image (packaging/image.py): the Debian root is made once per machine
# (~40 s, the machine's mirror), then only the bundle is packed again (~5 s).
build_image() {
  say "container image: Debian root + the bundle, as an OCI archive"
  "$VPY" packaging/image.py --bundle build/dist/tabby
}

if [ -n "$DESTDIR" ]; then
  say "staged under $DESTDIR"
  if [ "$IMAGE" = 1 ]; then build_image; fi
  exit 0
fi

say "smoke test: VERSION of the installed plugins (podman's dummy env)"
for p in "$CNI_BIN/tabby" "$CNI_BIN/tabby-ipam"; do
  out=$(echo '{"cniVersion":"1.1.0"}' | env -i CNI_COMMAND=VERSION CNI_PATH=dummy \
        CNI_NETNS=dummy CNI_IFNAME=dummy "$p")
  echo "$p: $out"
  case "$out" in
    *'"supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0","1.1.0"]'*) ;;
    *) echo "build.sh: VERSION smoke test of $p failed" >&2; exit 1 ;;
  esac
done
"$BIN_DIR/tabbyctl" version

if [ "$DEMO" = 1 ]; then
  say "main job: the cluster demo (3 nodes, etcd, BIRD, pods across nodes, a NetworkPolicy)"
  "$BIN_DIR/tabbyctl" demo --nodes 3 --backend bird
fi

if [ "$IMAGE" = 1 ]; then
  build_image
fi
