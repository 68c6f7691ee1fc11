"""dw's product launched per site (OLD) against this tree's one launch a pass, one process: chain GPU time at each
width's shipped settings (old, new, old, new; the faster of each two), MHAR and the single head, and the single head's
d 1280 with the gather backward forced; then that one's checks against the reference.
    git show 77390f3:routing_gather.py > out/routing_gather_old.py
    python results/gather_backward/dw_once_final.py out/routing_gather_old.py"""
import sys, importlib.util
sys.path.insert(0, ".")
import torch, bench, routing_kernel as rk
from dataclasses import replace
from bench import CHAIN_SHAPES
import routing_gather as new
spec = importlib.util.spec_from_file_location("rg_old", sys.argv[1])
old = importlib.util.module_from_spec(spec); sys.modules["routing_gather"] = old; spec.loader.exec_module(old)
mods = {"old": old, "new": new}
rows = [(n, L, d, H, B, T, None) for n, L, d, H, B, T in CHAIN_SHAPES if n in ("1B", "100M-train", "124M-train", "350M-train", "1B-train")]
rows += [(n, L, d, 1, B, T, None) for n, L, d, H, B, T in CHAIN_SHAPES if n.endswith("-train")]
rows += [("1B-train", 36, 1280, 1, 2, 1024, "gather")]
for name, L, d, H, B, T, force in rows:
    cfg = rk.config_for(d, H) if force is None else bench.forced_backward(d, H, force)
    out = []
    for k in ("old", "new", "old", "new"):
        sys.modules["routing_gather"] = mods[k]
        out.append(bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=cfg)[0])
    print(f"{name:11s} H={H} {cfg.backward:6s} old {min(out[0::2]):6.2f} ms  new {min(out[1::2]):6.2f} ms  "
          f"new/old {min(out[1::2]) / min(out[0::2]):.3f}", flush=True)
sys.modules["routing_gather"] = new
cfg = bench.forced_backward(1280, 1, "gather")
for dt in (torch.float32, torch.bfloat16):
    print("check 1B-train H=1 gather", dt, bench.check_against_reference(73, 1, 1024, 1280, 1, dt, "cuda", config=cfg), flush=True)
