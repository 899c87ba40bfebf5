#!/usr/bin/env bash
# Checks and benchmarks tpar's CUDA kernels on a GPU machine, next to PyTorch,
# in one command. The GPU machine needs no Rust: build the binaries where
# cargo is, carry them in a folder, and run this from the repository root:
#
#     # where cargo is (binaries land in $CARGO_TARGET_DIR, default target/;
#     # gpu_check is the binary of the tools crate, crates/tools):
#     cargo build --release -p tpar-tools --bin gpu_check
#     cargo build --release --example llama_2d
#     mkdir -p gpu-bin
#     cp "${CARGO_TARGET_DIR:-target}"/release/gpu_check \
#         "${CARGO_TARGET_DIR:-target}"/release/examples/llama_2d gpu-bin/
#     # the kernel cache (NVRTC needs up to a minute per large source on a GPU
#     # process's first use): every source for sm_90a (what an H100/H200 runs)
#     # and for sm_90 (the pre-Hopper kernels of the TPAR_CUDA_ARCH=sm_90 rerun
#     # below); no GPU needed, NVRTC from scripts/nvrtc-env.sh
#     source scripts/nvrtc-env.sh
#     TPAR_KERNEL_CACHE="$PWD/gpu-bin/kernel-cache" gpu-bin/gpu_check --precompile sm_90a
#     TPAR_KERNEL_CACHE="$PWD/gpu-bin/kernel-cache" gpu-bin/gpu_check --precompile sm_90
#     # (scripts/gpu-bundle.sh does all of this in one command, strips the
#     # binaries to fit a 64 MiB transfer and adds the NCCL test binary of 3b)
#
#     # on the GPU machine, from the repository root (gpu-bin/ carried along;
#     # gpu-bin/kernel-cache is used when TPAR_KERNEL_CACHE is not set):
#     scripts/gpu-check.sh
#
# Steps, in this order (a failing step is reported; the next still runs; with a
# time budget, BUDGET below, a step that no longer fits is skipped and the
# summary says so):
#   1. gpu_check --bench: every kernel family against the CPU kernels (one
#      PASS/FAIL line per output), then GEMM / attention TFLOP/s (ours and
#      cuBLASLt) and RMSNorm / RoPE / cross-entropy / copy GB/s; under
#      `timeout CHECK_TIMEOUT` (seconds; default 240 with QUICK=1, else 420,
#      which leaves a full run the time NVRTC needs on a cold kernel cache).
#      When gpu_check exits 3 (the CUDA context was lost: a
#      kernel trapped or faulted, which is how a Hopper kernel's mbarrier
#      watchdog stops a deadlock; where the wait timed out, which the lost
#      context's error then carries, goes to watchdog.txt) or 124/137
#      (stopped by CHECK_TIMEOUT), step 1 runs once more with
#      TPAR_CUDA_ARCH=sm_90 (no sm_90a kernels: the GEMM and the attention run
#      their mma.sync kernels) into
#      gpu_check_sm90.{log,json} and gemm_table_sm90.txt, and step 4 reads the
#      rerun's benchmarks when the first run has none;
#   1b. with SANITIZE=1 only: the checks of the AdamW, attention and GEMM
#      families under compute-sanitizer (racecheck, memcheck, synccheck; see
#      the step; logs sanitize_<tool>.log);
#   2. benches/torch_ref.py: the same benchmarks in PyTorch, plus one Llama
#      training step (tokens/s and torch.cuda.max_memory_allocated) in each bf16
#      mode: autocast (eager), fused (autocast, fused AdamW), compile
#      (torch.compile(model), autocast, fused AdamW), FSDP2 at world 1, bf16
#      parameters, for the training-step model below (under TORCH_TIMEOUT);
#   3. llama_2d --device cuda with the same model and batch as step 2 (its
#      outcome is reported, never fatal), with FSDP and with --no-fsdp (each
#      against every PyTorch mode in step 4's training table), --no-fsdp again
#      with --cuda-graph (llama_2d_graph.log), its host round
#      trips per step (logging steps and the others), then the GPU time per
#      kernel of 3 more steps (TPAR_CUDA_PROFILE=1; SKIP_PROFILE=1 skips);
#   3d. the training step (--no-fsdp) with TPAR_GEMM=cublaslt, ours, and auto
#      reading step 1's tuning table gemm_table.txt (SKIP_GEMM_STEP=1 skips;
#      logs in gemm_step.log);
#   3e. the training step (--no-fsdp) with TPAR_SDPA=hopper: the Hopper
#      attention kernels where they take the call (SKIP_SDPA_STEP=1 skips; log
#      in llama_2d_sdpa_hopper.log);
#   3f. the training step (--no-fsdp) with --fuse-proj --fuse-residual: q, k,
#      v and gate, up by one GEMM each (q and k rotated where the q/k/v GEMM
#      writes them), the residual adds in the GEMMs (also
#      under SMOKE=1; SKIP_FUSED_STEP=1 skips; log in llama_2d_fused.log);
#   3c. context parallelism on one GPU: llama_2d at a long sequence (the
#      step's model, batch 1, bf16 parameters, seq CP_SEQ, default 32768, one
#      long synthetic document) at cp 1 on one rank and at cp 2 as two rank
#      threads on the same GPU (SKIP_CP=1 skips): logged losses compared, time
#      per step and device peak of each (logs in cp.log);
#   3g. the 16-layer model (hidden 1024, 8 heads, context 256, batch 128;
#      SKIP_L16=1 skips): steps 2 and 3's training runs for it, torch_ref
#      without the kernel benchmarks (torch_ref_l16.*), llama_2d with FSDP
#      and with --no-fsdp (llama_2d_l16.log, llama_2d_l16_nofsdp.log);
#   3b. the small default model on the device and on the host in the
#      configurations whose emulated round trips the tests pin (world 1 with
#      and without FSDP, 2x2 with both plans, world 1 in bf16, world 1 over
#      NCCL under torchrun): the logged losses compared, the round trips read;
#      then one device step run twice by default and twice with --deterministic
#      (repro.log): whether each mode's two runs end with the same loss bits;
#   4. one table per benchmark key: ours, PyTorch, cuBLASLt, ours/PyTorch,
#      ours/cuBLASLt (python3 merges the JSON files); then the training table:
#      per model size, tpar (FSDP mixed precision, and --no-fsdp) against each
#      PyTorch mode, tokens/s and device peak memory (llama_2d's
#      device_peak_mib_max, torch's max_memory_allocated), and the ratios
#      tpar/torch of tokens/s and of peak memory, with the memory model's
#      predicted peak (llama_2d's predicted_peak_mib) beside the measured one.
#
# Output: $OUT if set, else ./gpu-results/ — gpu_check.{log,json},
# torch_ref.{log,json}, torch_ref_l16.{log,json}, llama_2d.log,
# llama_2d_nofsdp.log, llama_2d_graph.log, llama_2d_l16.log, llama_2d_l16_nofsdp.log, parity.log,
# repro.log, cp.log, gemm_table.txt, gemm_step.log, llama_2d_sdpa_hopper.log, llama_2d_fused.log,
# skipped.txt (the steps the budget skipped),
# summary.{txt,json} (its first line names the commit the binaries were built
# from, when gpu-bundle.sh's built-from.txt is there; copied beside it); after a
# lost context or a timeout in step 1 also
# gpu_check_sm90.{log,json} and gemm_table_sm90.txt.
#
# SMOKE=1 runs steps 2 to 4 on the host instead (no GPU needed: torch_ref.py
# --device cpu without the kernel benchmarks, llama_2d --device cpu, both
# model sizes shrunk to a few thousand parameters, gpu_check and parity
# skipped): a check that the script, its logs and its tables hold together,
# not a measurement.
# Exit status: step 1's first gpu_check's (0 every check passed, 1 a check
# failed, 2 no GPU or no binary, 3 the CUDA context was lost, 124/137 stopped
# by CHECK_TIMEOUT). Expect several minutes on an H200 (NVRTC compiles the kernels
# on first use; each llama_2d run is capped at LLAMA_TIMEOUT): where one command
# may run at most 10 minutes, use QUICK=1 (fewer shapes, and a 540 s budget: the
# steps that do not fit are skipped, in the order above, and the summary is still
# written); a second command can then run what was skipped, e.g. SKIP_CHECK=1
# SKIP_TORCH=1 for step 3 alone. The
# training table alone (both sizes, every PyTorch mode, tpar both ways):
# SKIP_CHECK=1 SKIP_PARITY=1 SKIP_PROFILE=1 TORCH_REF_ARGS=--skip-kernels.
#
# Environment: GPU_BIN (folder of the binaries; default ./gpu-bin), PYTHON
# (default python3), QUICK=1, SMOKE=1, SKIP_CHECK=1, SKIP_TORCH=1, SKIP_LLAMA=1,
# SANITIZE=1 (SANITIZE_ONLY, SANITIZE_TOOLS, SANITIZE_TIMEOUT), SKIP_L16=1, SKIP_PARITY=1, SKIP_CP=1, SKIP_GEMM_STEP=1, SKIP_SDPA_STEP=1, SKIP_FUSED_STEP=1, CP_SEQ, CHECK_TIMEOUT (seconds; default 240 with QUICK=1, else 420), LLAMA_TIMEOUT (seconds; default 180), PARITY_TIMEOUT (per
# run; default 120), TORCH_TIMEOUT (per torch_ref run; default 300), BUDGET
# (seconds for the whole script; default 540 with QUICK=1, else 0: none),
# SUMMARY_RESERVE (seconds kept for the summary; default 20), and extra flags in
# GPU_CHECK_ARGS, TORCH_REF_ARGS and LLAMA_ARGS.

