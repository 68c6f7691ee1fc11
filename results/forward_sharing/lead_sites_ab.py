# Wider forward read sharing (fwd_lead_sites 1 / 2 / 3: a leading forward runs the next 1-3 sites' softmax), one
# process: chain GPU time at the training microbatches and the 1B Table 5 shape, MHAR and H = 1 (order 1 2 3 3 2 1,
# best of two each); checks against the reference; then per width the best setting if < 0.98x, and steps with it.
#   python results/forward_sharing/lead_sites_ab.py [SCALE ...]
import os, sys
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
from dataclasses import replace
import torch
import bench, routing_config, routing_kernel as rk
from bench import CHAIN_SHAPES
train = [s for s in CHAIN_SHAPES if s[0].endswith("-train") or s[0] == "1B"]
rows = train + [(n, L, d, 1, B, T) for n, L, d, H, B, T in train if n != "1B"]
best = {}
for name, L, d, H, B, T in rows:
    base, t = rk.config_for(d, H), {}
    for k in (1, 2, 3, 3, 2, 1):
        cfg = replace(base, fwd_lead_sites=k)
        ms = bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=cfg)[0]
        t[k] = min(t.get(k, ms), ms)
    prof = {k: bench.profile_chain(2 * L + 1, B, T, d, H, "cuda", config=replace(base, fwd_lead_sites=k))["_chain_fwd"]
            for k in (1, 2, 3)}
    print(f"chain {name:11s} H={H}  sites 1 {t[1]:6.2f}  2 {t[2]:6.2f} ({t[2] / t[1]:.3f})  3 {t[3]:6.2f} ({t[3] / t[1]:.3f})"
          f" ms | forward kernels {prof[1]:.3f} / {prof[2]:.3f} / {prof[3]:.3f} ms", flush=True)
    if name != "1B":
        k = min(t, key=t.get)
        if t[k] < 0.98 * t[1] and (d, H) not in best:
            best[(d, H)] = k
print("best", best, flush=True)
for name, L, d, H, B, T in [r for r in rows if r[0] in ("100M-train", "350M-train", "1B-train")]:
    for dt in (torch.float32, torch.bfloat16):
        e = {k: bench.check_against_reference(2 * L + 1, 1, T, d, H, dt, "cuda",
                                              config=replace(rk.config_for(d, H), fwd_lead_sites=k)) for k in (1, 3)}
        print(f"check {name} H={H} {dt}: sites 3 {e[3]}  sites 1 {e[1]}", flush=True)
shipped = {k: dict(v) for k, v in routing_config.TUNED_H200.items()}
variant = {k: dict(v, **({"fwd_lead_sites": best[k]} if k in best else {})) for k, v in shipped.items()}
def use(k):
    routing_config.TUNED_H200.clear(); routing_config.TUNED_H200.update(shipped if k == "cur" else variant)
torch.backends.cuda.matmul.allow_tf32 = True
for scale in sys.argv[1:]:
    for name, k in (("baseline", "cur"), ("mhar_fused", "cur"), ("mhar_fused", "var"), ("attnres_fused", "var"),
                    ("attnres_fused", "cur"), ("mhar_fused", "cur"), ("mhar_fused", "var")):
        use(k)
        row = bench.bench_one(scale, name, "cuda", 20, 5, True, bench.PAPER_VOCAB, None, True)
        print(f"step {scale} {name:14s} {k} {row['tok_s']:>10,.0f} tok/s {row['step_ms']:7.1f} ms "
              f"peak {row['peak_gb']:.1f} GB", flush=True)
use("cur")
