"""
The routing chain alone (`python bench.py routing`): every site of a model, forward and backward, an elementwise
sublayer between sites, fused against the reference, at the paper's Table 5 shapes and training microbatches:
correctness against route_reference, GPU time (CUDA-graph replay) and eager wall time, GB/s by the design's byte model
(chain_bytes), GPU time per kernel (--profile: at the training microbatches too). --shapes=NAMES picks shapes;
--heads=H routes every shape with H heads (1: the single head); --blocks=n times block routing instead; --tune-train
searches each width's launch settings (routing_config.tune) and prints its entry for the card's table; --check-large
checks offsets past 2^31 elements; --delta times the per-call kernels at an 8B delta model's shape; --authors=PATH and
--peers=fla,liger time ours beside the authors' kernel and the single-head kernels of fla-core and Liger-Kernel (when
installed). See `python bench.py routing -h`.

Also the chains that bench.py's step table (its routing share) and the tests run: run_chain, chain_step, time_chain,
chain_grads, check_against_reference; and the results header every benchmark writes.
"""
import importlib
import json
import math
import os
import platform
import sys

import torch

import graphs
import routing_call
import routing_config
import routing_kernel as rk
import train
from model import BlockDepthHistory, fused_router, route_reference
from options import Count, Device, Names, Parser, Path

# (name, L, d, H, B, T): the paper's Table 5 shapes, then each model's training microbatch (Table 1; 124M: Table 9's
# width control at the 100M microbatch)
CHAIN_SHAPES = [("100M", 12, 512, 4, 2, 2048), ("350M", 24, 1024, 8, 1, 1024), ("1B", 36, 1280, 8, 1, 1024),
                ("100M-train", 12, 512, 4, 8, 2048), ("124M-train", 12, 768, 4, 8, 2048),
                ("350M-train", 24, 1024, 8, 4, 1024), ("1B-train", 36, 1280, 8, 2, 1024)]


# ---- the chains every routing benchmark and test runs ------------------------------------------------------------

def header(device):
    """The run's git revision, torch and Triton versions and device, for every results file."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return (f"git {train.git_revision()} | torch {torch.__version__} | triton {triton_version} | "
            f"{torch.cuda.get_device_name(device) if device.startswith('cuda') else platform.processor() or 'cpu'}")


def write_json(path, written_by="bench_routing.py", **fields_):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:   # written_by: what the write guard knows the record by (common.artifact)
        json.dump({"written_by": written_by, **fields_}, f, indent=1)
    os.replace(path + ".tmp", path)
    print(f"wrote {path}")


def run_chain(route_site, source0, n_sites, sublayer):
    """n_sites routing sites, like a model's: source j = sublayer(j - 1, output of site j); route_site(j, x)."""
    x = source0
    for j in range(1, n_sites + 1):
        x = route_site(j, x)
        if j < n_sites:
            x = sublayer(j - 1, x)
    return x


