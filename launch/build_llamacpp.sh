#!/usr/bin/env bash
# Build llama.cpp's native benchmark tools (llama-bench, llama-batched-bench, llama-simple)
# from the source that the llama-cpp-python sdist vendors, for launch/bench_served.py.
#
# Optional: the served benchmark runs without them (llama.cpp columns then stay blank).
#
#   launch/build_llamacpp.sh [SDIST.tar.gz | VERSION]
#
# With no argument the newest llama-cpp-python sdist is fetched with pip (the only network
# access); VERSION pins it; a local SDIST tarball needs no network. Output lives outside git,
# in $TPSERVE_CACHE/llamacpp/<version> (default ~/.cache/tpserve), and a finished build is
# reused: running the script again only prints the binaries' paths (one per line, last lines).
# Environment: PYTHON (a python with pip; default python3), JOBS (default 2).
set -euo pipefail

PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-2}
CACHE=${TPSERVE_CACHE:-$HOME/.cache/tpserve}/llamacpp
TARGETS=(llama-bench llama-batched-bench llama-simple)
mkdir -p "$CACHE/sdist"

sdist_path() {  # $1: "", a version, or a tarball path -> the tarball's path on stdout
    local arg=${1:-}
    if [[ -n $arg && -f $arg ]]; then echo "$arg"; return; fi
    local spec=llama-cpp-python${arg:+==$arg}
    if [[ -n $arg ]]; then
        local have; have=$(ls "$CACHE"/sdist/llama_cpp_python-"$arg".tar.gz 2>/dev/null || true)
        if [[ -n $have ]]; then echo "$have"; return; fi
    fi
    "$PYTHON" -m pip download "$spec" --no-binary :all: --no-deps -d "$CACHE/sdist" >&2
    ls -t "$CACHE"/sdist/llama_cpp_python-*.tar.gz | head -n1
}

SDIST=$(sdist_path "${1:-}")
VERSION=$(basename "$SDIST" .tar.gz); VERSION=${VERSION#llama_cpp_python-}
ROOT=$CACHE/$VERSION
BIN=$ROOT/build/bin

built() { for t in "${TARGETS[@]}"; do [[ -x $BIN/$t ]] || return 1; done; }

if ! built; then
    if [[ ! -f $ROOT/src/CMakeLists.txt ]]; then
        rm -rf "$ROOT/src" && mkdir -p "$ROOT/src"
        tar -xzf "$SDIST" -C "$ROOT/src" --strip-components=3 \
            "llama_cpp_python-$VERSION/vendor/llama.cpp"
    fi
    if ! command -v cmake >/dev/null; then
        "$PYTHON" -m pip install cmake >&2  # the PyPI wheel ships a cmake binary
        PATH=$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')"):$PATH
    fi
    # Static libraries: the binaries then run from anywhere. No network features, no server,
    # no tests: only what the three tools need. GGML_NATIVE tunes for this CPU (AVX2,
    # AVX-512, AVX512-BF16 when present), the fair setting against a server built on it.
    cmake -S "$ROOT/src" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_APP=OFF >&2
    cmake --build "$ROOT/build" --config Release -j "$JOBS" --target "${TARGETS[@]}" >&2
    built
fi
for t in "${TARGETS[@]}"; do echo "$BIN/$t"; done
