# A/B in one process: this tree's routing_kernel.py + routing_gather.py (cur) against a directory's two (var): chain GPU
# time (cur, var, var, cur) at the training microbatches and the 1B Table 5 shape, MHAR and H = 1; checks of both
# against the reference; peak memory of the chain; then the step at the scales named.
#   python results/gather_backward/tree_ab.py VARIANT_DIR [SCALE ...]
import importlib.util, os, sys
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
import torch
import bench
import routing_kernel, routing_gather
from bench import CHAIN_SHAPES


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


trees = {"cur": (routing_kernel, routing_gather)}
rk_var = load("routing_kernel", os.path.join(sys.argv[1], "routing_kernel.py"))
rg_var = load("routing_gather", os.path.join(sys.argv[1], "routing_gather.py"))   # (binds to rk_var)
trees["var"] = (rk_var, rg_var)


def use(k):
    rk, rg = trees[k]
    sys.modules["routing_kernel"], sys.modules["routing_gather"], bench.rk = rk, rg, rk


use("cur")
train = [s for s in CHAIN_SHAPES if s[0].endswith("-train") or s[0] == "1B"]
rows = train + [(n, L, d, 1, B, T) for n, L, d, H, B, T in train if n != "1B"]
for name, L, d, H, B, T in rows:
    out = {}
    for k in ("cur", "var", "var", "cur"):
        use(k)
        t = bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=routing_kernel.config_for(d, H))
        out[k] = min(out.get(k, t[0]), t[0])
        out[k + "_gb"] = t[1] if len(t) > 1 else None
    print(f"chain {name:11s} H={H}  cur {out['cur']:6.2f} ms  var {out['var']:6.2f} ms  var/cur {out['var'] / out['cur']:.3f}"
          f"  peak GB cur {out['cur_gb']}, var {out['var_gb']}", flush=True)
for name, L, d, H, B, T in [r for r in rows if r[0] in ("100M-train", "1B-train")]:
    for dt in (torch.float32, torch.bfloat16):
        e = {}
        for k in ("cur", "var"):
            use(k)
            e[k] = bench.check_against_reference(2 * L + 1, 1, T, d, H, dt, "cuda", config=routing_kernel.config_for(d, H))
        print(f"check {name} H={H} {dt}: var {e['var']}  cur {e['cur']}", flush=True)
torch.backends.cuda.matmul.allow_tf32 = True
for scale in sys.argv[2:]:
    for variant, k in (("baseline", "cur"), ("mhar_fused", "cur"), ("mhar_fused", "var"), ("attnres_fused", "var"),
                       ("attnres_fused", "cur")):
        use(k)
        row = bench.bench_one(scale, variant, "cuda", 20, 5, True, bench.PAPER_VOCAB, None, True)
        print(f"step {scale} {variant:14s} {k} {row['tok_s']:>10,.0f} tok/s {row['step_ms']:7.1f} ms "
              f"peak {row['peak_gb']:.1f} GB", flush=True)
