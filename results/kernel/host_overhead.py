"""Python cost of the fused routing chain without its kernels: the three Triton kernels replaced by no-ops, one
1B-shaped chain (73 sites, d 1280, H 8, 8 tokens) forward + backward on the CPU. From the repo root:
    PYTHONPATH=. python results/kernel/host_overhead.py
(BENCHMARKS.md: 70-130 us per site over six runs on the 2-core CI machine, commit b89824a)."""
import time

import torch

import routing_kernel as rk


class _Noop:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


for name in ("_route_fwd", "_route_bwd_site", "_route_bwd_gather"):
    setattr(rk, name, _Noop())
N, B, T, d, H = 73, 1, 8, 1280, 8
step = rk._fused_step(N, B, T, d, H, "cpu")
for _ in range(3):
    step()
n, t0 = 20, time.perf_counter()
for _ in range(n):
    step()
dt = (time.perf_counter() - t0) / n
print(f"chain of {N} sites, kernels stubbed: {dt * 1e3:.2f} ms per forward + backward = {dt / N * 1e6:.0f} us per site "
      f"(torch {torch.__version__})")
