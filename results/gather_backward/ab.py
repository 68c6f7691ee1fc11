"""The routing chain's two backwards side by side, same process, same inputs: the site pass + gather
(RoutingConfig.backward = "site", each width's tuned settings) against routing_gather.py's gather alone ("gather", the
same settings otherwise), at the training microbatches, MHAR's H and the single head. Per shape and backward: the
relative error of out and every gradient against route_reference (bench.check_against_reference, bf16 sources),
CUDA-graph GPU time (bench.time_chain: triton.testing.do_bench median, timed site, gather, gather, site; the faster of
each pair), the peak memory of one pass and the GPU time per kernel (torch profiler, one pass); then the
> 2^31-element check on the gather backward.
usage: python results/gather_backward/ab.py OUT.json [SHAPE ...]   (SHAPE: a name below; default all)"""
import json
import sys

import torch

sys.path.insert(0, ".")
import bench  # noqa: E402

# (name, L, d, MHAR's H, B, T): bench.py's training microbatches
SHAPES = [s for s in bench.CHAIN_SHAPES if s[0].endswith("-train")]
rows = []
print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {__import__('triton').__version__}",
      flush=True)
for name, L, d, H_mhar, B, T in SHAPES:
    if len(sys.argv) > 2 and name not in sys.argv[2:]:
        continue
    N = 2 * L + 1
    for H in (H_mhar, 1):
        # (a width may ship either backward)
        configs = {k: bench.forced_backward(d, H, k) for k in ("site", "gather")}
        errs = {k: bench.check_against_reference(N, B, T, d, H, torch.bfloat16, "cuda", c) for k, c in configs.items()}
        times = {k: [] for k in configs}
        for k in ("site", "gather", "gather", "site"):
            times[k].append(bench.time_chain("fused", N, B, T, d, H, "cuda", graph=True, config=configs[k]))
        for k in configs:
            ms, peak = min(t[0] for t in times[k]), times[k][0][1]
            kernels = bench.profile_chain(N, B, T, d, H, "cuda", configs[k])   # ms per kernel, one profiled pass
            rows.append(dict(shape=name, H=H, backward=k, ms=ms, peak_gb=peak, err=errs[k], kernels=kernels))
            print(f"{name:11s} H={H:<2d} {k:6s} {ms:7.3f} ms  peak {peak:5.2f} GB  err " +
                  " ".join(f"{e} {v:.2e}" for e, v in errs[k].items()) + f"  kernels (ms) {kernels}", flush=True)
        print(f"{name:11s} H={H:<2d} gather / site: {rows[-1]['ms'] / rows[-2]['ms']:.3f}", flush=True)
print("check 2^21 tokens, gather backward:", bench.check_large("cuda", bench.forced_backward(1024, 8, "gather")),
      flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
