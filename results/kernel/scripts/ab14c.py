"""Refactor check: v14 as committed (carry/routing_v14.py) vs the working tree, chain GPU time, and the forward's output bitwise."""
import importlib.util, sys, os
sys.path.insert(0, os.getcwd())
import torch
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
a, b = load("rk_a", "carry/routing_v14.py"), load("rk_b", "routing_kernel.py")
for args in [(9, 2, 333, 1280, 8), (25, 2, 1000, 512, 4), (13, 1, 777, 1024, 8)]:
    print("check", args, {k: f"{v:.1e}" for k, v in b.check_against_reference(*args, torch.float32, "cuda").items()}, flush=True)
for rep in range(2):
    for sname, L, d, H, B, T in [("100M-train", 12, 512, 4, 8, 2048), ("350M-train", 24, 1024, 8, 4, 1024), ("1B-train", 36, 1280, 8, 2, 1024)]:
        ta = a.time_chain('fused', 2 * L + 1, B, T, d, H, 'cuda', None, graph=True)[0]
        tb = b.time_chain('fused', 2 * L + 1, B, T, d, H, 'cuda', None, graph=True)[0]
        print(f"rep {rep} {sname:11s} committed {ta:.3f} ms  refactor {tb:.3f} ms", flush=True)
