"""A/B of the routing chain: an older routing_kernel.py (e.g. `git show db8590c:routing_kernel.py > old.py`) against
the working tree's, same process, same inputs. GPU time = CUDA-graph replay, or with --eager the wall time launched
from Python (triton.testing.do_bench median, warmup 50 ms, rep 300 ms), each shape timed old, new, new, old. Also
(GPU time only): are the outputs and every gradient bitwise equal, and how far apart?
usage: python results/fast_default_h200/ab_chain.py OLD_routing_kernel.py OUT.json [--eager]"""
import importlib.util
import json
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
import routing_kernel as new  # noqa: E402
from bench import graphed  # noqa: E402  (capture after two warm-up calls on a side stream, as bench.py routing does)

spec = importlib.util.spec_from_file_location("rk_old", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)

SHAPES = [("100M-train", 12, 512, 4, 8, 2048), ("350M-train", 24, 1024, 8, 4, 1024), ("1B-train", 36, 1280, 8, 2, 1024),
          ("100M", 12, 512, 4, 2, 2048), ("350M", 24, 1024, 8, 1, 1024), ("1B", 36, 1280, 8, 1, 1024)]


def make(which, N, B, T, d, H):
    gen = torch.Generator(device="cuda").manual_seed(1234)
    src = torch.randn(B, T, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    qs = [(torch.randn(d, device="cuda", generator=gen) * 0.5).requires_grad_(True) for _ in range(N)]
    gs = [(1 + 0.1 * torch.randn(d, device="cuda", generator=gen)).requires_grad_(True) for _ in range(N)]
    up = torch.randn(B, T, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    shift = torch.randn(B, T, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    router = (new if which == "new" else old).FusedRouter(N, H, 1e-6)
    state = {}

    def step():
        chain = router.start(src, qs, gs)
        route = lambda j, x: chain.route(j, x, qs[j - 1], gs[j - 1])
        x = src
        for j in range(1, N + 1):
            x = route(j, x)
            if j < N:
                x = x + shift
        x.backward(up)
        state["out"] = x.detach()
    return step, src, qs, gs, state


def grads(step, src, qs, gs, state):
    for t in [src, *qs, *gs]:
        t.grad = None
    step()
    torch.cuda.synchronize()
    return [state["out"], src.grad] + [q.grad for q in qs] + [g.grad for g in gs]


def graph_ms(step):
    return do_bench(graphed(step), warmup=50, rep=300, return_mode="median")


EAGER = "--eager" in sys.argv


def eager_ms(step):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    return do_bench(step, warmup=50, rep=300, return_mode="median")


rows = []
print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {__import__('triton').__version__}")
for name, L, d, H, B, T in SHAPES:
    N = 2 * L + 1
    made = {w: make(w, N, B, T, d, H) for w in ("old", "new")}
    if EAGER:
        bitwise, maxdiff = None, float("nan")
    else:
        g_old, g_new = grads(*made["old"]), grads(*made["new"])
        bitwise = all(torch.equal(a, b) for a, b in zip(g_old, g_new))
        maxdiff = max((a.float() - b.float()).abs().max().item() for a, b in zip(g_old, g_new))
    times = {"old": [], "new": []}
    for w in ("old", "new", "new", "old"):
        times[w].append((eager_ms if EAGER else graph_ms)(made[w][0]))
    row = dict(shape=name, N=N, B=B, T=T, d=d, H=H, old_ms=times["old"], new_ms=times["new"], bitwise=bitwise,
               max_abs_diff=maxdiff)
    rows.append(row)
    print(f"{name:11s} old {' / '.join(f'{t:.3f}' for t in times['old'])} ms | new {' / '.join(f'{t:.3f}' for t in times['new'])} "
          f"ms | new/old (medians) {sorted(times['new'])[len(times['new']) // 2] / sorted(times['old'])[len(times['old']) // 2]:.4f} | outputs and gradients bitwise equal: {bitwise} "
          f"(max abs diff {maxdiff:.2e})", flush=True)
json.dump(rows, open(sys.argv[2], "w"), indent=1)
