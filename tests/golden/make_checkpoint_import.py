"""Writes `llama_import.safetensors`: the weights of the tiny Llama of
`tests/checkpoint.rs` (vocab 48, hidden 32, intermediate 40, 2 layers, 8 heads, 4 kv
heads), keyed by tpar's FQNs, with Python's `safetensors` and numpy only (no torch), so
the import test reads a file another tool wrote.

    pip install safetensors numpy
    python3 tests/golden/make_checkpoint_import.py
"""

from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV = 48, 32, 40, 2, 8, 4
HD = HIDDEN // HEADS
rng = np.random.default_rng(20261125)


def randn(*shape, std=0.3):
    return (rng.standard_normal(shape) * std).astype(np.float32)


p = {"base_model.embed_tokens.weight": randn(VOCAB, HIDDEN, std=1.0)}
for i in range(LAYERS):
    pre = f"base_model.layers.{i}."
    p[pre + "input_layernorm.weight"] = 1.0 + randn(HIDDEN, std=0.1)
    p[pre + "self_attn.q_proj.weight"] = randn(HEADS * HD, HIDDEN)
    p[pre + "self_attn.k_proj.weight"] = randn(KV * HD, HIDDEN)
    p[pre + "self_attn.v_proj.weight"] = randn(KV * HD, HIDDEN)
    p[pre + "self_attn.o_proj.weight"] = randn(HIDDEN, HEADS * HD)
    p[pre + "post_attention_layernorm.weight"] = 1.0 + randn(HIDDEN, std=0.1)
    p[pre + "mlp.gate_proj.weight"] = randn(INTER, HIDDEN)
    p[pre + "mlp.up_proj.weight"] = randn(INTER, HIDDEN)
    p[pre + "mlp.down_proj.weight"] = randn(HIDDEN, INTER)
p["base_model.norm.weight"] = 1.0 + randn(HIDDEN, std=0.1)
p["lm_head.weight"] = randn(VOCAB, HIDDEN)

out = Path(__file__).with_name("llama_import.safetensors")
save_file({k: np.ascontiguousarray(v) for k, v in p.items()}, str(out), metadata={"writer": "numpy"})
print(f"wrote {out} ({out.stat().st_size} bytes, {len(p)} tensors)")
