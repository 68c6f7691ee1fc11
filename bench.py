"""
The training step minus data and eval (nanoGPT's bench.py): tokens/s, MFU, peak memory and the routing share of
every residual variant at the paper's scales, in the layout of paper Tables 4 / 8 (throughput relative to our
baseline, memory in GB). Synthetic tokens over the paper's vocabulary (151,936, Qwen3), bf16 autocast, fp32
master weights, fused AdamW step and gradient clipping included, one microbatch per step (the paper's per-GPU
microbatch: 8 x 2048 / 4 x 1024 / 2 x 1024), its forward and backward replayed as a CUDA graph on a GPU
(train.GraphedMicrostep; --cuda_graph=False launches every kernel from Python, as the eager step does).

  python bench.py                                                   # every scale and variant, one GPU
  python bench.py --scales=100m --variants=baseline,mhar_fused --steps=40 --profile
  python bench.py --scales=tiny --device=cpu --steps=2 --compile=False     # CPU smoke test (CI)

Variants (sublayers compiled in all of them when --compile): baseline; mhar_eager (reference routing, eager);
mhar_compiled (reference routing under torch.compile); mhar_fused (routing_kernel.py); attnres_fused (single
head, fused); hyper (dynamic hyper-connections, 4 streams). The routing share is the time of the routing chain
alone at the same shape (routing_kernel.time_chain; the fused chain replayed from a CUDA graph, i.e. GPU time)
over the step time: an estimate, since in the step the chain's launches overlap the sublayers' work. Peak memory:
the most allocated during the run, warm-up and graph capture included, above what the process held before it
(each run starts from a garbage-collected process and a reset torch.compile cache).
"""
import argparse
import gc
import json
import os
import platform
import sys
import time

import torch

import train
from model import GPT, GPTConfig, route_reference

SCALES = {"100m": "config/train_100m.py", "350m": "config/train_350m.py", "1b": "config/train_1b.py",
          "tiny": dict(n_layer=2, n_head=2, n_kv_head=1, n_embd=64, ffn_hidden=128, block_size=64, micro_batch=2)}
VARIANTS = {
    "baseline": dict(residual="baseline"),
    "mhar_eager": dict(residual="mhar", routing_impl="reference", compile_routing=False),
    "mhar_compiled": dict(residual="mhar", routing_impl="reference"),
    "mhar_fused": dict(residual="mhar", routing_impl="fused"),
    "attnres_fused": dict(residual="attnres", routing_impl="fused"),
    "hyper": dict(residual="hyper"),
}
PAPER_VOCAB = 151936


def scale_config(scale, vocab):
    """(GPTConfig kwargs, micro_batch) of a scale: the shapes of config/train_*.py."""
    spec = SCALES[scale]
    if isinstance(spec, str):
        cfg = train.parse_args([os.path.join(os.path.dirname(os.path.abspath(__file__)), spec)])
        spec = {k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden", "block_size", "micro_batch")}
    spec = dict(spec)
    micro_batch = spec.pop("micro_batch")
    return dict(spec, vocab_size=vocab if scale != "tiny" else 1024), micro_batch


def build(scale, variant, device, compile_model, vocab, chunked_ce=0):
    kw, B = scale_config(scale, vocab)
    v = dict(VARIANTS[variant])
    compile_routing = v.pop("compile_routing", True)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**kw, **v)).to(device)
    model.chunked_ce = chunked_ce
    if compile_model:
        model.compile_sublayers()
        if not compile_routing:
            model._route = route_reference   # the reference routing stays eager
    opt = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), fused=device.startswith("cuda"))
    return model, opt, B


