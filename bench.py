"""
Benchmarks: the training step (1), generation (2), the step on several processes (3), the routing chain alone (4).

1. The training step minus data and eval (nanoGPT's bench.py), run by train.py's own step code (run_microbatches,
optimizer_step): tokens/s, MFU, peak memory and the routing share of every residual variant at the paper's scales, in
the layout of paper Tables 4 / 8 (throughput relative to our baseline, memory in GB). Synthetic tokens over the paper's
vocabulary (151,936, Qwen3), bf16 autocast, fp32 master weights, fused AdamW and gradient clipping included, one
microbatch per step (the paper's per-GPU microbatch: 8 x 2048 / 4 x 1024 / 2 x 1024), its forward and backward replayed
as a CUDA graph on a GPU (--cuda_graph=False launches every kernel from Python, as the eager step does).

  python bench.py                                                   # 100m, 350m, 1b: every variant, one GPU
  python bench.py --scales=100m --variants=baseline,mhar_fused --steps=40 --profile
  python bench.py --scales=124m --variants=baseline,mhar_fused,attnres_fused   # paper Table 9's width control
  python bench.py --scales=tiny --device=cpu --steps=2 --compile=False     # CPU smoke test (CI)

Variants (sublayers compiled in all of them when --compile): baseline; mhar_eager (reference routing, eager);
mhar_compiled (reference routing under torch.compile); mhar_fused (routing_kernel.py, the width's launch settings);
attnres_fused (single head, fused); mhar_block8, attnres_block8 (block routing, 8 blocks); hyper (dynamic
hyper-connections, 4 streams). The routing share is the GPU time of the routing chain alone at the same shape
(time_chain, replayed from a CUDA graph) over the step time: an estimate, since in the step the chain's launches overlap
the sublayers' work. Peak memory: the most allocated during the run, warm-up and graph capture included, above what the
process held before it (each run starts from a garbage-collected process and a reset torch.compile cache).

2. `python bench.py generate`: tokens/s of GPT.generate with and without the KV cache and its CUDA-graphed step.

3. `torchrun --standalone --nproc_per_node=8 bench.py ddp`: the step on N processes at the paper's global batch, the
gradients averaged three ways (none, after the graphs, overlapped with the backward). See `python bench.py ddp -h`.

4. `python bench.py routing`: the routing chain alone (every site of a model, forward and backward, an elementwise
sublayer between sites) at the paper's Table 5 shapes and training microbatches: correctness against route_reference,
GPU time (CUDA-graph replay) and eager wall time, GB/s by the design's byte model (chain_bytes), per-kernel profile;
the launch settings' tuner (--tune-train), the authors' kernel and single-head peers side by side (--authors,
--peers), delta mode's per-call kernels (--delta). See `python bench.py routing -h`.
"""
import functools
import gc
import json
import os
import signal
import sys
import time
from types import SimpleNamespace

if __name__ == "__main__":   # Ctrl-C while torch loads: a quiet exit (nothing is written yet)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch
import torch.distributed as dist

import bench_routing
import configurator
import graphs
import routing_kernel as rk
import train
from bench_routing import header, time_chain, write_json
from common import keeps_signals, run_script, write_atomic
from options import Choice, Count, Counts, Device, Flag, Names, Parser, Path, Real
from metrics import mfu
from model import GPT, GPTConfig, route_reference

# a scale: its config files (applied in order) or the shape itself. 124m: paper Table 9's width control, d768 at the
# 100M recipe's microbatch (8 x 2048; the paper trained it at sequence 2048, global batch 64)
SCALES = {"100m": ("config/train_100m.py",), "124m": ("config/train_100m.py", "config/repro_124m.py"),
          "350m": ("config/train_350m.py",), "1b": ("config/train_1b.py",),
          "tiny": dict(n_layer=4, n_head=2, n_kv_head=1, n_embd=64, ffn_hidden=128, block_size=64, micro_batch=2)}
VARIANTS = {
    "baseline": dict(residual="baseline"),
    "mhar_eager": dict(residual="mhar", routing_impl="reference", compile_routing=False),
    "mhar_compiled": dict(residual="mhar", routing_impl="reference"),
    "mhar_fused": dict(residual="mhar", routing_impl="fused"),
    "attnres_fused": dict(residual="attnres", routing_impl="fused"),
    "mhar_block8": dict(residual="mhar", routing_impl="fused", route_blocks=8),        # block routing, 8 blocks
    "attnres_block8": dict(residual="attnres", routing_impl="fused", route_blocks=8),  # Block AttnRes (Kimi)
    "hyper": dict(residual="hyper"),
}
PAPER_VOCAB = 151936


