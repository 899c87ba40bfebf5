# shellcheck shell=bash
# Makes NVRTC (and ptxas) available to tpar's tests on a machine without a
# CUDA toolkit, e.g. a CPU-only CI runner. Source it; do not execute it:
#
#     source scripts/nvrtc-env.sh
#
# It uses the first of
#   1. $TPAR_NVRTC_DIR, a directory holding libnvrtc.so.13 (or .so.12), set by hand;
#   2. an NVRTC 13 already on this machine (LD_LIBRARY_PATH, /usr/local/cuda*,
#      the ldconfig cache, NVIDIA wheels in Python's site-packages) when a ptxas
#      comes with it (beside it, on PATH, or TPAR_PTXAS); without one, step 3's
#      pair is preferred and this NVRTC is the fallback;
#   3. NVIDIA's pip wheels nvidia-cuda-nvrtc and nvidia-cuda-nvcc (for ptxas),
#      installed once into $TPAR_CUDA_CACHE (default ~/.cache/tpar/cuda-13.0)
#      and reused afterwards; only this step needs the network;
#   4. an NVRTC 12 on this machine (the same places as 2).
#
# and exports
#   LD_LIBRARY_PATH      with NVRTC's directory in front: cudarc dlopens NVRTC by
#                        bare name (libnvrtc.so, ..., libnvrtc.so.13, .so.12, ...),
#                        and dlopen reads LD_LIBRARY_PATH once, when a process
#                        starts, so this must happen before the tests start;
#   TPAR_NVRTC_LIB_DIR   that directory;
#   TPAR_PTXAS           a ptxas binary, when one was found and none was set
#                        (the NVRTC test then reports registers and spills).
#
# Returns non-zero (without exiting an interactive shell) when no NVRTC can be
# set up; under `set -e` that stops the calling script.

