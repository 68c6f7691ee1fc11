"""
Benchmarks: the training step (1), the routing chain alone (2), generation (3), the step on several processes (4).

1. The training step minus data and eval (nanoGPT's bench.py): tokens/s, MFU, peak memory and the routing share of
every residual variant at the paper's scales, in the layout of paper Tables 4 / 8 (throughput relative to our
baseline, memory in GB). Synthetic tokens over the paper's vocabulary (151,936, Qwen3), bf16 autocast, fp32
master weights, fused AdamW step and gradient clipping included, one microbatch per step (the paper's per-GPU
microbatch: 8 x 2048 / 4 x 1024 / 2 x 1024), its forward and backward replayed as a CUDA graph on a GPU
(graphs.GraphedMicrostep; --cuda_graph=False launches every kernel from Python, as the eager step does).

  python bench.py                                                   # 100m, 350m, 1b: every variant, one GPU
  python bench.py --scales=100m --variants=baseline,mhar_fused --steps=40 --profile
  python bench.py --scales=124m --variants=baseline,mhar_fused,attnres_fused   # paper Table 9's width control
  python bench.py --scales=tiny --device=cpu --steps=2 --compile=False     # CPU smoke test (CI)

Variants (sublayers compiled in all of them when --compile): baseline; mhar_eager (reference routing, eager);
mhar_compiled (reference routing under torch.compile); mhar_fused (routing_kernel.py, the width's launch settings
and backward); attnres_fused (single head, fused); mhar_block8, attnres_block8 (block routing, 8 blocks); mhar_site,
attnres_site / mhar_gather, attnres_gather (the fused chain with the site-pass backward / routing_gather.py's,
forced); hyper (dynamic hyper-connections, 4 streams). The routing share is the time of the routing chain alone at
the same shape (time_chain below; the fused chain replayed from a CUDA graph, i.e. GPU time) over the step time: an
estimate, since in the step the chain's launches overlap the sublayers' work. Peak memory: the most allocated during
the run, warm-up and graph capture included, above what the process held before it (each run starts from a
garbage-collected process and a reset torch.compile cache).

2. `python bench.py routing`: the routing chain alone (every site of a model, forward and backward, an elementwise
sublayer between sites), fused against the reference, at the paper's Table 5 shapes and training microbatches:
correctness against route_reference, GPU time (CUDA-graph replay) and eager wall time, GB/s by the design's byte model
(chain_bytes), per-kernel profile (--profile: at the training microbatches too); --shapes=NAMES picks shapes;
--heads=H routes every shape with H heads (1: the single head); --blocks=n times block routing (routing_block.py)
instead; --tune / --tune-train search the launch settings (routing_config.RoutingConfig), --check-large checks offsets
past 2^31 elements, --delta times the per-call kernels at an 8B delta model's shape, --authors=PATH and
--peers=fla,liger time ours beside the authors' kernel and the single-head kernels of fla-core and Liger-Kernel (when
installed). See `python bench.py routing -h`.

3. `python bench.py generate`: tokens/s of GPT.generate with and without the KV cache and its CUDA-graphed step.

4. `torchrun --standalone --nproc_per_node=8 bench.py ddp`: the step on N processes at the paper's global batch,
the gradients averaged three ways (none, after the graphs, overlapped with the backward): the all-reduce's share of
the step and what overlapping it buys. See `python bench.py ddp -h`.
"""
import argparse
import functools
import gc
import json
import math
import os
import platform
import sys
import time
from dataclasses import fields, replace

import torch
import torch.distributed as dist

import graphs
import routing_call
import routing_kernel as rk
import train
from model import GPT, BlockDepthHistory, GPTConfig, route_reference

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
    # the fused chain with each backward forced (mhar_fused / attnres_fused: the width's own, routing_config.TUNED_H200)
    "mhar_site": dict(residual="mhar", routing_impl="fused", backward="site"),          # the site pass + gather
    "attnres_site": dict(residual="attnres", routing_impl="fused", backward="site"),
    "mhar_gather": dict(residual="mhar", routing_impl="fused", backward="gather"),      # routing_gather.py's backward
    "attnres_gather": dict(residual="attnres", routing_impl="fused", backward="gather"),
    "hyper": dict(residual="hyper"),
}
PAPER_VOCAB = 151936


def scale_spec(scale):
    """A scale's shape, per-process microbatch and global batch (sequences per optimizer step)."""
    spec = SCALES[scale]
    if not isinstance(spec, tuple):
        return dict(spec, global_batch=2 * spec["micro_batch"])
    cfg = train.parse_args([os.path.join(os.path.dirname(os.path.abspath(__file__)), f) for f in spec])
    keys = ("n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden", "block_size", "micro_batch")
    return dict({k: getattr(cfg, k) for k in keys}, global_batch=cfg.batch_tokens // cfg.block_size)


def scale_config(scale, vocab):
    """(GPTConfig kwargs, micro_batch) of a scale: its config files' shape and microbatch."""
    spec = scale_spec(scale)
    micro_batch = spec.pop("micro_batch")
    spec.pop("global_batch")
    return dict(spec, vocab_size=vocab if scale != "tiny" else 1024), micro_batch


def forced_backward(d, H, backward):
    """The width's launch settings with the chain's backward forced ("site" or "gather": the *_site / *_gather
    variants), at every token count."""
    return replace(rk.config_for(d, H), backward=backward, gather_min_tokens=0)


def build(scale, variant, device, compile_model, vocab):
    kw, B = scale_config(scale, vocab)
    v = dict(VARIANTS[variant])
    compile_routing, backward = v.pop("compile_routing", True), v.pop("backward", None)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**kw, **v)).to(device)
    if backward:
        model.routing_config = forced_backward(model.cfg.n_embd, model.cfg.heads, backward)
    if compile_model:
        model.compile_sublayers()
        if not compile_routing:
            model._route = route_reference   # the reference routing stays eager
    opt = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), fused=device.startswith("cuda"))
    return model, opt, B


