# The gathers' one-token programs on 2 / 4 warps at d 512 / 768 (tile 512 on 2 or 4 warps, never a tune candidate;
# ptxas sm_90 on the CPU: d 512 H 4 alone / leading 100 / 165 registers on 1 warp, 72 / 126 on 2, 56 / 72 on 4).
# Chain GPU time (graph), one process, shipped first and last; fp32 checks of each new setting that runs.
#   python results/gather_backward/gather_warps.py
import os, sys
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
from dataclasses import replace
import torch
import bench, routing_kernel as rk
rows = [("100M-train", 12, 512, 4, 8, 2048), ("100M-train/H1", 12, 512, 1, 8, 2048), ("124M-train", 12, 768, 4, 8, 2048),
        ("100M-T5", 12, 512, 4, 2, 2048)]
settings = [None, (512, 2, 3), (512, 2, 4), (512, 4, 3), (1024, 4, 3), None]
for name, L, d, H, B, T in rows:
    base = rk.config_for(d, H)
    for which in ("gather_bwd_lead", "gather_bwd", "both"):
        out = []
        for s in settings:
            if s is None:
                cfg = base
            elif which == "both":
                cfg = replace(base, gather_bwd=s, gather_bwd_lead=s)
            else:
                cfg = replace(base, **{which: s})
            ms = min(bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=cfg)[0] for _ in range(2))
            out.append(f"{s} {ms:6.3f}")
        print(f"gw {name:14s} {which:16s} " + " | ".join(out), flush=True)
    for s in [(512, 2, 3), (512, 4, 3)]:
        e = bench.check_against_reference(2 * L + 1, 1, T, d, H, torch.float32, "cuda",
                                          config=replace(base, gather_bwd=s, gather_bwd_lead=s))
        print(f"check {name} {s} fp32: {e}", flush=True)
