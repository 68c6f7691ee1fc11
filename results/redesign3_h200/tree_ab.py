# The third redesign before and after, in one process: the before tree (a folder holding 08cc0f0's .py files and
# config/) against this tree. (1) at every tuned width, the chain's output and every gradient bitwise equal (bf16 and
# fp32); (2) the chain's GPU time (CUDA-graph replay, the better of two readings each, order before, after, after,
# before) at 12 widths, before with its gather backward forced (and with what it ran by default where no entry was
# tuned), and its peak memory; (3) bench.py's step, every variant, before and after alternating, at the scales named,
# in R rounds (the order reversed every other round; each ratio against its own round's and tree's baseline).
#   python results/redesign3_h200/tree_ab.py BEFORE_DIR OUT.json [--rounds=R] [--step-only] [--variants=V,..] [SCALE ...]
import importlib, json, os, sys

import torch

HERE = os.getcwd()
NAMES = ("bench", "bench_routing", "model", "train", "graphs", "checkpoint", "generation", "prepare_data", "routing_call",
         "routing_config", "routing_kernel", "routing_gather", "routing_block")


def load(path, extra):
    """A tree's modules, imported from `path` (each tree keeps its own: its functions see their own globals)."""
    for name in NAMES:
        sys.modules.pop(name, None)
    sys.path.insert(0, path)
    for name in ("bench",) + extra:
        importlib.import_module(name)
    sys.path.remove(path)
    return {n: sys.modules[n] for n in NAMES if n in sys.modules}


def use(tree):   # a tree's lazy imports (model.py's routing files) resolve to its own modules
    for name in NAMES:
        sys.modules.pop(name, None)
    sys.modules.update(tree)
    return tree


before = load(os.path.abspath(sys.argv[1]), ("routing_gather", "routing_block"))
after = load(HERE, ("bench_routing", "routing_block"))
out, scales = sys.argv[2], [a for a in sys.argv[3:] if not a.startswith("--")]
rounds = int(next((a.split("=")[1] for a in sys.argv if a.startswith("--rounds=")), 1))
step_only = "--step-only" in sys.argv
torch.backends.cuda.matmul.allow_tf32 = True
record = dict(header=use(after)["bench_routing"].header("cuda"), bitwise=[], chain=[], step=[])

# (1) bitwise at the tuned widths (and two untuned: DEFAULT's gather backward both sides)
DEPTH = {512: 12, 768: 12, 1024: 24, 1280: 36, 2048: 36}
widths = list(before["routing_config"].TUNED_H200) + [(512, 8), (2048, 16)]
for d, H in ([] if step_only else widths):
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator().manual_seed(d + H)
        N, T = 2 * DEPTH[d] + 1, 384
        src0 = torch.randn(1, T, d, generator=gen).to("cuda", dtype)
        qs = [torch.randn(d, generator=gen).cuda() * 0.3 for _ in range(N)]
        gs = [(1 + 0.2 * torch.randn(d, generator=gen)).cuda() for _ in range(N)]
        up = torch.randn(1, T, d, generator=gen).to("cuda", dtype)
        shift = [torch.randn(1, T, d, generator=gen).to("cuda", dtype) for _ in range(N)]
        sub = lambda j, x: torch.tanh(x) + shift[j]
        b = use(before)["bench"]
        cfg = b.forced_backward(d, H, "gather")
        ref = b.chain_grads("fused", src0, qs, gs, sub, up, H, cfg)
        got = use(after)["bench_routing"].chain_grads("fused", src0, qs, gs, sub, up, H)
        same = [bool(torch.equal(x, y)) for x, y in zip(ref, got)]
        record["bitwise"].append(dict(d=d, H=H, dtype=str(dtype), N=N, tokens=T, equal=same))
        print(f"bitwise d={d} H={H} {dtype}: out, d_source0, dq, dg equal: {same}", flush=True)

# (2) chain GPU time at the training microbatches (d, H, B, T)
SHAPES = [(512, 1, 8, 2048), (512, 2, 8, 2048), (512, 4, 8, 2048), (512, 8, 8, 2048), (512, 16, 8, 2048),
          (768, 1, 8, 2048), (768, 4, 8, 2048), (1024, 1, 4, 1024), (1024, 8, 4, 1024), (1280, 1, 2, 1024),
          (1280, 8, 2, 1024), (2048, 16, 2, 1024)]
for d, H, B, T in ([] if step_only else SHAPES):
    N, res = 2 * DEPTH[d] + 1, {}
    for k in ("before", "after", "after", "before"):
        if k == "before":
            b = use(before)["bench"]
            ms, gb = b.time_chain("fused", N, B, T, d, H, "cuda", graph=True, config=b.forced_backward(d, H, "gather"))
        else:
            ms, gb = use(after)["bench_routing"].time_chain("fused", N, B, T, d, H, "cuda", graph=True)
        res[k] = min(res.get(k, ms), ms)
        res[k + "_gb"] = gb
    if (d, H) not in before["routing_config"].TUNED_H200:   # what the before tree ran at this width by default
        res["before_default"], res["before_default_gb"] = use(before)["bench"].time_chain("fused", N, B, T, d, H, "cuda",
                                                                                             graph=True)
    record["chain"].append(dict(d=d, H=H, B=B, T=T, N=N, **res))
    print(f"chain d={d:4d} H={H:2d} {B}x{T}: before (gather) {res['before']:6.2f} ms, after {res['after']:6.2f} ms, "
          f"after/before {res['after'] / res['before']:.3f}; peak GB {res['before_gb']:.2f} / {res['after_gb']:.2f}"
          + (f"; before's default (site) {res['before_default']:6.2f} ms: after/that "
             f"{res['after'] / res['before_default']:.3f}" if "before_default" in res else ""), flush=True)
    json.dump(record, open(out, "w"), indent=1)

# (3) the step, alternating trees, each variant against its own tree's baseline
VARIANTS = tuple(next((a.split("=")[1].split(",") for a in sys.argv if a.startswith("--variants=")),
                      ("baseline", "mhar_fused", "attnres_fused", "mhar_block8")))   # the baseline first
for i, (r, scale) in enumerate((r, s) for r in range(rounds) for s in scales):
    for variant in VARIANTS:
        for k in (("before", "after") if i % 2 == 0 else ("after", "before")):
            bench = use(before if k == "before" else after)["bench"]
            row = bench.bench_one(scale, variant, "cuda", 20, 5, True, bench.PAPER_VOCAB, None, True)
            record["step"].append(dict(tree=k, round=r, **row))
            print(f"step {scale} {variant:14s} {k:6s} {row['tok_s']:>10,.0f} tok/s {row['step_ms']:7.2f} ms "
                  f"peak {row['peak_gb']:.2f} GB", flush=True)
            json.dump(record, open(out, "w"), indent=1)
for scale in scales:
    for k in ("before", "after"):
        ratios = {v: [] for v in VARIANTS[1:]}
        for r in range(rounds):
            rows = {x["variant"]: x["tok_s"] for x in record["step"] if (x["tree"], x["scale"], x["round"]) == (k, scale, r)}
            for v in ratios:
                ratios[v].append(rows[v] / rows["baseline"])
        print(f"ratio {scale} {k:6s} " + ", ".join(f"{v} {sum(x) / len(x):.4f}x (rounds {', '.join(f'{y:.3f}' for y in x)})"
                                                  for v, x in ratios.items()), flush=True)
json.dump(record, open(out, "w"), indent=1)
print("done", flush=True)