def chain_step(impl, N, B, T, d, H, device, route_fn=route_reference, config=None, seed=0, authors=None, blocks=None):
    """A closure running one chain forward + backward (bf16 sources, the sublayer x + shift: one add per site): impl
    "fused" (model.fused_router), "authors" (the authors' fused kernel, `authors` its module), "fla" / "liger" (a
    single-head peer, `authors` its routing call; H must be 1), else the reference route_fn over the stacked history.
    blocks = n: block routing over the N - 1 sublayers in n blocks (the reference: model.BlockDepthHistory)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    src = torch.randn(B, T, d, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    qs = [(torch.randn(d, device=device, generator=gen) * 0.5).requires_grad_(True) for _ in range(N)]
    gs = [torch.ones(d, device=device, requires_grad=True) for _ in range(N)]
    up = torch.randn(B, T, d, device=device, dtype=torch.bfloat16, generator=gen)
    shift = torch.randn(B, T, d, device=device, dtype=torch.bfloat16, generator=gen)
    router = fused_router(N, H, 1e-6, config, blocks)
    add = lambda j, x: x + shift

    def step():
        if blocks and impl != "fused":
            hist = BlockDepthHistory(range(N), (N - 1) // blocks,
                                     lambda j, srcs: route_fn(torch.stack(srcs), qs[j], gs[j], H, 1e-6))
            out = run_chain(lambda j, x: hist.route(x), src, N, add)
        elif impl == "fused":   # full or block routing
            chain = router.start(src, qs, gs)
            out = run_chain(lambda j, x: chain.route(j, x, qs[j - 1], gs[j - 1]), src, N, add)
        elif impl == "authors":   # their context: a source buffer per pass; one launch per site forward, one backward
            ctx = authors.MHARFusedContext(N, src)
            out = run_chain(lambda j, x: authors._FusedMHARFn.apply(x, qs[j - 1], gs[j - 1], ctx, H, 1e-6), src, N, add)
        elif impl in ("fla", "liger"):   # single head: query q, key-norm weight g, as ours at H = 1
            hist = []
            call = (lambda j: authors(qs[j - 1], tuple(hist), gs[j - 1], rms_eps=1e-6)) if impl == "fla" else \
                (lambda j: authors.apply(torch.stack(hist), qs[j - 1], gs[j - 1], 1e-6))
            out = run_chain(lambda j, x: hist.append(x) or call(j), src, N, add)
        else:
            hist = []
            out = run_chain(lambda j, x: hist.append(x) or route_fn(torch.stack(hist), qs[j - 1], gs[j - 1], H), src, N,
                            add)
        out.backward(up)
        step.out = out.detach()
    step.router = router
    return step


def peak_gb(step):
    """Peak memory one call of step() allocates above what is allocated before it, in GB."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def graphed(step):
    """step captured as one CUDA graph (graphs.capture: two warm-up calls on a side stream); returns the replay."""
    return graphs.capture(step)[0].replay


def time_chain(impl, N, B, T, d, H, device, ref_compiled=None, graph=False, config=None, blocks=None):
    """(median ms, peak GB) of one chain forward + backward: fused, compiled (ref_compiled) or eager reference.
    graph: replay it from a CUDA graph, i.e. GPU time alone (no Python, no launch gaps). blocks: block routing."""
    from triton.testing import do_bench
    step = chain_step(impl, N, B, T, d, H, device, ref_compiled if impl == "compiled" else route_reference, config,
                      blocks=blocks)
    step()                      # compile
    step.router.chain = None    # measure memory from scratch: the chain's buffers count
    mem = peak_gb(step)
    return do_bench(graphed(step) if graph else step, warmup=50, rep=300, return_mode="median"), mem


def chain_grads(impl, src0, qs, gs, sublayer, up, H, config=None, blocks=None, router=None):
    """A chain of len(qs) sites from src0, fused or reference (blocks = n: block routing's): its output and every
    gradient of <out, up>, in float64: [out, d src0, dq of every site (concatenated), dg of every site]. router: the
    fused one to run (None: a new one; one kept across calls keeps its chain, as a training run does)."""
    N = len(qs)
    s0 = src0.clone().requires_grad_(True)
    q = [x.clone().requires_grad_(True) for x in qs]
    g = [x.clone().requires_grad_(True) for x in gs]
    if impl == "fused":
        chain = (router or fused_router(N, H, 1e-6, config, blocks)).start(s0, q, g)
        route = lambda j, x: chain.route(j, x, q[j - 1], g[j - 1])
    elif blocks:
        hist = BlockDepthHistory(range(N), (N - 1) // blocks,
                                 lambda j, srcs: route_reference(torch.stack(srcs), q[j], g[j], H, 1e-6))
        route = lambda j, x: hist.route(x)
    else:
        hist = []
        route = lambda j, x: hist.append(x) or route_reference(torch.stack(hist), q[j - 1], g[j - 1], H)
    out = run_chain(route, s0, N, sublayer)
    (out.double() * up.double()).sum().backward()
    return [out.detach().double(), s0.grad.double(), torch.cat([x.grad for x in q]).double(),
            torch.cat([x.grad for x in g]).double()]