def bench_one(scale, variant, device, steps, warmup, compile_model, vocab, profile_dir=None, cuda_graph=False,
              accum=1, grad_sync=None, bucket_mb=25.0):
    """One variant's step timed (see the docstring). Under torchrun (bench.py ddp) a step is accum microbatches and
    grad_sync says how the processes average the gradients: None (they do not: the step without communication),
    "after" (graphs.sync_grads after the graphs, train.py's default) or "overlap" (graphs.OverlappedGradSync); the
    step time is the slowest process's."""
    cuda = device.startswith("cuda")
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch._dynamo.reset()   # each variant compiles afresh: no recompile limits or guards shared with earlier ones
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        held = torch.cuda.memory_allocated(device)   # left by earlier runs in this process (should be ~0)
        torch.cuda.reset_peak_memory_stats(device)
    model, opt, B = build(scale, variant, device, compile_model, vocab)
    T = model.cfg.block_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.cfg.vocab_size, (B, T + 1), generator=gen).to(device)
    inputs, targets = x[:, :-1], x[:, 1:]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    params = [p for p in model.parameters() if p.requires_grad]
    overlap = graphs.OverlappedGradSync(params, bucket_mb) if grad_sync == "overlap" else None
    graphed = graphs.GraphedMicrostep(model, autocast, loss_scale=1 / accum, grad_sync=overlap) if cuda_graph and cuda else None
    # eager steps zero their gradients (into the overlap's buffer, where they are its views); graphed ones overwrite
    zero_grad = None if graphed is not None else overlap.zero_grad if overlap is not None else \
        functools.partial(opt.zero_grad, set_to_none=True)

    def step():   # no host sync inside: the loss stays on the device
        for k in range(accum):
            if graphed is not None:
                loss = graphed(inputs, targets, first=k == 0, last=k == accum - 1)
                continue
            if overlap is not None:
                overlap.begin(last=k == accum - 1)
            with autocast:
                _, loss = model(inputs, targets)
            (loss / accum).backward()
            if overlap is not None:
                overlap.finish()
        train.optimizer_step(opt, params, 1.0, world=world if grad_sync == "after" else None, zero_grad=zero_grad)
        return loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):   # compilation, autotuning, allocator warm-up
        step()
    sync()   # peak memory spans the warm-up too: a replayed graph allocates nothing, its pool was allocated in capture
    times = []
    for _ in range(steps):   # one window per step; each closed by a sync
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
    if not torch.isfinite(loss):
        raise RuntimeError(f"{scale}/{variant}: non-finite loss {loss.item()}")
    step_s = sorted(times)[len(times) // 2]
    if world > 1:   # the slowest process sets the pace
        slowest = torch.tensor([step_s], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        step_s = slowest.item()
    tok_s = accum * B * T / step_s   # per process
    name = torch.cuda.get_device_name(device) if cuda else None
    row = dict(scale=scale, variant=variant, cuda_graph=graphed is not None, micro_batch=B, seq_len=T, tok_s=tok_s,
               accum=accum, world=world, grad_sync=grad_sync, grad_bytes=sum(p.numel() * p.element_size() for p in params),
               step_ms=1e3 * step_s, step_ms_min=1e3 * min(times), step_ms_each=[round(1e3 * t, 3) for t in times],
               mfu=model.estimate_mfu(tok_s, name, T),
               peak_gb=(torch.cuda.max_memory_allocated(device) - held) / 1e9 if cuda else None,
               reserved_gb=torch.cuda.max_memory_reserved(device) / 1e9 if cuda else None,
               held_before_gb=held / 1e9 if cuda else None,
               params=model.num_params(), loss=loss.item())
    if grad_sync == "after":   # the all-reduce alone, on gradients of the step's shapes
        for p in params:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad   # eager steps leave them unset
        row["allreduce_ms"] = 1e3 * median_time(lambda: graphs.sync_grads(params, world), sync, steps)
    if profile_dir:
        from torch.profiler import ProfilerActivity, profile
        os.makedirs(profile_dir, exist_ok=True)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []), record_shapes=True) as prof:
            for _ in range(3):
                step()
            sync()
        path = os.path.join(profile_dir, f"{scale}_{variant}")
        prof.export_chrome_trace(path + ".json")
        events = prof.key_averages()
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        with open(path + ".txt", "w") as f:   # where the time goes: kernels and ops by their own time
            f.write(events.table(sort_by=sort, row_limit=40, max_name_column_width=80))
            f.write("\n\nOperators by input shape (device time of the kernels each one launched):\n")
            f.write(prof.key_averages(group_by_input_shape=True).table(
                sort_by="device_time_total" if cuda else "cpu_time_total", row_limit=40, max_name_column_width=50,
                max_shapes_column_width=70))
        row["trace"] = path + ".json"
        if cuda:   # kernel time per step against the step's wall time: below it, the host is the bottleneck
            row["gpu_busy_ms"] = sum(e.self_device_time_total for e in events) / 1e3 / 3
    del model, opt, graphed, step, loss, params, overlap, zero_grad
    if cuda:   # the step closure, the graph wrapper and the compiled modules hold each other: free them now, or
        gc.collect()   # the next run's peak counts this run's weights, gradients and graph pool
        torch.cuda.empty_cache()
    return row