set -u
set -o pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 2
out="${OUT:-$root/gpu-results}"
bin="${GPU_BIN:-$root/gpu-bin}"
py="${PYTHON:-python3}"
mkdir -p "$out" || exit 2

# ---------------------------------------------------------------- time budget
# BUDGET: seconds for the whole script (default 540 with QUICK=1, the mode for one
# 10-minute command; 0, no budget, otherwise). A step starts only when about the time
# it needs is left (`fits`: otherwise it is skipped, said here and in the summary), and
# each command's timeout is cut to what is left less SUMMARY_RESERVE seconds (`cap`),
# so the summary is written even when the steps run long. The steps run in the order
# of what a run is for: the kernel checks and benchmarks, the training step against
# PyTorch, the GEMM backends, the Hopper attention, the fused step, context
# parallelism, the 16-layer model, then parity with the host.
if [ "${QUICK:-0}" = 1 ]; then budget="${BUDGET:-540}"; else budget="${BUDGET:-0}"; fi
reserve="${SUMMARY_RESERVE:-20}"
: >"$out/skipped.txt"

# Seconds left of the budget less the summary's reserve (a large number without one).
room() {
    if [ "$budget" -gt 0 ]; then echo $((budget - SECONDS - reserve)); else echo 1000000; fi
}

# fits NAME SECONDS: whether step NAME, which needs about SECONDS, fits in what is left.
fits() {
    local l
    l=$(room)
    if [ "$l" -ge "$2" ]; then return 0; fi
    echo
    echo "== $1: skipped, $l s left of BUDGET=$budget (less $reserve for the summary), it needs about $2" |
        tee -a "$out/skipped.txt"
    return 1
}

# cap SECONDS: SECONDS, or what is left of the budget less the summary's reserve when
# that is less (at least 5).
cap() {
    local l
    l=$(room)
    if [ "$l" -lt "$1" ]; then echo $((l > 5 ? l : 5)); else echo "$1"; fi
}

quick=()
if [ "${QUICK:-0}" = 1 ]; then quick=(--quick); fi
# The training-step model of steps 2 and 3: examples/llama_2d.rs's defaults
# (2 layers, hidden 64, heads 4/2, intermediate 176, seq 64, batch 4) scaled
# up for a GPU; byte-level vocab (259) on both sides.
model=(--layers 8 --hidden 1024 --heads 16 --kv-heads 8 --intermediate 2816 --seq 1024 --batch 8)
# The second size (torch_ref.py --preset l16): 16 layers, hidden 1024, 8 heads
# (MHA), intermediate 2816, context 256, batch 128.
model_l16=(--layers 16 --hidden 1024 --heads 8 --kv-heads 8 --intermediate 2816 --seq 256 --batch 128)
# Step 3c's model: the step's widths at one long sequence.
cp_seq="${CP_SEQ:-32768}"
model_cp=(--layers 8 --hidden 1024 --heads 16 --kv-heads 8 --intermediate 2816 --batch 1)
dev=cuda
torch_dev=()
llama_steps=(--steps 10 --log-every 2)
if [ "${SMOKE:-0}" = 1 ]; then
    # The host, tiny models, no kernel benchmarks, no gpu_check, no parity runs.
    dev=cpu
    torch_dev=(--device cpu --skip-kernels --steps 2)
    model=(--layers 1 --hidden 32 --heads 4 --kv-heads 2 --intermediate 88 --seq 16 --batch 2)
    model_l16=(--layers 2 --hidden 32 --heads 2 --kv-heads 2 --intermediate 88 --seq 8 --batch 4)
    model_cp=(--layers 1 --hidden 32 --heads 4 --kv-heads 2 --intermediate 88 --batch 1)
    cp_seq="${CP_SEQ:-256}"
    llama_steps=(--steps 4 --log-every 2)
    SKIP_CHECK=1
    SKIP_PARITY=1
    SKIP_PROFILE=1
fi

# The commit the carried binaries were built from (scripts/gpu-bundle.sh writes
# it), with the results: every figure of a run comes from those binaries.
if [ -f "$bin/built-from.txt" ]; then
    cp "$bin/built-from.txt" "$out/built-from.txt"
    echo "binaries in $bin built from $(head -n 1 "$bin/built-from.txt")"
fi