def scale_spec(scale):
    """A scale's shape, per-process microbatch and global batch (sequences per optimizer step)."""
    spec = SCALES[scale]
    if not isinstance(spec, tuple):
        return dict(spec, global_batch=2 * spec["micro_batch"])
    cfg = configurator.parse_args([os.path.join(os.path.dirname(os.path.abspath(__file__)), f) for f in spec],
                                  paths=False)   # (its shapes only: no data needed)
    keys = ("n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden", "block_size", "micro_batch")
    return dict({k: getattr(cfg, k) for k in keys}, global_batch=cfg.batch_tokens // cfg.block_size)


def scale_config(scale, vocab):
    """(GPTConfig kwargs, micro_batch) of a scale: its config files' shape and microbatch."""
    spec = scale_spec(scale)
    micro_batch = spec.pop("micro_batch")
    spec.pop("global_batch")
    return dict(spec, vocab_size=vocab if scale != "tiny" else 1024), micro_batch


def build(scale, variant, device, compile_model, vocab):
    kw, B = scale_config(scale, vocab)
    v = dict(VARIANTS[variant])
    compile_routing = v.pop("compile_routing", True)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**kw, **v)).to(device)
    if compile_model:
        model.compile_sublayers()
        if not compile_routing:
            model._route = route_reference   # the reference routing stays eager
    opt = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), fused=device.startswith("cuda"))
    return model, opt, B