def median_time(fn, sync, n):
    """Median seconds of n calls of fn, each closed by sync."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2]


def routing_ms(scale, variant, device, vocab):
    """GPU time of the variant's routing chain alone at this shape (forward + backward), or None."""
    v = VARIANTS[variant]
    if v["residual"] not in ("attnres", "mhar"):
        return None
    if v["routing_impl"] == "fused" and not rk.available(torch.device(device)):
        return None
    kw, B = scale_config(scale, vocab)
    H = 1 if v["residual"] == "attnres" else kw["n_kv_head"]
    impl = "fused" if v["routing_impl"] == "fused" else "compiled" if v.get("compile_routing", True) else "eager"
    ref = torch.compile(route_reference, dynamic=True) if impl == "compiled" else None
    config = forced_backward(kw["n_embd"], H, v["backward"]) if "backward" in v else None
    ms, _ = time_chain(impl, 2 * kw["n_layer"] + 1, B, kw["block_size"], kw["n_embd"], H, device, ref, graph=impl == "fused",
                       config=config, blocks=v.get("route_blocks"))
    return ms


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


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["routing"]:
        return routing_main(argv[1:])
    if argv[:1] == ["generate"]:
        return generate_main(argv[1:])
    if argv[:1] == ["ddp"]:
        return ddp_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scales", default="100m,350m,1b", help=f"comma-separated subset of {','.join(SCALES)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (the median is reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, autotuning)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda | cuda:N | cpu")
    p.add_argument("--compile", default="True", choices=("True", "False"), help="torch.compile each sublayer")
    p.add_argument("--vocab", type=int, default=PAPER_VOCAB, help="vocabulary of the synthetic tokens (paper: 151,936)")
    p.add_argument("--profile", action="store_true", help="also write a torch.profiler trace of 3 steps per run")
    p.add_argument("--cuda_graph", default="True", choices=("True", "False"),
                   help="replay forward+backward as one CUDA graph (train.py --cuda_graph); CUDA only")
    p.add_argument("--output", default="out/bench.json", help="results JSON")
    args = p.parse_args(argv)
    scales = [s.strip() for s in args.scales.split(",") if s.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [s for s in scales if s not in SCALES] + [v for v in variants if v not in VARIANTS]
    if bad or not scales or not variants:
        sys.exit(f"bench.py: error: unknown scale/variant {bad}; scales: {','.join(SCALES)}; variants: {','.join(VARIANTS)}")
    if args.steps < 1 or args.warmup < 0:
        sys.exit(f"bench.py: error: --steps={args.steps} must be >= 1 and --warmup={args.warmup} >= 0")
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    header = (f"git {train.git_revision()} | torch {torch.__version__} | triton {triton_version} | "
              f"{torch.cuda.get_device_name(args.device) if cuda else platform.processor() or 'cpu'}")
    print(header, flush=True)
    rows = []
    for scale in scales:
        for variant in variants:
            try:
                row = bench_one(scale, variant, args.device, args.steps, args.warmup, args.compile == "True", args.vocab,
                                os.path.join(os.path.dirname(os.path.abspath(args.output)), "traces") if args.profile else None,
                                args.cuda_graph == "True")
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
                  + (f"routing {ms:6.2f} ms ({100 * row['routing_share']:.0f}%)" if ms else "")
                  + (" (the reference routing: the fused kernels need CUDA)" if "fused" in variant and not rk.available(args.device)
                     else ""),
                  flush=True)
    print(table(rows, scales, variants))
    if any("fused" in v for v in variants) and not rk.available(args.device):
        print(f"(the *_fused rows ran the reference routing: the fused kernels need CUDA, the device is {args.device})")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"header": header, "args": vars(args), "rows": rows}, f, indent=1)
    print(f"wrote {args.output}")
    return rows


# -----------------------------------------------------------------------------
# 3. generation: python bench.py generate [--scale=100m] [--device=...]

def generate_main(argv):
    """Tokens/s of GPT.generate: the KV cache with its CUDA-graphed decode step (the default on CUDA), the cache with
    eager steps, and no cache (random weights, greedy, bf16 autocast on CUDA)."""
    p = argparse.ArgumentParser(prog="bench.py generate", description=generate_main.__doc__)
    p.add_argument("--scale", default="100m", choices=sorted(SCALES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--new", type=int, default=512, help="generated tokens")
    p.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--residual", default="mhar", choices=("baseline", "hyper", "attnres", "mhar"))
    p.add_argument("--output", default="out/generate_bench.json", help="results JSON")
    args = p.parse_args(argv)
    batches = [int(x) for x in args.batch.split(",") if x.strip().isdigit()]
    if len(batches) != len(args.batch.split(",")) or min(batches + [args.prompt, args.new]) < 1:
        sys.exit(f"bench.py generate: error: --prompt={args.prompt}, --new={args.new} and --batch={args.batch!r} "
                 "must be positive integers (--batch: comma-separated)")
    kw, _ = scale_config(args.scale, 50304)
    model = GPT(GPTConfig(**{**kw, "residual": args.residual})).to(args.device).eval()
    cuda = args.device.startswith("cuda")
    ways = [("cache, graph", True, True)] if cuda else []
    ways += [("cache, eager", True, False), ("no cache", False, False)]
    rows = []
    for B in batches:
        prompt = torch.randint(0, model.cfg.vocab_size, (B, args.prompt), device=args.device)
        for name, use_cache, graph in ways:
            with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False):
                # warm-up at the timed shapes: the prefill, and steps on both sides of Triton's multiple-of-16 split
                model.generate(prompt, 20, temperature=0, use_cache=use_cache, cuda_graph=graph)
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                model.generate(prompt, args.new, temperature=0, use_cache=use_cache, cuda_graph=graph)
                if cuda:
                    torch.cuda.synchronize()
            s = time.perf_counter() - t0
            rows.append(dict(scale=args.scale, residual=args.residual, batch=B, way=name, prompt=args.prompt,
                             new=args.new, seconds=s, tok_s=B * args.new / s))
            print(f"{args.scale} {args.residual} batch {B:3d} {name:12s} {B * args.new / s:10,.0f} tok/s "
                  f"({s:.2f} s for {args.new} tokens)", flush=True)
        base = rows[-1]["tok_s"]
        print(f"  batch {B}: " + ", ".join(f"{r['way']} {r['tok_s'] / base:.1f}x" for r in rows[-len(ways):-1]) +
              " the tokens/s of no cache", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if cuda else "cpu", "rows": rows}, f, indent=1)
    return rows


# -----------------------------------------------------------------------------
# 2. the routing chain alone: python bench.py routing [...]

# (name, L, d, H, B, T): the paper's Table 5 shapes, then each model's training microbatch (Table 1; 124M: Table 9's
# width control at the 100M microbatch)
CHAIN_SHAPES = [("100M", 12, 512, 4, 2, 2048), ("350M", 24, 1024, 8, 1, 1024), ("1B", 36, 1280, 8, 1, 1024),
                ("100M-train", 12, 512, 4, 8, 2048), ("124M-train", 12, 768, 4, 8, 2048),
                ("350M-train", 24, 1024, 8, 4, 1024), ("1B-train", 36, 1280, 8, 2, 1024)]