# ---------------------------------------------------------------- libraries
# cudarc loads the driver, NVRTC (the kernels compile at run time) and
# cuBLASLt by file name, so their folders must be on LD_LIBRARY_PATH before
# the binaries start.

add_lib_dir() {
    case ":${LD_LIBRARY_PATH:-}:" in
        *":$1:"*) ;;
        *) export LD_LIBRARY_PATH="$1${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
    esac
}

# Prints the first folder holding the library file $1.
find_lib() {
    local d f s
    local IFS_SAVE="$IFS"
    IFS=:
    for d in ${LD_LIBRARY_PATH:-}; do
        if [ -n "$d" ] && [ -e "$d/$1" ]; then
            IFS="$IFS_SAVE"
            echo "$d"
            return 0
        fi
    done
    IFS="$IFS_SAVE"
    for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
        /usr/local/cuda-13*/targets/x86_64-linux/lib /usr/local/cuda*/lib64 /usr/local/nvidia/lib64 \
        /usr/lib/x86_64-linux-gnu; do
        if [ -e "$d/$1" ]; then
            echo "$d"
            return 0
        fi
    done
    f="$(ldconfig -p 2>/dev/null | awk -v n="$1" '$1 == n { print $NF; exit }')"
    if [ -n "$f" ]; then
        dirname "$f"
        return 0
    fi
    # NVIDIA's wheels in the Python environment (PyTorch's CUDA libraries).
    for s in $("$py" -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
        f="$(find "$s/nvidia" -name "$1" -print -quit 2>/dev/null)"
        if [ -n "$f" ]; then
            dirname "$f"
            return 0
        fi
    done
    return 1
}

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
for lib in libcuda.so.1 libnvrtc.so.13 libcublasLt.so.13 libnccl.so.2; do
    if dir="$(find_lib "$lib")"; then
        add_lib_dir "$dir"
        echo "  $lib: $dir"
    else
        echo "  $lib: not found (gpu_check will say what is missing)"
    fi
done

# ---------------------------------------------------------------- 1. gpu_check

# The kernel cache carried in the binaries' folder, unless one is named.
if [ -z "${TPAR_KERNEL_CACHE:-}" ] && [ -d "$bin/kernel-cache" ]; then
    export TPAR_KERNEL_CACHE="$bin/kernel-cache"
fi
if [ "${QUICK:-0}" = 1 ]; then
    check_timeout="${CHECK_TIMEOUT:-240}"
else
    check_timeout="${CHECK_TIMEOUT:-420}"
fi
check_timeout="$(cap "$check_timeout")"

# gpu_check --bench under CHECK_TIMEOUT into gpu_check$1.{log,json} and
# gemm_table$1.txt; its exit status (124 or 137: stopped by the timeout).
run_check() {
    # shellcheck disable=SC2086  # GPU_CHECK_ARGS is a list of flags
    timeout -k 10 "$check_timeout" "$bin/gpu_check" --bench ${quick[@]+"${quick[@]}"} \
        --json "$out/gpu_check$1.json" --gemm-table "$out/gemm_table$1.txt" ${GPU_CHECK_ARGS:-} \
        2>&1 | tee "$out/gpu_check$1.log"
}

check_rc=2
check_sm90_rc=none
if [ "${SKIP_CHECK:-0}" = 1 ]; then
    check_rc=skipped
elif [ -x "$bin/gpu_check" ]; then
    echo
    echo "== 1. gpu_check (correctness, then benchmarks; at most $check_timeout s)"
    run_check ""
    check_rc=$?
    echo "(gpu_check: exit $check_rc after $SECONDS s in all)"
    case "$check_rc" in
        3 | 124 | 137)
            if [ "$check_rc" = 3 ]; then
                why="lost the CUDA context (a kernel trapped or faulted; a Hopper kernel's mbarrier watchdog stops a deadlock this way)"
                # the watchdog's record (source line, barrier, parity, block,
                # thread, SM), which the lost context's error carries
                if grep -o "the mbarrier watchdog stopped [^;]*" "$out/gpu_check.log" | sort -u > "$out/watchdog.txt" && [ -s "$out/watchdog.txt" ]; then
                    echo "== 1. where the wait timed out (watchdog.txt):"
                    cat "$out/watchdog.txt"
                else
                    rm -f "$out/watchdog.txt"
                fi
            else
                why="was stopped by CHECK_TIMEOUT ($check_timeout s)"
            fi
            echo
            echo "== 1. again: gpu_check $why; rerun with TPAR_CUDA_ARCH=sm_90 (the pre-Hopper kernels) into gpu_check_sm90.{log,json}, gemm_table_sm90.txt"
            check_timeout="$(cap "$check_timeout")"
            (
                export TPAR_CUDA_ARCH=sm_90
                run_check _sm90
            )
            check_sm90_rc=$?
            echo "(gpu_check TPAR_CUDA_ARCH=sm_90: exit $check_sm90_rc after $SECONDS s in all)"
            ;;
    esac
else
    echo "missing $bin/gpu_check: build it as the top of $0 says" | tee "$out/gpu_check.log"
fi

# ---------------------------------------------------------------- 1b. sanitizer
# SANITIZE=1: the correctness checks of the families in SANITIZE_ONLY
# (default adamw,sdpa,gemm: the multi-tensor AdamW and the Hopper kernels'
# shared memory, mbarriers and bulk copies) at --quick sizes under
# compute-sanitizer, once per tool in SANITIZE_TOOLS (default racecheck
# memcheck synccheck), each under SANITIZE_TIMEOUT (default 150 s), into
# sanitize_<tool>.log. --report-api-errors no: the driver's parameter-info
# queries would otherwise fill the report. Each run's exit is 97 when the
# tool reported an error, else gpu_check's; any nonzero exit makes the
# step's status 1. The script's exit status stays step 1's.
sanitize_rc=skipped
if [ "${SANITIZE:-0}" = 1 ] && [ "$dev" = cuda ]; then
    sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)"
    if [ -z "$sanitizer" ] || [ ! -x "$bin/gpu_check" ]; then
        echo "== 1b. compute-sanitizer: ${sanitizer:-not found}, gpu_check: $bin/gpu_check; skipped"
        sanitize_rc=2
    else
        sanitize_rc=0
        for tool in ${SANITIZE_TOOLS:-racecheck memcheck synccheck}; do
            echo
            echo "== 1b. compute-sanitizer --tool $tool: gpu_check --quick --only ${SANITIZE_ONLY:-adamw,sdpa,gemm}"
            timeout -k 10 "$(cap "${SANITIZE_TIMEOUT:-150}")" "$sanitizer" --tool "$tool" --report-api-errors no --error-exitcode 97 \
                "$bin/gpu_check" --quick --only "${SANITIZE_ONLY:-adamw,sdpa,gemm}" \
                >"$out/sanitize_$tool.log" 2>&1
            rc=$?
            tail -n 3 "$out/sanitize_$tool.log"
            echo "(compute-sanitizer $tool: exit $rc; $(grep -c -E '^========= (Error|Race|Invalid|Barrier)' "$out/sanitize_$tool.log") reports)"
            if [ "$rc" != 0 ]; then sanitize_rc=1; fi
        done
    fi
