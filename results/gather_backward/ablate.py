# Attribution by ablation, timing only (the ablated gathers compute wrong gradients; never shipped): the chain with each
# gather's later-site w loads removed (w stays site j's) or its later-site gradient loads removed (G stays site j's),
# against the tree, one process. The compiler then also hoists the dot those values fed (the logit r <w, s>, or
# da = <G, s>), so each ablation removes a load and a dot per pair. Writes the two variants under out/ablate/.
#   python results/gather_backward/ablate.py
import importlib.util, os, sys
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
import torch, bench, routing_kernel, routing_gather
LOOP = """        g_a, g_b = _load(GB, (jp - 1) * M64 * DM, off_a, mask_a, off_b, mask_b, SPLIT)
        c = tl.load(C + (jp - 1) * H * M64 + hoff, mask=hmask, other=0.0)
        w_a, w_b, lse = _site(W, LSE, jp, woff_a, wmask_a, woff_b, wmask_b, hoff, hmask, M64, DM, H, SPLIT)
"""
ABLATED = {"abl_w": LOOP.replace("        w_a, w_b, lse = _site(W, LSE, jp, woff_a, wmask_a, woff_b, wmask_b, hoff, hmask, M64, DM, H, SPLIT)",
                                 "        lse = tl.load(LSE + (jp - 1) * H * M64 + hoff, mask=hmask, other=0.0)   # ABLATION: w stays site j's"),
           "abl_g": LOOP.replace("        g_a, g_b = _load(GB, (jp - 1) * M64 * DM, off_a, mask_a, off_b, mask_b, SPLIT)\n", "")}
for v, loop in ABLATED.items():
    os.makedirs(f"out/ablate/{v}", exist_ok=True)
    text = open("routing_gather.py").read()
    assert text.count(LOOP) == 1, "routing_gather.py's loop changed: update LOOP"
    open(f"out/ablate/{v}/routing_gather.py", "w").write(text.replace(LOOP, loop))
    open(f"out/ablate/{v}/routing_kernel.py", "w").write(open("routing_kernel.py").read())
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m; spec.loader.exec_module(m); return m
trees = {"tree": (routing_kernel, routing_gather)}
for v in ("abl_w", "abl_g"):
    rk = load("routing_kernel", f"out/ablate/{v}/routing_kernel.py"); rg = load("routing_gather", f"out/ablate/{v}/routing_gather.py")
    trees[v] = (rk, rg)
def use(k):
    rk, rg = trees[k]; sys.modules["routing_kernel"], sys.modules["routing_gather"], bench.rk = rk, rg, rk
shapes = [s for s in bench.CHAIN_SHAPES if s[0] in ("100M-train", "350M-train", "1B-train")]
shapes += [("100M-train/H1", 12, 512, 1, 8, 2048), ("350M-train/H1", 24, 1024, 1, 4, 1024)]
for name, L, d, H, B, T in shapes:
    out = {}
    for k in ("tree", "abl_w", "abl_g", "abl_g", "abl_w", "tree"):
        use(k)
        t = bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=trees[k][0].config_for(d, H))[0]
        out[k] = min(out.get(k, t), t)
    print(f"chain {name:14s} tree {out['tree']:6.3f}  no later w {out['abl_w']:6.3f} ({out['abl_w'] / out['tree']:.3f})"
          f"  no later G {out['abl_g']:6.3f} ({out['abl_g'] / out['tree']:.3f})", flush=True)
use("tree")
