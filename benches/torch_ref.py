#!/usr/bin/env python3
"""PyTorch reference numbers for tpar's GPU benchmarks.

The PyTorch side of ``gpu_check --bench`` (``crates/tools``): the same shapes, the
same byte and FLOP accounting and the same JSON keys, so that
``scripts/gpu-check.sh`` can print ours / PyTorch for every key both measured.

- ``gemm.bf16.{nn,nt}.MxNxK``: ``torch.matmul`` TFLOP/s (2*M*N*K per product),
  bf16 in and out; NT multiplies by a ``[N, K]`` matrix's transpose (a Linear
  weight), NN by a ``[K, N]`` matrix.
- ``sdpa.{fwd,fwdbwd}.sS``: ``F.scaled_dot_product_attention`` on the flash
  backend, causal, 32 q / 8 kv heads of 128 (``enable_gqa=True``, or the kv
  heads repeated beforehand when this torch cannot), batch = 16384 / S; and
  ``sdpa.{fwd,fwdbwd}.d64.s1024``: the training step's shape (16 q / 8 kv heads
  of 64, batch 8, seq 1024).
  FLOPs: 4*B*H*S^2*D/2 forward, 3.5 times that forward+backward.
- ``rmsnorm.{fwd,bwd,fwdbwd}``, ``rope.fwd``, ``cross_entropy.{fwd,bwd,fwdbwd}``,
  ``copy.dtod``: achieved GB/s counting the bytes the op must read and write
  once (RMSNorm 16384x4096, RoPE rotate-half on [4, 32, 4096, 128], cross-entropy
  8192x128256, all bf16; a 1 GiB device-to-device copy counts 2 GiB).
- ``train.llama.tokens_per_s``: one training step (forward, backward, gradient
  clipping, AdamW) of a small Llama in eager PyTorch with the architecture of
  tpar's ``LlamaForPretraining`` (crates/models/src/llama.rs) and the defaults of
  ``examples/llama_2d.rs`` scaled up for a GPU: RMSNorm (eps 1e-5), RoPE
  rotate-half (theta 10000, HF table layout), causal GQA attention, SwiGLU MLP,
  untied embedding and LM head, no biases, byte-level vocab of 259, AdamW
  (betas 0.9/0.99, eps 1e-8, weight decay 0.1), clip at 1.0. With
  ``--dtype bf16``, ``--train-mode`` picks how bf16 is used, so that each of
  llama_2d's modes has its like: ``autocast`` (the default) computes in bf16
  over f32 parameters; ``fsdp`` wraps every decoder layer and the root in
  FSDP2's ``fully_shard`` on a world-1 process group with bf16 parameters and
  f32 gradient reduction (llama_2d's FSDP mixed precision, gathers and copies
  included); ``bf16`` trains bf16 parameters without autocast (llama_2d's
  ``--no-fsdp``); ``fused`` is ``autocast`` with PyTorch's fused AdamW
  (``fused=True``: one kernel for every parameter's update); ``compile`` is
  ``fused`` with ``torch.compile(model)`` (Inductor; its compilation falls in
  the warm-up steps, which are not timed). ``--train-mode all`` measures the
  five in turn and reports each as ``train.<tag>.<mode>.tokens_per_s`` as well,
  with ``train.<tag>.<mode>.peak_mib``: ``torch.cuda.max_memory_allocated()``
  over the mode's model, optimizer and steps, in MiB (n/a on the CPU).
  ``<tag>`` is ``--tag`` (default ``llama``).
- Model sizes: the flags below, or ``--preset``: ``step`` (gpu-check.sh's
  training-step model: 8 layers, hidden 1024, heads 16/8, intermediate 2816,
  seq 1024, batch 8, 94.9M parameters) or ``l16`` (16 layers, hidden 1024,
  8 heads (8 kv heads), intermediate 2816, context 256, batch 128).

Every time is the median of 3 trials of enough back-to-back calls for about
0.2 s, after a warm-up, bracketed by ``torch.cuda.synchronize()`` (as in
gpu_check). Needs only torch. ``--json PATH`` writes the results.
"""

import argparse
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