# every setting DEFAULT and TUNED_H200 ship is a candidate, so a retune can find them again (a test checks it). (A
# gather of one or two tokens on 2 or 4 warps at d 512 / 768 took the chain 1.10-1.39x when leading: not one.)
TUNE_CANDIDATES = [(512, 1, 3), (512, 1, 4), (1024, 1, 3), (1024, 2, 3), (1024, 2, 4), (1024, 4, 3), (2048, 4, 3),
                   (4096, 4, 3), (4096, 4, 4), (4096, 8, 3), (8192, 8, 3), (8192, 8, 4), (16384, 8, 3)]
# gather_bwd, gather_bwd_lead, gather_logits: routing_gather's backward (tuned with it on; gather_logits from
# LOGIT_CHOICES); "backward": which of the two runs, chosen last (after both backwards' settings) from BACKWARDS on
# time alone (the gather backward holds ~0.7 GB more at the training microbatches: its fp32 site outputs)
# fwd_lead_sites: how many sites a leading forward runs (LEAD_SITES), tuned after fwd_lead's tile
CHAIN_KERNELS = ("fwd", "site", "pairs", "gather", "fwd_lead", "fwd_lead_sites", "gather_lead", "gather_bwd",
                 "gather_bwd_lead", "gather_logits", "backward")
