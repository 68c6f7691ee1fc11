# the candidate settings per width against the shipped ones, one process: chain GPU time (order cur, vars, vars
# reversed, cur; best of the two each). Ran on 066a3d9 (the tree before these settings shipped: config_for
# gave the earlier entries); python results/forward_sharing/final_sites.py
import os, sys
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
from dataclasses import replace
import bench, routing_kernel as rk
from bench import CHAIN_SHAPES
cands = {(512, 4): [dict(fwd_lead_sites=2)], (768, 4): [dict(fwd_lead_sites=2), dict(fwd_lead=(512, 1, 4)),
                                                         dict(fwd_lead_sites=2, fwd_lead=(512, 1, 4))],
         (1280, 8): [dict(fwd_lead_sites=2)], (512, 1): [dict(fwd_lead_sites=2)]}
rows = [s for s in CHAIN_SHAPES if s[0] in ("100M-train", "124M-train", "1B-train", "1B")]
rows += [("100M-train", 12, 512, 1, 8, 2048)]
for name, L, d, H, B, T in rows:
    base = rk.config_for(d, H)
    cfgs = [base] + [replace(base, **c) for c in cands[(d, H)]]
    t = {}
    for i in list(range(len(cfgs))) + list(range(len(cfgs)))[::-1]:
        ms = bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=cfgs[i])[0]
        t[i] = min(t.get(i, ms), ms)
    print(f"chain {name:11s} H={H} shipped {t[0]:6.2f} ms | " + " | ".join(
        f"{cands[(d, H)][i - 1]} {t[i]:6.2f} ({t[i] / t[0]:.3f})" for i in range(1, len(cfgs))), flush=True)
