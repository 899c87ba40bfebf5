#!/usr/bin/env bash
# llama_2d at 2x2 (FSDP x TP) as 4 processes over the tcp backend, started by
# tpar-run, trains with the same per-step losses, and the same final loss bit for bit,
# as the 4 rank threads of the local backend.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q --release --example llama_2d --bin tpar-run
bin=${CARGO_TARGET_DIR:-target}/release
args=(--steps 4 --log-every 1)
losses() { grep -oE 'step +[0-9]+/[0-9]+ loss [0-9.]+|final_loss_bits=[0-9a-f]+'; }
threads=$("$bin"/examples/llama_2d "${args[@]}" | losses)
procs=$("$bin"/tpar-run --nproc-per-node 4 -- "$bin"/examples/llama_2d \
    --backend tcp "${args[@]}" | grep '^\[rank 0\]' | losses)
if [ "$threads" != "$procs" ]; then
    printf 'threads:\n%s\nprocesses:\n%s\n' "$threads" "$procs" >&2
    echo "processes: the tcp backend's losses differ from the local backend's" >&2
    exit 1
fi
printf '%s\n' "$procs" >&2
echo "processes: 4 tcp processes train with the local backend's losses"
