"""Golden values for tpar's Llama, computed by an independent PyTorch implementation.

Run from the repository root (needs `pip install torch safetensors`; the Rust tests
only read the files this writes, so CI does not need torch):

    python tests/golden/make_llama_golden.py

Writes, all in float64:

- `tests/golden/llama.safetensors`: a tiny Llama (2 layers, grouped-query attention,
  RoPE, RMSNorm, SwiGLU, untied head) with fixed weights `param.<fqn>`, a batch of
  right-padded token ids `input_ids`, its `attention_mask` and `labels` (-100 at
  padding), then `logits`, `loss` (mean cross-entropy over the non-ignored tokens) and
  `grad.<fqn>` for every parameter; `causal.logits` / `causal.loss` / `causal.grad.<fqn>`
  for the same model with no padding mask (plain causal attention, labels of every
  position counted).
- `tests/golden/rope.safetensors`: RoPE cos/sin tables `<name>.cos`, `<name>.sin` for
  a few (head_dim, positions, theta), in the Hugging Face layout (the frequencies
  repeated over both halves of the head dim).
- `tests/golden/attention.safetensors`: scaled-dot-product attention with grouped
  key/value heads for each mask form (`causal`, `key_padding`, `additive`, `none`):
  inputs `q`, `k`, `v`, the output weight `w`, each form's additive mask (`<form>.mask`,
  absent for `causal` and `none`), output `<form>.out` and the gradients
  `<form>.dq`/`.dk`/`.dv` of `sum(out * w)`.

Everything here is written out from the formulas (no tpar code and no model library
is used), so a mistake shared by tpar's sharded and unsharded paths shows up as a
difference from these values.
"""

import math
import os

import torch
from safetensors.torch import save_file

torch.set_default_dtype(torch.float64)
HERE = os.path.dirname(os.path.abspath(__file__))

CFG = dict(
    vocab=32,
    hidden=16,
    intermediate=24,
    layers=2,
    heads=4,
    kv_heads=2,
    max_pos=16,
    eps=1e-5,
    theta=10000.0,
)


def rope_tables(head_dim, positions, theta):
    """cos/sin `[positions, head_dim]`: inv_freq_i = theta^(-2i/d), repeated over halves."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x, cos, sin):
    """x: [b, heads, s, d]; cos/sin: [s, d]."""
    return x * cos + rotate_half(x) * sin


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def attention(q, k, v, mask):
    """q: [b, hq, s, d], k/v: [b, hkv, s, d], mask: additive [b, 1, s, s] or None.

    Query head h reads key/value head h // (hq / hkv), as grouped-query attention does.
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + mask
    return torch.softmax(scores, dim=-1) @ v


def causal_mask(s):
    m = torch.zeros(s, s)
    m.masked_fill_(torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1), float("-inf"))
    return m


def padding_causal_mask(attention_mask):
    """[b, s] with 1 for tokens, 0 for padding -> additive [b, 1, s, s]."""
    b, s = attention_mask.shape
    m = causal_mask(s).expand(b, 1, s, s).clone()
    m.masked_fill_((attention_mask == 0)[:, None, None, :], float("-inf"))
    return m


def make_params(gen):
    c = CFG
    hd = c["hidden"] // c["heads"]

    def randn(*shape, std):
        return torch.randn(*shape, generator=gen) * std

    p = {"base_model.embed_tokens.weight": randn(c["vocab"], c["hidden"], std=1.0)}
    for i in range(c["layers"]):
        pre = f"base_model.layers.{i}."
        p[pre + "input_layernorm.weight"] = 1.0 + randn(c["hidden"], std=0.1)
        p[pre + "self_attn.q_proj.weight"] = randn(c["heads"] * hd, c["hidden"], std=0.3)
        p[pre + "self_attn.k_proj.weight"] = randn(c["kv_heads"] * hd, c["hidden"], std=0.3)
        p[pre + "self_attn.v_proj.weight"] = randn(c["kv_heads"] * hd, c["hidden"], std=0.3)
        p[pre + "self_attn.o_proj.weight"] = randn(c["hidden"], c["heads"] * hd, std=0.3)
        p[pre + "post_attention_layernorm.weight"] = 1.0 + randn(c["hidden"], std=0.1)
        p[pre + "mlp.gate_proj.weight"] = randn(c["intermediate"], c["hidden"], std=0.3)
        p[pre + "mlp.up_proj.weight"] = randn(c["intermediate"], c["hidden"], std=0.3)
        p[pre + "mlp.down_proj.weight"] = randn(c["hidden"], c["intermediate"], std=0.3)
    p["base_model.norm.weight"] = 1.0 + randn(c["hidden"], std=0.1)
    p["lm_head.weight"] = randn(c["vocab"], c["hidden"], std=0.3)
    return p


