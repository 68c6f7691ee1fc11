# Triton's host cost per launch against the number and kind of arguments (keywords, positional, and the kernel Triton
# returned called again: CompiledKernel[grid](*args), which routing_config.Launch calls after a key's first launch),
# and the eager routing chain's host time per site at 350M's width and depth (49 sites, d 1024, H 8) and B 8 x T 1024,
# with a cProfile of its forward. On a GPU, from the repository root:
#   python results/launch_cost/launch_probe.py [--launches]   (--launches: the table alone)
#   (launch_probe_h100.txt: one H100 80GB, tree 2701d00, before the compiled column)
import importlib.util, os, sys, tempfile, time
import torch, triton
sys.path.insert(0, os.getcwd())

def make(n_ptr, n_int, n_const):
    ptrs = [f"P{i}" for i in range(n_ptr)]; ints = [f"i{i}" for i in range(n_int)]; cs = [f"C{i}: tl.constexpr" for i in range(n_const)]
    src = ("import triton\nimport triton.language as tl\n@triton.jit\ndef k(" + ", ".join(ptrs + ints + cs) + "):\n"
           "    pid = tl.program_id(0)\n    tl.store(P0 + pid, tl.load(P0 + pid) + 1)\n")
    f = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False); f.write(src); f.close()
    spec = importlib.util.spec_from_file_location(f"k{n_ptr}_{n_int}_{n_const}", f.name)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m.k, ptrs, ints, [c.split(":")[0] for c in cs]

def host_us(fn, n=3000):
    for _ in range(50): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize(); return host

x = torch.zeros(1024, device="cuda")
print(f"triton {triton.__version__} torch {torch.__version__} {torch.cuda.get_device_name()}")
print("| pointers | ints | constexprs | host us per launch (kwargs) | (positional) | (compiled, positional) |")
for n_ptr, n_int, n_const in ((1, 0, 0), (4, 2, 2), (16, 4, 8), (24, 6, 12), (32, 8, 14), (16, 0, 0), (16, 8, 0), (1, 0, 16)):
    k, ptrs, ints, cs = make(n_ptr, n_int, n_const)
    kw = {**{p: x for p in ptrs}, **{i: 7 for i in ints}, **{c: 3 for c in cs}}
    pos = list(kw.values())
    a = host_us(lambda: k[(4,)](**kw)); b = host_us(lambda: k[(4,)](*pos))
    compiled = k[(4,)](*pos)[(4, 1, 1)]; c = host_us(lambda: compiled(*pos))
    print(f"| {n_ptr} | {n_int} | {n_const} | {a:.1f} | {b:.1f} | {c:.1f} |")
if "--launches" in sys.argv:
    sys.exit()

# the chain, eager, at 350M's width and depth (49 sites, d 1024, H 8), B 8 x T 1024
from routing_kernel import FusedRouter
N, B, T, d, H = 49, 8, 1024, 1024, 8
r = FusedRouter(N, H, 1e-6)
qs = [torch.randn(d, device="cuda", requires_grad=True) * 0.02 for _ in range(N)]
qs = [q.detach().requires_grad_() for q in qs]; gs = [torch.ones(d, device="cuda", requires_grad=True) for _ in range(N)]
x0 = torch.randn(B, T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
def step():
    c = r.start(x0, qs, gs)
    h = x0
    for j in range(1, N + 1):
        h = c.route(j, h, qs[j - 1], gs[j - 1])
    return h
def fwdbwd():
    h = step(); h.float().sum().backward()
def fwd_nograd():
    with torch.no_grad(): step()
for name, fn in (("forward+backward", fwdbwd), ("forward, no grad", fwd_nograd)):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    t = time.perf_counter(); n = 30
    for _ in range(n): fn()
    host = (time.perf_counter() - t) / n; torch.cuda.synchronize(); wall = (time.perf_counter() - t) / n
    print(f"chain {name}: host {host*1e3:.2f} ms, wall {wall*1e3:.2f} ms ({host/N*1e6:.0f} us host a site)")
# the same with the GPU's time alone: a CUDA graph
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3): fwd_nograd()
torch.cuda.current_stream().wait_stream(s)
with torch.cuda.graph(g): fwd_nograd()
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(30): g.replay()
torch.cuda.synchronize(); print(f"chain forward, no grad, graphed: {(time.perf_counter()-t)/30*1e3:.2f} ms")
# where a forward site's host time goes
c = r.start(x0, None, None, training=False)
import cProfile, pstats
pr = cProfile.Profile(); pr.enable()
for _ in range(20): fwd_nograd()
pr.disable(); torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(12)