FWD_KERNELS = ("fwd", "fwd_lead", "fwd_lead_sites")   # the others run in one backward or the other
BLOCK_KERNELS = ("block_fwd", "block_bwd", "block_waves")   # block routing's (routing_block.py; --blocks)
# block_waves' candidates, the backward's persistent programs per multiprocessor: up to 32, for one-warp programs (the
# single head's tuned tile at d 1280: 2 a multiprocessor would leave it 2 warps to hide memory latency with)
BLOCK_WAVES = (1, 2, 4, 8, 16, 32)
BACKWARDS = ("site", "gather")
LOGIT_CHOICES = (False, True)   # gather_logits: the gathers recompute each pair's logit, or load the forward's
LEAD_SITES = (1, 2, 3)


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
    "fused" (routing_kernel.FusedRouter), "authors" (the authors' fused kernel, `authors` its module: load_authors),
    "fla" / "liger" (a single-head peer, `authors` its routing call: load_peers; H must be 1), else the reference
    route_fn over the stacked history. blocks = n: block routing over the N - 1 sublayers in n blocks (fused:
    routing_block.BlockChain; else model.BlockDepthHistory, route_fn over each site's stacked sources)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    src = torch.randn(B, T, d, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    qs = [(torch.randn(d, device=device, generator=gen) * 0.5).requires_grad_(True) for _ in range(N)]
    gs = [torch.ones(d, device=device, requires_grad=True) for _ in range(N)]
    up = torch.randn(B, T, d, device=device, dtype=torch.bfloat16, generator=gen)
    shift = torch.randn(B, T, d, device=device, dtype=torch.bfloat16, generator=gen)
    router = rk.FusedRouter(N, H, 1e-6, config, blocks)

    def step():
        if blocks and impl != "fused":
            hist = BlockDepthHistory(range(N), (N - 1) // blocks,
                                     lambda j, srcs: route_fn(torch.stack(srcs), qs[j], gs[j], H, 1e-6))
            out = run_chain(lambda j, x: hist.route(x), src, N, lambda j, x: x + shift)
        elif impl == "fused":   # full or block routing
            chain = router.start(src, qs, gs)
            out = run_chain(lambda j, x: chain.route(j, x, qs[j - 1], gs[j - 1]), src, N, lambda j, x: x + shift)
        elif impl == "authors":   # their context: a source buffer per pass; one launch per site forward, one backward
            ctx = authors.MHARFusedContext(N, src)
            out = run_chain(lambda j, x: authors._FusedMHARFn.apply(x, qs[j - 1], gs[j - 1], ctx, H, 1e-6), src, N,
                            lambda j, x: x + shift)
        elif impl in PEERS:   # single head: query q, key-norm weight g, as ours at H = 1; fla a list, Liger a stack
            hist = []
            call = (lambda j: authors(qs[j - 1], tuple(hist), gs[j - 1], rms_eps=1e-6)) if impl == "fla" else \
                (lambda j: authors.apply(torch.stack(hist), qs[j - 1], gs[j - 1], 1e-6))
            out = run_chain(lambda j, x: hist.append(x) or call(j), src, N, lambda j, x: x + shift)
        else:
            hist = []
            out = run_chain(lambda j, x: hist.append(x) or route_fn(torch.stack(hist), qs[j - 1], gs[j - 1], H), src, N,
                            lambda j, x: x + shift)
        out.backward(up)
        step.out = out.detach()
    step.router = router
    return step


def _peak_gb(step):
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
    mem = _peak_gb(step)
    return do_bench(graphed(step) if graph else step, warmup=50, rep=300, return_mode="median"), mem


def chain_grads(impl, src0, qs, gs, sublayer, up, H, config=None, blocks=None):
    """A chain of len(qs) sites from src0, fused or reference (blocks = n: block routing's): its output and every
    gradient of <out, up>, in float64: [out, d src0, dq of every site (concatenated), dg of every site]."""
    N = len(qs)
    s0 = src0.clone().requires_grad_(True)
    q = [x.clone().requires_grad_(True) for x in qs]
    g = [x.clone().requires_grad_(True) for x in gs]
    if impl == "fused":
        chain = rk.FusedRouter(N, H, 1e-6, config, blocks).start(s0, q, g)
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
    one-hot softmaxes whose bf16 chain moves by ~1 (relative, gradients) under any change of rounding (the reference's
    own bf16 against fp32: 0.95 at d 1024, H 1, 49 sites, 1,024 tokens; 0.065 with the scaling), so the check would
    measure nothing; every MHAR width keeps 0.5."""
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


def check_large(device, config=None):
    """Forward + backward over 2 sites at 2^21 tokens x d 1024 (offsets past 2^31); compare the last rows."""
    M, d, H = 2**21, 1024, 8
    src = torch.randn(1, M, d, device=device, dtype=torch.bfloat16)
    q = [torch.randn(d, device=device) for _ in range(2)]
    g = [torch.ones(d, device=device) for _ in range(2)]
    s0 = src.clone().requires_grad_(True)
    chain = rk.FusedRouter(2, H, 1e-6, config).start(s0, q, g)
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
    return do_bench(step, warmup=1, rep=1, return_mode="median"), _peak_gb(step)


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
            key = next((k for k in ("_chain_fwd", "_chain_bwd_site", "_chain_bwd_gather", "_gather_bwd", "_dw_terms",
                                    "_block_fwd", "_block_bwd") if k in e.key),
                       "other")   # _gather_bwd, _dw_terms: routing_gather.py's backward; _block_*: routing_block.py
            total[key], launches = total.get(key, 0.0) + t / 1e3, launches + e.count
    return dict({k: round(v, 3) for k, v in sorted(total.items())}, launches=launches)


def load_authors(path):
    """The authors' fused routing (their repository's Attention-Residuals/mhar_triton.py), from a copy the user keeps:
    this repository does not ship it."""
    import importlib.util
    if not os.path.isfile(path):
        sys.exit(f"bench.py routing: --authors={path}: no such file; pass your copy of the authors' mhar_triton.py")
    spec = importlib.util.spec_from_file_location("authors_mhar_triton", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = [name for name in ("MHARFusedContext", "_FusedMHARFn") if not hasattr(module, name)]
    if missing:
        sys.exit(f"bench.py routing: --authors={path} has no {', '.join(missing)}: not the authors' mhar_triton.py")
    return module


# the single-head peers bench.py routing --peers can time: package, module, routing call, how to install it
PEERS = {"fla": ("fla-core", "fla.ops.attnres", "fused_attnres"),
         "liger": ("liger-kernel", "liger_kernel.ops.attn_res", "LigerAttnResFunction")}


def load_peers(names):
    """The routing calls of the single-head peers named (comma-separated), from the packages the user installed: this
    repository neither requires nor ships them."""
    import importlib
    peers, unknown = {}, [name for name in names.split(",") if name not in PEERS]
    if unknown:
        sys.exit(f"bench.py routing: --peers={names}: unknown peer {unknown[0]!r}; choose from {', '.join(PEERS)}")
    for name in names.split(","):
        package, module, call = PEERS[name]
        try:
            peers[name] = getattr(importlib.import_module(module), call)
        except ImportError as e:
            sys.exit(f"bench.py routing: --peers={name}: cannot import {module} ({e}); pip install {package}, or leave "
                     f"{name} out")
    if "fla" in peers:   # (measured on an H200: 4+ minutes at the 1B Table 5 shape alone)
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
        bound_ms = chain_bytes(N, B * T, d) / copy_bw / 1e6
        steps = {impl: chain_step(impl, N, B, T, d, H, device, authors=others.get(impl)) for impl in ("fused", *others)}
        ref = chain_step("reference", N, B, T, d, H, device)
        ref()
        row, eager = dict(shape=name, heads=H, bound_ms=bound_ms), {impl: [] for impl in steps}
        for impl, step in steps.items():
            step()
            step.router.chain = None   # our chain's buffers count in the peak, as the others' per-pass buffers do
            row[f"{impl}_peak_gb"] = _peak_gb(step)
            row[f"{impl}_graph_ms"] = do_bench(graphed(step), warmup=50, rep=300, return_mode="median")
            row[f"{impl}_out_rel_err"] = ((step.out.float() - ref.out.float()).abs().max() /
                                          ref.out.float().abs().max()).item()
        for _ in range(rounds):
            for impl, step in steps.items():
                eager[impl].append(do_bench(step, warmup=25, rep=200, return_mode="median"))
        for impl in steps:
            row[f"{impl}_eager_ms"] = sorted(eager[impl])[rounds // 2]
            row[f"{impl}_eager_all"] = eager[impl]
        rows.append(row)
        for other in others:
            print(f"{name:11s} H={H} {other:7s} | eager {row['fused_eager_ms']:6.2f} / {row[other + '_eager_ms']:6.2f} ms"
                  f" = {row[other + '_eager_ms'] / row['fused_eager_ms']:4.2f}x | graph {row['fused_graph_ms']:6.2f} / "
                  f"{row[other + '_graph_ms']:6.2f} ms = {row[other + '_graph_ms'] / row['fused_graph_ms']:4.2f}x | peak "
                  f"{row['fused_peak_gb']:.2f} / {row[other + '_peak_gb']:.2f} GB | of bound (graph) "
                  f"{100 * bound_ms / row['fused_graph_ms']:4.1f}% / {100 * bound_ms / row[other + '_graph_ms']:4.1f}% | "
                  f"max error against the reference {row['fused_out_rel_err']:.1e} / {row[other + '_out_rel_err']:.1e}",
                  flush=True)
    return rows


def host_profile(device, steps=20):
    """Where the eager chain's host time goes: the host time to queue one chain forward + backward at every shape
    (median of `steps`, the GPU drained before each), per site; then a Python profile of the 100M Table 5 chain."""
    import cProfile
    import pstats
    for name, L, d, H, B, T in CHAIN_SHAPES:
        N = 2 * L + 1
        step = chain_step("fused", N, B, T, d, H, device)
        times = []
        for i in range(steps + 3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        ms = sorted(times[3:])[steps // 2] * 1e3
        print(f"host {name:11s} {ms:6.2f} ms to queue one chain = {1e3 * ms / N:5.0f} us per site", flush=True)
        if name == "100M":
            prof = cProfile.Profile()
            torch.cuda.synchronize()
            prof.enable()
            for _ in range(5):
                step()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def chain_pairs(N, blocks=None):
    """(source, site) pairs of a chain of N sites: full routing's N (N + 1) / 2, or block routing's (n blocks of the
    N - 1 sublayers: site j reads the completed blocks, the embedding one of them, and the open block's partial sum)."""
    if not blocks:
        return N * (N + 1) // 2
    P = (N - 1) // blocks
    return sum(1 + (j - 1) // P + ((j - 1) % P != 0) for j in range(1, N + 1))


def chain_bytes(N, tokens, d, blocks=None):
    """The bf16 bytes a chain must move at least, by each design's own model, before any read sharing: full routing
    (routing_gather.py's header) 2 reads of every (source, site) pair's M x d, the forward's and the gather's, and 5
    passes a site (its fp32 output written and read, its source read again for dw), 2 x pairs + 5 N passes in all (the
    site-pass backward's 3 x pairs is more); block routing's kernels (routing_block.py's header) c + 3 passes over M x d
    forward and 3c + 2 backward for a site of c sources, 4 x pairs + 5 N passes in all."""
    passes = (2 * chain_pairs(N) if not blocks else 4 * chain_pairs(N, blocks)) + 5 * N
    return 2 * passes * tokens * d


def tune_configs(kernels, shapes, per_shape, device, candidates=TUNE_CANDIDATES, blocks=None):
    """Coordinate descent over each kernel's (tile, warps, stages) on chain GPU time (graph replay): from DEFAULT, the
    best geometric mean over all shapes (per_shape=False); or from config_for(d, H), the best at each shape; _lead
    kernels may also pick None (no pairing); blocks = n: block routing's chain (its kernels, BLOCK_KERNELS; block_bwd
    and block_waves over their product when both are asked for: one at a time stopped 0.8 ms short at 1B).
    Returns the configs and prints what changed, for RoutingConfig's defaults or a TUNED_H200 entry."""
    joint = "block_bwd" in kernels and "block_waves" in kernels   # the block backward's tile x its programs
    settings = lambda kernel, cand: dict(zip(("block_bwd", "block_waves"), cand)) if joint and kernel == "block_bwd" \
        else {kernel: cand}
    tuned = []
    for group in ([[s] for s in shapes] if per_shape else [shapes]):
        _, _, d, H, _, _ = group[0]
        cfg = rk.config_for(d, H) if per_shape else rk.DEFAULT
        for kernel in kernels:
            if joint and kernel == "block_waves":
                continue
            results, seen = [], set()
            for cand in BACKWARDS if kernel == "backward" else LOGIT_CHOICES if kernel == "gather_logits" else \
                    LEAD_SITES if kernel == "fwd_lead_sites" else \
                    BLOCK_WAVES if kernel == "block_waves" else \
                    [(c, w) for c in candidates for w in BLOCK_WAVES] if joint and kernel == "block_bwd" else \
                    candidates + ([None] if kernel.endswith("_lead") else []):
                key = cand[:1] if kernel == "pairs" and cand else cand   # the pair pass runs in the gather: its tile only
                if key in seen:
                    continue
                seen.add(key)
                # a kernel is timed in the backward that runs it (the site pass's: "site"; _bwd, gather_logits: "gather")
                backward = ({"backward": "gather" if "bwd" in kernel or kernel == "gather_logits" else "site"}
                            if kernel not in FWD_KERNELS + BLOCK_KERNELS + ("backward",) else {})
                trial = replace(cfg, **settings(kernel, cand), **backward)
                try:
                    times = [time_chain("fused", 2 * L + 1, B, T, dd, HH, device, graph=True, config=trial,
                                        blocks=blocks)[0] for _, L, dd, HH, B, T in group]
                except Exception as e:   # e.g. out of shared memory or registers: skip the candidate
                    print(f"tune {kernel:11s} {cand}: failed: {str(e)[:200]}")
                    continue
                results.append((math.prod(times) ** (1 / len(times)), str(cand), cand))
                print(f"tune {kernel:11s} {str(cand):16s} " + " | ".join(f"{s[0]} {t:6.2f} ms" for s, t in zip(group, times)),
                      flush=True)
            cfg = replace(cfg, **settings(kernel, min(results)[2]))
        changed = {f.name: getattr(cfg, f.name) for f in fields(cfg)
                   if f.name != "name" and getattr(cfg, f.name) != getattr(rk.DEFAULT, f.name)}
        print(f"tuned {'(%d, %d)' % (d, H) if per_shape else 'DEFAULT'}: {changed}", flush=True)
        tuned.append(cfg)
    return tuned


def routing_main(argv):
    p = argparse.ArgumentParser(prog="bench.py routing", description="The routing chain alone (see bench.py's docstring).")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda | cpu (a check only)")
    p.add_argument("--tune", nargs="?", const="site,gather,fwd,pairs", default=None, metavar="KERNELS",
                   help="tune DEFAULT's settings at the Table 5 shapes (comma-separated kernels)")
    p.add_argument("--tune-train", nargs="?", const=",".join(CHAIN_KERNELS), default=None, metavar="KERNELS",
                   help="tune each width's settings at its training microbatch, lead kernels and the backward "
                   "(site or gather) included")
    p.add_argument("--check-large", action="store_true", help="also check 2^21 tokens x d 1024 (64-bit offsets)")
    p.add_argument("--delta", action="store_true", help="time the per-call kernels at an 8B delta model's shape, then exit")
    p.add_argument("--cpu-profile", action="store_true",
                   help="where the eager chain's host time goes (host time per site, a Python profile), then exit")
    p.add_argument("--check-only", action="store_true", help="only the correctness checks, then exit")
    p.add_argument("--peers", metavar="NAMES", help="side by side with single-head peers you installed, e.g. fla,liger "
                   "(fla-core's fused_attnres, Liger-Kernel's LigerAttnResFunction): ours at H = 1, same measures as "
                   "--authors; then exit")
    p.add_argument("--authors", metavar="PATH", help="side by side with the authors' fused kernel (your copy of their "
                   "mhar_triton.py): eager and CUDA-graph time, memory, fraction of the bandwidth bound; then exit")
    p.add_argument("--blocks", type=int, default=None, metavar="N",
                   help="block routing in N blocks (routing_block.py) at every chain shape: its time and profile, and "
                   f"--tune-train of {', '.join(BLOCK_KERNELS)} on it (N must divide every shape's 2L sublayers)")
    p.add_argument("--heads", type=int, default=None, metavar="H",
                   help="route every chain shape (checks, timing and tuning) with H heads instead of its own (1: the "
                   "single head)")
    p.add_argument("--shapes", metavar="NAMES", default=",".join(s[0] for s in CHAIN_SHAPES),
                   help="comma-separated chain shapes to time, tune and compare (default: all)")
    p.add_argument("--profile", action="store_true", help="GPU time per kernel at every shape (default: the Table 5 "
                   "shapes only)")
    p.add_argument("--output", default="out/routing_bench.json", help="results JSON")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.shapes.split(",") if n.strip()]
    unknown = [n for n in names if n not in {s[0] for s in CHAIN_SHAPES}]
    if unknown or not names:
        sys.exit(f"bench.py routing: --shapes={args.shapes}: unknown shape {', '.join(unknown) or '(none given)'}; "
                 f"choose from {','.join(s[0] for s in CHAIN_SHAPES)}")
    by_name = {s[0]: s for s in CHAIN_SHAPES}   # in the order given (a slow peer's shape can go last), once each
    chain_shapes = [(name, L, d, H if args.heads is None else args.heads, B, T)
                    for name, L, d, H, B, T in (by_name[n] for n in dict.fromkeys(names))]
    kernels = (args.tune_train or args.tune or "").split(",")
    if args.blocks and args.tune_train == ",".join(CHAIN_KERNELS):   # --tune-train's default: the block chain's kernels
        kernels = list(BLOCK_KERNELS)
    allowed = BLOCK_KERNELS if args.blocks else CHAIN_KERNELS
    if (args.tune or args.tune_train) and any(k not in allowed for k in kernels):
        sys.exit(f"bench.py routing: --tune[-train]=KERNEL[,KERNEL]: one of {', '.join(allowed)}")
    if args.blocks is not None and (args.authors or args.peers or args.delta or args.cpu_profile):
        sys.exit("bench.py routing: --blocks times this repo's block chain alone: drop --authors, --peers, --delta and "
                 "--cpu-profile (they time full routing or delta mode)")
    sublayers = sorted({2 * L for _, L, _, _, _, _ in chain_shapes})
    if args.blocks is not None and (args.blocks < 1 or math.gcd(*sublayers) % args.blocks):
        sys.exit(f"bench.py routing: --blocks={args.blocks} must divide every chain shape's sublayers (2 x n_layer: "
                 f"{', '.join(map(str, sublayers))}): give a divisor of {math.gcd(*sublayers)}, e.g. 8")
    heads_fit = lambda d, H: H >= 1 and d % H == 0 and d // H >= 16   # the kernels' envelope (check_envelope)
    for name, _, d, H, _, _ in chain_shapes:
        if not heads_fit(d, H):
            sys.exit(f"bench.py routing: --heads={H} does not fit the {name} shape's width d={d} (H must divide d with "
                     f"d/H >= 16)")
    authors, peers = load_authors(args.authors) if args.authors else None, load_peers(args.peers) if args.peers else None
    device = args.device
    if device == "cpu" and not rk.available("cpu"):
        sys.exit("bench.py routing: no CUDA device; run with TRITON_INTERPRET=1 for Triton's CPU interpreter")
    # correctness: an awkward shape, and the paper's on a GPU (--blocks: block routing's chain, also at the 100M training
    # microbatch, where each backward program visits ~30 token blocks)
    shapes = [(13 if args.blocks else 5, 1, 33, 96, 4, torch.float32)]
    if device.startswith("cuda"):
        shapes += [(25, 2, 2048, 512, 4, torch.bfloat16), (49, 1, 1024, 1024, 8, torch.bfloat16),
                   (73, 1, 1024, 1280, 8, torch.bfloat16)]
        shapes += [(25, 8, 2048, 512, 4, torch.bfloat16)] if args.blocks else []
    for N, B, T, d, H, dtype in shapes:
        H = args.heads if args.heads and heads_fit(d, args.heads) else H   # --heads where it fits
        blocks = args.blocks and math.gcd(N - 1, args.blocks)
        errs = check_against_reference(N, B, T, d, H, dtype, device, blocks=blocks)
        print(f"check N={N} B={B} T={T} d={d} H={H} {str(dtype):15s}" + (f" blocks={blocks}" if blocks else "") + " " +
              " ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    if not device.startswith("cuda") or args.check_only:
        return None
    if args.check_large:
        print("check 2^21 tokens:", check_large(device), flush=True)
    from triton.testing import do_bench
    x = torch.empty(2**28, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    copy_bw = 2 * x.numel() * 2 / do_bench(lambda: y.copy_(x), return_mode="median") / 1e6   # GB/s, read + written
    header = (f"git {train.git_revision()} | {torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
              f"{__import__('triton').__version__} | device-to-device copy {copy_bw:.0f} GB/s")
    print(header)
    del x, y
    rows = []
    if authors or peers:
        for others in ([{"authors": authors}] if authors else []) + ([peers] if peers else []):
            print(f"side by side, ours / {' / '.join(others)} (same inputs, this process); x = how many times faster ours "
                  "is", flush=True)
            rows += side_by_side(others, device, copy_bw, shapes=chain_shapes)
    elif args.cpu_profile:
        host_profile(device)
    elif args.delta:
        for impl in ("fused", "reference-ckpt"):
            t, mem = time_delta(impl, device)
            rows.append(dict(shape="8B-delta", impl=impl, ms=t, peak_gb=mem))
            print(f"8B delta   {impl:15s} {t:8.1f} ms  peak {mem:.2f} GB  (64 sites, H 8, 2 x 4096 tokens, d 4096)", flush=True)
        print(f"fused is {rows[1]['ms'] / rows[0]['ms']:.2f}x faster than the checkpointed reference")
    else:
        if args.tune or args.tune_train:
            per_shape = args.tune_train is not None
            tune_configs(kernels, [s for s in chain_shapes if s[0].endswith("train") == per_shape], per_shape, device,
                         blocks=args.blocks)
        ref_compiled = torch.compile(route_reference, dynamic=True)
        for name, L, d, H, B, T in chain_shapes:
            N = 2 * L + 1
            model = "4c + 5 passes a site" if args.blocks else "2c + 5 passes a site"
            for impl in ("fused", "fused-graph") + (() if name.endswith("train") else ("compiled", "eager")):
                t, mem = time_chain(impl.split("-")[0], N, B, T, d, H, device, ref_compiled, graph=impl.endswith("graph"),
                                    blocks=args.blocks)
                gbps = chain_bytes(N, B * T, d, args.blocks) / t / 1e6
                rows.append(dict(shape=name, heads=H, impl=impl, ms=t, gbps=gbps, copy_frac=gbps / copy_bw, peak_gb=mem))
                print(f"{name:11s} H={H:<2d} {impl:11s} {t:8.2f} ms  {gbps:6.0f} GB/s ({model}, "
                      f"{100 * gbps / copy_bw:4.1f}% of copy)  peak {mem:.2f} GB", flush=True)
            if args.profile or not name.endswith("train"):
                try:
                    print(f"{name:11s} fused kernels (profiler, ms): "
                          f"{profile_chain(N, B, T, d, H, device, blocks=args.blocks)}", flush=True)
                except Exception as e:   # the profiler's event fields move between torch versions
                    print(f"profiler failed: {e!r}")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"header": header, "copy_gbps": copy_bw, "rows": rows}, f, indent=1)
    print(f"wrote {args.output}")
    return rows


# -----------------------------------------------------------------------------
# 4. several processes: torchrun --standalone --nproc_per_node=N bench.py ddp [...]

WAYS = ("none", "after", "overlap")


def ddp_main(argv):
    """The training step on N processes at the paper's global batch (each process: its share, in microbatches),
    with the gradient average done three ways in one process group: none (no communication: what the step would
    cost if it were free), after (train.py's default: one all-reduce after the step's graphs) and overlap
    (--grad_sync=overlap: bucketed all-reduces captured under the last microbatch's backward). The all-reduce's share
    of the step is 1 - none / after; the all-reduce alone is timed on the same gradients."""
    p = argparse.ArgumentParser(prog="bench.py ddp", description=ddp_main.__doc__)
    p.add_argument("--scales", default="100m,350m,1b", help=f"comma-separated subset of {','.join(SCALES)}")
    p.add_argument("--variants", default="baseline,mhar_fused", help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated subset of {','.join(WAYS)}")
    p.add_argument("--accum", type=int, default=0, help="microbatches per step (0: the scale's global batch / N)")
    p.add_argument("--bucket_mb", type=float, default=25.0, help="overlap: gradient bucket size (train.py --grad_bucket_mb)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (the median is reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, autotuning, capture)")
    p.add_argument("--compile", default="True", choices=("True", "False"), help="torch.compile each sublayer")
    p.add_argument("--cuda_graph", default="True", choices=("True", "False"), help="CUDA-graph microsteps (CUDA only)")
    p.add_argument("--vocab", type=int, default=PAPER_VOCAB, help="vocabulary of the synthetic tokens (paper: 151,936)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"),
                   help="cuda: one GPU per process (NCCL); cpu: gloo")
    p.add_argument("--output", default="out/bench_ddp.json", help="results JSON (rank 0)")
    args = p.parse_args(argv)
    pick = lambda text: [v.strip() for v in text.split(",") if v.strip()]
    scales, variants, ways = pick(args.scales), pick(args.variants), pick(args.ways)
    bad = [v for v in scales if v not in SCALES] + [v for v in variants if v not in VARIANTS] + [v for v in ways if v not in WAYS]
    if bad or not (scales and variants and ways):
        sys.exit(f"bench.py ddp: error: unknown scale/variant/way {bad}; scales: {','.join(SCALES)}; variants: "
                 f"{','.join(VARIANTS)}; ways: {','.join(WAYS)}")
    if "RANK" not in os.environ:
        sys.exit("bench.py ddp: run it under torchrun, e.g. torchrun --standalone --nproc_per_node=8 bench.py ddp")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = args.device == "cuda"
    device = f"cuda:{local_rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    dist.init_process_group("nccl" if cuda else "gloo", device_id=torch.device(device) if cuda else None)
    world, master = dist.get_world_size(), dist.get_rank() == 0
    say = print if master else (lambda *a, **k: None)
    dist.barrier()   # the communicator exists before any graph capture
    header = (f"git {train.git_revision()} | torch {torch.__version__} | {world} x "
              f"{torch.cuda.get_device_name(device) if cuda else platform.processor() or 'cpu'}")
    say(header, flush=True)
    rows = []
    for scale in scales:
        spec = scale_spec(scale)
        accum = args.accum or spec["global_batch"] // (world * spec["micro_batch"])
        if not args.accum and accum * world * spec["micro_batch"] != spec["global_batch"]:
            sys.exit(f"bench.py ddp: {scale}'s global batch of {spec['global_batch']} sequences is not a multiple of "
                     f"{world} processes x microbatch {spec['micro_batch']}; pass --accum")
        for variant in variants:
            for way in ways:
                row = bench_one(scale, variant, device, args.steps, args.warmup, args.compile == "True", args.vocab,
                                cuda_graph=args.cuda_graph == "True", accum=accum,
                                grad_sync=None if way == "none" else way, bucket_mb=args.bucket_mb)
                rows.append(row)
                say(f"{scale:5s} {variant:14s} {way:8s} {world} x {accum} x {row['micro_batch']} x {row['seq_len']}: "
                    f"{row['step_ms']:8.1f} ms/step, {world * row['tok_s']:12,.0f} tok/s"
                    + (f"; the all-reduce alone {row['allreduce_ms']:.2f} ms ({row['grad_bytes'] / 1e9:.2f} GB)"
                       if "allreduce_ms" in row else ""), flush=True)
    say(ddp_table(rows, world))
    if master:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump({"header": header, "args": vars(args), "rows": rows}, f, indent=1)
        print(f"wrote {args.output}")
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
    main()