fi

# ---------------------------------------------------------------- 2. PyTorch

torch_rc=skipped
if [ "${SKIP_TORCH:-0}" != 1 ] && fits "2. PyTorch reference" 120; then
    echo
    echo "== 2. PyTorch reference (benches/torch_ref.py)"
    # shellcheck disable=SC2086
    # Every bf16 mode (autocast, FSDP2 at world 1, bf16 parameters): the ratio row
    # compares llama_2d (FSDP mixed precision) with the first, autocast.
    PYTHONUNBUFFERED=1 timeout -k 10 "$(cap "${TORCH_TIMEOUT:-300}")" "$py" "$root/benches/torch_ref.py" \
        ${quick[@]+"${quick[@]}"} "${model[@]}" --train-mode all ${torch_dev[@]+"${torch_dev[@]}"} \
        --json "$out/torch_ref.json" ${TORCH_REF_ARGS:-} 2>&1 | tee "$out/torch_ref.log"
    torch_rc=$?
    echo "(torch_ref: exit $torch_rc, $SECONDS s in all; 124 = stopped by its timeout)"
fi

# ---------------------------------------------------------------- 3. llama_2d

llama_rc=skipped
if [ "${SKIP_LLAMA:-0}" != 1 ] && fits "3. llama_2d" 40; then
    echo
    echo "== 3. llama_2d --device $dev (outcome reported, never fatal)"
    if [ -x "$bin/llama_2d" ]; then
        # shellcheck disable=SC2086
        timeout "$(cap "${LLAMA_TIMEOUT:-180}")" "$bin/llama_2d" --world 1 --dp 1 --tp 1 "${model[@]}" \
            --dtype bf16 "${llama_steps[@]}" --device "$dev" ${LLAMA_ARGS:-} 2>&1 |
            tee "$out/llama_2d.log"
        llama_rc=$?
        echo "(llama_2d: exit $llama_rc, $SECONDS s in all; 124 = stopped by LLAMA_TIMEOUT)"
        # bf16 parameters without FSDP, the like of PyTorch's `bf16` mode.
        # shellcheck disable=SC2086
        timeout "$(cap "${LLAMA_TIMEOUT:-180}")" "$bin/llama_2d" --world 1 --dp 1 --tp 1 "${model[@]}" \
            --dtype bf16 --no-fsdp "${llama_steps[@]}" --device "$dev" ${LLAMA_ARGS:-} \
            >"$out/llama_2d_nofsdp.log" 2>&1
        echo "(llama_2d --no-fsdp: exit $?, $(grep -o 'steady_step_s=[0-9.eE+-]*' "$out/llama_2d_nofsdp.log"))"
        if [ "$dev" = cuda ] && fits "3. --cuda-graph" 15; then
            # The same step captured once as a CUDA graph and replayed (--cuda-graph).
            # shellcheck disable=SC2086
            timeout "$(cap "${LLAMA_TIMEOUT:-180}")" "$bin/llama_2d" --world 1 --dp 1 --tp 1 "${model[@]}" \
                --dtype bf16 --no-fsdp --cuda-graph "${llama_steps[@]}" --device "$dev" \
                ${LLAMA_ARGS:-} >"$out/llama_2d_graph.log" 2>&1
            echo "(llama_2d --no-fsdp --cuda-graph: exit $?, $(grep -o 'steady_step_s=[0-9.eE+-]*' "$out/llama_2d_graph.log"))"
        fi
        if [ "$llama_rc" = 0 ] && [ "${SKIP_PROFILE:-0}" != 1 ] && fits "3. profile" 20; then
            # Where the device time goes: GPU time per kernel over 3 steps
            # (TPAR_CUDA_PROFILE=1 times each launch with CUDA events).
            echo "=== profile (TPAR_CUDA_PROFILE=1, 3 steps)" | tee -a "$out/llama_2d.log"
            # shellcheck disable=SC2086
            TPAR_CUDA_PROFILE=1 timeout "$(cap "${LLAMA_TIMEOUT:-180}")" "$bin/llama_2d" --world 1 --dp 1 \
                --tp 1 "${model[@]}" --dtype bf16 --steps 3 --log-every 1 --device "$dev" \
                ${LLAMA_ARGS:-} 2>&1 | tee -a "$out/llama_2d.log" | grep -A40 '^GPU time by kernel'
        fi
    else
        echo "missing $bin/llama_2d: build it as the top of $0 says" | tee "$out/llama_2d.log"
        llama_rc=missing
    fi
fi

# ---------------------------------------------------------------- 3d. GEMM backends

# The training step (--no-fsdp, the step's model) with each GEMM backend: cuBLASLt for
# every product, tpar's kernel for every product, and auto with step 1's tuning table
# (tpar's kernel where it measured at least as fast). Logs in gemm_step.log, each run
# after `=== <backend>`.
if [ "${SKIP_GEMM_STEP:-0}" != 1 ] && [ "$dev" = cuda ] && [ -x "$bin/llama_2d" ] &&
    fits "3d. GEMM backends" 40; then
    echo
    echo "== 3d. llama_2d --no-fsdp with each GEMM backend (logs in gemm_step.log)"
    : >"$out/gemm_step.log"
    for backend in cublaslt ours auto; do
        fits "3d. TPAR_GEMM=$backend" 12 || continue
        echo "=== $backend" >>"$out/gemm_step.log"
        # shellcheck disable=SC2086
        TPAR_GEMM="$backend" TPAR_GEMM_TABLE="$out/gemm_table.txt" timeout "$(cap "${LLAMA_TIMEOUT:-180}")" \
            "$bin/llama_2d" --world 1 --dp 1 --tp 1 "${model[@]}" --dtype bf16 --no-fsdp \
            "${llama_steps[@]}" --device "$dev" ${LLAMA_ARGS:-} >>"$out/gemm_step.log" 2>&1
        rc=$?
        echo "=== exit $rc" >>"$out/gemm_step.log"
        echo "  TPAR_GEMM=$backend: exit $rc, $(grep -o 'steady_step_s=[0-9.eE+-]*' "$out/gemm_step.log" | tail -1)"
    done
fi

# ---------------------------------------------------------------- 3e. Hopper attention

# The training step (--no-fsdp, the step's model) with TPAR_SDPA=hopper: attention on the
# Hopper kernels where the device runs sm_90a kernels and they take the call (the
# mma.sync kernels elsewhere). Log in llama_2d_sdpa_hopper.log.
if [ "${SKIP_SDPA_STEP:-0}" != 1 ] && [ "$dev" = cuda ] && [ -x "$bin/llama_2d" ] &&
    fits "3e. Hopper attention" 15; then
    echo
    echo "== 3e. llama_2d --no-fsdp with TPAR_SDPA=hopper (log in llama_2d_sdpa_hopper.log)"
    # shellcheck disable=SC2086
    TPAR_SDPA=hopper timeout "$(cap "${LLAMA_TIMEOUT:-180}")" \
        "$bin/llama_2d" --world 1 --dp 1 --tp 1 "${model[@]}" --dtype bf16 --no-fsdp \
        "${llama_steps[@]}" --device "$dev" ${LLAMA_ARGS:-} >"$out/llama_2d_sdpa_hopper.log" 2>&1
    rc=$?
    echo "  TPAR_SDPA=hopper: exit $rc, $(grep -o 'steady_step_s=[0-9.eE+-]*' "$out/llama_2d_sdpa_hopper.log" | tail -1)"
