"""Golden values for tpar's optimizers, gradient clipping and LR schedules, from torch.optim.

Run from the repository root (needs `pip install torch safetensors`; the Rust tests
only read the file this writes, so CI does not need torch):

    python tests/golden/make_optim_golden.py

Writes `tests/golden/optim.safetensors`, every tensor float64, with fixed seeds:

- AdamW (`torch.optim.AdamW`, single-tensor implementation) cases `adamw.<case>`:
  `config` = [lr, beta1, beta2, eps, weight_decay, steps, num_params]; for each
  parameter `p<i>`: `init` (its starting value), `grad` ([steps, *shape], the gradient
  fed at each step), `has_grad` ([steps], 0 where the gradient is None at that step so
  the parameter is skipped), `param` ([steps, *shape], the value after each step) and,
  after the last step, `exp_avg`, `exp_avg_sq` and `step`. Case `tiny` has gradients
  around 1e-7 with eps 1e-6, so where eps enters the denominator changes the result;
  case `sched` also has `lr` ([steps], the learning rate each step used) and
  `schedule` = [warmup, total, start_factor, eta_min]: the optimizer is driven by
  SequentialLR(LinearLR(start_factor, 1, warmup), CosineAnnealingLR(total - warmup,
  eta_min), milestones=[warmup]), stepped after every optimizer step.
- SGD (`torch.optim.SGD`) cases `sgd.<case>`: `config` = [lr, momentum, dampening,
  weight_decay, nesterov, steps, num_params]; per parameter `init`, `grad`, `param`
  as above and `momentum_buffer` after the last step (absent without momentum).
- `torch.nn.utils.clip_grad_norm_` cases `clip.<case>`: `max_norm` [1], `num_grads`
  [1], gradients `g<i>`, the returned `total_norm` [1] and the gradients afterwards
  `clipped<i>`. Case `clips` clips, `below` does not, `at_max` has max_norm equal to
  the norm (torch's `max_norm / (norm + 1e-6)` still scales it, by 1 - ~1e-7).
- LR schedules `lr.<case>` driven by `torch.optim.lr_scheduler` on an SGD optimizer:
  `base_lr` [1], `params` (the schedule's arguments, see `SCHEDULES` below) and `lrs`
  ([steps + 1]: `get_last_lr()` right after construction, then after each `step()`).
"""

import math
import os

import torch
from safetensors.torch import save_file

torch.set_default_dtype(torch.float64)
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = {}


def put(key, t):
    OUT[key] = torch.as_tensor(t, dtype=torch.float64).detach().clone().contiguous()


def make_params(seed, shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def make_grads(seed, shapes, steps, scale):
    """Per-step gradients of varying size (scale * (0.5 + step) * randn)."""
    g = torch.Generator().manual_seed(seed)
    return [
        [scale * (0.5 + 0.7 * k) * torch.randn(s, generator=g) for s in shapes]
        for k in range(steps)
    ]


def run(opt, params, grads, has_grad, sched=None):
    """Steps `opt` through `grads`; returns per-parameter trajectories and lrs used."""
    traj = [[] for _ in params]
    lrs = []
    for k, gs in enumerate(grads):
        for i, (p, g) in enumerate(zip(params, gs)):
            p.grad = g.clone() if has_grad[i][k] else None
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched is not None:
            sched.step()
        for i, p in enumerate(params):
            traj[i].append(p.detach().clone())
    return traj, lrs


def adamw_case(name, seed, shapes, steps, lr, betas, eps, wd, grad_scale, skip=(),
               schedule=None):
    params = [p.requires_grad_(True) for p in make_params(seed, shapes)]
    init = [p.detach().clone() for p in params]
    grads = make_grads(seed + 1, shapes, steps, grad_scale)
    has_grad = [[(i, k) not in skip for k in range(steps)] for i in range(len(shapes))]
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd,
                            foreach=False)
    sched = None
    if schedule is not None:
        warmup, total, start, eta_min = schedule
        sched = torch.optim.lr_scheduler.SequentialLR(
            opt,
            [
                torch.optim.lr_scheduler.LinearLR(opt, start, 1.0, total_iters=warmup),
                torch.optim.lr_scheduler.CosineAnnealingLR(opt, total - warmup, eta_min),
            ],
            milestones=[warmup],
        )
        put(f"adamw.{name}.schedule", schedule)
    traj, lrs = run(opt, params, grads, has_grad, sched)
    put(f"adamw.{name}.config", [lr, betas[0], betas[1], eps, wd, steps, len(shapes)])
    if schedule is not None:
        put(f"adamw.{name}.lr", lrs)
    for i, p in enumerate(params):
        k = f"adamw.{name}.p{i}"
        put(f"{k}.init", init[i])
        put(f"{k}.grad", torch.stack([gs[i] for gs in grads]))
        put(f"{k}.has_grad", [float(h) for h in has_grad[i]])
        put(f"{k}.param", torch.stack(traj[i]))
        st = opt.state[p]
        put(f"{k}.exp_avg", st["exp_avg"])
        put(f"{k}.exp_avg_sq", st["exp_avg_sq"])
        put(f"{k}.step", [float(st["step"])])
    return init, grads, traj