def fresh_memory(device):
    """Free what earlier runs left and restart the peak count; returns the bytes still held (should be ~0)."""
    gc.collect()   # the step closure, the graph wrapper and the compiled modules hold each other
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def bench_one(scale, variant, device, steps, warmup, compile_model, vocab, profile_dir=None, cuda_graph=False,
              accum=1, grad_sync=None, bucket_mb=25.0):
    """One variant's step timed (see the docstring): accum microbatches through train.run_microbatches, then
    train.optimizer_step. Under torchrun (bench.py ddp) grad_sync says how the processes average the gradients: None
    (they do not: the step without communication), "after" (one all-reduce after the graphs, train.py's default) or
    "overlap" (graphs.OverlappedGradSync in the graphs); the step time is the slowest process's."""
    cuda = device.startswith("cuda")
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch._dynamo.reset()   # each variant compiles afresh: no recompile limits or guards shared with earlier ones
    held = fresh_memory(device) if cuda else 0
    model, opt, B = build(scale, variant, device, compile_model, vocab)
    T = model.cfg.block_size
    x = torch.randint(0, model.cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0)).to(device)
    batch = lambda micro: (x[:, :-1], x[:, 1:])   # the step minus data: the same tokens, already on the device
    rt = SimpleNamespace(ddp=False, device=device, say=print,
                         autocast=torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False))
    params = [p for p in model.parameters() if p.requires_grad]
    overlap = graphs.OverlappedGradSync(params, bucket_mb) if grad_sync == "overlap" else None
    graphed = graphs.GraphedMicrostep(model, rt.autocast, loss_scale=1 / accum, grad_sync=overlap) if cuda_graph and cuda else None
    zero_grad = None if graphed is not None else functools.partial(opt.zero_grad, set_to_none=True)

    def step():   # train.py's step; no host sync inside (the loss stays on the device)
        loss, _ = train.run_microbatches(batch, accum, model, graphed, rt)
        train.optimizer_step(opt, params, 1.0, world=world if grad_sync == "after" else None, zero_grad=zero_grad)
        return loss / accum
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):   # compilation, autotuning, allocator warm-up, graph capture
        step()
    sync()   # peak memory spans the warm-up too: a replayed graph allocates nothing, its pool was allocated in capture
    times = [timed(step, sync) for _ in range(steps)]
    loss = step()
    if not torch.isfinite(loss):
        raise RuntimeError(f"{scale}/{variant}: non-finite loss {loss.item()}")
    step_s = slowest(sorted(times)[len(times) // 2], device) if world > 1 else sorted(times)[len(times) // 2]
    tok_s = accum * B * T / step_s   # per process
    row = dict(scale=scale, variant=variant, cuda_graph=graphed is not None, micro_batch=B, seq_len=T, tok_s=tok_s,
               accum=accum, world=world, grad_sync=grad_sync, grad_bytes=sum(p.numel() * p.element_size() for p in params),
               step_ms=1e3 * step_s, step_ms_min=1e3 * min(times), step_ms_each=[round(1e3 * t, 3) for t in times],
               mfu=mfu(model, tok_s, torch.cuda.get_device_name(device) if cuda else None, T),
               peak_gb=(torch.cuda.max_memory_allocated(device) - held) / 1e9 if cuda else None,
               held_before_gb=held / 1e9 if cuda else None, params=model.num_params(), loss=loss.item())
    if grad_sync == "after":   # the all-reduce alone, on gradients of the step's shapes
        for p in params:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad   # eager steps leave them unset
        row["allreduce_ms"] = 1e3 * sorted(timed(lambda: graphs.sync_grads(params, world), sync) for _ in range(steps))[steps // 2]
    if profile_dir:
        row.update(profile_step(step, sync, cuda, os.path.join(profile_dir, f"{scale}_{variant}")))
    del model, opt, graphed, step, loss, params, overlap, zero_grad
    if cuda:   # or the next run's peak counts this run's weights, gradients and graph pool
        fresh_memory(device)
    return row


def timed(fn, sync):
    """Seconds of one call of fn, closed by sync."""
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def slowest(seconds, device):
    """The largest of every process's `seconds` (the slowest process sets the pace)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def profile_step(step, sync, cuda, path):
    """A torch.profiler trace of 3 steps (path.json) and where the time goes, by kernel and by input shape (path.txt);
    on CUDA the kernel time per step ("gpu_busy_ms"): below the step's wall time, the host is the bottleneck."""
    from torch.profiler import ProfilerActivity, profile
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []), record_shapes=True) as prof:
        for _ in range(3):
            step()
        sync()
    prof.export_chrome_trace(path + ".json")
    events, sort = prof.key_averages(), "self_device_time_total" if cuda else "self_cpu_time_total"
    with open(path + ".txt", "w") as f:
        f.write(events.table(sort_by=sort, row_limit=40, max_name_column_width=80))
        f.write("\n\nOperators by input shape (device time of the kernels each one launched):\n")
        f.write(prof.key_averages(group_by_input_shape=True).table(
            sort_by="device_time_total" if cuda else "cpu_time_total", row_limit=40, max_name_column_width=50,
            max_shapes_column_width=70))
    return dict(trace=path + ".json", **({"gpu_busy_ms": sum(e.self_device_time_total for e in events) / 1e3 / 3}
                                         if cuda else {}))


def routing_ms(scale, variant, device, vocab):
    """GPU time of the variant's routing chain alone at this shape (forward + backward), or None."""
    v = VARIANTS[variant]
    if v["residual"] not in ("attnres", "mhar") or (v["routing_impl"] == "fused" and not rk.available(device)):
        return None
    kw, B = scale_config(scale, vocab)
    H = 1 if v["residual"] == "attnres" else kw["n_kv_head"]
    impl = "fused" if v["routing_impl"] == "fused" else "compiled" if v.get("compile_routing", True) else "eager"
    ref = torch.compile(route_reference, dynamic=True) if impl == "compiled" else None
    return time_chain(impl, 2 * kw["n_layer"] + 1, B, kw["block_size"], kw["n_embd"], H, device, ref,
                      graph=impl == "fused", blocks=v.get("route_blocks"))[0]


def table(rows, scales, variants):
    """Paper Table 4 / 8 layout: per variant and scale, throughput relative to our baseline, tok/s, memory."""
    by = {(r["scale"], r["variant"]): r for r in rows}
    lines = ["| variant | " + " | ".join(f"{s}: x baseline, tok/s, peak GB, MFU, routing" for s in scales) + " |",
             "|---|" + "---|" * len(scales)]
    for v in variants:
        cells = []
        for s in scales:
            r, base = by.get((s, v)), by.get((s, "baseline"))
            if r is None:
                cells.append("-")
                continue
            rel = f"{r['tok_s'] / base['tok_s']:.2f}x" if base else "-"
            mem = f"{r['peak_gb']:.1f} GB" if r["peak_gb"] is not None else "-"
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
            share = f"{100 * r['routing_share']:.0f}%" if r.get("routing_share") is not None else "-"
            cells.append(f"{rel}, {r['tok_s']:,.0f}, {mem}, {mfu}, {share}")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parser():
    """bench.py's options (the training step), each with its kind and range (options.py)."""
    p = Parser(prog="bench.py", description=__doc__)
    p.add_argument("--scales", type=Names(*SCALES), default="100m,350m,1b", help=f"comma-separated subset of "
                   f"{','.join(SCALES)}")
    p.add_argument("--variants", type=Names(*VARIANTS), default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    add_step_options(p)
    p.add_argument("--device", type=Device(), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda | cuda:N | cpu")
    p.add_argument("--profile", action="store_true", help="also write a torch.profiler trace of 3 steps per run")
    p.add_argument("--output", type=Path("out_file", writes="bench record"), default="out/bench.json", help="results JSON")
    return p


def add_step_options(p):
    """The step's options that bench.py and bench.py ddp share."""
    p.add_argument("--steps", type=Count(1, 10**6), default=20, help="timed steps per run (the median is reported)")
    p.add_argument("--warmup", type=Count(0, 10**6), default=5, help="untimed steps first (compilation, autotuning)")
    p.add_argument("--compile", type=Flag(), default=True, help="torch.compile each sublayer")
    p.add_argument("--cuda_graph", type=Flag(), default=True,
                   help="replay forward+backward as CUDA graphs (train.py --cuda_graph); CUDA only")
    p.add_argument("--vocab", type=Count(2, 2**24), default=PAPER_VOCAB, help="vocabulary of the synthetic tokens "
                   "(paper: 151,936)")


@keeps_signals
def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    modes = {"routing": bench_routing.main, "generate": generate_main, "ddp": ddp_main}   # 2-4: pages of their own
    if argv[:1] and argv[0] in modes:
        return modes[argv[0]](argv[1:])
    args = parser().parse_args(argv)
    scales, variants = args.scales, args.variants
    if args.device == "cpu":
        print("bench.py: timing on the CPU (the reference routing, every kernel from Python): each run takes minutes; a "
              "line per run as it ends", flush=True)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    print(head := header(args.device), flush=True)
    traces = None
    if args.profile:   # the traces' folder beside the record: bench.py's own (its manifest) or new, nothing else
        traces = os.path.join(os.path.dirname(os.path.abspath(args.output)), "traces")
        try:
            Path("out_dir", writes="bench traces").check(traces)
        except ValueError as e:
            sys.exit(f"bench.py: error: --profile writes {traces}, which {e}")
        os.makedirs(traces, exist_ok=True)
        write_atomic(os.path.join(traces, "traces.json"), json.dumps({"written_by": "bench.py --profile"}))
    rows = []
    for scale in scales:
        for variant in variants:
            try:
                row = bench_one(scale, variant, args.device, args.steps, args.warmup, args.compile, args.vocab,
                                traces, args.cuda_graph)
            except torch.OutOfMemoryError as e:
                print(f"{scale:5s} {variant:14s} out of memory: {str(e).splitlines()[0]}", flush=True)
                torch.cuda.empty_cache()
                continue
            ms = routing_ms(scale, variant, args.device, args.vocab) if cuda else None
            row["routing_ms"], row["routing_share"] = ms, (ms / row["step_ms"] if ms else None)
            rows.append(row)
            print(f"{scale:5s} {variant:14s} {row['tok_s']:>12,.0f} tok/s  {row['step_ms']:8.1f} ms/step  "
                  + (f"peak {row['peak_gb']:5.1f} GB  " if row["peak_gb"] is not None else "")
                  + (f"mfu {100 * row['mfu']:4.1f}%  " if row["mfu"] is not None else "")
                  + (f"routing {ms:6.2f} ms ({100 * row['routing_share']:.0f}%)" if ms else ""), flush=True)
    print(table(rows, scales, variants))
    if any("fused" in v or "block" in v for v in variants) and not rk.available(args.device):
        print(f"(the fused rows ran the reference routing: the fused kernels need CUDA, the device is {args.device})")
    write_json(args.output, "bench.py", header=head, args=vars(args), rows=rows)
    return rows


# -----------------------------------------------------------------------------
# 2. generation: python bench.py generate [--scale=100m] [--device=...]

def generate_parser():
    """bench.py generate's options, each with its kind and range (options.py)."""
    p = Parser(prog="bench.py generate", description=generate_main.__doc__)
    p.add_argument("--scale", type=Choice(*sorted(SCALES)), default="100m")
    p.add_argument("--device", type=Device(), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompt", type=Count(1, 2**16), default=512, help="prompt tokens")
    p.add_argument("--new", type=Count(1, 2**16), default=512, help="generated tokens")
    p.add_argument("--batch", type=Counts(1, 4096), default="1,16", help="comma-separated batch sizes")
    p.add_argument("--residual", type=Choice("baseline", "hyper", "attnres", "mhar"), default="mhar")
    p.add_argument("--output", type=Path("out_file", writes="bench record"), default="out/generate_bench.json", help="results JSON")
    return p


def generate_main(argv):
    """Tokens/s of GPT.generate: the KV cache with its CUDA-graphed decode step (the default on CUDA), the cache with
    eager steps, and no cache (random weights, greedy, bf16 autocast on CUDA)."""
    args = generate_parser().parse_args(argv)
    batches = args.batch
    kw, _ = scale_config(args.scale, 50304)
    model = GPT(GPTConfig(**{**kw, "residual": args.residual})).to(args.device).eval()
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ways = ([("cache, graph", True, True)] if cuda else []) + [("cache, eager", True, False), ("no cache", False, False)]
    rows = []
    for B in batches:
        prompt = torch.randint(0, model.cfg.vocab_size, (B, args.prompt), device=args.device)
        for name, use_cache, graph in ways:
            with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False):
                # warm-up at the timed shapes: the prefill, and steps on both sides of Triton's multiple-of-16 split
                timed(lambda: model.generate(prompt, 20, temperature=0, use_cache=use_cache, cuda_graph=graph), sync)
                s = timed(lambda: model.generate(prompt, args.new, temperature=0, use_cache=use_cache, cuda_graph=graph),
                          sync)
            rows.append(dict(scale=args.scale, residual=args.residual, batch=B, way=name, prompt=args.prompt,
                             new=args.new, seconds=s, tok_s=B * args.new / s))
            print(f"{args.scale} {args.residual} batch {B:3d} {name:12s} {B * args.new / s:10,.0f} tok/s "
                  f"({s:.2f} s for {args.new} tokens)", flush=True)
        print(f"  batch {B}: " + ", ".join(f"{r['way']} {r['tok_s'] / rows[-1]['tok_s']:.1f}x" for r in rows[-len(ways):-1])
              + " the tokens/s of no cache", flush=True)
    write_json(args.output, "bench.py", device=torch.cuda.get_device_name() if cuda else "cpu", rows=rows)
    return rows


# -----------------------------------------------------------------------------
# 3. several processes: torchrun --standalone --nproc_per_node=N bench.py ddp [...]

WAYS = ("none", "after", "overlap")


def ddp_parser():
    """bench.py ddp's options, each with its kind and range (options.py)."""
    p = Parser(prog="bench.py ddp", description=ddp_main.__doc__)
    p.add_argument("--scales", type=Names(*SCALES), default="100m,350m,1b", help=f"comma-separated subset of "
                   f"{','.join(SCALES)}")
    p.add_argument("--variants", type=Names(*VARIANTS), default="baseline,mhar_fused",
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--ways", type=Names(*WAYS), default=",".join(WAYS), help=f"comma-separated subset of {','.join(WAYS)}")
    p.add_argument("--accum", type=Count(0, 2**16), default=0, help="microbatches per step (0: the scale's global "
                   "batch / N)")
    p.add_argument("--bucket_mb", type=Real(0, 1e6, lo_open=True), default=25.0,
                   help="overlap: gradient bucket size (train.py --grad_bucket_mb)")
    add_step_options(p)
    p.add_argument("--device", type=Choice("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda: one GPU per process (NCCL); cpu: gloo")
    p.add_argument("--output", type=Path("out_file", writes="bench record"), default="out/bench_ddp.json", help="results JSON (rank 0)")
    return p


def ddp_args(argv):
    args = ddp_parser().parse_args(argv)
    if "overlap" in args.ways and (args.device == "cpu" or not args.cuda_graph):
        print("bench.py ddp: overlap runs in the graphs (train.py's grad_sync_plan); on eager steps it is the "
              "all-reduce after the backward", file=sys.stderr)
    if "RANK" not in os.environ:
        sys.exit("bench.py ddp: run it under torchrun, e.g. torchrun --standalone --nproc_per_node=8 bench.py ddp")
    return args


def ddp_main(argv):
    """The training step on N processes at the paper's global batch (each process: its share, in microbatches),
    with the gradient average done three ways in one process group: none (no communication: what the step would
    cost if it were free), after (train.py's default: one all-reduce after the step's graphs) and overlap
    (--grad_sync=overlap: bucketed all-reduces captured under the last microbatch's backward). The all-reduce's share
    of the step is 1 - none / after; the all-reduce alone is timed on the same gradients."""
    args = ddp_args(argv)
    cuda = args.device == "cuda"
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    dist.init_process_group("nccl" if cuda else "gloo", device_id=torch.device(device) if cuda else None)
    world, master = dist.get_world_size(), dist.get_rank() == 0
    say = print if master else (lambda *a, **k: None)
    dist.barrier()   # the communicator exists before any graph capture
    say(head := f"{header(device)} | {world} processes", flush=True)
    rows = []
    for scale in args.scales:
        spec = scale_spec(scale)
        accum = args.accum or spec["global_batch"] // (world * spec["micro_batch"])
        if not args.accum and accum * world * spec["micro_batch"] != spec["global_batch"]:
            sys.exit(f"bench.py ddp: {scale}'s global batch of {spec['global_batch']} sequences is not a multiple of "
                     f"{world} processes x microbatch {spec['micro_batch']}; pass --accum")
        for variant in args.variants:
            for way in args.ways:
                row = bench_one(scale, variant, device, args.steps, args.warmup, args.compile, args.vocab,
                                cuda_graph=args.cuda_graph, accum=accum,
                                grad_sync=None if way == "none" else way, bucket_mb=args.bucket_mb)
                rows.append(row)
                say(f"{scale:5s} {variant:14s} {way:8s} {world} x {accum} x {row['micro_batch']} x {row['seq_len']}: "
                    f"{row['step_ms']:8.1f} ms/step, {world * row['tok_s']:12,.0f} tok/s"
                    + (f"; the all-reduce alone {row['allreduce_ms']:.2f} ms ({row['grad_bytes'] / 1e9:.2f} GB)"
                       if "allreduce_ms" in row else ""), flush=True)
    say(ddp_table(rows, world))
    if master:
        write_json(args.output, "bench.py", header=head, args=vars(args), rows=rows)
    dist.destroy_process_group()
    return rows


def ddp_table(rows, world):
    """Per scale and variant: step time by way, the all-reduce's share of the step, overlap's gain, the all-reduce
    alone (with its bus bandwidth, NCCL's convention: bytes x 2 (N - 1) / N per second)."""
    lines = ["| scale | variant | step ms: none, after, overlap | all-reduce share (1 - none / after) | "
             "overlap: x the tok/s of after | all-reduce alone: ms, bus GB/s |", "|---|---|---|---|---|---|"]
    for key in dict.fromkeys((r["scale"], r["variant"]) for r in rows):
        by = {r["grad_sync"] or "none": r for r in rows if (r["scale"], r["variant"]) == key}
        ms = lambda w: by[w]["step_ms"] if w in by else None
        cell = lambda v, f: f.format(v) if v is not None else "-"
        share = 1 - ms("none") / ms("after") if ms("none") and ms("after") else None
        gain = ms("after") / ms("overlap") if ms("after") and ms("overlap") else None
        alone = by.get("after", {}).get("allreduce_ms")
        bus = by["after"]["grad_bytes"] * 2 * (world - 1) / world / (alone / 1e3) / 1e9 if alone and world > 1 else None
        lines.append(f"| {key[0]} | {key[1]} | {', '.join(cell(ms(w), '{:.1f}') for w in WAYS)} | "
                     f"{cell(share, '{:.1%}')} | {cell(gain, '{:.3f}x')} | {cell(alone, '{:.2f}')}, {cell(bus, '{:.0f}')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    run_script(main, "bench.py", "; no results file was written")