fi

# ---------------------------------------------------------------- 3f. fused projections

# The training step (--no-fsdp, the step's model) with --fuse-proj --fuse-residual: q, k,
# v and gate, up each by one GEMM over the concatenated weights, and the residual adds
# read by o_proj's and down_proj's GEMMs; its time per step next to step 3's
# --no-fsdp run. Runs on the host too under SMOKE=1. Log in llama_2d_fused.log.
if [ "${SKIP_FUSED_STEP:-0}" != 1 ] && [ "${SKIP_LLAMA:-0}" != 1 ] && [ -x "$bin/llama_2d" ] &&
    fits "3f. fused projections" 15; then
    echo
    echo "== 3f. llama_2d --no-fsdp --fuse-proj --fuse-residual (log in llama_2d_fused.log)"
    # shellcheck disable=SC2086
    timeout "$(cap "${LLAMA_TIMEOUT:-180}")" \
        "$bin/llama_2d" --world 1 --dp 1 --tp 1 "${model[@]}" --dtype bf16 --no-fsdp \
        --fuse-proj --fuse-residual "${llama_steps[@]}" --device "$dev" ${LLAMA_ARGS:-} \
        >"$out/llama_2d_fused.log" 2>&1
    rc=$?
    echo "  fused: exit $rc, $(grep -o 'steady_step_s=[0-9.eE+-]*' "$out/llama_2d_fused.log" | tail -1)" \
        "(unfused --no-fsdp: $(grep -o 'steady_step_s=[0-9.eE+-]*' "$out/llama_2d_nofsdp.log" 2>/dev/null | tail -1))"
fi

# ---------------------------------------------------------------- 3c. context parallelism

# cp 2 as two rank threads on one GPU against cp 1 on it, at one long sequence: a
# synthetic document longer than the sequence (byte tokens), read in order, so every
# step trains on full rows. Each run's output goes to cp.log after `=== cp<N>`.
cp_rc=skipped
if [ "${SKIP_CP:-0}" != 1 ] && [ -x "$bin/llama_2d" ] && fits "3c. context parallelism" 40; then
    echo
    echo "== 3c. context parallelism on one $dev device, seq $cp_seq (logs in cp.log)"
    : >"$out/cp.log"
    cp_rc=0
    long="$out/cp_document.txt"
    "$py" - "$long" "$cp_seq" <<'PY'
import sys
path, n = sys.argv[1], int(sys.argv[2])
words = [f"w{(i * 7919) % 1009}" for i in range(2 * n)]
line = " ".join(words)[: 2 * n]
with open(path, "w") as f:
    f.write(line + "\n\n" + line[::-1] + "\n")
PY
    for cp in 1 2; do
        fits "3c. cp $cp" 15 || continue
        echo "=== cp$cp" >>"$out/cp.log"
        # shellcheck disable=SC2086
        timeout "$(cap "${LLAMA_TIMEOUT:-180}")" "$bin/llama_2d" --world "$cp" --dp 1 --cp "$cp" --tp 1 \
            "${model_cp[@]}" --seq "$cp_seq" --dtype bf16 --no-fsdp --steps 4 --log-every 1 \
            --data "$long" --no-shuffle --device "$dev" ${LLAMA_ARGS:-} >>"$out/cp.log" 2>&1
        rc=$?
        echo "=== exit $rc" >>"$out/cp.log"
        echo "  cp $cp: exit $rc, $(grep -o 'steady_step_s=[0-9.eE+-]*' "$out/cp.log" | tail -1)"
        [ "$rc" = 0 ] || cp_rc=1
    done
fi

# ---------------------------------------------------------------- 3g. the 16-layer model

# The training table's second size (16 layers, hidden 1024, 8 heads, context 256, batch
# 128): PyTorch's training step in every mode (torch_ref_l16.{log,json}), then llama_2d
# with FSDP and with --no-fsdp (llama_2d_l16.log, llama_2d_l16_nofsdp.log).
if [ "${SKIP_L16:-0}" != 1 ] && fits "3g. the 16-layer model" 120; then
    echo
    echo "== 3g. the 16-layer model (training step only)"
    if [ "${SKIP_TORCH:-0}" != 1 ]; then
        # shellcheck disable=SC2086
        PYTHONUNBUFFERED=1 timeout -k 10 "$(cap "${TORCH_TIMEOUT:-300}")" "$py" "$root/benches/torch_ref.py" \
            --skip-kernels "${model_l16[@]}" --tag l16 --train-mode all ${torch_dev[@]+"${torch_dev[@]}"} \
            --json "$out/torch_ref_l16.json" ${TORCH_REF_ARGS:-} 2>&1 | tee "$out/torch_ref_l16.log"
        echo "(torch_ref l16: exit $?, $SECONDS s in all)"
    fi
    if [ "${SKIP_LLAMA:-0}" != 1 ] && [ -x "$bin/llama_2d" ]; then
        for mode in fsdp nofsdp; do
            flags=()
            log="$out/llama_2d_l16.log"
            if [ "$mode" = nofsdp ]; then
                flags=(--no-fsdp)
                log="$out/llama_2d_l16_nofsdp.log"
            fi
            fits "3g. llama_2d l16 $mode" 15 || continue
            # shellcheck disable=SC2086
            timeout "$(cap "${LLAMA_TIMEOUT:-180}")" "$bin/llama_2d" --world 1 --dp 1 --tp 1 \
                "${model_l16[@]}" --dtype bf16 ${flags[@]+"${flags[@]}"} "${llama_steps[@]}" \
                --device "$dev" ${LLAMA_ARGS:-} >"$log" 2>&1
            echo "(llama_2d l16 $mode: exit $?, $(grep -o 'steady_step_s=[0-9.eE+-]*' "$log"))"
        done
    fi
fi

# ---------------------------------------------------------------- 3b. parity

