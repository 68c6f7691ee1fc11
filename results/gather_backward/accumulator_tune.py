"""bench.tune_configs of the gather backward's tiles (gather_bwd, gather_bwd_lead) at each training microbatch, MHAR
and H = 1, with routing_gather replaced by a file (ran on d55359d with routing_gather.py as it ships after it):
    python results/gather_backward/accumulator_tune.py ROUTING_GATHER_PY [SHAPE ...]"""
import sys, os, importlib.util
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
spec = importlib.util.spec_from_file_location("routing_gather", sys.argv[1]); m = importlib.util.module_from_spec(spec)
sys.modules["routing_gather"] = m; spec.loader.exec_module(m)
import bench
names = sys.argv[2:] or ["100M-train", "350M-train", "1B-train", "124M-train"]
shapes = [s for s in bench.CHAIN_SHAPES if s[0] in names]
shapes += [(n + "/H1", L, d, 1, B, T) for n, L, d, H, B, T in shapes]
bench.tune_configs(["gather_bwd", "gather_bwd_lead"], shapes, True, "cuda")
