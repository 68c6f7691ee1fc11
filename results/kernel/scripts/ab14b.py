"""v13 vs v14 (committed configs) chain GPU time at the training and Table 5 shapes, with per-kernel profiles."""
import importlib.util, sys, os, json
sys.path.insert(0, os.getcwd())
import torch
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
v13, v14 = load("rk_v13", "carry/routing_v13.py"), load("rk_v14", "routing_kernel.py")
for args in [(9, 2, 333, 1280, 8), (25, 2, 1000, 512, 4), (13, 1, 777, 1024, 8)]:
    print("check", args, {k: f"{v:.1e}" for k, v in v14.check_against_reference(*args, torch.float32, "cuda").items()}, flush=True)
SHAPES = [("100M-train", 12, 512, 4, 8, 2048), ("350M-train", 24, 1024, 8, 4, 1024), ("1B-train", 36, 1280, 8, 2, 1024),
          ("100M", 12, 512, 4, 2, 2048), ("350M", 24, 1024, 8, 1, 1024), ("1B", 36, 1280, 8, 1, 1024)]
rows = []
for rep in range(2):
    for sname, L, d, H, B, T in SHAPES:
        a = v13.time_chain('fused', 2 * L + 1, B, T, d, H, 'cuda', None, graph=True)
        b = v14.time_chain('fused', 2 * L + 1, B, T, d, H, 'cuda', None, graph=True)
        rows.append(dict(rep=rep, shape=sname, v13_ms=a[0], v14_ms=b[0], v13_gb=a[1], v14_gb=b[1]))
        print(f"rep {rep} {sname:11s} v13 {a[0]:.3f} ms ({a[1]:.2f} GB)  v14 {b[0]:.3f} ms ({b[1]:.2f} GB)", flush=True)
for sname, L, d, H, B, T in SHAPES[:3]:
    print("profile", sname, "v13", v13.profile_chain(2 * L + 1, B, T, d, H, "cuda"), flush=True)
    print("profile", sname, "v14", v14.profile_chain(2 * L + 1, B, T, d, H, "cuda"), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
