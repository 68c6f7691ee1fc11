"""Both backwards at every chain shape (bench.py's CHAIN_SHAPES), at each shape's H and at H = 1, in one process:
chain GPU time (graph replay) with the site pass and with the gather backward, each forced at every token count
(bench.forced_backward). Run from the repository root on a GPU: python results/gather_backward/backward_by_shape.py
(backward_by_shape_h200.txt: its output on d062e6f with the settings now in TUNED_H200 applied in memory, the 1B single
head's gather tiles then DEFAULT's; it timed each backward twice, site, gather, site, gather, and kept the second)."""
import os
import sys

sys.path.insert(0, os.getcwd())
import bench  # noqa: E402

for name, L, d, H, B, T in bench.CHAIN_SHAPES:
    for heads in (H, 1):
        times = {}
        for backward in ("site", "gather", "site", "gather"):
            times[backward] = bench.time_chain("fused", 2 * L + 1, B, T, d, heads, "cuda", graph=True,
                                               config=bench.forced_backward(d, heads, backward))[0]
        print(f"AB {name:11s} H={heads} shipped={bench.rk.config_for(d, heads).backward}: site {times['site']:.2f} "
              f"gather {times['gather']:.2f}", flush=True)
