# deeper cp.async pipelines for the one-warp gathers (smem per stage at d 512: 3.1 KB, d 1024: 6.2 KB; ptxas for sm_90:
# registers unchanged by stages), and the forward's stages, at the training microbatches: chain GPU time per setting,
# shipped setting timed first and last (python results/gather_backward/stages_ab.py [SHAPE ...])
import sys, os
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
from dataclasses import replace
import bench, routing_kernel as rk
names = sys.argv[1:] or ["100M-train", "350M-train", "124M-train", "1B-train"]
shapes = [s for s in bench.CHAIN_SHAPES if s[0] in names]
shapes += [(n + "/H1", L, d, 1, B, T) for n, L, d, H, B, T in shapes]
for name, L, d, H, B, T in shapes:
    base = rk.config_for(d, H)
    t = lambda cfg: min(bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=cfg)[0] for _ in range(2))
    ref = t(base)
    print(f"{name:14s} shipped {ref:6.3f} ms", flush=True)
    for kernel in ("gather_bwd_lead", "gather_bwd", "fwd_lead", "fwd"):
        cur = getattr(base, kernel)
        if not cur:
            continue
        for st in (2, 4, 5, 6):
            cand = (cur[0], cur[1], st)
            try:
                ms = t(replace(base, **{kernel: cand}))
            except Exception as e:
                print(f"  {kernel:15s} {cand}: failed {str(e)[:120]}", flush=True)
                continue
            print(f"  {kernel:15s} {str(cand):16s} {ms:6.3f} ms  x shipped {ms / ref:.3f}", flush=True)
    print(f"{name:14s} shipped again {t(base):6.3f} ms", flush=True)
