"""A few eager chains at one shape, for ncu (accumulator_ncu_350m_h200.txt):
    ncu --clock-control none --kernel-name regex:_gather_bwd --launch-skip 100 --launch-count 3 --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        python results/gather_backward/one_chain.py 350M-train 0 ROUTING_GATHER_PY|cur"""
import sys, os, importlib.util
sys.path.insert(0, ".")
if sys.argv[3] != "cur":
    spec = importlib.util.spec_from_file_location("routing_gather", sys.argv[3]); m = importlib.util.module_from_spec(spec)
    sys.modules["routing_gather"] = m; spec.loader.exec_module(m)
import torch, bench, routing_kernel as rk
name, L, d, H, B, T = next(s for s in bench.CHAIN_SHAPES if s[0] == sys.argv[1])
H = int(sys.argv[2]) or H
step = bench.chain_step("fused", 2 * L + 1, B, T, d, H, "cuda", bench.route_reference, rk.config_for(d, H))
for _ in range(3):
    step()
torch.cuda.synchronize()
