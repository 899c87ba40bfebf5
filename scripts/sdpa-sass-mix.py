#!/usr/bin/env python3
"""Static registers, spills and SASS instruction mix of the tensor-core SDPA
kernels (crates/kernels/cuda/sdpa.cu), bf16, sm_90. No GPU needed.

    source scripts/nvrtc-env.sh
    python3 scripts/sdpa-sass-mix.py [--cu FILE] [--full-tile]

Compiles FILE (default crates/kernels/cuda/sdpa.cu) after the prelude with
NVRTC as the library does (sm_90, C++17), assembles it with $TPAR_PTXAS and
disassembles it with cuobjdump ($CUOBJDUMP or on PATH; NVIDIA's pip wheel
nvidia-cuda-cuobjdump has one). For each kernel it prints registers, spill
bytes and instruction counts by class for the whole kernel and for its main
loop (the longest backward branch: the key-tile loop of the forward, the
query-tile loop of the backward):
  int     IMAD (not IMAD.MOV), IADD3, LEA, SHF, LOP3, ISETP, SEL, PRMT, ...
  tensor  HMMA
  float   FFMA, FMUL, FADD, FMNMX, MUFU, FSETP, FSEL, F2FP, ...
  mem     LDSM, LDS, STS, LDG, LDGSTS, REDG, SHFL, LDC, ...
  move    MOV, IMAD.MOV, CS2R, S2R, ...
  ctrl    the rest (branches, barriers)
The loop counts hold every path of the loop body. --full-tile first rewrites
the kernels so that every tile takes the path of a whole tile without an
additive mask (the masked code is removed), which counts what such a tile
executes; the rewritten kernels are for counting only.
"""
import argparse
import collections
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Pairs (old, new) that leave only the whole-tile, unmasked path; the first
# set matches the current kernels, the second the kernels before the
# per-tile mask checks of the backward.
FULL_TILE = [
    [
        ("j0 + kBlock > a.kv_len || (a.causal && j0 + kBlock - 1 > q0 + wrow) || M != nullptr;",
         "false;"),
        ("if (k0 + kBlock <= a.kv_len && nq == kBlock &&\n"
         "            !(a.causal && k0 + warp * 16 + 15 > i0) && a.mask == nullptr) {",
         "if (true) {"),
    ],
    [
        ("j0 + kBlock > a.kv_len || (a.causal && j0 + kBlock - 1 > q0) || M != nullptr;", "false;"),
        ("if (j < a.kv_len && qi < nq && !(a.causal && j > r)) {\n"
         "                    float x = st[nt][e] * sl2;\n"
         "                    if (M != nullptr) x += to_f32(M[(i64)r * a.mask_rs + j]) * kLog2e;",
         "if (true) {\n                    float x = st[nt][e] * sl2;"),
    ],
]

INT = {"IMAD", "IADD3", "IADD", "LEA", "SHF", "LOP3", "LOP", "ISETP", "IMNMX", "VIMNMX", "SEL",
       "IABS", "POPC", "FLO", "BMSK", "SGXT", "PRMT", "ISCADD", "I2F", "F2I", "I2FP", "F2IP",
       "VIADD", "VIADDMNMX", "IMUL", "ULEA", "UIADD3", "UIMAD", "ULOP3", "USHF", "UISETP", "USEL",
       "UPRMT", "USGXT", "UBMSK", "UFLO", "UPOPC", "UIMNMX", "UVIADD"}
FLT = {"FFMA", "FMUL", "FADD", "FMNMX", "MUFU", "FSETP", "FSEL", "F2FP", "FCHK", "FRND", "F2F",
       "HADD2", "HFMA2", "HMUL2", "FMNMX3"}
MEM = {"LDSM", "LDS", "STS", "LDG", "STG", "LDGSTS", "RED", "REDG", "ATOM", "ATOMG", "ATOMS", "LDC",
       "ULDC", "LDGDEPBAR", "DEPBAR", "SHFL", "LD", "ST", "LDL", "STL"}
MOVE = {"MOV", "UMOV", "CS2R", "S2R", "S2UR", "R2UR", "P2R", "R2P", "PLOP3", "UPLOP3", "MOV32I",
        "VOTEU", "VOTE"}