def adam_variant(init, grads, steps, lr, betas, eps, wd, variant):
    """AdamW with eps placed wrongly, to check the `tiny` case is sensitive to it."""
    b1, b2 = betas
    out = []
    for i, p0 in enumerate(init):
        p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
        for k in range(steps):
            g = grads[k][i]
            p = p * (1 - lr * wd)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            bc1, bc2 = 1 - b1 ** (k + 1), 1 - b2 ** (k + 1)
            if variant == "inside_sqrt":
                denom = (v / bc2 + eps).sqrt()
            else:  # eps added before the bias correction
                denom = (v.sqrt() + eps) / math.sqrt(bc2)
            p = p - lr / bc1 * m / denom
        out.append(p)
    return out


# ---- AdamW ------------------------------------------------------------------------------

SHAPES = [(3, 4), (5,), (2, 1, 3)]
adamw_case("main", 10, SHAPES, 6, 0.05, (0.8, 0.95), 1e-6, 0.1, 1.0, skip={(2, 2), (2, 3)})
init, grads, traj = adamw_case("tiny", 20, SHAPES, 5, 1e-2, (0.9, 0.95), 1e-6, 0.2, 1e-7)
for variant in ["inside_sqrt", "before_bias_correction"]:
    alt = adam_variant(init, grads, 5, 1e-2, (0.9, 0.95), 1e-6, 0.2, variant)
    moved = [(a - t[-1]).abs().max() / (t[-1] - i0).abs().max()
             for a, t, i0 in zip(alt, traj, init)]
    assert min(moved) > 1e-3, (variant, moved)
adamw_case("sched", 30, [(4, 3), (6,)], 8, 0.02, (0.85, 0.99), 1e-8, 0.05, 1.0,
           schedule=(3, 8, 0.2, 1e-3))

# ---- SGD --------------------------------------------------------------------------------


def sgd_case(name, seed, shapes, steps, lr, momentum, dampening, wd, nesterov):
    params = [p.requires_grad_(True) for p in make_params(seed, shapes)]
    init = [p.detach().clone() for p in params]
    grads = make_grads(seed + 1, shapes, steps, 1.0)
    has_grad = [[True] * steps for _ in shapes]
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum, dampening=dampening,
                          weight_decay=wd, nesterov=nesterov, foreach=False)
    traj, _ = run(opt, params, grads, has_grad)
    put(f"sgd.{name}.config",
        [lr, momentum, dampening, wd, float(nesterov), steps, len(shapes)])
    for i, p in enumerate(params):
        k = f"sgd.{name}.p{i}"
        put(f"{k}.init", init[i])
        put(f"{k}.grad", torch.stack([gs[i] for gs in grads]))
        put(f"{k}.param", torch.stack(traj[i]))
        buf = opt.state[p].get("momentum_buffer")
        if buf is not None:
            put(f"{k}.momentum_buffer", buf)


