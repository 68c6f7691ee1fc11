# d 768's non-leading forward: DEFAULT's (4096, 4, 4) tile (255 registers + 88 B of spill, Triton 3.6) against the
# one- and two-warp tiles, alternately, three rounds; checks of the best against the reference (fp32, bf16).
#   python results/gather_backward/fwd768_ab.py
import os, sys
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
from dataclasses import replace
import torch
import bench, routing_kernel as rk
tiles = [(4096, 4, 4), (512, 1, 3), (512, 1, 4), (512, 1, 2), (1024, 2, 3), (1024, 1, 3), (2048, 4, 3)]
for name, L, d, H, B, T in [("124M-train", 12, 768, 4, 8, 2048), ("124M-train/H1", 12, 768, 1, 8, 2048)]:
    base = rk.config_for(d, H)
    res = {t: [] for t in tiles}
    for _ in range(3):
        for t in tiles:
            cfg = replace(base, fwd=t)
            res[t].append(bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=cfg)[0])
    for t in tiles:
        print(f"chain {name:14s} fwd {str(t):16s} " + " ".join(f"{x:6.3f}" for x in res[t]) + f"  min {min(res[t]):6.3f}", flush=True)
    best = min(tiles, key=lambda t: min(res[t]))
    for dt in (torch.float32, torch.bfloat16):
        e = bench.check_against_reference(2 * L + 1, 1, T, d, H, dt, "cuda", config=replace(base, fwd=best))
        e0 = bench.check_against_reference(2 * L + 1, 1, T, d, H, dt, "cuda", config=base)
        print(f"check {name} fwd={best} {dt}: {e}  shipped {e0}", flush=True)