# The device measured: "cuda", or "cpu" to smoke-test this script without a GPU.
DEV = "cuda"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def time_per_call(fn, min_time=0.2):
    """Seconds per call of ``fn``: median of 3 trials after a warm-up."""
    fn()
    sync()
    t = time.perf_counter()
    fn()
    sync()
    one = max(time.perf_counter() - t, 1e-6)
    reps = min(max(math.ceil(min_time / one), 3), 2000)
    trials = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        trials.append((time.perf_counter() - t) / reps)
    trials.sort()
    return trials[1]


class Results:
    """Measured values with their units and notes, printed as they come."""

    def __init__(self):
        self.values, self.units, self.notes = {}, {}, {}

    def add(self, key, value, unit, note=""):
        self.values[key] = value
        self.units[key] = unit
        self.notes[key] = note
        shown = ("n/a" if unit == "MiB" else "-") if value is None else f"{value:.1f}"
        print(f"  {key:<34} torch {shown:>9} {unit}  ({note})", flush=True)

    def guard(self, keys, unit, note, fn):
        """Runs ``fn`` (returning one value per key); an error is recorded, not raised."""
        try:
            vals = fn()
        except Exception as e:  # a shape that does not fit, a missing backend...
            print(f"  {', '.join(keys)}: {type(e).__name__}: {e}", file=sys.stderr)
            vals = [None] * len(keys)
            note = f"{note}; error: {type(e).__name__}: {str(e)[:200]}"
        for k, v in zip(keys, vals):
            self.add(k, v, unit, note)
        if DEV == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- kernels


def bench_gemm(r, quick):
    shapes = [("square", 4096, 4096, 4096)]
    if not quick:
        shapes += [
            ("square", 8192, 8192, 8192),
            ("llama8b q/o proj", 8192, 4096, 4096),
            ("llama8b k/v proj", 8192, 1024, 4096),
            ("llama8b gate/up proj", 8192, 14336, 4096),
            ("llama8b down proj", 8192, 4096, 14336),
        ]
    dev = DEV
    for label, m, n, k in shapes:
        for layout in ("nn", "nt"):
            key = f"gemm.bf16.{layout}.{m}x{n}x{k}"

            def run(m=m, n=n, k=k, layout=layout):
                a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                if layout == "nn":
                    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
                else:
                    b = torch.randn(n, k, device=dev, dtype=torch.bfloat16).t()
                c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                t = time_per_call(lambda: torch.matmul(a, b, out=c))
                return [2.0 * m * n * k / t / 1e12]

            r.guard([key], "TFLOP/s", label, run)


