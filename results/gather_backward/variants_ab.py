# A/B/... in one process: this tree's routing_kernel.py + routing_gather.py against each directory's two: chain GPU time
# (tree, A, B, ..., ..., B, A, tree; the min of two readings each) at the training microbatches and the 1B Table 5
# shape, MHAR and H = 1 at 100M / 350M; checks of each against the reference (fp32 and bf16, 100M and 1B).
#   python results/gather_backward/variants_ab.py DIR [DIR ...]
import importlib.util, os, sys
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
import torch, bench, routing_kernel, routing_gather
from bench import CHAIN_SHAPES
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m; spec.loader.exec_module(m); return m
trees = {"tree": (routing_kernel, routing_gather)}
for path in sys.argv[1:]:
    trees[os.path.basename(path.rstrip("/"))] = (load("routing_kernel", f"{path}/routing_kernel.py"),
                                                 load("routing_gather", f"{path}/routing_gather.py"))
def use(k):
    rk, rg = trees[k]; sys.modules["routing_kernel"], sys.modules["routing_gather"], bench.rk = rk, rg, rk
names = list(trees)
shapes = [s for s in CHAIN_SHAPES if s[0].endswith("-train") or s[0] == "1B"]
shapes += [(n, L, d, 1, B, T) for n, L, d, H, B, T in shapes if n in ("100M-train", "350M-train")]
for name, L, d, H, B, T in shapes:
    out = {}
    for k in names + names[::-1]:
        use(k)
        t = bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=trees[k][0].config_for(d, H))[0]
        out[k] = min(out.get(k, t), t)
    print(f"chain {name:11s} H={H}  tree {out['tree']:6.3f}  " + "  ".join(
        f"{k} {out[k]:6.3f} ({out[k] / out['tree']:.3f})" for k in names[1:]), flush=True)
for name, L, d, H, B, T in [s for s in shapes if s[0] in ("100M-train", "1B-train")]:
    for dt in (torch.float32, torch.bfloat16):
        for k in names:
            use(k)
            e = bench.check_against_reference(2 * L + 1, 1, T, d, H, dt, "cuda", config=trees[k][0].config_for(d, H))
            print(f"check {name} H={H} {dt} {k}: " + " ".join(f"{x} {v:.3e}" for x, v in e.items()), flush=True)
use("tree")
