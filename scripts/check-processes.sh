#!/usr/bin/env bash
# The examples as CPU processes over the tcp backend, started by tpar-run, train with
# the same per-step losses, and the same final loss bit for bit, as rank threads of the
# local backend: llama_2d at 2x2 (FSDP x TP), and llama_pp's zero-bubble pipeline at
# pp 2 x dp 2 (FSDP).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q --release --example llama_2d --example llama_pp --bin tpar-run
bin=${CARGO_TARGET_DIR:-target}/release
losses() { grep -oE 'step +[0-9]+/[0-9]+ loss [0-9.]+|final_loss_bits=[0-9a-f]+'; }
# check EXAMPLE ARGS...: 4 rank threads against 4 tcp processes.
check() {
    local example=$1 threads procs
    shift
    threads=$("$bin/examples/$example" --steps 4 --log-every 1 "$@" | losses)
    procs=$("$bin/tpar-run" --nproc-per-node 4 -- "$bin/examples/$example" --backend tcp \
        --steps 4 --log-every 1 "$@" | sed 's/^\[rank [0-9]*\] //' | losses)
    if [ "$threads" != "$procs" ]; then
        printf 'threads:\n%s\nprocesses:\n%s\n' "$threads" "$procs" >&2
        echo "processes: $example's tcp losses differ from the local backend's" >&2
        exit 1
    fi
    echo "processes: $example as 4 tcp processes trains with the local backend's losses ($(printf '%s\n' "$procs" | tail -1))"
}
check llama_2d
check llama_pp --pp 2 --dp 2 --schedule zb
