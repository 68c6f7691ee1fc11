"""The shipped tree against an earlier one in one process: routing_gather.py and routing_config.py's TUNED_H200 of
each (the files of the earlier tree given), chain GPU time (before, after, after, before; the faster of each two) at
the training microbatches and the 1B Table 5 shape, MHAR and H = 1; then the training step of both at the scales named
(bench.py's bench_one, as `python bench.py --scales=...` runs it).
    git show d55359d:routing_gather.py > out/rg_before.py; git show d55359d:routing_config.py > out/rc_before.py
    python results/gather_backward/accumulator_final.py out/rg_before.py out/rc_before.py [SCALE ...]"""
import importlib.util
import os
import sys
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
import torch
import bench
import routing_config
import routing_kernel as rk
from bench import CHAIN_SHAPES


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


after = dict(rg=load("rg_after", "routing_gather.py"), tuned=routing_config.TUNED_H200)
before = dict(rg=load("rg_before", sys.argv[1]), tuned=load("rc_before", sys.argv[2]).TUNED_H200)
trees = dict(before=before, after=after)


def use(k):   # routing_kernel imports routing_gather at a chain's start; config_for reads TUNED_H200 when called
    sys.modules["routing_gather"], routing_config.TUNED_H200 = trees[k]["rg"], trees[k]["tuned"]


train = [s for s in CHAIN_SHAPES if s[0].endswith("-train") or s[0] == "1B"]
rows = train + [(n, L, d, 1, B, T) for n, L, d, H, B, T in train if n != "1B"]
for name, L, d, H, B, T in rows:
    out = {}
    for k in ("before", "after", "after", "before"):
        use(k)
        t = bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=rk.config_for(d, H))[0]
        out[k] = min(out.get(k, t), t)
    print(f"chain {name:11s} H={H}  before {out['before']:6.2f} ms  after {out['after']:6.2f} ms  "
          f"after/before {out['after'] / out['before']:.3f}", flush=True)
torch.backends.cuda.matmul.allow_tf32 = True
for scale in sys.argv[3:]:
    for variant, k in (("baseline", "after"), ("mhar_fused", "before"), ("mhar_fused", "after"), ("attnres_fused", "after"),
                       ("attnres_fused", "before")):
        use(k)
        row = bench.bench_one(scale, variant, "cuda", 20, 5, True, bench.PAPER_VOCAB, None, True)
        print(f"step {scale} {variant:14s} {k:6s} {row['tok_s']:>10,.0f} tok/s {row['step_ms']:7.1f} ms "
              f"peak {row['peak_gb']:.1f} GB", flush=True)
