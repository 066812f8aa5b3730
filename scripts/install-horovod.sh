#!/usr/bin/env bash
# Build and install real Horovod 0.28.1 (the last release) for synctune's `horovod` runtime.
#
# Why a script rather than a pip extra: Horovod 0.28.1 as published does not build or run here
# as it is. This script takes the source distribution from the package index (nothing else is
# downloaded), applies these fixes, and builds a CPU wheel with the gloo controller (no MPI, no
# CUDA):
#   1. C++17 for the core and the torch extension (torch >= 2.1's headers need it; Horovod's
#      CMakeLists ask for C++14);
#   2. a process set's gloo device uses the interface Horovod was started with
#      (HOROVOD_GLOO_IFACE). As published, GlooContext::InitializeForProcessSet reads the
#      process set's own, never-set interface and falls back to the hostname's address; where the
#      hostname resolves to loopback (network namespaces, containers) the global process set then
#      listens on 127.0.0.1 and ranks on other hosts abort with "connect [127.0.0.1]: Connection
#      refused";
#   3. with TensorFlow installed, its binding is built too, without Horovod's XLA ops:
#      horovod/tensorflow/xla_mpi_ops.cc includes TensorFlow's xla/printer.h, which includes
#      highwayhash/arch_specific.h, a header the tensorflow wheel does not ship (TensorFlow 2.21).
#      The XLA ops serve only HOROVOD_ENABLE_XLA_OPS=1, which synctune never sets.
#
# Usage: scripts/install-horovod.sh      (python3; override with PYTHON=...; SYNCTUNE_HVD_TF=0
#                                         skips the TensorFlow binding even where TensorFlow is)
# The wheel is cached in ${SYNCTUNE_HVD_CACHE:-~/.cache/synctune/horovod/...}: a second run is fast.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VERSION=0.28.1
FIXES=fix3  # the fixes' revision: a wheel or an install made with fewer fixes is never reused

WITH_TF=0
if [ "${SYNCTUNE_HVD_TF:-auto}" != "0" ] && "$PYTHON" -c "import tensorflow" >/dev/null 2>&1; then
    WITH_TF=1
fi
FLAVOUR="$FIXES-$([ "$WITH_TF" = 1 ] && echo torch-tf || echo torch)"
CACHE="${SYNCTUNE_HVD_CACHE:-$HOME/.cache/synctune/horovod}/$FLAVOUR"
mkdir -p "$CACHE"

marker() {
    "$PYTHON" -c 'import horovod, os; print(os.path.join(os.path.dirname(horovod.__file__), ".synctune-'"$FLAVOUR"'"))' \
        2>/dev/null || true
}
MARKER="$(marker)"
if [ -n "$MARKER" ] && [ -f "$MARKER" ] && "$PYTHON" -c "import horovod.torch" >/dev/null 2>&1; then
    echo "horovod: already installed ($FLAVOUR)"
    exit 0
fi

WHEEL="$(ls "$CACHE"/horovod-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$WHEEL" ]; then
    WORK="$(mktemp -d)"
    trap 'rm -rf "$WORK"' EXIT
    echo "horovod: fetching the $VERSION source distribution from the package index"
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: "horovod==$VERSION" -d "$WORK"
    tar xzf "$WORK/horovod-$VERSION.tar.gz" -C "$WORK"
    SRC="$WORK/horovod-$VERSION"
    apply() {  # apply() FILE CHECK-PATTERN WHAT SED-SCRIPT
        sed -i "$4" "$SRC/$1"
        grep -q "$2" "$SRC/$1" || { echo "horovod: fix '$3' did not apply to $1" >&2; exit 1; }
    }
    apply CMakeLists.txt 'CMAKE_CXX_STANDARD 17' "C++17" 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/'
    apply horovod/torch/CMakeLists.txt 'CMAKE_CXX_STANDARD 17' "C++17" \
        's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/'
    apply horovod/common/gloo/gloo_context.cc 'device_attr.iface = global_context.gloo_iface_;' "process-set interface" \
        '/GlooContext::InitializeForProcessSet/,/CreateDevice/ s/device_attr.iface = gloo_iface_;/device_attr.iface = global_context.gloo_iface_;/'
    # Horovod's build needs these importable (it imports torch, and TensorFlow, to find headers).
    "$PYTHON" -m pip install -q -c constraints.txt cloudpickle psutil pyyaml packaging cffi wheel
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
        HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo HOROVOD_GPU_OPERATIONS= \
        MAKEFLAGS="-j$(nproc)"
    if [ "$WITH_TF" = 1 ]; then
        sed -i '/xla_mpi_ops.cc/d' "$SRC/horovod/tensorflow/CMakeLists.txt"
        ! grep -q 'xla_mpi_ops.cc' "$SRC/horovod/tensorflow/CMakeLists.txt" \
            || { echo "horovod: fix 'no XLA ops' did not apply" >&2; exit 1; }
        export HOROVOD_WITH_TENSORFLOW=1
    else
        export HOROVOD_WITHOUT_TENSORFLOW=1
    fi
    echo "horovod: building $FLAVOUR (CPU, gloo; a few minutes on a small machine)"
    "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation "$SRC" -w "$CACHE"
    WHEEL="$(ls "$CACHE"/horovod-"$VERSION"-*.whl | head -n1)"
fi
"$PYTHON" -m pip install -q --force-reinstall --no-deps -c constraints.txt "$WHEEL"
"$PYTHON" -m pip install -q -c constraints.txt cloudpickle psutil pyyaml packaging cffi
"$PYTHON" -c "import horovod.torch as hvd; assert hvd.gloo_built(), 'horovod built without gloo'"
if [ "$WITH_TF" = 1 ]; then
    "$PYTHON" -c "import os; os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'; import horovod.tensorflow" 2>/dev/null \
        || { echo "horovod: the TensorFlow binding does not load" >&2; exit 1; }
fi
touch "$(marker)"
echo "horovod: installed $VERSION ($FLAVOUR)"
