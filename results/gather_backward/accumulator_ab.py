"""A/B in one process: this tree's routing_gather (cur) against a variant file (var): chain GPU time (cur, var, var,
cur; the faster of each two) at the training microbatches and the 1B Table 5 shape, MHAR and H = 1; registers and
spills of every compiled gather; var's profile; checks of both against the reference; the training step of both
(unless `nostep`). Ran on d55359d with var = routing_gather.py as it ships after it (one accumulator), and with
token_major_variant.py's file made from that:
    python results/gather_backward/accumulator_ab.py VARIANT_PY [nostep]"""
import sys, os, importlib.util
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
import torch, bench, routing_kernel as rk
from bench import CHAIN_SHAPES
mods = {}
for k, p in (("cur", "routing_gather.py"), ("var", sys.argv[1])):
    spec = importlib.util.spec_from_file_location(f"rg_{k}", p); m = importlib.util.module_from_spec(spec)
    sys.modules["routing_gather"] = m; spec.loader.exec_module(m); mods[k] = m
use = lambda k: sys.modules.__setitem__("routing_gather", mods[k])
steps = len(sys.argv) < 3 or sys.argv[2] != "nostep"
train = [s for s in CHAIN_SHAPES if s[0].endswith("-train") or s[0] == "1B"]
rows = [(n, L, d, H, B, T) for n, L, d, H, B, T in train] + [(n, L, d, 1, B, T) for n, L, d, H, B, T in train if n != "1B"]

def regs(k):
    out = []
    try:
        for dev, cache in mods[k]._gather_bwd.device_caches.items():
            for key, kern in cache[0].items():
                kern = getattr(kern, "result", lambda: kern)()
                kern._init_handles()
                out.append((kern.metadata.num_warps, kern.n_regs, kern.n_spills))
    except Exception as e:
        out.append(f"(registers unavailable: {e})")
    return out

for name, L, d, H, B, T in rows:
    cfg, out = rk.config_for(d, H), []
    for k in ("cur", "var", "var", "cur"):
        use(k); out.append(bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=cfg)[0])
    a, b = min(out[0::3]), min(out[1:3])
    print(f"chain {name:11s} H={H} {cfg.backward:6s} cur {a:6.2f} ms  var {b:6.2f} ms  var/cur {b / a:.3f}", flush=True)
for k in ("cur", "var"):
    print(k, "gather kernels (warps, registers, spills):", regs(k), flush=True)
use("var")
for name, L, d, H, B, T in rows[:5]:
    print(name, "profile var", bench.profile_chain(2 * L + 1, B, T, d, H, "cuda", config=rk.config_for(d, H)), flush=True)
for name, L, d, H, B, T in [r for r in rows if r[0] in ("100M-train", "1B-train")]:
    for dt in (torch.float32, torch.bfloat16):
        e = {}
        for k in ("cur", "var"):
            use(k); e[k] = bench.check_against_reference(2 * L + 1, 1, T, d, H, dt, "cuda", config=rk.config_for(d, H))
        print(f"check {name} H={H} {dt}: var {e['var']}  cur {e['cur']}", flush=True)
if steps:
    torch.backends.cuda.matmul.allow_tf32 = True
    for scale in ("100m", "350m", "1b"):
        for variant, k in (("baseline", "cur"), ("mhar_fused", "cur"), ("mhar_fused", "var"), ("attnres_fused", "var"),
                           ("attnres_fused", "cur")):
            use(k)
            row = bench.bench_one(scale, variant, "cuda", 20, 5, True, bench.PAPER_VOCAB, None, True)
            print(f"step {scale} {variant:14s} {k} {row['tok_s']:>10,.0f} tok/s {row['step_ms']:7.1f} ms "
                  f"peak {row['peak_gb']:.1f} GB", flush=True)
