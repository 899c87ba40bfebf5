#!/usr/bin/env python3
"""PyTorch's side of ``benches/attention.rs``: forward + backward of
``F.scaled_dot_product_attention`` on the CPU with a key-padding mask.

Same shapes and forms as the Rust bench: batch 1, 4 heads of 64, f32, the last
quarter of the positions padding; loss ``y.sum()``.

- ``keys``: a boolean ``[1, 1, 1, s]`` key mask, not causal;
- ``causal``: causal attention that also skips padded keys. PyTorch takes no
  mask together with ``is_causal=True``, so this form passes the boolean
  ``[1, 1, s, s]`` causal-and-padding mask (what Hugging Face builds).

Peak memory is the growth of the peak resident set over one step (Linux:
``/proc/self/clear_refs`` restarts the peak). The script re-runs itself with
glibc's mmap threshold fixed at 128 KiB, so freed large buffers leave the
resident set and a step's peak is not hidden by memory an earlier step kept. Threads: ``torch.get_num_threads()``
(all cores by default, as the Rust bench's rayon pool).

Usage: ``python3 benches/attention_torch.py [SEQ ...]`` (default 1024 4096 8192 16384).
"""

import os
import sys
import time

import torch
import torch.nn.functional as F

MIB = float(1 << 20)


def rss():
    """(resident, peak resident) bytes of this process."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, kb = line.split()[:2]
                vals[key] = int(kb) * 1024
    return vals.get("VmRSS:", 0), vals.get("VmHWM:", 0)


def reset_rss_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def main():
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
        os.execv(sys.executable, [sys.executable] + sys.argv)
    seqs = [int(a) for a in sys.argv[1:]] or [1024, 4096, 8192, 16384]
    b, h, d = 1, 4, 64
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| seq | form | fwd+bwd s | RSS peak MiB |")
    print("|---:|---|---:|---:|")
    for s in seqs:
        g = torch.Generator().manual_seed(s)
        q, k, v = (torch.randn(b, h, s, d, generator=g).requires_grad_(True) for _ in range(3))
        tokens = s - s // 4
        keys = torch.arange(s) < tokens  # True: a token
        for form in ("causal", "keys"):
            if form == "keys":
                mask = keys.view(1, 1, 1, s)
            else:
                causal = torch.ones(s, s, dtype=torch.bool).tril()
                mask = (causal & keys.view(1, s)).view(1, 1, s, s)

            def step():
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                y.sum().backward()
                for t in (q, k, v):
                    t.grad = None

            reps = 1 if s >= 8192 else 3
            if reps > 1:
                step()
            times, peak = [], 0
            for _ in range(reps):
                reset_rss_peak()
                rss0 = rss()[0]
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
                peak = max(peak, rss()[1] - rss0)
            times.sort()
            print(f"| {s} | {form} | {times[len(times) // 2]:.3f} | {peak / MIB:.1f} |", flush=True)
            del mask


if __name__ == "__main__":
    main()