def sdpa_context():
    """The flash backend only (a context manager), across torch versions."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    except ImportError:
        return torch.backends.cuda.sdp_kernel(
            enable_flash=True, enable_math=False, enable_mem_efficient=False
        )


def gqa_attention_fn(hq, hkv):
    """``attn(q, k, v)`` for causal GQA, and how the kv heads are shared."""

    def native(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    # Probe once: enable_gqa needs torch >= 2.5 and a backend that takes it.
    q = torch.randn(1, hq, 128, 128, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(1, hkv, 128, 128, device=DEV, dtype=torch.bfloat16)
    try:
        with sdpa_context():
            native(q, k, k)
        return native, "enable_gqa"
    except (TypeError, RuntimeError):
        rep = hq // hkv

        def repeated(q, k, v):
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return repeated, "repeat_interleave"


def bench_sdpa(r, quick):
    seqs = [1024, 2048] if quick else [1024, 2048, 4096, 8192]
    # (label, batch, q heads, kv heads, seq, head dim): 16k tokens at heads of 128, then
    # the training step's shape (gpu_check's `sdpa.*.d64.s1024`).
    cases = [(f"s{s}", 16384 // s, 32, 8, s, 128) for s in seqs]
    cases.append(("d64.s1024", 8, 16, 8, 1024, 64))
    how = None
    for label, b, hq, hkv, s, d in cases:
        attn, how = gqa_attention_fn(hq, hkv)
        note = f"b{b} h{hq}/{hkv} d{d} causal, flash, {how}"
        fwd_flops = 4.0 * b * hq * s * s * d * 0.5

        def run(s=s, b=b, hq=hq, hkv=hkv, d=d, attn=attn, fwd_flops=fwd_flops):
            opts = dict(device=DEV, dtype=torch.bfloat16)
            q = torch.randn(b, hq, s, d, **opts, requires_grad=True)
            k = torch.randn(b, hkv, s, d, **opts, requires_grad=True)
            v = torch.randn(b, hkv, s, d, **opts, requires_grad=True)
            dout = torch.randn(b, hq, s, d, **opts)
            with sdpa_context():
                with torch.no_grad():
                    t_fwd = time_per_call(lambda: attn(q, k, v))

                def step():
                    out = attn(q, k, v)
                    torch.autograd.grad(out, (q, k, v), dout)

                t_all = time_per_call(step)
            return [fwd_flops / t_fwd / 1e12, 3.5 * fwd_flops / t_all / 1e12]

        r.guard([f"sdpa.fwd.{label}", f"sdpa.fwdbwd.{label}"], "TFLOP/s", note, run)
    return how


def rms_norm(x, w, eps):
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * w


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_tables(seq, hd, theta, device, dtype):
    """``cos``/``sin`` ``[seq, hd]``, the frequencies repeated over both halves."""
    half = hd // 2
    j = torch.arange(hd, device=device, dtype=torch.float64) % half
    inv = theta ** (-2.0 * j / hd)
    ang = torch.arange(seq, device=device, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def bench_bandwidth(r):
    opts = dict(device=DEV, dtype=torch.bfloat16)

    def copy():
        n = 1 << 30
        a = torch.empty(n, device=DEV, dtype=torch.uint8)
        b = torch.empty_like(a)
        t = time_per_call(lambda: b.copy_(a))
        return [2.0 * n / t / 1e9]

    r.guard(["copy.dtod"], "GB/s", "1 GiB tensor.copy_", copy)

    rows, dim = 16384, 4096
    nx = rows * dim

    def rms():
        x = torch.randn(rows, dim, **opts, requires_grad=True)
        w = (1.0 + 0.1 * torch.randn(dim, **opts)).requires_grad_(True)
        dy = torch.randn(rows, dim, **opts)
        with torch.no_grad():
            tf = time_per_call(lambda: rms_norm(x, w, 1e-5))
        y = rms_norm(x, w, 1e-5)
        tb = time_per_call(lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True))
        ta = time_per_call(lambda: torch.autograd.grad(rms_norm(x, w, 1e-5), (x, w), dy))
        return [2 * nx * 2 / tf / 1e9, 3 * nx * 2 / tb / 1e9, 5 * nx * 2 / ta / 1e9]

    impl = "F.rms_norm" if hasattr(F, "rms_norm") else "manual"
    keys = ["rmsnorm.fwd", "rmsnorm.bwd", "rmsnorm.fwdbwd"]
    r.guard(keys, "GB/s", f"16384x4096 bf16, {impl}", rms)

    def rope():
        x = torch.randn(4, 32, 4096, 128, **opts)
        cos, sin = rope_tables(4096, 128, 10000.0, DEV, torch.bfloat16)
        with torch.no_grad():
            t = time_per_call(lambda: apply_rope(x, cos, sin))
        return [2.0 * x.numel() * 2 / t / 1e9]

    r.guard(["rope.fwd"], "GB/s", "[4, 32, 4096, 128] bf16, eager rotate-half", rope)

    rows, vocab = 8192, 128256
    nl = rows * vocab

    def ce():
        logits = torch.randn(rows, vocab, **opts, requires_grad=True)
        targets = torch.randint(0, vocab, (rows,), device=DEV)
        with torch.no_grad():
            tf = time_per_call(lambda: F.cross_entropy(logits, targets))
        loss = F.cross_entropy(logits, targets)
        tb = time_per_call(lambda: torch.autograd.grad(loss, logits, retain_graph=True))
        ta = time_per_call(lambda: torch.autograd.grad(F.cross_entropy(logits, targets), logits))
        return [nl * 2 / tf / 1e9, 2 * nl * 2 / tb / 1e9, 3 * nl * 2 / ta / 1e9]

    keys = ["cross_entropy.fwd", "cross_entropy.bwd", "cross_entropy.fwdbwd"]
    r.guard(keys, "GB/s", "8192x128256 bf16", ce)


# ---------------------------------------------------------------- the model


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight.to(x.dtype), self.eps)


class Attention(nn.Module):
    def __init__(self, cfg, attn):
        super().__init__()
        h, hd = cfg.hidden, cfg.hidden // cfg.heads
        self.heads, self.kv_heads, self.hd = cfg.heads, cfg.kv_heads, hd
        self.q_proj = nn.Linear(h, cfg.heads * hd, bias=False)
        self.k_proj = nn.Linear(h, cfg.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, cfg.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.heads * hd, h, bias=False)
        self.attn = attn

    def forward(self, x, cos, sin):
        b, s, _ = x.shape

        def heads(proj, n):
            return proj(x).view(b, s, n, self.hd).transpose(1, 2)

        q = heads(self.q_proj, self.heads)
        k = heads(self.k_proj, self.kv_heads)
        v = heads(self.v_proj, self.kv_heads)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = self.attn(q, k, v)
        return self.o_proj(a.transpose(1, 2).reshape(b, s, self.heads * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, attn):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, 1e-5)
        self.self_attn = Attention(cfg, attn)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, 1e-5)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Embedding, decoder layers, final norm, untied LM head."""

    def __init__(self, cfg, attn):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg, attn) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, 1e-5)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg.seq, cfg.hidden // cfg.heads, 10000.0, "cpu", torch.float32)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids):
        s = ids.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def shard_world1(model):
    """FSDP2 over a world-1 process group: every decoder layer and the root,
    bf16 parameters, f32 gradient reduction (llama_2d's FSDP configuration)."""
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if DEV == "cuda" else "gloo", rank=0, world_size=1)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)


