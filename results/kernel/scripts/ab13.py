"""Routing v13 (two-level dw reduction in the gather) against v8: chain GPU time (graph replay) at the training shapes
for the current SHAPE_CONFIG and small site-pass tiles; checks; per-kernel profile; writes the best site config per
width into OUTDIR/shape_config.py. usage: python carry/ab13.py OUTDIR"""
import importlib.util, sys, os, json, copy
sys.path.insert(0, os.getcwd())
import torch
out = sys.argv[1]
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
v8, v13 = load("rk_v8", "carry/routing_v8.py"), load("rk_v13", "routing_kernel.py")
shapes = [("100M-train", 12, 512, 4, 8, 2048), ("350M-train", 24, 1024, 8, 4, 1024), ("1B-train", 36, 1280, 8, 2, 1024)]
SITE = [None, (1024, 2, 4), (512, 1, 3), (2048, 2, 3), (1024, 2, 3)]
base = copy.deepcopy(v13.SHAPE_CONFIG)
for N, B, T, d, H, dt in [(25, 2, 2048, 512, 4, torch.bfloat16), (73, 1, 1024, 1280, 8, torch.bfloat16), (9, 2, 333, 1280, 8, torch.float32)]:
    for site in (None, (512, 1, 3)):
        v13.SHAPE_CONFIG = copy.deepcopy(base)
        if site: v13.SHAPE_CONFIG.setdefault((d, H), {})["site"] = site
        print("v13 site", site, "check", N, B, T, d, H, dt, {k: f"{v:.1e}" for k, v in v13.check_against_reference(N, B, T, d, H, dt, "cuda").items()}, flush=True)
    print("v8 check", N, B, T, d, H, dt, {k: f"{v:.1e}" for k, v in v8.check_against_reference(N, B, T, d, H, dt, "cuda").items()}, flush=True)
res = {}
for rep in range(2):
    for sname, L, d, H, B, T in shapes:
        ms, _ = v8.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", None, graph=True)
        res.setdefault((sname, "v8"), []).append(ms)
        print(f"rep {rep} {sname} v8 {ms:.3f} ms", flush=True)
        for site in SITE:
            v13.SHAPE_CONFIG = copy.deepcopy(base)
            if site: v13.SHAPE_CONFIG.setdefault((d, H), {})["site"] = site
            ms, _ = v13.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", None, graph=True)
            res.setdefault((sname, str(site)), []).append(ms)
            print(f"rep {rep} {sname} v13 site {site} {ms:.3f} ms", flush=True)
new = copy.deepcopy(base)
for sname, L, d, H, B, T in shapes:
    best = min(SITE, key=lambda s: min(res[(sname, str(s))]))
    print(sname, "v8", min(res[(sname, "v8")]), "v13 best site", best, min(res[(sname, str(best))]), flush=True)
    if best: new.setdefault((d, H), {})["site"] = best
    v13.SHAPE_CONFIG = copy.deepcopy(new)
    print(f"{sname} v13 kernels (ms): {v13.profile_chain(2 * L + 1, B, T, d, H, 'cuda')}", flush=True)
    print(f"{sname} v8  kernels (ms): {v8.profile_chain(2 * L + 1, B, T, d, H, 'cuda')}", flush=True)
v13.SHAPE_CONFIG = copy.deepcopy(new)
for sname, L, d, H, B, T in [("100M", 12, 512, 4, 2, 2048), ("350M", 24, 1024, 8, 1, 1024), ("1B", 36, 1280, 8, 1, 1024)]:
    a = v8.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", None, graph=True)[0]
    b = v13.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", None, graph=True)[0]
    print(f"Table 5 {sname}: v8 {a:.3f} ms  v13 {b:.3f} ms", flush=True)
print("SHAPE_CONFIG =", repr(new), flush=True)
json.dump({f"{k[0]} {k[1]}": v for k, v in res.items()}, open(os.path.join(out, "ab13.json"), "w"), indent=1)
open(os.path.join(out, "shape_config.py"), "w").write("SHAPE_CONFIG = " + repr(new) + "\n")
