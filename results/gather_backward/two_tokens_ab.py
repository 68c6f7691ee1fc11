# The gathers on two tokens a program on one warp (a tile of 2 x d on 1 warp: never a tune candidate) against what
# ships, alone and leading, one process: chain GPU time (ship, A, B, C, C, B, A, ship; min of two each) at the
# training microbatches of d 512 / 768 / 1024, MHAR and H = 1; checks of each at 100M (fp32, bf16).
#   python results/gather_backward/two_tokens_ab.py
import os, sys
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
from dataclasses import replace
import torch, bench, routing_kernel as rk
from bench import CHAIN_SHAPES
shapes = [s for s in CHAIN_SHAPES if s[0] in ("100M-train", "124M-train", "350M-train")]
shapes += [(n + "/H1", L, d, 1, B, T) for n, L, d, H, B, T in shapes if n != "124M-train"]
for name, L, d, H, B, T in shapes:
    cfg = rk.config_for(d, H)
    two = (2 * d, 1, 3)   # two tokens (every head) on one warp
    variants = {"ship": cfg, "alone2": replace(cfg, gather_bwd=two), "lead2": replace(cfg, gather_bwd_lead=two),
                "both2": replace(cfg, gather_bwd=two, gather_bwd_lead=two)}
    out = {}
    for k in list(variants) + list(variants)[::-1]:
        t = bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=variants[k])[0]
        out[k] = min(out.get(k, t), t)
    print(f"chain {name:14s} ship {out['ship']:6.3f}  " + "  ".join(
        f"{k} {out[k]:6.3f} ({out[k] / out['ship']:.3f})" for k in list(variants)[1:]), flush=True)
    if name == "100M-train":
        for dt in (torch.float32, torch.bfloat16):
            for k in ("ship", "both2"):
                e = bench.check_against_reference(2 * L + 1, 1, T, d, H, dt, "cuda", config=variants[k])
                print(f"check {name} {dt} {k}: " + " ".join(f"{x} {v:.3e}" for x, v in e.items()), flush=True)
