"""Golden files for tpar's Hugging Face Llama import and export (tests/hf_checkpoint.rs).

Builds tiny Llamas with `transformers` (2 layers, hidden 32, 4 query heads, 2 key/value
heads, vocab 96, float32, fixed seed), saves them with `save_pretrained` (safetensors;
a small `max_shard_size`, so the untied one is sharded through
`model.safetensors.index.json`) and writes their logits on a fixed batch:

- `tests/golden/hf_tiny/`: untied head, sharded; `logits.safetensors` holds
  `input_ids` (i64 [2, 8]) and `logits` (f32 [2, 8, 96]) of `LlamaForCausalLM` in eval
  mode with no attention mask (plain causal attention).
  It also holds a `tokenizer.json` of 96 ids (a BPE the `tokenizers` library trains on
  the first 20,000 characters of `crates/data/data/corpus.txt`; specials `<unk>`, `<s>`,
  `</s>`, `<pad>`), so the trainers' `--init-from` runs on it.
- `tests/golden/hf_tiny_tied/`: `tie_word_embeddings=True` (no `lm_head.weight` in the
  file), one `model.safetensors`, and its `logits.safetensors` on the same batch.
- `tests/golden/hf_tiny_llama3/`: Llama 3's RoPE scaling (`rope_type` llama3, factor 8,
  low/high frequency factors 1 and 4, original context 16, head dim 8: one frequency
  kept, one blended, two divided), one file, its logits on a batch of 2 x 24.

Run from the repository root (needs `pip install torch transformers safetensors`; the
Rust tests read only the committed files, so CI needs no Python):

    python scripts/make_hf_golden.py

With `--check-export DIR`, instead loads a directory tpar exported
(`llama_2d --export-hf DIR`, or the test's export with TPAR_HF_EXPORT_DIR set) with
`LlamaForCausalLM.from_pretrained` and, when DIR holds `logits.safetensors`, checks
that transformers' logits on its `input_ids` equal them (f32, 1e-5).
"""

import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")

SIZES = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    bos_token_id=1,
    eos_token_id=2,
)


LLAMA3 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)


def batch(seq=8):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, SIZES["vocab_size"], (2, seq), generator=g, dtype=torch.int64)


def make(name, tie, seed, shard, rope_scaling=None, seq=8):
    torch.manual_seed(seed)
    extra = {}
    if rope_scaling is not None:
        extra["rope_scaling"] = dict(rope_scaling, rope_theta=SIZES["rope_theta"])
    cfg = LlamaConfig(**SIZES, tie_word_embeddings=tie, **extra)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    # Norm weights other than ones, so a mix-up of the two norms shows.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    out = os.path.join(GOLDEN, name)
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):
        os.remove(os.path.join(out, f))
    model.save_pretrained(out, max_shard_size=shard, safe_serialization=True)
    ids = batch(seq)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    save_file({"input_ids": ids, "logits": logits.contiguous()}, os.path.join(out, "logits.safetensors"))
    files = sorted(os.listdir(out))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in files)
    print(f"wrote {out}: {files} ({size} bytes)")


def write_tokenizer(name):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    with open(os.path.join(ROOT, "crates", "data", "data", "corpus.txt"), encoding="utf-8") as f:
        text = f.read()[:20000]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=SIZES["vocab_size"],
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        limit_alphabet=48,
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer=trainer)
    assert tok.get_vocab_size() <= SIZES["vocab_size"], tok.get_vocab_size()
    out = os.path.join(GOLDEN, name, "tokenizer.json")
    tok.save(out)
    print(f"wrote {out} ({tok.get_vocab_size()} ids)")


def check_export(d):
    model = LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
    print(f"transformers loaded {d}: {model.config.num_hidden_layers} layers, "
          f"vocab {model.config.vocab_size}, tied {model.config.tie_word_embeddings}")
    golden = os.path.join(d, "logits.safetensors")
    if not os.path.exists(golden):
        return 0
    g = load_file(golden)
    with torch.no_grad():
        got = model(input_ids=g["input_ids"]).logits.float()
    err = (got - g["logits"]).abs().max().item()
    print(f"max |transformers - tpar| = {err:.3e}")
    return 0 if err <= 1e-5 else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-export", metavar="DIR")
    ap.add_argument("--only", metavar="NAME", help="write only this golden directory")
    a = ap.parse_args()
    if a.check_export:
        sys.exit(check_export(a.check_export))
    want = lambda n: a.only is None or a.only == n
    if want("hf_tiny"):
        make("hf_tiny", tie=False, seed=1234, shard="40KB")
        write_tokenizer("hf_tiny")
    if want("hf_tiny_tied"):
        make("hf_tiny_tied", tie=True, seed=4321, shard="10MB")
    if want("hf_tiny_llama3"):
        make("hf_tiny_llama3", tie=False, seed=2468, shard="10MB", rope_scaling=LLAMA3, seq=24)
