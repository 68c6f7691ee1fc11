# The eager routing chain's host time and wall, another tree's routing files (BEFORE_DIR: a folder holding its .py
# files) against this checkout's, in one process, alternating before, after, after, before over 3 rounds (20 passes
# each after 3 warm-ups); first the two trees' outputs (and x0's gradient) compared bitwise. From the repository root,
# on one GPU:
#   python results/launch_cost/launch_ab.py BEFORE_DIR [N d H B]   (default 49 sites, d 1024, H 8, B 4: 350M at
#   bench.py's microbatch, T 1024)
#   MODE=eval ...: passes without a backward (no grad), whose chain FusedRouter.start makes anew each pass
# Outputs and their trees: README.md.
import importlib
import os
import sys
import time

import torch

NAMES = ("routing_config", "routing_kernel", "routing_block", "routing_call")   # the routing files: each tree's own


def load(path):
    """A tree's routing modules, imported from `path` (and left out of sys.modules' way for the next tree)."""
    for n in NAMES:
        sys.modules.pop(n, None)
    sys.path.insert(0, path)
    importlib.import_module("routing_kernel")
    sys.path.remove(path)
    return {n: sys.modules[n] for n in NAMES if n in sys.modules}


def make(tree, mode):
    """One pass of the chain in `tree`: every site routed in order, then (mode train) a backward from the outputs."""
    for n in NAMES:
        sys.modules.pop(n, None)
    sys.modules.update(tree)
    router = tree["routing_kernel"].FusedRouter(N, H, 1e-6)

    def step():
        with torch.set_grad_enabled(mode == "train"):
            chain = router.start(x0, qs, gs) if mode == "train" else router.start(x0)
            h, outs = x0, []
            for j in range(1, N + 1):
                h = chain.route(j, h, qs[j - 1], gs[j - 1])
                outs.append(h)
        if mode == "train":
            h.float().sum().backward()
        return outs
    return step


MODE = os.environ.get("MODE", "train")
if MODE not in ("train", "eval"):
    sys.exit(f"launch_ab.py: MODE={MODE!r} is not train or eval")
before, after = load(os.path.abspath(sys.argv[1])), load(os.getcwd())
N, d, H, B = (int(x) for x in (sys.argv[2:] or (49, 1024, 8, 4)))
T = 1024
g = torch.Generator().manual_seed(0)
x0 = torch.randn(B, T, d, generator=g).to("cuda", torch.bfloat16).requires_grad_()
qs = [(torch.randn(d, generator=g) * 0.3).cuda().requires_grad_() for _ in range(N)]
gs = [(1 + 0.2 * torch.randn(d, generator=g)).cuda().requires_grad_() for _ in range(N)]
steps = {"before": make(before, MODE), "after": make(after, MODE)}
ref = {}
for k, step in steps.items():
    x0.grad = None
    ref[k] = [o.detach().clone() for o in step()] + ([x0.grad.clone()] if MODE == "train" else [])
print("bitwise outputs" + (" and x0.grad:" if MODE == "train" else ":"),
      all(torch.equal(a, b) for a, b in zip(ref["before"], ref["after"])), flush=True)
res = {"before": [], "after": []}
for rnd in range(3):
    for k in ("before", "after", "after", "before"):
        for _ in range(3):
            steps[k]()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            steps[k]()
        host = (time.perf_counter() - t) / 20
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / 20
        res[k].append((host * 1e3, wall * 1e3))
        print(f"round {rnd} {k:6s} host {host*1e3:7.2f} ms wall {wall*1e3:7.2f} ms ({host/N*1e6:.0f} us host a site)",
              flush=True)
for k, v in res.items():
    hs, ws = sorted(h for h, _ in v), sorted(w for _, w in v)
    print(f"{k}: host median {hs[len(hs)//2]:.2f} ms (min {hs[0]:.2f}), wall median {ws[len(ws)//2]:.2f} ms "
          f"(min {ws[0]:.2f})")
print(MODE, torch.cuda.get_device_name(), torch.__version__)
