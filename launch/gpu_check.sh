#!/usr/bin/env bash
# The GPU gate: every CUDA path, each step under `timeout -s KILL` (a timeout is a failure),
# one JSON summary, non-zero exit unless every step passed (or was skipped and not required).
#
#   launch/gpu_check.sh [SUMMARY.json]        # default: $OUT/gpu_check.json, else ./gpu_check_out/
#   REQUIRE=cuda_p2p,symm_mem launch/gpu_check.sh   # a refusal or skip of these fails the gate
#   STEP_TIMEOUT=300 SERVE_TIMEOUT=180 BUDGET_S=1500 PYTHON=.venv/bin/python launch/gpu_check.sh
#
# Steps, cheapest and most telling first: versions and the P2P / atomics / NVLink matrix (and
# auto's choice); the demo model served on one GPU with a sampled and a greedy request; with 2+
# GPUs a TP=N server per backend (N: the most GPUs, up to 8, that divide the demo's 8 heads) and
# comm_backends.bench with correctness; then the `-m gpu` tests; the comm tests at every
# available GPU count; the decode table. The multi-GPU steps come before the test suites,
# which alone can outlast the budget, so that a multi-GPU host always gets its TP=N results;
# a server check gets SERVE_TIMEOUT (start-up to shutdown), so one that hangs costs the others
# only that. Without a GPU it prints one line and exits 1. Needs torch with CUDA, pytest, cupy
# for cuda_p2p (pip install 'tpserve[gpu,test,bench]'); where nothing can be installed,
# `launch/gpu_wheels.sh` fetches the rest elsewhere into .whl/, which this script installs into
# a scratch directory first.
#
# Every step runs inside one budget (BUDGET_S, default 540 s: a lent GPU machine runs one
# command for at most 10 minutes): a step gets at most what is left, one that cannot start is
# recorded as not run (a failure), and the summary is rewritten after every step with
# "complete": false until the last, so a run cut off still says how far it got and cannot read
# as a pass.
set -uo pipefail

SUMMARY=${1:-${OUT:+$OUT/gpu_check.json}}
SUMMARY=$(realpath -m "${SUMMARY:-gpu_check_out/gpu_check.json}")  # before cd: relative to the caller
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-$(command -v python || command -v python3)}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
SERVE_TIMEOUT=${SERVE_TIMEOUT:-180}  # one demo server: start-up, four requests, shutdown
BENCH_TIMEOUT=${BENCH_TIMEOUT:-180}  # 13 sizes x 3 backends, each capped at 2 s, plus start-up
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-540} ))
export REQUIRE=${REQUIRE:-}

NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null)
if [ -z "$NGPU" ] || [ "$NGPU" -lt 1 ]; then
    echo "gpu_check: no CUDA GPU visible (torch.cuda.device_count() = ${NGPU:-unavailable}); nothing was checked"
    exit 1
fi

LOGS="$(dirname "$SUMMARY")/gpu_check_logs"
mkdir -p "$LOGS"
STEPS="$LOGS/steps.jsonl"
: > "$STEPS"

# Wheels carried from elsewhere (launch/gpu_wheels.sh): installed without an index into a
# scratch directory that every step's Python then sees first.
if compgen -G ".whl/*.whl" > /dev/null; then
    SITE=${WHEEL_SITE:-/tmp/tpserve_gpu_site}
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl > "$LOGS/wheels.log" 2>&1; then
        echo "gpu_check: installing .whl/ failed (log: $LOGS/wheels.log)"
        exit 1
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

# summarise COMPLETE: (re)write the JSON summary from the steps so far; exit status 0 only
# for a complete run whose every step passed (or was skipped and not required).
summarise() {
    "$PY" - "$STEPS" "$LOGS/topology.json" "$SUMMARY" "$NGPU" "$1" <<'PYEOF'
import json, os, sys
steps_path, topo_path, summary_path, ngpu, complete = sys.argv[1:6]
steps = [json.loads(line) for line in open(steps_path) if line.strip()]
topology = json.load(open(topo_path)) if os.path.exists(topo_path) else None
complete = complete == "1"
ok = complete and all(s["status"] in ("pass", "skipped") for s in steps)
summary = {"ok": ok, "complete": complete, "gpus": int(ngpu),
           "require": [r for r in os.environ["REQUIRE"].split(",") if r],
           "steps": steps, "topology": topology}
with open(summary_path, "w") as f:
    json.dump(summary, f, indent=2)
if complete:
    bad = [s["step"] + ": " + s["status"] for s in steps if s["status"] not in ("pass", "skipped")]
    print(f"gpu_check: {'PASS' if ok else 'FAIL'}; summary in {summary_path}"
          + ("" if ok else "; " + ", ".join(bad)))
sys.exit(0 if ok else 1)
PYEOF
}