sgd_case("plain", 40, SHAPES, 5, 0.1, 0.0, 0.0, 0.03, False)
sgd_case("momentum", 41, SHAPES, 6, 0.05, 0.9, 0.0, 0.0, False)
sgd_case("dampening", 42, SHAPES, 6, 0.05, 0.8, 0.3, 0.05, False)
sgd_case("nesterov", 43, SHAPES, 6, 0.04, 0.85, 0.0, 0.02, True)

# ---- clip_grad_norm_ --------------------------------------------------------------------


def clip_case(name, seed, max_norm=None):
    gs = make_params(seed, SHAPES)
    params = [torch.zeros(s, requires_grad=True) for s in SHAPES]
    for p, g in zip(params, gs):
        p.grad = g.clone()
    if max_norm is None:  # exactly the norm
        max_norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in gs])))
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
    put(f"clip.{name}.max_norm", [max_norm])
    put(f"clip.{name}.num_grads", [len(gs)])
    put(f"clip.{name}.total_norm", [float(total)])
    for i, (p, g) in enumerate(zip(params, gs)):
        put(f"clip.{name}.g{i}", g)
        put(f"clip.{name}.clipped{i}", p.grad)


clip_case("clips", 50, 1.5)
clip_case("below", 51, 100.0)
clip_case("at_max", 52)

# ---- LR schedules -----------------------------------------------------------------------

S = torch.optim.lr_scheduler
# name: (steps, params, constructor from (optimizer, params))
SCHEDULES = {
    # params = [start_factor, end_factor, total_iters]
    "linear": (9, [0.25, 0.9, 5], lambda o, a: S.LinearLR(o, a[0], a[1], int(a[2]))),
    "linear_default": (7, [1 / 3, 1.0, 5], lambda o, a: S.LinearLR(o)),
    # params = [t_max, eta_min] (run past t_max: torch's cosine is periodic)
    "cosine": (16, [6, 0.01], lambda o, a: S.CosineAnnealingLR(o, int(a[0]), a[1])),
    "cosine_zero_min": (8, [5, 0.0], lambda o, a: S.CosineAnnealingLR(o, int(a[0]), a[1])),
    # params = [warmup, total, start_factor, eta_min] (tpar's SequentialLR::warmup_cosine)
    "warmup_cosine": (13, [3, 10, 0.1, 1e-3], lambda o, a: S.SequentialLR(
        o,
        [S.LinearLR(o, a[2], 1.0, int(a[0])), S.CosineAnnealingLR(o, int(a[1] - a[0]), a[3])],
        milestones=[int(a[0])],
    )),
    # params = [m1, m2]: LinearLR(0.5, 1, 2) until m1, CosineAnnealingLR(4, 0.002) until m2,
    # then LinearLR(1, 0.2, 3)
    "sequential3": (12, [2, 6], lambda o, a: S.SequentialLR(
        o,
        [S.LinearLR(o, 0.5, 1.0, 2), S.CosineAnnealingLR(o, 4, 0.002), S.LinearLR(o, 1.0, 0.2, 3)],
        milestones=[int(a[0]), int(a[1])],
    )),
}

BASE_LR = 0.3
for name, (steps, args, make) in SCHEDULES.items():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=BASE_LR)
    sched = make(opt, args)
    lrs = [sched.get_last_lr()[0]]
    for _ in range(steps):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
        assert opt.param_groups[0]["lr"] == lrs[-1]
    put(f"lr.{name}.base_lr", [BASE_LR])
    put(f"lr.{name}.params", args)
    put(f"lr.{name}.lrs", lrs)

path = os.path.join(HERE, "optim.safetensors")
save_file(OUT, path, metadata={"torch": torch.__version__})
print(f"wrote {path}: {len(OUT)} tensors, {os.path.getsize(path)} bytes, torch {torch.__version__}")
