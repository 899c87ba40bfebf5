"""Golden index lists of `torch.utils.data.DistributedSampler`.

Run from the repository root (needs `pip install torch`; the Rust tests only read the
file this writes, so CI does not need torch):

    python tests/golden/make_sampler_golden.py

Writes `tests/golden/sampler.json`: `{"torch": <version>, "cases": [...]}` where each
case is `{"len", "num_replicas", "shuffle", "drop_last", "seed", "epoch", "ranks"}` and
`ranks[r]` is the list of indices rank `r` gets (`list(iter(sampler))` after
`set_epoch(epoch)`). Dataset lengths cover divisible and non-divisible by
`num_replicas` and lengths smaller than it; with shuffle on, the (seed, epoch) pairs
include (0, 1) and (1, 0), which torch seeds alike (its generator takes seed + epoch).
"""

import json
import os

import torch
from torch.utils.data import DistributedSampler

HERE = os.path.dirname(os.path.abspath(__file__))

LENGTHS = [1, 2, 7, 10, 12, 23]
REPLICAS = [2, 3, 4]
SEED_EPOCHS = [(0, 0), (0, 1), (1, 0), (5, 2)]

cases = []
for n in LENGTHS:
    dataset = list(range(n))
    for reps in REPLICAS:
        for shuffle in [False, True]:
            for drop_last in [False, True]:
                for seed, epoch in SEED_EPOCHS if shuffle else [(0, 0)]:
                    ranks = []
                    for r in range(reps):
                        s = DistributedSampler(dataset, num_replicas=reps, rank=r,
                                               shuffle=shuffle, seed=seed, drop_last=drop_last)
                        s.set_epoch(epoch)
                        ranks.append([int(i) for i in s])
                    cases.append(dict(len=n, num_replicas=reps, shuffle=shuffle,
                                      drop_last=drop_last, seed=seed, epoch=epoch,
                                      ranks=ranks))

path = os.path.join(HERE, "sampler.json")
with open(path, "w") as f:
    f.write('{"torch": %s, "cases": [\n' % json.dumps(torch.__version__))
    f.write(",\n".join(json.dumps(c, separators=(",", ":")) for c in cases))
    f.write("\n]}\n")
print(f"wrote {path}: {len(cases)} cases, {os.path.getsize(path)} bytes, torch {torch.__version__}")
