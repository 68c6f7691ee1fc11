# (1) dw's product: tokens a step x warps (routing_gather.dw_launch; shipped 16 x 4) at the training microbatches:
# chain GPU time and the dw kernel's profiler time, checks against the reference for each; (2) the leading forward's
# tile x led sites at d 512 (H 4) and d 1024 (H 8). One process; the shipped setting timed first and last.
#   python results/gather_backward/dw_fwd_grid.py
import os, sys
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
from dataclasses import replace
import torch
import bench, routing_gather as rg, routing_kernel as rk
from bench import CHAIN_SHAPES
shipped_launch = rg.dw_launch
def dw_with(bt, warps):
    def launch(N, M, H, D):
        bj, _, bc, splits, _ = shipped_launch(N, M, H, D)
        return bj, bt, bc, splits, warps
    return launch
train = [s for s in CHAIN_SHAPES if s[0].endswith("-train")]
rows = train + [("100M-train/H1", 12, 512, 1, 8, 2048), ("350M-train/H1", 24, 1024, 1, 4, 1024)]
for name, L, d, H, B, T in rows:
    cfg = rk.config_for(d, H)
    out = []
    for bt, w in [(16, 4), (32, 4), (32, 8), (64, 8), (16, 4)]:
        rg.dw_launch = dw_with(bt, w)
        ms = min(bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=cfg)[0] for _ in range(2))
        prof = bench.profile_chain(2 * L + 1, B, T, d, H, "cuda", config=cfg)
        out.append(f"{bt}x{w} {ms:6.3f} ms (dw {prof.get('_dw_terms', 0):.3f})")
    print(f"dw {name:14s} " + " | ".join(out), flush=True)
    for bt, w in [(32, 4), (64, 8)]:
        rg.dw_launch = dw_with(bt, w)
        e = bench.check_against_reference(2 * L + 1, 1, T, d, H, torch.float32, "cuda", config=cfg)
        print(f"check {name} {bt}x{w} fp32: {e}", flush=True)
    rg.dw_launch = shipped_launch
for name, L, d, H, B, T in [s for s in train if s[2] in (512, 1024)]:
    base = rk.config_for(d, H)
    cands = [(base.fwd_lead, base.fwd_lead_sites)] + [(t, k) for t in [(512, 1, 3), (512, 1, 4), (1024, 2, 3), (1024, 4, 3)]
                                                      for k in (1, 2, 3)] + [(base.fwd_lead, base.fwd_lead_sites)]
    for t, k in cands:
        ms = min(bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True,
                                  config=replace(base, fwd_lead=t, fwd_lead_sites=k))[0] for _ in range(2))
        print(f"fwd {name:11s} fwd_lead {str(t):14s} sites {k}  {ms:6.3f} ms", flush=True)
