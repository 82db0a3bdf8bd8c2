#!/usr/bin/env bash
# The whole test suite: build + install the binaries, then every tier.
#
#   bash tests/run.sh               build, install, fuzz every target for a bounded time, run
#                                    unit + privileged + e2e + cluster + Kubernetes tiers, then
#                                    the e2e tier again through tabby-node
#   bash tests/run.sh --no-build    reuse the installed binaries
#   bash tests/run.sh --no-kubernetes   skip the Kubernetes tier (and building Kubernetes,
#                                    ~7 min the first time on a machine)
#   bash tests/run.sh --unit        the whole unit tier, slow tests included (no root, no build)
#   bash tests/run.sh --quick       what to run while working (under a minute on 2 cores): the
#                                    unit tier without its slow tests (tests/selection.py), on
#                                    up to 4 processes (pytest-xdist)
#   any other arguments go to pytest (e.g. -k dataplane, -x)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."

BUILD=1 UNIT_ONLY=0 QUICK=0 KUBERNETES=1 args=()
for a in "$@"; do
  case "$a" in
    --no-build) BUILD=0 ;;
    --no-kubernetes) KUBERNETES=0 ;;
    --unit) UNIT_ONLY=1; BUILD=0 ;;
    --quick) UNIT_ONLY=1; QUICK=1; BUILD=0 ;;
    *) args+=("$a") ;;
  esac
done

if [ "$UNIT_ONLY" = 1 ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/python -c 'import pytest, xdist, hypothesis' 2>/dev/null || .venv/bin/pip install -q -e '.[dev]'
  # Compiled test modules are kept (__pycache__, ignored by git): pytest rewrites and
  # compiles every test module again in each process otherwise (~4 s of a quick run's 45).
  unset PYTHONDONTWRITEBYTECODE
  if [ "$QUICK" = 1 ]; then
    workers=$(nproc); [ "$workers" -le 4 ] || workers=4
    exec .venv/bin/python -m pytest tests/unit -n "$workers" "${args[@]}"
  fi
  exec .venv/bin/python -m pytest tests/unit --run-slow "${args[@]}"
fi

if [ "$(id -u)" != 0 ]; then
  echo "tests/run.sh: the privileged and e2e tiers need root (or use --unit)" >&2
  exit 2
fi

if [ "$BUILD" = 1 ]; then
  ./build.sh --no-demo
fi
# The real runtimes the e2e tier drives (libcni, podman, containerd, reference plugins),
# what the cluster tier and the datastore tests run (etcd, BIRD 2, nftables, openssl for
# test certificates), mmdebstrap for the image tier (tests/image builds the container image
# from the installed bundle; its Debian root is made once per machine), Prometheus (promtool
# for the alert rules' tests, a real server scraping the cluster tier's lab), then the test
# tooling built from tests/e2e/tools (libcni driver, CRI client, pause image).
if [ "${TABBY_SKIP_DEPS:-0}" != 1 ]; then
  [ -d /var/lib/apt/lists ] && [ -n "$(ls -A /var/lib/apt/lists 2>/dev/null | head -1)" ] \
    || apt-get update -qq
  PYTHON=$PWD/.venv/bin/python bash tests/e2e/tools/install-deps.sh
  missing=()
  for pair in etcd:etcd-server bird:bird2 nft:nftables openssl:openssl unshare:util-linux \
              mmdebstrap:mmdebstrap promtool:prometheus; do
    command -v "${pair%%:*}" >/dev/null || missing+=("${pair##*:}")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
  fi
fi
PYTHON=$PWD/.venv/bin/python bash tests/e2e/tools/build.sh
# The Kubernetes tier: kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and
# kubectl built from Debian's kubernetes source package when this machine has not built them
# yet (~7 min, once; cached under /var/cache/tabby/kubernetes), and what the lab runs
# besides (containerd, runc, Debian's loopback plugin, busybox-static and gcc for the
# images: install-deps.sh above; openssl, etcd, BIRD, nftables: the list above).
kube_args=()
if [ "$KUBERNETES" = 1 ]; then
  .venv/bin/python -m lab.kubernetes.build
  kube_args=(--run-kubernetes)
fi
# Fuzzing (docs/testing.md "Fuzzing"): every atheris target for TABBY_FUZZ_SECONDS (20 by
# default; ~3 min for the 8 targets) from its corpus in tests/fuzz/corpus; a crash fails the
# run and prints the input that did it. Their properties also run in the unit tier.
.venv/bin/python -m tests.fuzz
# Every tier with the binaries standing alone (the default: no daemon; the cluster tier
# runs tabby-node on its nodes), then the e2e tier again with tabby-node serving the calls
# (the whole e2e tier passes both ways).
.venv/bin/python -m pytest --run-privileged --run-e2e "${kube_args[@]}" "${args[@]}"
TABBY_E2E_NODE=1 .venv/bin/python -m pytest --run-privileged --run-e2e "${args[@]}" tests/e2e
