"""dw's product launched per site (OLD: a routing_gather.py of that design) against one launch a pass (this tree's
routing_gather.py, "new") and variants of it made by editing its text (a variant whose edit no longer applies is
skipped), in one process: chain GPU time at five shapes (two rounds), a per-kernel profile, the checks against the
reference next to OLD's, then the training step of the baseline, MHAR and the single head with OLD and the fastest
variant that checks out.
    git show 77390f3:routing_gather.py > out/routing_gather_old.py
    python results/gather_backward/dw_once_ab.py out/routing_gather_old.py out/dw_once_ab.json
As run on the H200 (dw_once_ab_h200.txt), "new" still used IEEE products and new_tf32x3 was the edit that shipped."""
import sys, os, importlib.util, math, json
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
import torch, bench, routing_kernel as rk
from bench import CHAIN_SHAPES
src = open("routing_gather.py").read()
old_path, out_json = sys.argv[1], sys.argv[2]
variants = {"old": open(old_path).read(), "new": src,
            "new_bj16": src.replace("bj, bc = 32,", "bj, bc = 16,"),
            "new_p4096": src.replace("triton.cdiv(2048, programs)", "triton.cdiv(4096, programs)"),
            "new_tf32x3": src.replace('input_precision="ieee"', 'input_precision="tf32x3"')}
variants = {k: v for k, v in variants.items() if k in ("old", "new") or v != src or print(f"skipped {k}: no edit")}
mods = {}
os.makedirs("out/ab", exist_ok=True)
for k, v in variants.items():
    p = f"out/ab/rg_{k}.py"; open(p, "w").write(v)
    spec = importlib.util.spec_from_file_location(f"rg_{k}", p); m = importlib.util.module_from_spec(spec)
    sys.modules["routing_gather"] = m; spec.loader.exec_module(m); mods[k] = m
use = lambda k: sys.modules.__setitem__("routing_gather", mods[k])
shapes = [s for s in CHAIN_SHAPES if s[0] in ("1B", "100M-train", "124M-train", "350M-train", "1B-train")]
res = {}
for rnd in range(2):
    for name, L, d, H, B, T in shapes:
        for k in variants:
            use(k)
            t = bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=rk.config_for(d, H))[0]
            res.setdefault((name, k), []).append(t)
            print(f"round {rnd} {name:11s} H={H} {k:11s} {t:6.2f} ms", flush=True)
print("\nmedian-of-2 (min) per shape:")
for name, *_ in shapes:
    print(name, "  ".join(f"{k} {min(res[(name, k)]):.2f}" for k in variants), flush=True)
gm = {k: math.exp(sum(math.log(min(res[(s[0], k)])) for s in shapes) / len(shapes)) for k in variants}
print("geomean", gm, flush=True)
# profile of the new one
use("new")
for name, L, d, H, B, T in shapes[1:]:
    print(name, "profile new", bench.profile_chain(2 * L + 1, B, T, d, H, "cuda", config=rk.config_for(d, H)), flush=True)
# checks
ok = {}
for k in variants:
    if k == "old": continue
    use(k); worst = 0
    for name, L, d, H, B, T in [s for s in shapes if s[0] in ("100M-train", "1B-train")]:
        for dt in (torch.float32, torch.bfloat16):
            e = bench.check_against_reference(2 * L + 1, 1, T, d, H, dt, "cuda", config=rk.config_for(d, H))
            use("old"); e0 = bench.check_against_reference(2 * L + 1, 1, T, d, H, dt, "cuda", config=rk.config_for(d, H)); use(k)
            print(f"check {k} {name} {dt}: {e}  old: {e0}", flush=True)
            worst = max(worst, max(e[x] / max(e0[x], 1e-7) for x in e))
    ok[k] = worst < 1.5
print("ok", ok, flush=True)
best = min((k for k in variants if k != "old" and ok.get(k)), key=lambda k: gm[k])
print("best", best, flush=True)
json.dump({"best": best, "gm": gm, "res": {f"{a}|{b}": v for (a, b), v in res.items()}}, open(out_json, "w"))
# step: baseline, MHAR old, MHAR best, single head best, per scale (same process)
torch.backends.cuda.matmul.allow_tf32 = True
for scale in ("100m", "350m", "1b"):
    for variant, k in (("baseline", "old"), ("mhar_fused", "old"), ("mhar_fused", best), ("attnres_fused", best),
                       ("attnres_fused", "old")):
        use(k)
        row = bench.bench_one(scale, variant, "cuda", 20, 5, True, bench.PAPER_VOCAB, None, True)
        print(f"step {scale} {variant:14s} {k:11s} {row['tok_s']:>10,.0f} tok/s {row['step_ms']:7.1f} ms "
              f"peak {row['peak_gb']:.1f} GB", flush=True)
