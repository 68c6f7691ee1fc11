# dw's product with two tf32 products (x's high and low parts against the 16-bit sources, exact in tf32) against the
# shipped three (tf32x3) and one (tf32: timing only, lower precision), one process: chain GPU time (a, b, c, c, b, a;
# min of two) and dw's kernel time (profiler) at the training microbatches; bf16 checks of each at 100M and 1B.
#   python results/gather_backward/dw_precision_ab.py
import os, sys
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
import torch, bench, routing_gather as rg
from bench import CHAIN_SHAPES
build = rg.GatherChain._backward_buffers
choice = {"p": None}
def patched(self, *args):
    build(self, *args)
    if choice["p"]:
        self.dw_precision = choice["p"]
rg.GatherChain._backward_buffers = patched
names = ("tf32x3", "tf32x2", "tf32")
shapes = [s for s in CHAIN_SHAPES if s[0] in ("100M-train", "350M-train", "1B-train")]
shapes += [("100M-train", 12, 512, 1, 8, 2048)]
for name, L, d, H, B, T in shapes:
    out, dw = {}, {}
    for k in names + names[::-1]:
        choice["p"] = k
        t = bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True)[0]
        out[k] = min(out.get(k, t), t)
        p = bench.profile_chain(2 * L + 1, B, T, d, H, "cuda")["_dw_terms"]
        dw[k] = min(dw.get(k, p), p)
    print(f"chain {name:11s} H={H}  " + "  ".join(f"{k} {out[k]:6.3f} ({out[k] / out['tf32x3']:.3f}, dw {dw[k]:.3f})"
                                                 for k in names), flush=True)
for name, L, d, H, B, T in [s for s in shapes if s[0] in ("100M-train", "1B-train") and s[3] > 1]:
    for k in names:
        choice["p"] = k
        e = bench.check_against_reference(2 * L + 1, 1, T, d, H, torch.bfloat16, "cuda")
        print(f"check {name} H={H} bf16 {k}: " + " ".join(f"{x} {v:.3e}" for x, v in e.items()), flush=True)