# reap TAG: SIGKILL every process a step left behind (found by the tag in its environment).
# torchrun starts each rank in a session of its own, so `timeout -s KILL`, which kills its own
# process group, never reaches them: ranks left running would hold their GPUs and memory and
# fail every later step.
reap() {
    local pid
    for pid in $(grep -lsxzF "GPU_CHECK_STEP=$1" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3); do
        kill -KILL "$pid" 2>/dev/null
    done
}

# step NAME LIMIT_S CMD...: run CMD under `timeout -s KILL` (LIMIT_S or what is left of the
# budget, whichever is less), log it, record the outcome. Exit 0 = pass, 137 = timeout, else a
# failure; with SKIPPABLE=1 (the server checks only), 3 = skipped (a refusal of a backend not in
# REQUIRE): pytest's own 3 is an internal error. CMD sees its limit as STEP_LIMIT (the server
# check stops its server before it); whatever it leaves running is reaped.
step() {
    local name=$1 limit=$2
    shift 2
    local log="$LOGS/$name.log" start rc status left
    left=$(( DEADLINE - $(date +%s) ))
    (( left < limit )) && limit=$left
    start=$(date +%s%N)
    if (( left < 20 )); then
        echo "budget spent: not run" > "$log"
        rc=-1
        status=not_run
    else
        echo "== $name (limit ${limit}s)"
        GPU_CHECK_STEP="$name.$$" STEP_LIMIT=$limit timeout -s KILL "$limit" "$@" > "$log" 2>&1
        rc=$?
        reap "$name.$$"
        case $rc in
            0) status=pass ;;
            137) status=timeout ;;
            3) [ "${SKIPPABLE:-0}" = 1 ] && status=skipped || status=fail ;;
            *) status=fail ;;
        esac
    fi
    local seconds
    seconds=$(awk -v a="$start" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
    printf '{"step": "%s", "status": "%s", "rc": %d, "seconds": %s, "log": "%s"}\n' \
        "$name" "$status" "$rc" "$seconds" "$log" >> "$STEPS"
    tail -n 4 "$log"
    echo "-- $name: $status (${seconds}s)"
    summarise 0
}

# serve_check NAME RANKS BACKEND: the demo model on CUDA, one sampled + one greedy request.
serve_check() {
    SKIPPABLE=1 step "$1" "$SERVE_TIMEOUT" "$PY" -m launch.gpu_serve_check --device cuda \
        --ranks "$2" --allreduce "$3" --json "$LOGS/$1.json" --log "$LOGS/$1.server.log"
}

step versions_topology 120 "$PY" -m comm_backends.topology_report --json "$LOGS/topology.json"
serve_check serve_tp1 1 auto

if [ "$NGPU" -ge 2 ]; then
    # The demo model has 8 heads: TP must divide them (6 GPUs serve at TP=4, not 6).
    NPROC=1
    while (( NPROC * 2 <= NGPU && NPROC * 2 <= 8 )); do NPROC=$(( NPROC * 2 )); done
    for backend in auto nccl cuda_p2p symm_mem hier; do
        serve_check "serve_tp${NPROC}_${backend}" "$NPROC" "$backend"
    done
    BENCH_PROCS=$(( NGPU > 8 ? 8 : NGPU ))
    optional=$(echo nccl,cuda_p2p,symm_mem | tr ',' '\n' | grep -vxF -f <(echo "$REQUIRE" | tr ',' '\n') | paste -sd, -)
    step comm_bench "$BENCH_TIMEOUT" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$BENCH_PROCS" \
        -m comm_backends.bench --backends nccl,cuda_p2p,symm_mem --optional "$optional" \
        --sizes 4K,8K,14K,64K,256K,1M,8M --decode-sizes --dtype bf16 --iters 200 --max-seconds 2 \
        --json "$LOGS/comm_bench.json" --plot "$LOGS/comm_bench.png"
fi

# Only the files that hold GPU tests: collecting all of tests/ imports the CPU suite's
# test-only packages (schemathesis, openai), which a GPU image need not have.
mapfile -t GPU_TESTS < <(grep -l "mark\.gpu" tests/test_*.py)
step gpu_marked_tests "$STEP_TIMEOUT" "$PY" -m pytest -q -rs -m gpu "${GPU_TESTS[@]}"
# Every GPU count from 2 to all of them, each backend separately; REQUIRE turns skips into failures.
step comm_tests "$STEP_TIMEOUT" "$PY" -m pytest -q -rs tests/test_comm_cuda.py \
    tests/test_cuda_kernel_source.py tests/test_cuda_p2p_flag.py
step decode_table "$STEP_TIMEOUT" "$PY" -m launch.gpu_decode_table --json "$LOGS/decode_table.json"

summarise 1