def bench_one(scale, variant, device, steps, warmup, compile_model, vocab, profile_dir=None, chunked_ce=0,
              cuda_graph=False):
    cuda = device.startswith("cuda")
    torch._dynamo.reset()   # each variant compiles afresh: no recompile limits or guards shared with earlier ones
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        held = torch.cuda.memory_allocated(device)   # left by earlier runs in this process (should be ~0)
        torch.cuda.reset_peak_memory_stats(device)
    model, opt, B = build(scale, variant, device, compile_model, vocab, chunked_ce)
    T = model.cfg.block_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.cfg.vocab_size, (B, T + 1), generator=gen).to(device)
    inputs, targets = x[:, :-1], x[:, 1:]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    graphed = train.GraphedMicrostep(model, autocast) if cuda_graph and cuda else None

    def step():   # no host sync inside: the loss stays on the device
        if graphed is not None:
            loss = graphed(inputs, targets)
        else:
            with autocast:
                _, loss = model(inputs, targets)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if graphed is None:   # the graph's backward overwrites its own .grad tensors
            opt.zero_grad(set_to_none=True)
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
    tok_s = B * T / step_s
    name = torch.cuda.get_device_name(device) if cuda else None
    row = dict(scale=scale, variant=variant, cuda_graph=graphed is not None, micro_batch=B, seq_len=T, tok_s=tok_s,
               step_ms=1e3 * step_s, step_ms_min=1e3 * min(times), step_ms_each=[round(1e3 * t, 3) for t in times],
               mfu=model.estimate_mfu(tok_s, name, T),
               peak_gb=(torch.cuda.max_memory_allocated(device) - held) / 1e9 if cuda else None,
               reserved_gb=torch.cuda.max_memory_reserved(device) / 1e9 if cuda else None,
               held_before_gb=held / 1e9 if cuda else None,
               params=model.num_params(), loss=loss.item())
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
    del model, opt, graphed, step, loss
    if cuda:   # the step closure, the graph wrapper and the compiled modules hold each other: free them now, or
        gc.collect()   # the next run's peak counts this run's weights, gradients and graph pool
        torch.cuda.empty_cache()
    return row


def routing_ms(scale, variant, device, vocab):
    """GPU time of the variant's routing chain alone at this shape (forward + backward), or None."""
    v = VARIANTS[variant]
    if v["residual"] not in ("attnres", "mhar"):
        return None
    import routing_kernel
    if v["routing_impl"] == "fused" and not routing_kernel.available(torch.device(device)):
        return None
    kw, B = scale_config(scale, vocab)
    H = 1 if v["residual"] == "attnres" else kw["n_kv_head"]
    impl = "fused" if v["routing_impl"] == "fused" else "compiled" if v.get("compile_routing", True) else "eager"
    ref = torch.compile(route_reference, dynamic=True) if impl == "compiled" else None
    ms, _ = routing_kernel.time_chain(impl, 2 * kw["n_layer"] + 1, B, kw["block_size"], kw["n_embd"], H, device, ref,
                                      graph=impl == "fused")
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scales", default="100m,350m,1b", help=f"comma-separated subset of {','.join(SCALES)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (the median is reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, autotuning)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda | cuda:N | cpu")
    p.add_argument("--compile", default="True", choices=("True", "False"), help="torch.compile each sublayer")
    p.add_argument("--vocab", type=int, default=PAPER_VOCAB, help="vocabulary of the synthetic tokens (paper: 151,936)")
    p.add_argument("--profile", action="store_true", help="also write a torch.profiler trace of 3 steps per run")
    p.add_argument("--chunked_ce", type=int, default=0, help="loss over this many tokens at a time (0: whole logits)")
    p.add_argument("--cuda_graph", default="True", choices=("True", "False"),
                   help="replay forward+backward as one CUDA graph (train.py --cuda_graph); CUDA only")
    p.add_argument("--output", default="bench.json", help="results JSON")
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
                                args.chunked_ce, args.cuda_graph == "True")
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
    with open(args.output, "w") as f:
        json.dump({"header": header, "args": vars(args), "rows": rows}, f, indent=1)
    print(f"wrote {args.output}")
    return rows


if __name__ == "__main__":
    main()
