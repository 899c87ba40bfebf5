#!/usr/bin/env bash
# A run interrupted after step 3 and resumed from its checkpoint ends with the same
# loss, bit for bit, as the run that went straight through, with synchronous and with
# asynchronous saves: llama_2d at 2x2 (FSDP x TP), and llama_pp's pipeline (3 stages,
# 1F1B; and interleaved 1F1B over pp 2 x dp 2 with FSDP).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
bits() { grep -o 'final_loss_bits=[0-9a-f]*' | cut -d= -f2; }
# check NAME EXAMPLE ARGS...: the straight run against stop-after-3-and-resume runs.
check() {
    local name=$1 example=$2
    shift 2
    run() { cargo run -q --release --example "$example" -- --steps 6 --log-every 1 "$@"; }
    local straight out resumed
    straight=$(run "$@" | bits)
    for mode in sync async; do
        local flags=(--checkpoint-dir "$dir/$name-$mode" --save-every 3)
        [ "$mode" = async ] && flags+=(--async-save)
        run "$@" "${flags[@]}" --stop-after 3 >/dev/null
        out=$(run "$@" "${flags[@]}")
        printf '%s\n' "$out" | grep -E '^(resumed|summary)' >&2
        resumed=$(printf '%s\n' "$out" | bits)
        if [ "$straight" != "$resumed" ]; then
            echo "resume $name $mode: final loss $resumed, straight run $straight" >&2
            exit 1
        fi
    done
    echo "resume $name: the resumed runs end with the straight run's loss ($straight)"
}
check llama_2d llama_2d --layers 1
check llama_pp llama_pp
check llama_pp_interleaved llama_pp --schedule interleaved --pp 2 --dp 2 --layers 4
