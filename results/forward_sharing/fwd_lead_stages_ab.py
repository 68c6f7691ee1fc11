# A/B in one process: launch settings (TUNED_H200 entries patched in place) against the shipped ones: chain GPU time
# (cur, var, var, cur) at the training microbatches and the 1B Table 5 shape, MHAR and H = 1; then steps.
#   python results/forward_sharing/fwd_lead_stages_ab.py [SCALE ...]
import os, sys
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
import torch
import bench, routing_config, routing_kernel
from bench import CHAIN_SHAPES
shipped = {k: dict(v) for k, v in routing_config.TUNED_H200.items()}
variant = {k: dict(v) for k, v in shipped.items()}
for key, fl in {(512, 4): (1024, 2, 4), (512, 1): (512, 1, 4), (768, 4): (512, 1, 4), (768, 1): (512, 1, 4),
                (1024, 8): (512, 1, 4), (1024, 1): (512, 1, 4), (1280, 8): (512, 1, 4)}.items():
    variant[key]["fwd_lead"] = fl
def use(k):
    routing_config.TUNED_H200.clear(); routing_config.TUNED_H200.update(shipped if k == "cur" else variant)
train = [s for s in CHAIN_SHAPES if s[0].endswith("-train") or s[0] == "1B"]
rows = train + [(n, L, d, 1, B, T) for n, L, d, H, B, T in train if n != "1B"]
for name, L, d, H, B, T in rows:
    out = {}
    for k in ("cur", "var", "var", "cur"):
        use(k)
        t = bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=routing_kernel.config_for(d, H))
        out[k] = min(out.get(k, t[0]), t[0])
    print(f"chain {name:11s} H={H}  cur {out['cur']:6.2f} ms  var {out['var']:6.2f} ms  var/cur {out['var'] / out['cur']:.3f}", flush=True)
torch.backends.cuda.matmul.allow_tf32 = True
for scale in sys.argv[1:]:
    for variant_name, k in (("baseline", "cur"), ("mhar_fused", "cur"), ("mhar_fused", "var"), ("attnres_fused", "var"),
                            ("attnres_fused", "cur"), ("mhar_fused", "cur")):
        use(k)
        row = bench.bench_one(scale, variant_name, "cuda", 20, 5, True, bench.PAPER_VOCAB, None, True)
        print(f"step {scale} {variant_name:14s} {k} {row['tok_s']:>10,.0f} tok/s {row['step_ms']:7.1f} ms "
              f"peak {row['peak_gb']:.1f} GB", flush=True)