# The small default model on the device and on the host, in the configurations
# whose emulated host round trips tests/cuda_emulated_training.rs pins: world 1
# with and without FSDP, 2x2 (FSDP x TP, the local backend's four ranks on one
# GPU) with both plans, and world 1 over NCCL under torchrun when it is there.
# Each run's output goes to parity.log after a `=== <name> <device>` line;
# the summary compares the logged losses and reads the round trips.
parity_rc=skipped
if [ "${SKIP_PARITY:-0}" != 1 ] && [ -x "$bin/llama_2d" ] && fits "3b. parity" 60; then
    echo
    echo "== 3b. llama_2d parity: cuda against cpu, small model (logs in parity.log)"
    : >"$out/parity.log"
    parity_rc=0
    small=(--steps 6 --log-every 3)
    run_parity() {
        local name="$1" dev="$2"
        shift 2
        fits "3b. parity $name on $dev" 8 || return 0
        echo "=== $name $dev" >>"$out/parity.log"
        timeout "$(cap "${PARITY_TIMEOUT:-120}")" "$@" "${small[@]}" --device "$dev" >>"$out/parity.log" 2>&1
        local rc=$?
        echo "=== exit $rc" >>"$out/parity.log"
        echo "  $name on $dev: exit $rc"
        [ "$rc" = 0 ] || parity_rc=1
    }
    for cfg in "w1-nofsdp:--world 1 --dp 1 --tp 1 --no-fsdp" "w1-fsdp:--world 1 --dp 1 --tp 1" \
        "2x2-sp:--world 4 --dp 2 --tp 2 --plan sp" "2x2-megatron:--world 4 --dp 2 --tp 2 --plan megatron" \
        "w1-fsdp-bf16:--world 1 --dp 1 --tp 1 --dtype bf16"; do
        name="${cfg%%:*}"
        # shellcheck disable=SC2206  # the configuration's flags, split on spaces
        flags=(${cfg#*:})
        run_parity "$name" cpu "$bin/llama_2d" "${flags[@]}"
        run_parity "$name" cuda "$bin/llama_2d" "${flags[@]}"
    done
    # Run-to-run reproducibility on the device: the same step twice, by default (the
    # attention backward's dQ summed by f32 atomics in the order blocks run) and with
    # --deterministic (summed in key-block order); 4 key blocks a sequence, so dQ sums
    # several blocks. Each run's final_loss_bits goes to repro.log; the summary says
    # whether the two runs of each mode agree.
    : >"$out/repro.log"
    repro=(--world 1 --dp 1 --tp 1 --no-fsdp --layers 2 --hidden 256 --heads 4 --kv-heads 2
        --intermediate 512 --seq 256 --batch 8 --steps 3 --log-every 3 --device cuda)
    for mode in default deterministic; do
        for i in 1 2; do
            fits "3b. reproducibility $mode $i" 8 || continue
            flags=("${repro[@]}")
            [ "$mode" = deterministic ] && flags+=(--deterministic)
            bits=$(timeout "$(cap "${PARITY_TIMEOUT:-120}")" "$bin/llama_2d" "${flags[@]}" 2>&1 |
                sed -n 's/.* final_loss_bits=\([0-9a-f]*\).*/\1/p')
            echo "$mode $i ${bits:-none}" | tee -a "$out/repro.log" | sed 's/^/  reproducibility: /'
        done
    done
    # The nccl backend's device path at world size 1 (tpar-collectives' test binary, if
    # carried: `cargo test --release -p tpar-collectives --test nccl --no-run`, copied
    # to $bin/nccl_test).
    if [ -x "$bin/nccl_test" ]; then
        echo "=== nccl-tests" >>"$out/parity.log"
        timeout "$(cap "${PARITY_TIMEOUT:-120}")" "$bin/nccl_test" --test-threads 1 --nocapture \
            >>"$out/parity.log" 2>&1
        rc=$?
        echo "=== exit $rc" >>"$out/parity.log"
        echo "  nccl tests (tpar-collectives --test nccl): exit $rc"
        [ "$rc" = 0 ] || parity_rc=1
    fi
    if command -v torchrun >/dev/null 2>&1; then
        run_parity nccl-w1 cuda torchrun --standalone --nproc-per-node 1 --no-python \
            "$bin/llama_2d" --backend nccl --dp 1 --tp 1
    fi
    echo "(parity: $SECONDS s in all)"
fi

# ---------------------------------------------------------------- 4. summary

echo
echo "== 4. summary"
"$py" - "$out" "$check_rc" "$torch_rc" "$llama_rc" "$parity_rc" "$dev" "$check_sm90_rc" "$sanitize_rc" <<'PY' || echo "the summary failed (see above)"
import json
import os
import re
import sys

out, check_rc, torch_rc, llama_rc, parity_rc, dev, check_sm90_rc, sanitize_rc = sys.argv[1:9]


def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


g = load("gpu_check.json") or {}
g90 = load("gpu_check_sm90.json")
t = load("torch_ref.json") or {}
# The benchmarks: step 1's, or its TPAR_CUDA_ARCH=sm_90 rerun's when the first run has none
# (it lost the CUDA context or timed out before them).
gb, bench_from = g, "gpu_check.json"
if not g.get("bench", {}).get("ours") and g90 and g90.get("bench", {}).get("ours"):
    gb, bench_from = g90, "gpu_check_sm90.json (the TPAR_CUDA_ARCH=sm_90 rerun: pre-Hopper kernels)"
ours = dict(gb.get("bench", {}).get("ours", {}))
cublaslt = gb.get("bench", {}).get("cublaslt", {})
torch = t.get("bench", {}).get("torch", {})
units = {**t.get("units", {}), **gb.get("units", {})}

# llama_2d: its summary line carries tokens_per_s when it trained.
llama = {"exit": llama_rc}
try:
    with open(os.path.join(out, "llama_2d.log")) as f:
        log = f.read()
except OSError:
    log = ""
m = re.search(r"tokens_per_s=([0-9.eE+-]+)", log)
if m:
    # llama_2d's tokens_per_s counts the tokens that are not padding (the embedded
    # corpus pads short documents); torch_ref's counts every token of its random
    # batches, after three warm-up steps. Compared here: every token (batch x seq
    # per step) over llama_2d's steady_step_s (the seconds per step after its
    # warm-up: cuBLASLt's algorithm search and first loads fall in the first
    # steps), or over its whole training time when the run was too short for that.
    steps = re.search(r" steps=([0-9]+)", log)
    secs = re.search(r" seconds=([0-9.eE+-]+)", log)
    steady = re.search(r" steady_step_s=([0-9.eE+-]+)", log)
    shape = re.search(r"seq ([0-9]+), batch ([0-9]+) per dp rank", log)
    if steps and secs and shape and float(secs.group(1)) > 0:
        step_s = float(secs.group(1)) / int(steps.group(1))
        llama["first_steps_included"] = True
        if steady and float(steady.group(1)) > 0:
            step_s = float(steady.group(1))
            llama["first_steps_included"] = False
        ours["train.llama.tokens_per_s"] = int(shape.group(1)) * int(shape.group(2)) / step_s
        # The same FSDP step against PyTorch's autocast and FSDP2 modes (torch_ref
        # --train-mode all), and the --no-fsdp step against its bf16 mode.
        for mode in ("autocast", "fsdp"):
            ours[f"train.llama.{mode}.tokens_per_s"] = ours["train.llama.tokens_per_s"]
            units[f"train.llama.{mode}.tokens_per_s"] = "tokens/s"
        try:
            with open(os.path.join(out, "llama_2d_nofsdp.log")) as f:
                plain = re.search(r" steady_step_s=([0-9.eE+-]+)", f.read())
        except OSError:
            plain = None
        if plain and float(plain.group(1)) > 0:
            ours["train.llama.bf16.tokens_per_s"] = (
                int(shape.group(1)) * int(shape.group(2)) / float(plain.group(1))
            )
            units["train.llama.bf16.tokens_per_s"] = "tokens/s"
            llama["no_fsdp_step_ms"] = 1e3 * float(plain.group(1))
        llama["step_ms"] = 1e3 * step_s
    units["train.llama.tokens_per_s"] = "tokens/s"
    llama["tokens_per_s_not_padding"] = float(m.group(1))
    llama["outcome"] = "trained"
else:
    tail = [l for l in log.strip().splitlines() if l.strip()][-3:]
    llama["outcome"] = "did not train: " + (" | ".join(tail) if tail else "no output")
# Host round trips per step on the device (rank 0): logging steps read the loss once,
# the others nothing; the emulator's counts are pinned by tests/cuda_emulated_training.rs.
for kind in ("logging", "quiet"):
    m = re.search(rf"round_trips_{kind}=([0-9,]*)", log)
    if m:
        llama[f"round_trips_{kind}"] = [int(x) for x in m.group(1).split(",") if x]

keys = list(ours) + [k for k in torch if k not in ours]


def fmt(v):
    return "-" if v is None else f"{v:.1f}"


def ratio(a, b):
    return f"{a / b:.2f}" if a is not None and b else "-"


# The commit of the binaries (scripts/gpu-bundle.sh), and whether tracked files
# differed from it then.
try:
    with open(os.path.join(out, "built-from.txt")) as f:
        stamp = f.read().split("\n")
    built_from = {"commit": stamp[0].strip(), "uncommitted": [l for l in stamp[1:] if l.strip()]}
except OSError:
    built_from = None

lines = []
if built_from:
    lines.append(f"binaries: built from {built_from['commit']}"
                 + (" with uncommitted changes" if built_from["uncommitted"] else ""))
checks = g.get("checks", [])
failed = [c for c in checks if not c.get("pass")]
lines.append(f"device: {g.get('device', gb.get('device', '?'))} / {t.get('device', '?')} (torch {t.get('torch_version', '?')})")
lines.append(
    f"gpu_check: exit {check_rc}, {len(checks)} checks, {len(failed)} failed"
    + "".join(f"\n  FAIL {c['name']} {c['dtype']} {c['shape']} err {c['err']} {c['note']}" for c in failed)
)
if g.get("context_lost"):
    lines.append(f"  the CUDA context was lost by {g['context_lost']}; the rest did not run")
if check_sm90_rc != "none":
    g90 = g90 or {}
    checks90 = g90.get("checks", [])
    failed90 = [c for c in checks90 if not c.get("pass")]
    lines.append(
        f"gpu_check rerun with TPAR_CUDA_ARCH=sm_90: exit {check_sm90_rc}, {len(checks90)} checks, "
        f"{len(failed90)} failed"
        + "".join(f"\n  FAIL {c['name']} {c['dtype']} {c['shape']} err {c['err']} {c['note']}" for c in failed90)
    )
try:
    with open(os.path.join(out, "skipped.txt")) as f:
        skipped = [l.strip()[3:] for l in f if l.strip()]
except OSError:
    skipped = []
if skipped:
    lines.append("skipped for the time budget: " + "; ".join(skipped))
lines.append(f"benchmarks from {bench_from}")
lines.append(f"torch_ref: exit {torch_rc}")
if sanitize_rc != "skipped":
    lines.append(f"compute-sanitizer (step 1b): exit {sanitize_rc} (0 no reports; logs sanitize_<tool>.log)")
lines.append(f"llama_2d --device {dev}: exit {llama_rc}, {llama['outcome']}")
if "round_trips_quiet" in llama or "round_trips_logging" in llama:
    lines.append(
        "llama_2d host round trips per step (rank 0): logging steps "
        f"{llama.get('round_trips_logging', [])}, other steps {llama.get('round_trips_quiet', [])}"
    )

def sections(name, header):
    """The lines of log `name` after each line matching `header`, keyed by its groups
    (one group: that group's text)."""
    try:
        with open(os.path.join(out, name)) as f:
            text = f.read()
    except OSError:
        text = ""
    runs, cur = {}, None
    for line in text.splitlines():
        m = re.match(header, line)
        if m:
            cur = m.groups() if len(m.groups()) > 1 else m.group(1)
            runs[cur] = []
        elif cur is not None:
            runs[cur].append(line)
    return runs


def losses(t):
    """first_loss (step 1 logs only in the summary line), then the loss lines."""
    return [float(x) for x in re.findall(r"(?:first_loss=| loss )([0-9.]+)", t)]


# Parity: per configuration, the device run's logged losses against the host's.
parity = {}
runs = sections("parity.log", r"=== (\S+) (cpu|cuda)$")
lines.append(f"parity (exit {parity_rc}): cuda against cpu, logged losses")
for (name, dev), body in runs.items():
    if dev != "cuda":
        continue
    text = "\n".join(body)
    ref = "\n".join(runs.get((name.replace("nccl-w1", "w1-fsdp"), "cpu"), []))
    ls, lr = losses(text), losses(ref)
    diff = max((abs(a - b) for a, b in zip(ls, lr)), default=None)
    rt = {k: re.search(rf"round_trips_{k}=([0-9,]*)", text) for k in ("logging", "quiet")}
    rt = {k: v.group(1) for k, v in rt.items() if v}
    ok = bool(ls) and len(ls) == len(lr) and diff is not None and diff <= 2e-3
    parity[name] = {"cuda_losses": ls, "cpu_losses": lr, "max_abs_diff": diff, "round_trips": rt, "match": ok}
    tail = " | ".join([l for l in body if l.strip()][-2:]) if not ls else ""
    lines.append(f"  {name:<14} {'MATCH' if ok else 'DIFFER'} cuda {ls} cpu {lr} max|d| {diff} "
                 f"round trips logging {rt.get('logging', '?')} quiet {rt.get('quiet', '?')} {tail}")
# Reproducibility (3b): each mode's two runs' final loss bits.
repro = {}
try:
    with open(os.path.join(out, "repro.log")) as f:
        for line in f:
            w = line.split()
            if len(w) == 3:
                repro.setdefault(w[0], []).append(w[2])
except OSError:
    pass
if repro:
    lines.append("reproducibility (3b): the same device step twice, final loss bits")
for mode, bits in repro.items():
    same = len(bits) == 2 and bits[0] == bits[1] and bits[0] != "none"
    lines.append(f"  {mode:<14} {'SAME' if same else 'DIFFER'} {' '.join(bits)}")
# Context parallelism (3c): cp 2 on one device against cp 1, losses and step time.
cp = {}
cruns = sections("cp.log", r"=== (cp[0-9]+)$")
if cruns:
    lines.append("context parallelism on one device (3c): cp 2 against cp 1")
for name, body in cruns.items():
    t = "\n".join(body)
    ls = losses(t)
    st = re.search(r" steady_step_s=([0-9.eE+-]+)", t)
    pk = re.search(r" device_peak_mib_max=([0-9.eE+-]+)", t)
    cp[name] = {"losses": ls, "step_s": float(st.group(1)) if st else None,
                "device_peak_mib": float(pk.group(1)) if pk else None}
if "cp1" in cp and "cp2" in cp:
    a, b = cp["cp1"], cp["cp2"]
    d = max((abs(x - y) for x, y in zip(a["losses"], b["losses"])), default=None)
    ok = bool(a["losses"]) and len(a["losses"]) == len(b["losses"]) and d is not None and d <= 2e-2
    r = b["step_s"] / a["step_s"] if a["step_s"] and b["step_s"] else None
    cp["match"], cp["max_abs_loss_diff"], cp["step_ratio"] = ok, d, r
    lines.append(f"  losses {'MATCH' if ok else 'DIFFER'} (max|d| {d}): cp1 {a['losses']} cp2 {b['losses']}")
    lines.append(f"  step s: cp1 {a['step_s']} cp2 {b['step_s']} (cp2/cp1 {ratio(b['step_s'], a['step_s'])}); "
                 f"device peak MiB: cp1 {a['device_peak_mib']} cp2 {b['device_peak_mib']}")
lines.append("")
head = f"{'benchmark':<34} {'unit':<9} {'ours':>9} {'torch':>9} {'cuBLASLt':>9} {'ours/torch':>11} {'ours/cuBLASLt':>14}"
lines.append(head)
lines.append("-" * len(head))
rows = []
for k in keys:
    o, p, c = ours.get(k), torch.get(k), cublaslt.get(k)
    rows.append({"key": k, "unit": units.get(k, ""), "ours": o, "torch": p, "cublaslt": c,
                 "ours_over_torch": o / p if o is not None and p else None,
                 "ours_over_cublaslt": o / c if o is not None and c else None})
    lines.append(f"{k:<34} {units.get(k, ''):<9} {fmt(o):>9} {fmt(p):>9} {fmt(c):>9} "
                 f"{ratio(o, p):>11} {ratio(o, c):>14}")


# The training table: per model size, tpar's two runs against every PyTorch mode of
# torch_ref (--train-mode all), tokens/s and device peak memory, and tpar/torch.
def tpar_run(name):
    """tokens/s (every token over steady_step_s) and device peak of a llama_2d log."""
    try:
        with open(os.path.join(out, name)) as f:
            log = f.read()
    except OSError:
        return None
    steady = re.search(r" steady_step_s=([0-9.eE+-]+)", log)
    secs = re.search(r" seconds=([0-9.eE+-]+)", log)
    steps = re.search(r" steps=([0-9]+)", log)
    shape = re.search(r"seq ([0-9]+), batch ([0-9]+) per dp rank", log)
    peak = re.search(r" device_peak_mib_max=([0-9.eE+-]+)", log)
    pred = re.search(r" predicted_peak_mib=([0-9.eE+-]+)", log)
    if not (shape and (steady or (secs and steps))):
        tail = [l for l in log.strip().splitlines() if l.strip()][-1:]
        return {"error": tail[0] if tail else "no output"}
    step_s = float(steady.group(1)) if steady and float(steady.group(1)) > 0 else 0.0
    if step_s <= 0 and secs and steps:
        step_s = float(secs.group(1)) / max(int(steps.group(1)), 1)
    if step_s <= 0:
        return {"error": "no step time"}
    tokens = int(shape.group(1)) * int(shape.group(2)) / step_s
    return {"tokens_per_s": tokens, "step_ms": 1e3 * step_s,
            "peak_mib": float(peak.group(1)) if peak else None,
            "predicted_peak_mib": float(pred.group(1)) if pred else None}


training = {}
lines.append("")
lines.append("training step: tpar against each PyTorch mode (tokens/s; peak MiB: tpar's "
             "device_peak_mib_max, torch's max_memory_allocated; ratios tpar/torch; "
             "pred MiB: tpar's memory model, predicted_peak_mib)")
sizes = [("step", "torch_ref.json", "llama", "llama_2d.log", "llama_2d_nofsdp.log"),
         ("l16", "torch_ref_l16.json", "l16", "llama_2d_l16.log", "llama_2d_l16_nofsdp.log")]
thead = (f"{'size':<5} {'tpar run':<9} {'torch mode':<9} {'tpar tok/s':>11} {'torch tok/s':>11} "
         f"{'tok/s ratio':>11} {'tpar MiB':>9} {'torch MiB':>9} {'MiB ratio':>9} {'pred MiB':>9}")
lines.append(thead)
lines.append("-" * len(thead))
for size, tjson, tag, fsdp_log, plain_log in sizes:
    tr = load(tjson) or {}
    modes = tr.get("train_modes", {})
    runs = {"fsdp": tpar_run(fsdp_log), "no-fsdp": tpar_run(plain_log)}
    training[size] = {"tpar": runs, "torch": modes, "ratios": {}}
    if not modes and all(r is None for r in runs.values()):
        continue
    for run, r in runs.items():
        if r is None or "error" in r:
            lines.append(f"{size:<5} {run:<9} {'-':<9} {('no run' if r is None else r['error'])[:60]}")
            continue
        for mode, res in modes.items():
            tt, tp = res.get("tokens_per_s"), res.get("peak_mib")
            rt = r["tokens_per_s"] / tt if tt else None
            rm = r["peak_mib"] / tp if r["peak_mib"] is not None and tp else None
            training[size]["ratios"][f"{run}/{mode}"] = {"tokens_per_s": rt, "peak_mib": rm}
            pm = "n/a" if tp is None else f"{tp:.0f}"
            om = "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
            pp = "n/a" if r["predicted_peak_mib"] is None else f"{r['predicted_peak_mib']:.0f}"
            lines.append(f"{size:<5} {run:<9} {mode:<9} {r['tokens_per_s']:>11.0f} "
                         f"{fmt(tt):>11} {ratio(r['tokens_per_s'], tt):>11} {om:>9} {pm:>9} "
                         f"{ratio(r['peak_mib'], tp):>9} {pp:>9}")
text = "\n".join(lines)
print(text)
with open(os.path.join(out, "summary.txt"), "w") as f:
    f.write(text + "\n")
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump({"gpu_check_exit": check_rc, "gpu_check_sm90_exit": check_sm90_rc,
               "context_lost": g.get("context_lost"), "benchmarks_from": bench_from,
               "built_from": built_from,
               "sanitize_exit": sanitize_rc, "skipped": skipped,
               "torch_ref_exit": torch_rc, "llama_2d": llama,
               "parity": parity, "reproducibility": repro, "context_parallel": cp, "checks_total": len(checks), "checks_failed": [c["name"] for c in failed],
               "rows": rows, "training": training}, f, indent=2)
PY

echo
echo "results in $out"
case "$check_rc" in
    skipped) exit 0 ;;
    *) exit "$check_rc" ;;
esac
