#!/usr/bin/env bash
# One-time check of the CUDA allreduce backends (cuda_p2p, symm_mem, nccl) on a GPU machine:
# runs tests/test_comm_cuda.py, the CUDA-graph tests and decode table (one GPU is enough),
# then a short benchmark on all visible GPUs (at least 2 needed
# for the benchmark; one GPU still runs the world-of-one kernel and CUDA-graph tests).
#
# Needs an environment that already has torch with CUDA, pytest, and cupy for cuda_p2p
# (pip install 'tpserve[gpu,test,bench]'). Installs nothing.
#
#   launch/gpu_check.sh                 # results in ./gpu_check_out/
#   OUT_DIR=/tmp/x NPROC=4 launch/gpu_check.sh
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT_DIR=${OUT_DIR:-gpu_check_out}
mkdir -p "$OUT_DIR"

"$PY" - <<'PYEOF'
import importlib.util
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    print(f"  GPU {i}: {torch.cuda.get_device_name(i)} cc {torch.cuda.get_device_capability(i)}")
print("cupy:", "yes" if importlib.util.find_spec("cupy") else "NO (cuda_p2p will be skipped)")
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device visible: nothing to check")
PYEOF

echo "== tests/test_comm_cuda.py"
"$PY" -m pytest tests/test_comm_cuda.py -q -rs 2>&1 | tee "$OUT_DIR/pytest.txt"

# CUDA graphs (issue 7): replay == eager per bucket, with speculation, through each
# capture-safe backend at world size 1; then decode tok/s with/without graphs vs HBM limit.
echo "== tests/test_cuda_graphs.py"
"$PY" -m pytest tests/test_cuda_graphs.py -q -rs 2>&1 | tee "$OUT_DIR/pytest_graphs.txt"
# MoE / MLA / FP8 (issue 14): DeepSeek-V3 eager and graphed on CUDA vs CPU, FP8 block GEMM.
echo "== tests/test_moe_cuda.py tests/test_fp8.py (CUDA parts)"
"$PY" -m pytest tests/test_moe_cuda.py "tests/test_fp8.py::test_cuda_block_gemm" -q -rs 2>&1 \
    | tee "$OUT_DIR/pytest_moe.txt"
echo "== decode table (~1B random Llama, batch 1/8/32, eager vs CUDA graphs)"
"$PY" -m launch.gpu_decode_table --json "$OUT_DIR/decode_table.json" 2>&1 \
    | grep -v "^INFO" | tee "$OUT_DIR/decode_table.txt"

NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
NPROC=${NPROC:-$(( NGPU > 8 ? 8 : NGPU ))}
if [ "$NPROC" -lt 2 ]; then
    echo "== benchmark skipped: it needs at least 2 GPUs (found $NGPU)"
    exit 0
fi

echo "== benchmark on $NPROC GPUs"
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m comm_backends.bench \
    --backends nccl,cuda_p2p,symm_mem --sizes 4K,8K,14K,64K,256K,1M,8M --decode-sizes \
    --dtype bf16 --iters 200 --max-seconds 2 \
    --json "$OUT_DIR/comm_bench.json" --plot "$OUT_DIR/comm_bench.png" 2>&1 | tee "$OUT_DIR/bench.txt"
echo "== results in $OUT_DIR/"