# The modes of --train-mode all, in order (module docs).
TRAIN_MODES = ["autocast", "fused", "compile", "fsdp", "bf16"]

# --preset: the model sizes of scripts/gpu-check.sh's training-step rows.
PRESETS = {
    "step": dict(layers=8, hidden=1024, heads=16, kv_heads=8, intermediate=2816, seq=1024, batch=8),
    "l16": dict(layers=16, hidden=1024, heads=8, kv_heads=8, intermediate=2816, seq=256, batch=128),
}


def peak_mib():
    """``torch.cuda.max_memory_allocated()`` in MiB; None on the CPU (no allocator stats)."""
    if DEV != "cuda":
        return None
    return torch.cuda.max_memory_allocated() / (1 << 20)


def bench_train(r, cfg, mode="autocast"):
    """One training step of ``cfg`` in ``mode`` (see the module docs), timed."""
    hd = cfg.hidden // cfg.heads
    if cfg.hidden % cfg.heads or cfg.heads % cfg.kv_heads or hd % 2:
        raise SystemExit("--hidden / --heads / --kv-heads: inconsistent head sizes")
    gqa, how = gqa_attention_fn(cfg.heads, cfg.kv_heads)

    def attn(q, k, v):
        if q.dtype == torch.float32:  # flash takes 16-bit inputs only
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return gqa(q, k, v)

    if DEV == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(cfg.seed)
    model = Llama(cfg, attn).to(DEV)
    params = sum(p.numel() for p in model.parameters())
    half = cfg.dtype == "bf16"
    if half and mode == "bf16":
        model = model.to(torch.bfloat16)
    elif half and mode == "fsdp":
        shard_world1(model)
    # fused / compile: PyTorch's fused AdamW (one kernel over every parameter).
    fused = mode in ("fused", "compile")
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1,
        **({"fused": True} if fused else {}),
    )
    params_list = list(model.parameters())
    if mode == "compile":
        model = torch.compile(model)
    amp = half and mode in ("autocast", "fused", "compile")
    losses = []

    def step():
        data = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), device=DEV)
        x, y = data[:, :-1], data[:, 1:]
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=amp):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab).float(), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params_list, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    for _ in range(3):
        step()
    sync()
    t = time.perf_counter()
    for _ in range(cfg.steps):
        step()
    sync()
    secs = (time.perf_counter() - t) / cfg.steps
    tokens = cfg.batch * cfg.seq / secs
    peak = peak_mib()
    how_run = {"compile": "torch.compile", "fused": "eager, fused AdamW"}.get(mode, "eager")
    if mode == "compile":
        how_run += ", fused AdamW"
    note = (
        f"{cfg.layers} layers, hidden {cfg.hidden}, heads {cfg.heads}/{cfg.kv_heads}, "
        f"intermediate {cfg.intermediate}, seq {cfg.seq}, batch {cfg.batch}, vocab {cfg.vocab}, "
        f"{cfg.dtype}{f' {mode}' if half else ''}, {params / 1e6:.1f}M params, {how_run}, {how}"
    )
    tag = cfg.tag
    if f"train.{tag}.tokens_per_s" not in r.values:  # the first mode's
        r.add(f"train.{tag}.tokens_per_s", tokens, "tokens/s", note)
    if half:
        r.add(f"train.{tag}.{mode}.tokens_per_s", tokens, "tokens/s", note)
        where = "torch.cuda.max_memory_allocated" if DEV == "cuda" else "n/a on the CPU"
        r.add(f"train.{tag}.{mode}.peak_mib", peak, "MiB", where)
    return {
        "config": {k: getattr(cfg, k) for k in (
            "layers", "hidden", "heads", "kv_heads", "intermediate", "seq", "batch",
            "vocab", "dtype", "steps")},
        "params": params,
        "step_ms": secs * 1e3,
        "tokens_per_s": tokens,
        "mode": mode if half else "f32",
        "peak_mib": peak,
        "loss_first": float(losses[0]),
        "loss_last": float(losses[-1]),
    }


