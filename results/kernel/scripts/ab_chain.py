"""A/B of routing-kernel versions in one process: chain GPU time (graph replay) at the training and Table 5
shapes, per-kernel profile at 100M training shape, and fp32 / bf16 checks. usage: python carry/ab_chain.py name=path ..."""
import importlib.util, sys, json, os, torch
sys.path.insert(0, os.getcwd())
mods = {}
for arg in sys.argv[1:]:
    name, path = arg.split("=")
    spec = importlib.util.spec_from_file_location("rk_" + name, path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); mods[name] = m
shapes = [("100M-train", 12, 512, 4, 8, 2048), ("350M-train", 24, 1024, 8, 4, 1024), ("1B-train", 36, 1280, 8, 2, 1024),
          ("100M", 12, 512, 4, 2, 2048), ("350M", 24, 1024, 8, 1, 1024), ("1B", 36, 1280, 8, 1, 1024)]
rows = []
for name, m in mods.items():
    for N, B, T, d, H, dt in [(25, 2, 2048, 512, 4, torch.bfloat16), (73, 1, 1024, 1280, 8, torch.bfloat16), (9, 2, 333, 1280, 8, torch.float32)]:
        print(name, "check", N, B, T, d, H, dt, {k: f"{v:.1e}" for k, v in m.check_against_reference(N, B, T, d, H, dt, "cuda").items()}, flush=True)
for rep in range(int(os.environ.get("REPS", "2"))):
    for sname, L, d, H, B, T in shapes:
        for name, m in mods.items():
            ms, mem = m.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", None, graph=True)
            rows.append(dict(rep=rep, shape=sname, version=name, ms=ms, peak_gb=mem))
            print(f"rep {rep} {sname:11s} {name:6s} {ms:7.3f} ms  peak {mem:.2f} GB", flush=True)
for sname, L, d, H, B, T in shapes:
    for name, m in mods.items():
        print(f"{sname:11s} {name:6s} kernels (ms): {m.profile_chain(2 * L + 1, B, T, d, H, 'cuda')}", flush=True)
if os.environ.get("OUT"):
    json.dump(rows, open(os.path.join(os.environ["OUT"], "ab_chain.json"), "w"), indent=1)
