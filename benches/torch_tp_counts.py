"""PyTorch's tensor-parallel collective counts for the Llama of tpar's count test.

The model of crates/parallel-styles/tests/tp_counts.rs (2 decoder layers, hidden 16,
4 heads / 2 kv heads, vocab 40, batch 4 x 6 tokens) with HF Llama module names, under
the sequence-parallel plan of tpar_models::llama_plans (verbatim) and under the
Megatron-style plans (`megatron_layer_plan`: heads sharded, sequence-parallel norms;
and without sequence parallelism: ColwiseParallel / RowwiseParallel only), all with
loss_parallel; one forward + loss and one backward, each counted with
CommDebugMode on rank 0 of a 2-rank gloo (CPU) run.

    python3 benches/torch_tp_counts.py

prints one line per plan and phase: `plan phase all_gather reduce_scatter all_reduce`.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV, SEQ, BATCH = 40, 16, 24, 2, 4, 2, 6, 4
HD = HIDDEN // HEADS


def rope(x, cos, sin):
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HD, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV * HD, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV * HD, bias=False)
        self.o_proj = nn.Linear(HEADS * HD, HIDDEN, bias=False)

    def forward(self, x, cos, sin):
        b, s = x.shape[0], x.shape[1]
        q = self.q_proj(x).view(b, s, -1, HD).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, HD).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, HD).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(a.transpose(1, 2).reshape(b, s, -1))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(HIDDEN, eps=1e-5)
        self.self_attn = Attention()
        self.post_attention_layernorm = nn.RMSNorm(HIDDEN, eps=1e-5)
        self.mlp = Mlp()

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN, eps=1e-5)


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.base_model = Base()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        inv = 1.0 / (10000.0 ** (torch.arange(0, HD, 2).float() / HD))
        f = torch.outer(torch.arange(SEQ).float(), inv)
        emb = torch.cat([f, f], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.base_model.embed_tokens(ids)
        for layer in self.base_model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.base_model.norm(x))


def plans(name):
    if name == "megatron_sequence_parallel":
        layer, top = plans("sequence_parallel")
        layer["self_attn.q_proj"] = ColwiseParallel()
        layer["self_attn.k_proj"] = ColwiseParallel()
        layer["self_attn.v_proj"] = ColwiseParallel()
        layer["self_attn.o_proj"] = RowwiseParallel(output_layouts=Shard(1))
        return layer, top
    if name == "sequence_parallel":
        layer = {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
            ),
            "self_attn.q_proj": ColwiseParallel(output_layouts=Replicate()),
            "self_attn.k_proj": ColwiseParallel(output_layouts=Replicate()),
            "self_attn.v_proj": ColwiseParallel(output_layouts=Replicate()),
            "self_attn.o_proj": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1)
            ),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        }
        top = {
            "base_model.embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1)
            ),
            "base_model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
        }
    else:
        layer = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        top = {
            "base_model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(use_local_output=False),
        }
    return layer, top


def counts(mode):
    c = mode.get_comm_counts()
    out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for op, n in c.items():
        s = str(op)
        for k in out:
            if k in s:
                out[k] += n
    return out


def run(rank, world):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29561"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for name in ["sequence_parallel", "megatron_sequence_parallel", "megatron"]:
        model = Llama()
        layer_plan, top_plan = plans(name)
        for layer in model.base_model.layers:
            parallelize_module(layer, mesh, layer_plan)
        parallelize_module(model, mesh, top_plan)
        g = torch.Generator().manual_seed(1)
        all_ids = torch.randint(1, VOCAB, (BATCH, SEQ + 1), generator=g)
        ids, tgt = all_ids[:, :SEQ], all_ids[:, 1:]
        with loss_parallel():
            with CommDebugMode() as fwd:
                logits = model(ids)
                loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(0, 1))
            with CommDebugMode() as bwd:
                loss.backward()
        if rank == 0:
            for phase, m in [("forward+loss", fwd), ("backward", bwd)]:
                c = counts(m)
                print(name, phase, c["all_gather"], c["reduce_scatter"], c["all_reduce"],
                      flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(2,), nprocs=2, join=True)