# ---------------------------------------------------------------- main


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-train", action="store_true")
    # Model: examples/llama_2d.rs defaults (2 layers, hidden 64, heads 4/2,
    # intermediate 176 = 2.75 x hidden, seq 64, batch 4) scaled up for a GPU.
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=259, help="259: llama_2d's byte tokenizer")
    p.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    p.add_argument("--steps", type=int, default=10, help="timed training steps")
    p.add_argument("--train-mode", choices=TRAIN_MODES + ["all"], default="autocast",
                   help="how --dtype bf16 trains (module docs); all: the five in turn")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="a model size of the module docs (overrides the model flags)")
    p.add_argument("--tag", default="llama",
                   help="the training keys' name: train.<tag>.<mode>.tokens_per_s")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: only to smoke-test this script without a GPU")
    a = p.parse_args()
    for k, v in PRESETS.get(a.preset, {}).items():
        setattr(a, k, v)
    global DEV
    DEV = a.device
    if DEV == "cuda" and not torch.cuda.is_available():
        print("torch_ref: no CUDA device visible to torch", file=sys.stderr)
        sys.exit(2)
    name = torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu"
    print(f"torch_ref: torch {torch.__version__} (CUDA {torch.version.cuda}) on {name}")
    r = Results()
    out = {
        "tool": "torch_ref",
        "device": name,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "bf16_reduced_precision_reduction": bool(
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        ),
    }
    if not a.skip_kernels:
        print("== kernels", flush=True)
        bench_gemm(r, a.quick)
        out["sdpa_gqa"] = bench_sdpa(r, a.quick)
        bench_bandwidth(r)
    if not a.skip_train:
        print("== training step", flush=True)
        modes = [a.train_mode]
        if a.train_mode == "all":  # the modes differ in bf16 only
            modes = TRAIN_MODES if a.dtype == "bf16" else ["autocast"]
        for mode in modes:
            try:
                res = bench_train(r, a, mode)
            except Exception as e:
                print(f"torch_ref: training step ({mode}): {type(e).__name__}: {e}", file=sys.stderr)
                res = {"error": f"{type(e).__name__}: {e}", "mode": mode}
            # "train" stays the first mode's (the default's) for older readers.
            out.setdefault("train", res)
            out.setdefault("train_modes", {})[mode] = res
            if DEV == "cuda":
                torch.cuda.empty_cache()
    out["bench"] = {"torch": r.values}
    out["units"] = r.units
    out["notes"] = r.notes
    copy = r.values.get("copy.dtod")
    print(f"\n{'benchmark':<34} {'torch':>10} {'unit':<9} ratio")
    for k, v in r.values.items():
        unit = r.units[k]
        ratio = ""
        if unit == "GB/s" and copy and v and k != "copy.dtod":
            ratio = f"{100 * v / copy:.0f}% of copy"
        shown = ("n/a" if unit == "MiB" else "-") if v is None else f"{v:.1f}"
        print(f"{k:<34} {shown:>10} {unit:<9} {ratio}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