def llama_logits(p, ids, mask):
    c = CFG
    b, s = ids.shape
    hd = c["hidden"] // c["heads"]
    cos, sin = rope_tables(hd, c["max_pos"], c["theta"])
    cos, sin = cos[:s], sin[:s]
    x = p["base_model.embed_tokens.weight"][ids]
    for i in range(c["layers"]):
        pre = f"base_model.layers.{i}."
        h = rms_norm(x, p[pre + "input_layernorm.weight"], c["eps"])

        def heads(name, n):
            return (h @ p[pre + name].T).view(b, s, n, hd).transpose(1, 2)

        q = apply_rope(heads("self_attn.q_proj.weight", c["heads"]), cos, sin)
        k = apply_rope(heads("self_attn.k_proj.weight", c["kv_heads"]), cos, sin)
        v = heads("self_attn.v_proj.weight", c["kv_heads"])
        a = attention(q, k, v, mask if mask is not None else causal_mask(s))
        a = a.transpose(1, 2).reshape(b, s, c["heads"] * hd)
        x = x + a @ p[pre + "self_attn.o_proj.weight"].T
        h = rms_norm(x, p[pre + "post_attention_layernorm.weight"], c["eps"])
        gate = h @ p[pre + "mlp.gate_proj.weight"].T
        up = h @ p[pre + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ p[pre + "mlp.down_proj.weight"].T
    x = rms_norm(x, p["base_model.norm.weight"], c["eps"])
    return x @ p["lm_head.weight"].T


def forward_backward(params, ids, labels, mask):
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    logits = llama_logits(p, ids, mask)
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, CFG["vocab"]), labels.reshape(-1), ignore_index=-100
    )
    loss.backward()
    return logits.detach(), loss.detach(), {k: v.grad for k, v in p.items()}


def llama_golden():
    gen = torch.Generator().manual_seed(20261125)
    params = make_params(gen)
    b, s = 4, 8
    tokens = torch.randint(0, CFG["vocab"], (b, s + 1), generator=gen)
    # Right padding; rows 0+1 and rows 2+3 (the two data-parallel halves) hold the same
    # number of counted labels, so the mean of the halves' means is the global mean.
    lengths = [6, 8, 7, 7]
    attention_mask = torch.zeros(b, s, dtype=torch.int64)
    for r, n in enumerate(lengths):
        attention_mask[r, :n] = 1
    ids = tokens[:, :s].clone()
    labels = tokens[:, 1:].clone()
    ids[attention_mask == 0] = 0
    labels[attention_mask == 0] = -100
    out = {"input_ids": ids, "attention_mask": attention_mask, "labels": labels}
    out.update({"param." + k: v for k, v in params.items()})
    logits, loss, grads = forward_backward(params, ids, labels, padding_causal_mask(attention_mask))
    out["logits"], out["loss"] = logits, loss.reshape(1)
    out.update({"grad." + k: g for k, g in grads.items()})
    all_labels = tokens[:, 1:].clone()
    out["causal.input_ids"], out["causal.labels"] = tokens[:, :s].clone(), all_labels
    logits, loss, grads = forward_backward(params, tokens[:, :s], all_labels, None)
    out["causal.logits"], out["causal.loss"] = logits, loss.reshape(1)
    out.update({"causal.grad." + k: g for k, g in grads.items()})
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(HERE, "llama.safetensors"))


def rope_golden():
    out = {}
    for name, (hd, n, theta) in {
        "d8_theta1e4": (8, 16, 10000.0),
        "d16_theta5e5": (16, 32, 500000.0),
        "d6_theta100": (6, 12, 100.0),
    }.items():
        out[name + ".cos"], out[name + ".sin"] = rope_tables(hd, n, theta)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(HERE, "rope.safetensors"))


def attention_golden():
    gen = torch.Generator().manual_seed(7)
    b, hq, hkv, s, d = 2, 4, 2, 9, 8
    q = torch.randn(b, hq, s, d, generator=gen)
    k = torch.randn(b, hkv, s, d, generator=gen)
    v = torch.randn(b, hkv, s, d, generator=gen)
    w = torch.randn(b, hq, s, d, generator=gen)
    key_padding = torch.zeros(b, 1, 1, s)
    key_padding[0, ..., 6:] = float("-inf")
    key_padding[1, ..., 2] = float("-inf")
    additive = torch.randn(b, 1, s, s, generator=gen) * 2.0
    additive[1, 0, :, 4] = float("-inf")
    forms = {
        "none": None,
        "causal": causal_mask(s),
        "key_padding": key_padding.expand(b, 1, s, s).clone(),
        "additive": additive,
    }
    out = {"q": q, "k": k, "v": v, "w": w}
    for form, mask in forms.items():
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        o = attention(qq, kk, vv, mask)
        (o * w).sum().backward()
        if mask is not None and form != "causal":
            out[form + ".mask"] = mask
        out[form + ".out"] = o.detach()
        out[form + ".dq"], out[form + ".dk"], out[form + ".dv"] = qq.grad, kk.grad, vv.grad
    save_file(
        {k: v.contiguous() for k, v in out.items()}, os.path.join(HERE, "attention.safetensors")
    )


if __name__ == "__main__":
    llama_golden()
    rope_golden()
    attention_golden()
    print(f"wrote llama, rope and attention golden files with torch {torch.__version__}")
