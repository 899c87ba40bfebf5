#!/usr/bin/env bash
# Prepares, on a machine with cargo and no GPU, everything scripts/gpu-check.sh
# needs on a GPU machine that has no Rust: the release binaries and a kernel
# cache compiled ahead of time, in one folder (default ./gpu-bin) to carry
# along. Run from anywhere:
#
#     scripts/gpu-bundle.sh
#
# It builds (release) gpu_check (crates/tools), the example llama_2d and
# tpar-collectives' NCCL test binary (gpu-check.sh step 3b runs it as
# gpu-bin/nccl_test), copies them into the folder stripped of their symbols
# (a device call carries at most 64 MiB), and has NVRTC compile
# every kernel source for sm_90a (what an H100/H200 runs) and sm_90 (the
# pre-Hopper kernels, for a rerun with TPAR_CUDA_ARCH=sm_90 when a Hopper kernel
# fails) into gpu-bin/kernel-cache (`gpu_check --precompile`; NVRTC comes from
# scripts/nvrtc-env.sh). A GPU process with the same NVRTC version then loads
# the kernels instead of compiling them; with another version it compiles on
# first use (slower, same results). Last, it prints the folder's size and the
# command to run on the GPU machine from the repository root:
#
#     TPAR_KERNEL_CACHE="$PWD/gpu-bin/kernel-cache" QUICK=1 scripts/gpu-check.sh
#
# Environment: GPU_BIN (the folder; default ./gpu-bin), CARGO_TARGET_DIR
# (where cargo builds; default target/), ARCHS (default "sm_90a sm_90"),
# SKIP_BUILD=1 (only refresh the kernel cache, with the binaries already there).
# Exit status: 0 when every binary and every architecture's cache is in place,
# else that of the first step that failed.

set -eu
set -o pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bin="${GPU_BIN:-$root/gpu-bin}"
target="${CARGO_TARGET_DIR:-$root/target}"
archs="${ARCHS:-sm_90a sm_90}"
mkdir -p "$bin"

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    echo "== building the release binaries"
    cargo build --release -p tpar-tools --bin gpu_check
    cargo build --release --example llama_2d
    # The test binary's path is the last "executable" cargo reports for it.
    nccl="$(cargo test --release -p tpar-collectives --test nccl --no-run --message-format json 2>/dev/null |
        sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)"
    cp "$target/release/gpu_check" "$target/release/examples/llama_2d" "$bin/"
    strip "$bin/gpu_check" "$bin/llama_2d"
    if [ -n "$nccl" ] && [ -x "$nccl" ]; then
        cp "$nccl" "$bin/nccl_test"
        strip "$bin/nccl_test"
    else
        echo "gpu-bundle: no NCCL test binary (tpar-collectives --test nccl); step 3b skips it" >&2
    fi
fi
for b in gpu_check llama_2d; do
    if [ ! -x "$bin/$b" ]; then
        echo "gpu-bundle: $bin/$b is missing (run without SKIP_BUILD=1)" >&2
        exit 2
    fi
done

echo "== kernel cache for: $archs"
# shellcheck source=scripts/nvrtc-env.sh
source "$root/scripts/nvrtc-env.sh"
export TPAR_KERNEL_CACHE="$bin/kernel-cache"
mkdir -p "$TPAR_KERNEL_CACHE"
for arch in $archs; do
    "$bin/gpu_check" --precompile "$arch" | tail -n 1
done

# Which commit the binaries and kernels come from (gpu-check.sh prints it with its
# results): the commit, then the tracked files that differed from it.
{
    git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown
    git -C "$root" status --porcelain --untracked-files=no 2>/dev/null || true
} >"$bin/built-from.txt"

echo "== $bin"
echo "  built from $(head -n 1 "$bin/built-from.txt")$([ "$(wc -l <"$bin/built-from.txt")" -gt 1 ] && echo ' with uncommitted changes')"
du -sh "$bin"/* | sed 's/^/  /'
total_kib="$(du -sk "$bin" | cut -f1)"
echo "  in all: $((total_kib / 1024)) MiB (a device call carries at most 64 MiB)"
if [ "$total_kib" -gt $((64 * 1024)) ]; then
    echo "gpu-bundle: $bin is over 64 MiB: strip the binaries (strip $bin/*) or carry fewer" >&2
    exit 1
fi
rel="${bin#"$root"/}"
echo
echo "On the GPU machine, from the repository root, with $rel carried along:"
echo "    TPAR_KERNEL_CACHE=\"\$PWD/$rel/kernel-cache\" GPU_BIN=\"\$PWD/$rel\" QUICK=1 scripts/gpu-check.sh"
