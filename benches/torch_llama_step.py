#!/usr/bin/env python3
"""PyTorch's side of ``cargo bench --bench llama_step``: the same training step of the
same small Llama, on CPU processes over gloo, so the bench can print tpar / PyTorch.

Model: hidden 256, 4 decoder layers, 8 query / 4 kv heads of 32, SwiGLU MLP of 768,
vocab 4096, seq 256, RMSNorm (eps 1e-5), RoPE rotate-half (theta 10000), untied
embedding and head, no biases, f32 (the architecture of tpar's ``LlamaForPretraining``,
module names as Hugging Face's). A step: forward, cross-entropy (``loss_parallel`` when
tp > 1), backward, ``clip_grad_norm_(1.0)``, AdamW (lr 1e-3, betas (0.9, 0.99), eps 1e-8,
weight decay 0.1), ``zero_grad``, on a global batch of 8 sequences of synthetic token ids
split over dp. Attention is ``F.scaled_dot_product_attention(is_causal=True)``.

Configurations (``--configs``, comma-separated; default all):

- ``single``: one process, 2 threads;
- ``tp2-sp`` / ``tp2-megatron``: 2 processes, the sequence-parallel or Megatron plan
  (``parallelize_module``, torchtitan's plan with PyTorch's styles);
- ``dp2-fsdp``: 2 processes, ``fully_shard`` per decoder layer and on the root;
- ``2x2-sp-fsdp`` / ``2x2-megatron-fsdp``: 4 processes, a (dp, tp) mesh, both.

Multi-rank configurations run one process per rank over gloo with 1 thread each. Each
runs ``--warmup`` steps (default 3), then ``--steps`` timed steps (default 10), each
after a barrier; rank 0's median step time is reported. ``--rounds N`` (default 1) runs
the whole list N times in turn and reports each configuration's median over the rounds.
``--json PATH`` writes ``{config: seconds_per_step}`` for the bench to read (``--torch
PATH``). Needs only torch.
"""

import argparse
import logging
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

HIDDEN, LAYERS, HEADS, KV_HEADS, MLP, VOCAB, SEQ, BATCH = 256, 4, 8, 4, 768, 4096, 256, 8
HEAD_DIM = HIDDEN // HEADS

CONFIGS = {
    # name: (dp, tp, plan, fsdp)
    "single": (1, 1, None, False),
    "tp2-sp": (1, 2, "sp", False),
    "tp2-megatron": (1, 2, "megatron", False),
    "dp2-fsdp": (2, 1, None, True),
    "2x2-sp-fsdp": (2, 2, "sp", True),
    "2x2-megatron-fsdp": (2, 2, "megatron", True),
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        # -1 heads: all heads (sequence-parallel plan) or this rank's (Megatron).
        q = self.q_proj(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, MLP, bias=False)
        self.up_proj = nn.Linear(HIDDEN, MLP, bias=False)
        self.down_proj = nn.Linear(MLP, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN)
        self.self_attn = Attention()
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.mlp = Mlp()

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        freqs = torch.outer(torch.arange(SEQ).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos()[None, None], persistent=False)
        self.register_buffer("sin", emb.sin()[None, None], persistent=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.lm_head(self.norm(x))


def tensor_parallel(model, tp_mesh, plan):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    qkv = ColwiseParallel(output_layouts=Replicate()) if plan == "sp" else ColwiseParallel()
    o = (
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        if plan == "sp"
        else RowwiseParallel(output_layouts=Shard(1))
    )
    layer_plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
        ),
        "self_attn.q_proj": qkv,
        "self_attn.k_proj": qkv,
        "self_attn.v_proj": qkv,
        "self_attn.o_proj": o,
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, layer_plan)
    parallelize_module(
        model,
        tp_mesh,
        {
            "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
        },
    )


def worker(rank, world, port, config, warmup, steps, out):
    dp, tp, plan, fsdp = CONFIGS[config]
    torch.set_num_threads(2 if world == 1 else 1)
    # The 2-D gradient norm's two all_reduces are what FSDP2 x TP does; not news per step.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Llama()
    if tp > 1:
        tensor_parallel(model, mesh["tp"], plan)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1
    )
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    dp_rank = mesh["dp"].get_local_rank()
    per = BATCH // dp
    mine = tokens[dp_rank * per : (dp_rank + 1) * per]
    ids, labels = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
    if tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        logits = model(ids)
        if tp > 1:
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
                loss.backward()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(statistics.median(times))
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    runs = {}
    ctx = mp.get_context("spawn")
    configs = a.configs.split(",")
    for rnd in range(max(1, a.rounds)):
        for config in configs:
            dp, tp, _, _ = CONFIGS[config]
            out = ctx.SimpleQueue()
            port = free_port()
            procs = [
                ctx.Process(target=worker, args=(r, dp * tp, port, config, a.warmup, a.steps, out))
                for r in range(dp * tp)
            ]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
                if p.exitcode != 0:
                    raise SystemExit(f"{config}: a rank exited with {p.exitcode}")
            runs.setdefault(config, []).append(out.get())
            if a.rounds > 1:
                print(f"torch round {rnd + 1} {config:<20} {runs[config][-1]:.4f} s/step", flush=True)
    results = {c: statistics.median_high(v) for c, v in runs.items()}
    for config, secs in results.items():
        print(f"torch {config:<20} {secs:.4f} s/step", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