def check_against_reference(N, B, T, d, H, dtype, device, config=None, blocks=None):
    """Relative error of fused against reference (fp32 math in both) for out and every gradient (dq, dg: all sites
    at once, since site 1's are 0); blocks = n: block routing's chain. Queries 0.5 a channel, scaled down for heads
    wider than 160 channels (the paper's widest, 1B's): at 0.5 one 1,024-wide head has logits of spread ~16, near
    one-hot softmaxes whose bf16 chain moves by ~1 (relative, gradients) under any change of rounding, so the check
    would measure nothing; every MHAR width keeps 0.5."""
    gen = torch.Generator(device="cpu").manual_seed(N * 7 + d)
    src0 = (torch.randn(B, T, d, generator=gen)).to(device=device, dtype=dtype)
    q_scale = 0.5 * min(1.0, (160 / (d // H)) ** 0.5)
    qs = [torch.randn(d, generator=gen).to(device) * q_scale for _ in range(N)]
    gs = [(1 + 0.2 * torch.randn(d, generator=gen)).to(device) for _ in range(N)]
    up = torch.randn(B, T, d, generator=gen).to(device=device, dtype=dtype)
    shift = [torch.randn(B, T, d, generator=gen).to(device=device, dtype=dtype) for _ in range(N)]
    sublayer = lambda j, x: torch.tanh(x) + shift[j]     # non-linear, so every gradient path matters
    f, r = (chain_grads(impl, src0, qs, gs, sublayer, up, H, config, blocks) for impl in ("fused", "reference"))
    rel = lambda a, b: ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    return {name: rel(a, b) for name, a, b in zip(("out", "d_source0", "dq", "dg"), f, r)}


def chain_pairs(N, blocks=None):
    """(source, site) pairs of a chain of N sites: full routing's N (N + 1) / 2, or block routing's (n blocks of the
    N - 1 sublayers: site j reads the completed blocks, the embedding one of them, and the open block's partial sum)."""
    if not blocks:
        return N * (N + 1) // 2
    P = (N - 1) // blocks
    return sum(1 + (j - 1) // P + ((j - 1) % P != 0) for j in range(1, N + 1))


def chain_bytes(N, tokens, d, blocks=None):
    """The bf16 bytes a chain must move at least, by each design's own model, before any read sharing: full routing
    (routing_kernel.py's header) 2 reads of every (source, site) pair's M x d, the forward's and the gather's, and 5
    passes a site (its fp32 output written and read, its source read again for dw), 2 x pairs + 5 N passes in all;
    block routing's kernels (routing_block.py's header) c + 3 passes over M x d forward and 3c + 2 backward for a site
    of c sources, 4 x pairs + 5 N passes in all."""
    passes = (2 * chain_pairs(N) if not blocks else 4 * chain_pairs(N, blocks)) + 5 * N
    return 2 * passes * tokens * d


# ---- checks and timings beyond the chain ------------------------------------------------------------------------------

def check_large(device, config=None):
    """Forward + backward over 2 sites at 2^21 tokens x d 1024 (offsets past 2^31); compare the last rows."""
    M, d, H = 2**21, 1024, 8
    src = torch.randn(1, M, d, device=device, dtype=torch.bfloat16)
    q = [torch.randn(d, device=device) for _ in range(2)]
    g = [torch.ones(d, device=device) for _ in range(2)]
    s0 = src.clone().requires_grad_(True)
    chain = fused_router(2, H, 1e-6, config).start(s0, q, g)
    out = chain.route(2, chain.route(1, s0, q[0], g[0]) * 0.5 + 1.0, q[1], g[1])
    up = torch.randn_like(out)
    out.backward(up)
    tail = slice(M - 4096, M)   # the last rows: their offsets are beyond 2^31 elements
    a = src[:, tail].detach().clone().requires_grad_(True)
    ref = route_reference(torch.stack([a, a * 0.5 + 1.0]), q[1], g[1], H)
    ref.backward(up[:, tail])
    rel = lambda x, y: ((x.float() - y.float()).norm() / y.float().norm()).item()
    return {"out": rel(out[:, tail], ref), "d_source0": rel(s0.grad[:, tail], a.grad)}


def time_delta(impl, device, B=2, T=4096, d=4096, H=8, n_layer=32, num_blocks=8):
    """All 2L delta routing calls of a forward + backward: block b's sites mix null + b + 1 history sources.
    reference-ckpt: route_reference on the stacked sources, each call under activation checkpointing (as the
    paper's reference), fused: routing_call.route_stack. Returns (median ms, peak GB above the inputs)."""
    from triton.testing import do_bench
    gen = torch.Generator(device=device).manual_seed(0)
    history = [torch.randn(B, T, d, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_(True)
               for _ in range(num_blocks)]
    sites = [[(torch.randn(d, device=device) * 0.1).requires_grad_(True) for _ in range(3)] for _ in range(2 * n_layer)]
    up = torch.randn(B, T, d, device=device, dtype=torch.bfloat16)
    per_block = 2 * n_layer // num_blocks

    def ref_call(stacked, null, q, g):
        return route_reference(torch.cat([null.to(stacked.dtype).expand(1, *stacked.shape[1:]), stacked]), q, g, H)

    def step():
        total = None
        for k, (null, q, g) in enumerate(sites):
            if k % per_block == 0:
                hist = torch.stack(history[: k // per_block + 1])
                r = routing_call.rms_factors(hist, 1e-6) if impl == "fused" else None
            if impl == "fused":
                out = routing_call.route_stack(hist, q, g, H, 1e-6, null=null, r=r)
            else:
                out = torch.utils.checkpoint.checkpoint(ref_call, hist, null, q, g, use_reentrant=False)
            total = out if total is None else total + out
        total.backward(up)
    step()                      # compile
    return do_bench(step, warmup=1, rep=1, return_mode="median"), peak_gb(step)


def profile_chain(N, B, T, d, H, device, config=None, blocks=None):
    """GPU time per kernel over one fused chain forward + backward (blocks = n: block routing's), in ms; "other":
    PyTorch's own kernels, "launches": how many kernels ran."""
    from torch.profiler import ProfilerActivity, profile
    step = chain_step("fused", N, B, T, d, H, device, config=config, blocks=blocks)
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    total, launches = {}, 0
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            key = next((k for k in ("_chain_fwd", "_gather_bwd", "_dw_terms", "_block_fwd", "_block_bwd") if k in e.key),
                       "other")
            total[key], launches = total.get(key, 0.0) + t / 1e3, launches + e.count
    return dict({k: round(v, 3) for k, v in sorted(total.items())}, launches=launches)


# ---- others' kernels side by side --------------------------------------------------------------------------------------

def load_authors(path):
    """The authors' fused routing (Attention-Residuals/mhar_triton.py of the code they published), from a copy the user
    keeps: this repository does not ship it."""
    import importlib.util
    if not os.path.isfile(path):
        sys.exit(f"bench.py routing: --authors={path}: no such file; pass your copy of the authors' mhar_triton.py")
    spec = importlib.util.spec_from_file_location("authors_mhar_triton", path)
    if spec is None:
        sys.exit(f"bench.py routing: --authors={path} is not a Python file (.py); pass your copy of the authors' "
                 "mhar_triton.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:   # a syntax error, or not Python at all
        line = f", line {e.lineno}" if isinstance(e, SyntaxError) and e.lineno else ""
        sys.exit(f"bench.py routing: --authors={path}{line} does not load ({type(e).__name__}: "
                 f"{str(e).splitlines()[0] if str(e) else ''}): not the authors' mhar_triton.py")
    missing = [name for name in ("MHARFusedContext", "_FusedMHARFn") if not hasattr(module, name)]
    if missing:
        sys.exit(f"bench.py routing: --authors={path} has no {', '.join(missing)}: not the authors' mhar_triton.py")
    return module


# the single-head peers bench.py routing --peers can time: package, module, routing call
PEERS = {"fla": ("fla-core", "fla.ops.attnres", "fused_attnres"),
         "liger": ("liger-kernel", "liger_kernel.ops.attn_res", "LigerAttnResFunction")}


def load_peers(names):
    """The routing calls of the single-head peers named (comma-separated), from the packages the user installed: this
    repository neither requires nor ships them."""
    names = names.split(",") if isinstance(names, str) else names
    peers, unknown = {}, [name for name in names if name not in PEERS]
    if unknown:
        sys.exit(f"bench.py routing: --peers={','.join(names)}: unknown peer {unknown[0]!r}; choose from {', '.join(PEERS)}")
    for name in names:
        package, module, call = PEERS[name]
        try:
            peers[name] = getattr(importlib.import_module(module), call)
        except ImportError as e:
            sys.exit(f"bench.py routing: --peers={name}: cannot import {module} ({e}); pip install {package}, or leave "
                     f"{name} out")
    if "fla" in peers:   # it autotunes at every new shape
        print("bench.py routing: fla autotunes its kernels at each new shape, minutes a shape; --shapes=NAMES runs fewer",
              file=sys.stderr, flush=True)
    return peers


def side_by_side(others, device, copy_bw, rounds=3, shapes=CHAIN_SHAPES):
    """Our chain and others on the same inputs in this process, at every one of `shapes`: eager wall time (timed
    alternately, `rounds` times each, medians), CUDA-graph GPU time, peak memory, the fraction of the bandwidth bound
    each reaches (chain_bytes at this run's copy bandwidth), and each one's output against the reference chain's.
    others: {"authors": their module} (MHAR at each shape's H) or single-head peers {"fla": call, "liger": call}
    (load_peers; every chain then at H = 1)."""
    from triton.testing import do_bench
    rows = []
    for name, L, d, H, B, T in shapes:
        N, H = 2 * L + 1, H if "authors" in others else 1
        steps = {impl: chain_step(impl, N, B, T, d, H, device, authors=others.get(impl)) for impl in ("fused", *others)}
        ref = chain_step("reference", N, B, T, d, H, device)
        ref()
        row = dict(shape=name, heads=H, bound_ms=chain_bytes(N, B * T, d) / copy_bw / 1e6)
        for impl, step in steps.items():
            step()
            step.router.chain = None   # our chain's buffers count in the peak, as the others' per-pass buffers do
            row[f"{impl}_peak_gb"] = peak_gb(step)
            row[f"{impl}_graph_ms"] = do_bench(graphed(step), warmup=50, rep=300, return_mode="median")
            row[f"{impl}_out_rel_err"] = ((step.out.float() - ref.out.float()).abs().max() /
                                          ref.out.float().abs().max()).item()
        eager = {impl: [] for impl in steps}
        for _ in range(rounds):
            for impl, step in steps.items():
                eager[impl].append(do_bench(step, warmup=25, rep=200, return_mode="median"))
        for impl in steps:
            row[f"{impl}_eager_ms"], row[f"{impl}_eager_all"] = sorted(eager[impl])[rounds // 2], eager[impl]
        rows.append(row)
        for o in others:
            f = lambda key: f"{row['fused_' + key]:6.2f} / {row[o + '_' + key]:6.2f}"
            print(f"{name:11s} H={H} {o:7s} | eager {f('eager_ms')} ms = {row[o + '_eager_ms'] / row['fused_eager_ms']:4.2f}x"
                  f" | graph {f('graph_ms')} ms = {row[o + '_graph_ms'] / row['fused_graph_ms']:4.2f}x | peak "
                  f"{f('peak_gb')} GB | of bound (graph) {100 * row['bound_ms'] / row['fused_graph_ms']:4.1f}% / "
                  f"{100 * row['bound_ms'] / row[o + '_graph_ms']:4.1f}% | max error against the reference "
                  f"{row['fused_out_rel_err']:.1e} / {row[o + '_out_rel_err']:.1e}", flush=True)
    return rows


# ---- the command ------------------------------------------------------------------------------------------------------

def parser():
    """bench.py routing's options, each with its kind and range (options.py)."""
    p = Parser(prog="bench.py routing", description=__doc__)
    p.add_argument("--device", type=Device(), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda | cuda:N | cpu (a check only)")
    p.add_argument("--tune-train", nargs="?", type=Names(*routing_config.TUNABLE, *routing_config.BLOCK_TUNABLE),
                   const=",".join(routing_config.TUNABLE), default=None, metavar="KERNELS",
                   help="tune each width's settings at its training microbatch (comma-separated settings; default: "
                   "the chain's, or with --blocks the block chain's)")
    p.add_argument("--check-large", action="store_true", help="also check 2^21 tokens x d 1024 (64-bit offsets)")
    p.add_argument("--delta", action="store_true", help="time the per-call kernels at an 8B delta model's shape, then exit")
    p.add_argument("--check-only", action="store_true", help="only the correctness checks, then exit")
    p.add_argument("--peers", type=Names("fla", "liger"), metavar="NAMES", help="side by side with single-head peers "
                   "you installed, e.g. fla,liger (fla-core's fused_attnres, Liger-Kernel's LigerAttnResFunction): ours at "
                   "H = 1, same measures as --authors; then exit")
    p.add_argument("--authors", type=Path("file", "the authors' mhar_triton.py"), metavar="PATH",
                   help="side by side with the authors' fused kernel (your copy of their mhar_triton.py): eager and "
                   "CUDA-graph time, memory, fraction of the bandwidth bound; then exit")
    p.add_argument("--blocks", type=Count(1, 2048), default=None, metavar="N", help="block routing in N blocks at every "
                   "chain shape: its time and profile, and --tune-train of its settings (N must divide every shape's 2L "
                   "sublayers)")
    p.add_argument("--heads", type=Count(1, 65536), default=None, metavar="H", help="route every chain shape (checks, "
                   "timing and tuning) with H heads instead of its own (1: the single head)")
    p.add_argument("--shapes", type=Names(*(s[0] for s in CHAIN_SHAPES)), metavar="NAMES",
                   default=",".join(s[0] for s in CHAIN_SHAPES),
                   help="comma-separated chain shapes to time, tune and compare (default: all)")
    p.add_argument("--profile", action="store_true", help="GPU time per kernel at every shape (default: the Table 5 "
                   "shapes only)")
    p.add_argument("--output", type=Path("out_file", writes="routing bench record"), default="out/routing_bench.json", help="results JSON")
    return p


def parse(argv):
    return parser().parse_args(argv)


def chosen_shapes(args):
    """The chain shapes asked for (once each, in the order given, --heads applied) and the settings to tune, after
    checking every option against them: a one-line error before anything runs."""
    known = {s[0]: s for s in CHAIN_SHAPES}
    names = args.shapes.split(",") if isinstance(args.shapes, str) else args.shapes   # (Names: a list, checked)
    shapes = [(n, L, d, H if args.heads is None else args.heads, B, T)
              for n, L, d, H, B, T in (known[n] for n in dict.fromkeys(names))]
    allowed = routing_config.BLOCK_TUNABLE if args.blocks else routing_config.TUNABLE
    kernels = args.tune_train.split(",") if isinstance(args.tune_train, str) else list(args.tune_train or [])
    if args.blocks and args.tune_train == ",".join(routing_config.TUNABLE):   # the default: the block chain's
        kernels = list(allowed)
    if any(k not in allowed for k in kernels):
        unknown = ", ".join(k for k in kernels if k not in allowed) or "(none given)"
        sys.exit(f"bench.py routing: --tune-train={','.join(kernels)}: unknown setting {unknown}; choose from "
                 f"{', '.join(allowed)}")
    if args.blocks is not None and (args.authors or args.peers or args.delta):
        sys.exit("bench.py routing: --blocks times this repo's block chain alone: drop --authors, --peers and --delta "
                 "(they time full routing or delta mode)")
    sublayers = sorted({2 * L for _, L, _, _, _, _ in shapes})
    if args.blocks is not None and (args.blocks < 1 or math.gcd(*sublayers) % args.blocks):
        sys.exit(f"bench.py routing: --blocks={args.blocks} must divide every chain shape's sublayers (2 x n_layer: "
                 f"{', '.join(map(str, sublayers))}): give a divisor of {math.gcd(*sublayers)}, e.g. 8")
    for name, _, d, H, _, _ in shapes:
        if not heads_fit(d, H):
            sys.exit(f"bench.py routing: --heads={H} does not fit the {name} shape's width d={d} (H must divide d with "
                     f"d/H >= 16)")
    return shapes, kernels


def heads_fit(d, H):
    return H >= 1 and d % H == 0 and d // H >= 16   # the kernels' envelope (routing_config.check_envelope)


def run_checks(args, device):
    """The fused chain against the reference: an awkward shape, and the paper's on a GPU (--blocks: block routing's
    chain, also at the 100M training microbatch, where each backward program visits ~30 token blocks)."""
    shapes = [(13 if args.blocks else 5, 1, 33, 96, 4, torch.float32)]
    if device.startswith("cuda"):
        shapes += [(25, 2, 2048, 512, 4, torch.bfloat16), (49, 1, 1024, 1024, 8, torch.bfloat16),
                   (73, 1, 1024, 1280, 8, torch.bfloat16)] + ([(25, 8, 2048, 512, 4, torch.bfloat16)] if args.blocks else [])
    for N, B, T, d, H, dtype in shapes:
        H = args.heads if args.heads and heads_fit(d, args.heads) else H   # --heads where it fits
        blocks = args.blocks and math.gcd(N - 1, args.blocks)
        errs = check_against_reference(N, B, T, d, H, dtype, device, blocks=blocks)
        print(f"check N={N} B={B} T={T} d={d} H={H} {str(dtype):15s}" + (f" blocks={blocks}" if blocks else "") + " " +
              " ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)


def time_shapes(args, shapes, copy_bw, device, configs=None):
    """Each shape's chain: fused (eager and graphed), and at the Table 5 shapes the reference (compiled and eager);
    GB/s by the byte model, peak memory, the per-kernel profile. configs: {shape name: the launch settings it runs}
    (after --tune-train, the tuned ones); a shape without one runs its card's table (config_for)."""
    rows, ref_compiled, configs = [], torch.compile(route_reference, dynamic=True), configs or {}
    for name, L, d, H, B, T in shapes:
        N = 2 * L + 1
        for impl in ("fused", "fused-graph") + (() if name.endswith("train") else ("compiled", "eager")):
            t, mem = time_chain(impl.split("-")[0], N, B, T, d, H, device, ref_compiled, graph=impl.endswith("graph"),
                                config=configs.get(name), blocks=args.blocks)
            gbps = chain_bytes(N, B * T, d, args.blocks) / t / 1e6
            rows.append(dict(shape=name, heads=H, impl=impl, ms=t, gbps=gbps, copy_frac=gbps / copy_bw, peak_gb=mem))
            print(f"{name:11s} H={H:<2d} {impl:11s} {t:8.2f} ms  {gbps:6.0f} GB/s ({'4c' if args.blocks else '2c'} + 5 "
                  f"passes a site, {100 * gbps / copy_bw:4.1f}% of copy)  peak {mem:.2f} GB", flush=True)
        if args.profile or not name.endswith("train"):
            kernels = profile_chain(N, B, T, d, H, device, configs.get(name), args.blocks)
            print(f"{name:11s} fused kernels (profiler, ms): {kernels}", flush=True)
    return rows


def main(argv):
    args = parse(argv)   # every option by its rule (--blocks and --heads against the shapes: next)
    shapes, kernels = chosen_shapes(args)
    authors, peers = load_authors(args.authors) if args.authors else None, load_peers(args.peers) if args.peers else None
    device = args.device
    if device == "cpu" and not rk.available("cpu"):
        sys.exit("bench.py routing: no CUDA device; run with TRITON_INTERPRET=1 for Triton's CPU interpreter")
    run_checks(args, device)
    if not device.startswith("cuda") or args.check_only:
        return None
    if args.check_large:
        print("check 2^21 tokens:", check_large(device), flush=True)
    from triton.testing import do_bench
    x = torch.empty(2**28, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    copy_bw = 2 * x.numel() * 2 / do_bench(lambda: y.copy_(x), return_mode="median") / 1e6   # GB/s, read + written
    del x, y
    print(head := f"{header(device)} | device-to-device copy {copy_bw:.0f} GB/s", flush=True)
    rows = []
    if authors or peers:
        for others in ([{"authors": authors}] if authors else []) + ([peers] if peers else []):
            print(f"side by side, ours / {' / '.join(others)} (same inputs, this process); x = how many times faster ours "
                  "is", flush=True)
            rows += side_by_side(others, device, copy_bw, shapes=shapes)
    elif args.delta:
        for impl in ("fused", "reference-ckpt"):
            t, mem = time_delta(impl, device)
            rows.append(dict(shape="8B-delta", impl=impl, ms=t, peak_gb=mem))
            print(f"8B delta   {impl:15s} {t:8.1f} ms  peak {mem:.2f} GB  (64 sites, H 8, 2 x 4096 tokens, d 4096)", flush=True)
        print(f"fused is {rows[1]['ms'] / rows[0]['ms']:.2f}x faster than the checkpointed reference")
    else:
        configs = {}   # shape name -> the tuned settings (--tune-train); the others run their card's table
        if kernels:
            time_fn = lambda cfg, L, d, H, B, T: time_chain("fused", 2 * L + 1, B, T, d, H, device, graph=True, config=cfg,
                                                            blocks=args.blocks)[0]
            train = [s for s in shapes if s[0].endswith("train")]
            configs = dict(zip([s[0] for s in train], routing_config.tune(kernels, train, time_fn)))
        rows = time_shapes(args, shapes, copy_bw, device, configs)
    write_json(args.output, header=head, copy_gbps=copy_bw, rows=rows)
    return rows
