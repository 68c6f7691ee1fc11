"""Tune v14's lead kernels per training shape; write the resulting SHAPE_CONFIG entries. usage: python carry/tune14.py OUT.json NAME..."""
import sys, os, json
sys.path.insert(0, os.getcwd())
import routing_kernel as rk
SH = {"100M-train": ("100M-train", 12, 512, 4, 8, 2048), "350M-train": ("350M-train", 24, 1024, 8, 4, 1024),
      "1B-train": ("1B-train", 36, 1280, 8, 2, 1024)}
cands = [(512, 1, 3), (1024, 2, 3), (1024, 2, 4), (2048, 4, 3), (2048, 4, 4), (4096, 4, 3), (4096, 4, 4), (4096, 8, 3), (8192, 8, 3)]
shapes = [SH[n] for n in sys.argv[2:]]
rk.tune_configs(["fwd_lead", "gather_lead"], shapes, True, "cuda", candidates=cands)
res = {}
for s in shapes:
    key = (s[2], s[3])
    res[str(key)] = {k: rk.SHAPE_CONFIG[key].get(k) for k in ("fwd_lead", "gather_lead")}
    t = rk.time_chain("fused", 2 * s[1] + 1, s[4], s[5], s[2], s[3], "cuda", None, graph=True)[0]
    print("final", s[0], res[str(key)], f"{t:.3f} ms", flush=True)
json.dump(res, open(sys.argv[1], "w"))
