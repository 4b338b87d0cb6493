#!/bin/sh
# The images' entrypoint: run tpserve under torchrun, sized and placed by the environment.
#
#   TPSERVE_NPROC      ranks on this node (default: the GPUs this container sees, else 1)
#   NNODES             nodes in the job (default 1: torchrun --standalone)
#   NODE_RANK          this node's index, 0 .. NNODES-1 (default 0); the node holding global rank 0 (the rendezvous decides) serves HTTP
#   RDZV_ENDPOINT      HOST:PORT of the c10d rendezvous (required when NNODES > 1)
#   RDZV_ID            job id shared by every node (optional; torchrun's default otherwise)
#   TPSERVE_MODULE     the module torchrun runs (default tpserve; e.g. comm_backends.bench)
#   TPSERVE_ENTRYPOINT_DRY_RUN=1  print the command instead of running it
#
# Arguments go to the module. A first argument that is not a flag (bash, python ...) is run
# as the command instead, so the image can also host one-off tools.
set -eu

die() {
    echo "tpserve-entrypoint: error: $*" >&2
    exit 2
}

is_uint() {
    case "$1" in
        '' | *[!0-9]*) return 1 ;;
        *) return 0 ;;
    esac
}

# Entries of a comma list such as CUDA_VISIBLE_DEVICES ("" counts 0).
count_list() {
    printf '%s' "$1" | tr ',' '\n' | grep -c . || true
}

# CUDA_VISIBLE_DEVICES when set (torch honours it), else the GPUs nvidia-smi lists (the
# NVIDIA runtime mounts only the devices given to --gpus), else 1 rank for the CPU.
default_nproc() {
    if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
        n=$(count_list "$CUDA_VISIBLE_DEVICES")
    elif command -v nvidia-smi >/dev/null 2>&1; then
        n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    else
        n=0
    fi
    if [ "${n:-0}" -gt 0 ]; then echo "$n"; else echo 1; fi
}

# One argument as the shell would need it typed (dry-run output is copy-pasteable).
quote() {
    case "$1" in
        '' | *[!A-Za-z0-9_./:=,@%+-]*)
            printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")" ;;
        *) printf '%s' "$1" ;;
    esac
}

run() {
    if [ "${TPSERVE_ENTRYPOINT_DRY_RUN:-0}" = "1" ]; then
        sep=""
        for arg in "$@"; do
            printf '%s' "$sep"
            quote "$arg"
            sep=" "
        done
        printf '\n'
        exit 0
    fi
    exec "$@"
}

case "${1:-}" in
    '' | -*) ;;
    *) run "$@" ;;
esac

nproc="${TPSERVE_NPROC:-$(default_nproc)}"
is_uint "$nproc" && [ "$nproc" -ge 1 ] || die "TPSERVE_NPROC must be a positive integer, got '$nproc'"
nnodes="${NNODES:-1}"
is_uint "$nnodes" && [ "$nnodes" -ge 1 ] || die "NNODES must be a positive integer, got '$nnodes'"
node_rank="${NODE_RANK:-0}"
is_uint "$node_rank" && [ "$node_rank" -lt "$nnodes" ] \
    || die "NODE_RANK must be an integer in 0..$((nnodes - 1)), got '$node_rank'"
endpoint="${RDZV_ENDPOINT:-}"
if [ "$nnodes" -gt 1 ] && [ -z "$endpoint" ]; then
    die "NNODES=$nnodes needs RDZV_ENDPOINT=HOST:PORT (the rendezvous every node can reach)"
fi
case "$endpoint" in
    '' | ?*:*[0-9]) ;;
    *) die "RDZV_ENDPOINT must be HOST:PORT, got '$endpoint'" ;;
esac

module="${TPSERVE_MODULE:-tpserve}"
set -- --nproc-per-node "$nproc" -m "$module" "$@"
if [ -n "$endpoint" ]; then
    # c10d: the rendezvous store runs inside the torchrun that owns HOST:PORT; the others join.
    if [ -n "${RDZV_ID:-}" ]; then set -- --rdzv-id "$RDZV_ID" "$@"; fi
    set -- --nnodes "$nnodes" --node-rank "$node_rank" --rdzv-backend c10d \
        --rdzv-endpoint "$endpoint" "$@"
else
    # One node: a private rendezvous on a free port, so nothing else on the host can clash.
    set -- --standalone "$@"
fi
run torchrun "$@"
