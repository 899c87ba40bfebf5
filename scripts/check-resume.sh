#!/usr/bin/env bash
# A run interrupted after step 3 and resumed from its checkpoint ends with the same
# loss, bit for bit, as the run that went straight through (llama_2d at 2x2, FSDP x TP),
# with synchronous and with asynchronous saves.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
run() { cargo run -q --release --example llama_2d -- --steps 6 --log-every 1 --layers 1 "$@"; }
bits() { grep -o 'final_loss_bits=[0-9a-f]*' | cut -d= -f2; }
straight=$(run | bits)
for mode in sync async; do
    flags=(--checkpoint-dir "$dir/$mode" --save-every 3)
    [ "$mode" = async ] && flags+=(--async-save)
    run "${flags[@]}" --stop-after 3 >/dev/null
    out=$(run "${flags[@]}")
    printf '%s\n' "$out" | grep -E '^(resumed|summary)' >&2
    resumed=$(printf '%s\n' "$out" | bits)
    if [ "$straight" != "$resumed" ]; then
        echo "resume $mode: final loss $resumed, straight run $straight" >&2
        exit 1
    fi
done
echo "resume: the resumed runs end with the straight run's loss ($straight)"
