#!/usr/bin/env bash
# Build and install real Horovod 0.28.1 (the last release) for synctune's `horovod` runtime.
#
# Why a script rather than a pip extra: Horovod 0.28.1 as published does not compile against
# torch >= 2.1, whose headers need C++17, while Horovod's CMakeLists set C++14 for the core and
# the torch extension. This script takes the source distribution from the package index (nothing
# else is downloaded), applies two fixes and builds a CPU wheel with the gloo controller (no MPI,
# no CUDA):
#   1. C++17 for the core and the torch extension (torch's headers need it);
#   2. a process set's gloo device uses the interface Horovod was started with
#      (HOROVOD_GLOO_IFACE). As published, GlooContext::InitializeForProcessSet reads the
#      process set's own, never-set interface and falls back to the hostname's address; where the
#      hostname resolves to loopback (network namespaces, containers) the global process set then
#      listens on 127.0.0.1 and ranks on other hosts abort with "connect [127.0.0.1]: Connection
#      refused".
# The TensorFlow extension is built only with SYNCTUNE_HVD_TF=1; against TensorFlow 2.21 it does
# not compile: horovod/tensorflow/xla_mpi_ops.cc includes TensorFlow's xla/printer.h, which
# includes highwayhash/arch_specific.h, a header the tensorflow wheel does not ship.
#
# Usage: scripts/install-horovod.sh            (uses python3; override with PYTHON=...)
# The wheel is cached in ${SYNCTUNE_HVD_CACHE:-~/.cache/synctune/horovod} so a second run is fast.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VERSION=0.28.1
# The cache folder names the fixes' revision: a wheel built with fewer fixes is never reused.
CACHE="${SYNCTUNE_HVD_CACHE:-$HOME/.cache/synctune/horovod/fix2}"
mkdir -p "$CACHE"

MARKER="$("$PYTHON" -c 'import horovod, os; print(os.path.join(os.path.dirname(horovod.__file__), ".synctune-fix2"))' 2>/dev/null || true)"
if [ -n "$MARKER" ] && [ -f "$MARKER" ] && "$PYTHON" -c "import horovod.torch" >/dev/null 2>&1; then
    echo "horovod: already installed ($("$PYTHON" -c 'import horovod; print(horovod.__version__)'))"
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
    # The one fix: torch's headers require C++17.
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/horovod/torch/CMakeLists.txt" \
        || { echo "horovod: the C++17 patch did not apply" >&2; exit 1; }
    # Fix 2: process sets' gloo devices on HOROVOD_GLOO_IFACE (see the header).
    sed -i '/GlooContext::InitializeForProcessSet/,/CreateDevice/ s/device_attr.iface = gloo_iface_;/device_attr.iface = global_context.gloo_iface_;/' \
        "$SRC/horovod/common/gloo/gloo_context.cc"
    grep -q 'device_attr.iface = global_context.gloo_iface_;' "$SRC/horovod/common/gloo/gloo_context.cc" \
        || { echo "horovod: the process-set interface patch did not apply" >&2; exit 1; }
    # Horovod's build needs these importable (it imports torch to find its headers).
    "$PYTHON" -m pip install -q -c constraints.txt cloudpickle psutil pyyaml packaging cffi wheel
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
        HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo HOROVOD_GPU_OPERATIONS= \
        MAKEFLAGS="-j$(nproc)"
    if [ "${SYNCTUNE_HVD_TF:-0}" = "1" ]; then
        export HOROVOD_WITH_TENSORFLOW=1
    else
        export HOROVOD_WITHOUT_TENSORFLOW=1
    fi
    echo "horovod: building (CPU, gloo; several minutes on a small machine)"
    "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation "$SRC" -w "$CACHE"
    WHEEL="$(ls "$CACHE"/horovod-"$VERSION"-*.whl | head -n1)"
fi
"$PYTHON" -m pip install -q --force-reinstall --no-deps -c constraints.txt "$WHEEL"
"$PYTHON" -m pip install -q -c constraints.txt cloudpickle psutil pyyaml packaging cffi
touch "$("$PYTHON" -c 'import horovod, os; print(os.path.join(os.path.dirname(horovod.__file__), ".synctune-fix2"))')"
"$PYTHON" -c "import horovod, horovod.torch as hvd; assert hvd.gloo_built(), 'horovod built without gloo'; print('horovod: installed', horovod.__version__)"