tpar_nvrtc_env() {
    local want="${TPAR_NVRTC_VERSION:-13.0.*}"
    local cache="${TPAR_CUDA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tpar/cuda-13.0}"
    local lib="" ptxas="" d f

    # Directories where an installed NVRTC may live.
    local places=()
    local saved_ifs="$IFS"
    IFS=:
    for d in ${LD_LIBRARY_PATH:-}; do
        if [ -n "$d" ]; then places+=("$d"); fi
    done
    IFS="$saved_ifs"
    for d in /usr/local/cuda/lib64 /usr/local/cuda-1[0-9]*/lib64 \
        /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
        if [ -d "$d" ]; then places+=("$d"); fi
    done
    if command -v ldconfig >/dev/null 2>&1; then
        while read -r f; do
            if [ -n "$f" ]; then places+=("$(dirname "$f")"); fi
        done < <(ldconfig -p 2>/dev/null | awk '/libnvrtc\.so\.1[23] /{print $NF}' || true)
    fi
    if command -v python3 >/dev/null 2>&1; then
        while read -r d; do
            for f in "$d"/nvidia/cu13/lib "$d"/nvidia/cuda_nvrtc/lib; do
                if [ -d "$f" ]; then places+=("$f"); fi
            done
        done < <(python3 -c 'import site, sys
print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null || true)
    fi
    # The first place holding libnvrtc.so.<major>.
    tpar_find_nvrtc() {
        local p
        for p in "${places[@]}"; do
            if [ -e "$p/libnvrtc.so.$1" ]; then
                echo "$p"
                return 0
            fi
        done
        return 1
    }

    if [ -n "${TPAR_NVRTC_DIR:-}" ]; then
        if [ -e "$TPAR_NVRTC_DIR/libnvrtc.so.13" ] || [ -e "$TPAR_NVRTC_DIR/libnvrtc.so.12" ]; then
            lib="$TPAR_NVRTC_DIR"
        else
            echo "nvrtc-env: TPAR_NVRTC_DIR=$TPAR_NVRTC_DIR holds no libnvrtc.so.13 or .so.12" >&2
            return 1
        fi
    fi
    # An NVRTC 13 already here is used when a ptxas comes with it (or is set or on
    # PATH); without one, the cached pair of the same release is preferred (installed
    # once), since the NVRTC found may write PTX newer than any ptxas at hand and the
    # ptxas checks would skip.
    local found=""
    if [ -z "$lib" ]; then
        found="$(tpar_find_nvrtc 13)" || found=""
        if [ -n "$found" ] && { [ -n "${TPAR_PTXAS:-}" ] || command -v ptxas >/dev/null 2>&1 ||
            [ -x "$found/../bin/ptxas" ]; }; then
            lib="$found"
        fi
    fi

    if [ -z "$lib" ]; then
        local stamp="$cache/.installed"
        if [ ! -f "$stamp" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
            local start=$SECONDS tmp="$cache.tmp.$$"
            echo "nvrtc-env: installing nvidia-cuda-nvrtc==$want and ptxas (nvidia-cuda-nvcc==$want) into $cache" >&2
            rm -rf "$tmp"
            mkdir -p "$(dirname "$cache")"
            # --no-deps: the wheels' own dependencies (nvvm, runtime, crt) are not
            # needed for NVRTC or ptxas.
            if command -v python3 >/dev/null 2>&1 &&
                PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --no-deps \
                    --disable-pip-version-check --no-input --target "$tmp" \
                    "nvidia-cuda-nvrtc==$want" "nvidia-cuda-nvcc==$want" >&2 &&
                [ -n "$(find "$tmp" -name libnvrtc.so.13 -print -quit)" ]; then
                # Keep what the tests use; drop the rest of the nvcc toolchain and
                # the alternative NVRTC builds (together over half the size).
                local root
                root="$(dirname "$(find "$tmp" -name libnvrtc.so.13 -print -quit)")/.."
                rm -f "$root"/lib/*.alt.so* "$root"/bin/nvcc "$root"/bin/nvlink \
                    "$root"/bin/cudafe++ "$root"/bin/fatbinary "$root"/bin/bin2c \
                    "$root"/bin/__nvcc_device_query
                echo "$want" >"$tmp/.installed"
                rm -rf "$cache"
                mv "$tmp" "$cache"
                echo "nvrtc-env: installed in $((SECONDS - start)) s ($(du -sh "$cache" | cut -f1))" >&2
            else
                rm -rf "$tmp"
                echo "nvrtc-env: could not install the wheels (no python3 -m pip, or no network)" >&2
            fi
        fi
        if [ -f "$stamp" ]; then
            local so
            so="$(find "$cache" -name libnvrtc.so.13 -print -quit)"
            if [ -n "$so" ]; then
                lib="$(cd "$(dirname "$so")" && pwd)"
                # Unversioned names beside the versioned files, for tools that want
                # them (cudarc itself also tries libnvrtc.so.13).
                [ -e "$lib/libnvrtc.so" ] || ln -s libnvrtc.so.13 "$lib/libnvrtc.so"
                f="$(cd "$lib" && ls libnvrtc-builtins.so.13.* 2>/dev/null | head -n1)" || f=""
                if [ -n "$f" ] && [ ! -e "$lib/libnvrtc-builtins.so" ]; then
                    ln -s "$f" "$lib/libnvrtc-builtins.so"
                fi
                f="$(find "$cache" -name ptxas -type f -perm -u+x -print -quit)"
                if [ -n "$f" ]; then ptxas="$f"; fi
            fi
        fi
    fi

    if [ -z "$lib" ] && [ -n "$found" ]; then
        lib="$found"
        echo "nvrtc-env: NVRTC 13 without a ptxas of its release: the ptxas checks will skip" >&2
    fi
    if [ -z "$lib" ]; then
        lib="$(tpar_find_nvrtc 12)" || lib=""
        if [ -n "$lib" ]; then echo "nvrtc-env: no NVRTC 13; using NVRTC 12" >&2; fi
    fi
    if [ -z "$lib" ]; then
        echo "nvrtc-env: no NVRTC found or installed; the NVRTC tests will skip (or fail with TPAR_REQUIRE_NVRTC=1)" >&2
        return 1
    fi

    case ":${LD_LIBRARY_PATH:-}:" in
        *":$lib:"*) ;;
        *) export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
    esac
    export TPAR_NVRTC_LIB_DIR="$lib"
    if [ -z "${TPAR_PTXAS:-}" ]; then
        if command -v ptxas >/dev/null 2>&1; then
            ptxas="$(command -v ptxas)"
        elif [ -z "$ptxas" ] && [ -x "$lib/../bin/ptxas" ]; then
            ptxas="$(cd "$lib/../bin" && pwd)/ptxas"
        fi
        if [ -n "$ptxas" ]; then export TPAR_PTXAS="$ptxas"; fi
    fi
    echo "nvrtc-env: NVRTC from $lib${TPAR_PTXAS:+, ptxas $TPAR_PTXAS}" >&2
}

tpar_nvrtc_env
tpar_nvrtc_status=$?
unset -f tpar_nvrtc_env tpar_find_nvrtc
# `return` works when sourced; the `exit` only runs if the file was executed.
return "$tpar_nvrtc_status" 2>/dev/null || exit "$tpar_nvrtc_status"
