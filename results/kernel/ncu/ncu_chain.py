"""One fused routing chain (forward + backward) at a given shape, for Nsight Compute. From the repo root:
ncu --clock-control none -k regex:_route_bwd_site --launch-skip 30 --launch-count 1 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section SchedulerStats python results/kernel/ncu/ncu_chain.py 73 1 1024 1280 8     # N B T d H (1B)
(backward runs sites N..1, so skipping 30 site-pass launches profiles site 43; forward: skip 42)."""
import sys

import torch

sys.path.insert(0, ".")
import routing_kernel as rk  # noqa: E402

N, B, T, d, H = (int(x) for x in sys.argv[1:6])
rk._fused_step(N, B, T, d, H, "cuda")()
torch.cuda.synchronize()
