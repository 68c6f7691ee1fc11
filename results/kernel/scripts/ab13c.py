import importlib.util, sys, os
sys.path.insert(0, os.getcwd())
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
v8, v13 = load("rk_v8", "carry/routing_v8.py"), load("rk_v13", "routing_kernel.py")
print("check", {k: f"{v:.1e}" for k, v in v13.check_against_reference(9, 2, 333, 1280, 8, __import__('torch').float32, "cuda").items()}, flush=True)
for rep in range(2):
    for sname, L, d, H, B, T in [("1B-train", 36, 1280, 8, 2, 1024), ("1B", 36, 1280, 8, 1, 1024), ("100M-train", 12, 512, 4, 8, 2048)]:
        print(f"rep {rep} {sname} v8 {v8.time_chain('fused', 2 * L + 1, B, T, d, H, 'cuda', None, graph=True)[0]:.3f} ms", flush=True)
        print(f"rep {rep} {sname} v13 {v13.time_chain('fused', 2 * L + 1, B, T, d, H, 'cuda', None, graph=True)[0]:.3f} ms", flush=True)
