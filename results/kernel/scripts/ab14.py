"""v13 vs v14 (shared reads between neighbouring sites) chain GPU time, AHEAD_MIN swept. usage: python carry/ab14.py"""
import importlib.util, sys, os
sys.path.insert(0, os.getcwd())
import torch
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
v13, v14 = load("rk_v13", "carry/routing_v13.py"), load("rk_v14", "routing_kernel.py")
for least in (1, 6):
    v14.AHEAD_MIN = least
    for args in [(9, 2, 333, 1280, 8), (25, 2, 1000, 512, 4), (13, 1, 777, 1024, 8)]:
        print("check", least, args, {k: f"{v:.1e}" for k, v in v14.check_against_reference(*args, torch.float32, "cuda").items()}, flush=True)
SHAPES = [("100M-train", 12, 512, 4, 8, 2048), ("350M-train", 24, 1024, 8, 4, 1024), ("1B-train", 36, 1280, 8, 2, 1024),
          ("100M", 12, 512, 4, 1, 4096), ("350M", 24, 1024, 8, 1, 4096), ("1B", 36, 1280, 8, 1, 4096)]
reps = int(os.environ.get("REPS", "2"))
for rep in range(reps):
    for sname, L, d, H, B, T in SHAPES:
        if rep > 0 and "train" not in sname:
            continue
        t13 = v13.time_chain('fused', 2 * L + 1, B, T, d, H, 'cuda', None, graph=True)
        line = f"rep {rep} {sname:11s} v13 {t13[0]:.3f} ms {t13[1]:.2f} GB |"
        for least in (None, 4, 6, 8, 10):
            v14.AHEAD_MIN = least
            t = v14.time_chain('fused', 2 * L + 1, B, T, d, H, 'cuda', None, graph=True)
            line += f" v14[{least}] {t[0]:.3f} ({t[1]:.2f} GB)"
        print(line, flush=True)
v14.AHEAD_MIN = 6
for sname, L, d, H, B, T in SHAPES[:3]:
    print("profile", sname, "v13", v13.profile_chain(2 * L + 1, B, T, d, H, "cuda"), flush=True)
    print("profile", sname, "v14[6]", v14.profile_chain(2 * L + 1, B, T, d, H, "cuda"), flush=True)
