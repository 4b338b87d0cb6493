#!/usr/bin/env bash
# Download the wheels the GPU gate needs that the lent GPU machines' image lacks, for that
# image's Python (3.12, x86-64 manylinux), into DEST (default .whl). Nothing can be fetched
# on those machines: run this here, carry DEST with the device call, and gpu_check.sh installs
# it (`--no-index --no-deps` into a scratch site dir) before its first step.
#
#   bash launch/gpu_wheels.sh [DEST]      # then: device run, carry [".whl"], launch/gpu_check.sh
#
# The image (/work/.library/device/KINDS.md) holds torch 2.11 (CUDA 13), cupy-cuda13x, pytest,
# transformers, tokenizers, safetensors, httpx, aiohttp, prometheus-client, jinja2, anyio,
# click, einops, ninja, requests, tabulate, tqdm and nvidia-ml-py; it lacks the HTTP stack and
# FlashInfer. The versions are the ones CI and the CPU suite run with (pydantic-core must be
# the one pydantic pins); flashinfer-python 0.6.0 is the last release whose wheel fits the
# device call's 64 MiB (0.7.x is ~100 MB) and it JIT-compiles its kernels with the image's nvcc.
set -euo pipefail
DEST=${1:-.whl}
PY=${PYTHON:-python3}
WHEELS=(
    fastapi==0.165.0 annotated-doc starlette==1.10.0 uvicorn==0.55.0 httptools==0.9.0
    orjson==3.13.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
    typing-inspection==0.4.5 typing-extensions==4.16.0
    flashinfer-python==0.6.0 apache-tvm-ffi==0.1.6
)
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$DEST" "${WHEELS[@]}"
du -sh "$DEST"