def klass(op):
    base = op.split(".")[0]
    if op.startswith("IMAD.MOV"):
        return "move"
    if base == "HMMA":
        return "tensor"
    for name, group in (("int", INT), ("float", FLT), ("mem", MEM), ("move", MOVE)):
        if base in group:
            return name
    return "ctrl"


def mix(instrs):
    c = collections.Counter()
    for _, text in instrs:
        op = text.split()[0]
        if op != "NOP":
            c[klass(op)] += 1
            c["total"] += 1
    return c


def main_loop(instrs):
    best = None
    for addr, text in instrs:
        m = re.search(r"0x([0-9a-f]+)", text)
        if text.startswith("BRA") and m:
            target = int(m.group(1), 16)
            if target < addr and (best is None or addr - target > best[1] - best[0]):
                best = (target, addr)
    return [] if best is None else [(a, t) for a, t in instrs if best[0] <= a <= best[1]]


def compile_ptx(text):
    lib_dir = os.environ.get("TPAR_NVRTC_LIB_DIR")
    if not lib_dir:
        sys.exit("no TPAR_NVRTC_LIB_DIR: source scripts/nvrtc-env.sh first")
    lib = ctypes.CDLL(os.path.join(lib_dir, "libnvrtc.so.13"))
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), b"sdpa.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [b"--gpu-architecture=sm_90", b"-std=c++17"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    if rc:
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        sys.exit(log.value.decode())
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cu", default=os.path.join(ROOT, "crates/kernels/cuda/sdpa.cu"))
    ap.add_argument("--full-tile", action="store_true")
    args = ap.parse_args()
    ptxas = os.environ.get("TPAR_PTXAS") or shutil.which("ptxas")
    cuobjdump = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not ptxas or not cuobjdump:
        sys.exit("needs ptxas (TPAR_PTXAS) and cuobjdump (CUOBJDUMP or on PATH)")
    text = open(args.cu).read()
    if args.full_tile:
        for subs in FULL_TILE:
            if all(old in text for old, _ in subs):
                for old, new in subs:
                    text = text.replace(old, new)
                break
        else:
            sys.exit("--full-tile: the mask conditions of the kernels were not found")
    prelude = open(os.path.join(ROOT, "crates/kernels/cuda/tpar.cuh")).read()
    ptx = compile_ptx(prelude + '\n#line 1 "sdpa.cu"\n' + text)
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "sdpa.ptx"), "wb") as f:
            f.write(ptx)
        cubin = os.path.join(d, "sdpa.cubin")
        r = subprocess.run([ptxas, "-arch=sm_90", "-v", os.path.join(d, "sdpa.ptx"), "-o", cubin],
                           capture_output=True, text=True, check=True)
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    usage, cur = {}, None
    for line in (r.stderr + r.stdout).splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and cur:
            usage.setdefault(cur, {})["spill"] = f"{m.group(1)}/{m.group(2)}"
        m = re.search(r"Used (\d+) registers", line)
        if m and cur:
            usage.setdefault(cur, {})["regs"] = int(m.group(1))
    funcs, cur = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\w+)", line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and cur:
            funcs[cur].append((int(m.group(1), 16), re.sub(r"^@!?U?P[T0-9]+\s+", "", m.group(2))))
    cols = ("total", "int", "tensor", "float", "mem", "move")
    print(f"{'kernel':28} {'regs':>4} {'spill':>9} | kernel: " + " ".join(f"{c:>6}" for c in cols)
          + " | main loop: " + " ".join(f"{c:>6}" for c in cols))
    for name in sorted(k for k in funcs if "_tc" in k and k.endswith("_bf16")):
        u = usage.get(name, {})
        whole, loop = mix(funcs[name]), mix(main_loop(funcs[name]))
        print(f"{name:28} {u.get('regs', '?'):>4} {u.get('spill', '?'):>9} | kernel: "
              + " ".join(f"{whole[c]:>6}" for c in cols) + " | main loop: "
              + " ".join(f"{loop[c]:>6}" for c in cols))


if __name__ == "__main__":
    main()
