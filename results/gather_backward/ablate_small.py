# Attribution by ablation, timing only (the ablated gathers compute wrong gradients; never shipped): the per-pair
# small loads and stores of each head's scalars. "no later c, lse": each later site's c and lse loads removed (site j's
# stay: H scattered 4-byte loads a token each, [N, H, M]); "no DLR": each pair's dlogit r_n store removed (H scattered
# 4-byte stores a token, [P, H, M]); both. Against the tree, one process; then GPU time per kernel of the tree's
# chain with the gathers loading token-major stored logits or not (the files of that variant in DIR, if given).
#   python results/gather_backward/ablate_small.py [DIR]   (on 086ce9f: its edits match that routing_gather.py)
import importlib.util, os, sys
from dataclasses import replace
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
import torch, bench, routing_kernel, routing_gather
LOOP_CL = """        c = tl.load(C + (jp - 1) * H * M64 + hoff, mask=hmask, other=0.0)
        w_a, w_b, lse = _site(W, LSE, jp, woff_a, wmask_a, woff_b, wmask_b, hoff, hmask, M64, DM, H, SPLIT)
"""
NO_CL = """        w_a, w_b = _load(W, (jp - 1) * DM, woff_a, wmask_a, woff_b, wmask_b, SPLIT)   # ABLATION: c, lse site j's
        w_a, w_b = w_a[None, :, :], w_b[None, :, :]
"""
STORE = "    tl.store(DLR + row * H * M64 + hoff, rdl, mask=hmask)\n"
ABLATED = {"no_cl": [(LOOP_CL, NO_CL)], "no_dlr": [(STORE, "")], "no_both": [(LOOP_CL, NO_CL), (STORE, "")]}
for v, edits in ABLATED.items():
    os.makedirs(f"out/ablate/{v}", exist_ok=True)
    text = open("routing_gather.py").read()
    for old, new in edits:
        assert text.count(old) == 1, f"routing_gather.py changed: update {old!r}"
        text = text.replace(old, new)
    open(f"out/ablate/{v}/routing_gather.py", "w").write(text)
    open(f"out/ablate/{v}/routing_kernel.py", "w").write(open("routing_kernel.py").read())
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m; spec.loader.exec_module(m); return m
trees = {"tree": (routing_kernel, routing_gather)}
dirs = {v: f"out/ablate/{v}" for v in ABLATED}
if len(sys.argv) > 1:
    dirs["token_major"] = sys.argv[1]
for v, path in dirs.items():
    trees[v] = (load("routing_kernel", f"{path}/routing_kernel.py"), load("routing_gather", f"{path}/routing_gather.py"))
def use(k):
    rk, rg = trees[k]; sys.modules["routing_kernel"], sys.modules["routing_gather"], bench.rk = rk, rg, rk
shapes = [s for s in bench.CHAIN_SHAPES if s[0] in ("100M-train", "350M-train", "1B-train")]
shapes += [("100M-train/H1", 12, 512, 1, 8, 2048), ("350M-train/H1", 24, 1024, 1, 4, 1024)]
for name, L, d, H, B, T in shapes:
    out = {}
    for k in ("tree", *ABLATED, *reversed(ABLATED), "tree"):
        use(k)
        t = bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=trees[k][0].config_for(d, H))[0]
        out[k] = min(out.get(k, t), t)
    print(f"chain {name:14s} tree {out['tree']:6.3f}  " + "  ".join(
        f"{k} {out[k]:6.3f} ({out[k] / out['tree']:.3f})" for k in ABLATED), flush=True)
for name, L, d, H, B, T in shapes[:2]:
    for k in ("tree", "token_major") if "token_major" in trees else ("tree",):
        use(k)
        cfg = trees[k][0].config_for(d, H)
        for on in (False, True):
            print(f"profile {name} {k} gather_logits={on}: "
                  f"{bench.profile_chain(2 * L + 1, B, T, d, H, 'cuda', config=replace(cfg, gather_logits=on))}", flush=True)
use("tree")
