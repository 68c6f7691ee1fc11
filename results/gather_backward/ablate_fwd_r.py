# Attribution by ablation, timing only (wrong outputs; never shipped): the forward without each older source's RMS
# factor r_n (a [BLOCK_M] tile of 4-byte copies in every lane, beside the source tile's 16-byte ones): r_n := the
# newest source's. Chain GPU time (tree, no_r, no_r, tree; min of two) and the forward kernels' profile, one process.
#   python results/gather_backward/ablate_fwd_r.py
import importlib.util, os, sys
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
import bench, routing_kernel, routing_gather
LINE = "            s_a, s_b, r = _source_parts(S, R, n, M, tile_a, mask_a, tile_b, mask_b, rows64, rmask, DM, SPLIT)\n"
text = open("routing_kernel.py").read()
first = text.index(LINE)   # the first is _chain_fwd's loop (the second the site pass's)
os.makedirs("out/ablate/no_r", exist_ok=True)
open("out/ablate/no_r/routing_kernel.py", "w").write(
    text[:first] + LINE + "            r = r_new   # ABLATION: no r_n load\n" + text[first + len(LINE):])
open("out/ablate/no_r/routing_gather.py", "w").write(open("routing_gather.py").read())
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m; spec.loader.exec_module(m); return m
trees = {"tree": (routing_kernel, routing_gather)}
trees["no_r"] = (load("routing_kernel", "out/ablate/no_r/routing_kernel.py"), load("routing_gather", "out/ablate/no_r/routing_gather.py"))
def use(k):
    rk, rg = trees[k]; sys.modules["routing_kernel"], sys.modules["routing_gather"], bench.rk = rk, rg, rk
for name, L, d, H, B, T in [s for s in bench.CHAIN_SHAPES if s[0] in ("100M-train", "350M-train", "1B-train")]:
    out, prof = {}, {}
    for k in ("tree", "no_r", "no_r", "tree"):
        use(k)
        t = bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=trees[k][0].config_for(d, H))[0]
        out[k] = min(out.get(k, t), t)
        prof[k] = bench.profile_chain(2 * L + 1, B, T, d, H, "cuda", config=trees[k][0].config_for(d, H))["_chain_fwd"]
    print(f"chain {name:11s} tree {out['tree']:6.3f}  no_r {out['no_r']:6.3f} ({out['no_r'] / out['tree']:.3f})  "
          f"forward kernels {prof['tree']:.3f} -> {prof['no_r']:.3f} ms", flush=True)
use("tree")
