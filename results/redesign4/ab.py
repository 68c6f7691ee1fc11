# The fourth redesign before and after, in one process on one GPU: the before tree (a folder holding the .py files of
# the commit before it) against this tree. (1) at every tuned width and two untuned, the chain's output and every
# gradient bitwise equal, bf16 and fp32, full routing and block routing (n = 8 where it divides); (2) the chain's GPU
# time (CUDA-graph replay, the better of two readings each, order before, after, after, before) at 12 widths;
# (3) bench.py's step, every variant, both trees at their defaults, alternating, at the scales named, in R rounds: the
# ratios to the baseline before and after. --eager: part 3 launches every kernel from Python (bench.py
# --cuda_graph=False), as FSDP and --cuda_graph=False training do. Part (4), the direct launcher on and off in one
# tree (launcher_h100.*), ran at 0df7054, the last tree with the launcher: `git show 0df7054:results/redesign4/ab.py`.
# --interleave: part 3 eager, the two trees' models of a variant held at once and their steps alternated one by one
# (the order swapped every step), so a slow phase of the host (an eager step is the host's pace) falls on both alike:
# each variant's median step before and after, and the median of the steps' paired after/before ratios.
#   python results/redesign4/ab.py BEFORE_DIR OUT.json [--rounds=R] [--skip-bitwise] [--skip-chain] [--skip-trees]
#       [--eager] [--interleave] [--widths=DxH,...] [--variants=baseline,V,...] [--steps=S] [SCALE ...]
#   (--widths: part 1 at these widths only, e.g. several processes at once; --variants: part 3's, the baseline first,
#   as each costs a compile a tree and round; --steps: timed steps a reading, 20 unless told: more, where the host's
#   jitter moves an eager step)
import functools
import importlib
import json
import os
import sys
import time
from types import SimpleNamespace

import torch

HERE = os.getcwd()
BEFORE = os.path.abspath(sys.argv[1])
if os.path.lexists(sys.argv[2]):   # (the record is written as it goes: never over another file)
    sys.exit(f"ab.py: {sys.argv[2]} exists; give a new path for this record (nothing is replaced)")
# every module either tree has: each tree imports its own (a name left out would be shared, the first tree's)
NAMES = sorted({f[:-3] for tree in (BEFORE, HERE) for f in os.listdir(tree) if f.endswith(".py")})


def load(path):
    """A tree's modules, imported from `path` (each tree keeps its own: its functions see their own globals)."""
    for name in NAMES:
        sys.modules.pop(name, None)
    sys.path.insert(0, path)
    for name in ("bench", "bench_routing", "routing_block"):
        importlib.import_module(name)
    sys.path.remove(path)
    return {n: sys.modules[n] for n in NAMES if n in sys.modules}


def use(tree):   # a tree's lazy imports (model.py's routing files) resolve to its own modules
    for name in NAMES:
        sys.modules.pop(name, None)
    sys.modules.update(tree)
    return tree


before, after = load(BEFORE), load(HERE)
out, scales = sys.argv[2], [a for a in sys.argv[3:] if not a.startswith("--")]
graphed = "--eager" not in sys.argv
rounds = int(next((a.split("=")[1] for a in sys.argv if a.startswith("--rounds=")), 1))
torch.backends.cuda.matmul.allow_tf32 = True
record = dict(header=use(after)["bench_routing"].header("cuda"), bitwise=[], chain=[])
DEPTH = {512: 12, 768: 12, 1024: 24, 1280: 36, 2048: 36}

# (1) bitwise: the same inputs through both trees' chains
widths = list(after["routing_config"].TUNED_H200) + [(512, 8), (2048, 16)]
pick = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--widths=")), None)   # e.g. --widths=512x4,768x1
widths = [tuple(int(x) for x in w.split("x")) for w in pick.split(",")] if pick else widths
for d, H in ([] if "--skip-bitwise" in sys.argv else widths):
    for dtype in (torch.bfloat16, torch.float32):
        for blocks in (None, 8):
            N = 2 * DEPTH[d] + 1
            gen = torch.Generator().manual_seed(d + H)
            src0 = torch.randn(1, 384, d, generator=gen).to("cuda", dtype)
            qs = [torch.randn(d, generator=gen).cuda() * 0.3 for _ in range(N)]
            gs = [(1 + 0.2 * torch.randn(d, generator=gen)).cuda() for _ in range(N)]
            up = torch.randn(1, 384, d, generator=gen).to("cuda", dtype)
            shift = [torch.randn(1, 384, d, generator=gen).to("cuda", dtype) for _ in range(N)]
            sub = lambda j, x: torch.tanh(x) + shift[j]
            got = [use(t)["bench_routing"].chain_grads("fused", src0, qs, gs, sub, up, H, blocks=blocks)
                   for t in (before, after)]
            same = [bool(torch.equal(x, y)) for x, y in zip(*got)]
            record["bitwise"].append(dict(d=d, H=H, dtype=str(dtype), blocks=blocks, N=N, equal=same))
            print(f"bitwise d={d} H={H} {dtype} blocks={blocks}: out, d_source0, dq, dg equal: {same}", flush=True)
json.dump(record, open(out, "w"), indent=1)

# (2) chain GPU time at the training microbatches (d, H, B, T)
SHAPES = [(512, 1, 8, 2048), (512, 2, 8, 2048), (512, 4, 8, 2048), (512, 8, 8, 2048), (512, 16, 8, 2048),
          (768, 1, 8, 2048), (768, 4, 8, 2048), (1024, 1, 4, 1024), (1024, 8, 4, 1024), (1280, 1, 2, 1024),
          (1280, 8, 2, 1024), (2048, 16, 2, 1024)]
for d, H, B, T in ([] if "--skip-chain" in sys.argv else SHAPES):
    N, res = 2 * DEPTH[d] + 1, {}
    for k in ("before", "after", "after", "before"):
        ms, gb = use(before if k == "before" else after)["bench_routing"].time_chain("fused", N, B, T, d, H, "cuda",
                                                                                       graph=True)
        res[k], res[k + "_gb"] = min(res.get(k, ms), ms), gb
    record["chain"].append(dict(d=d, H=H, B=B, T=T, N=N, **res))
    print(f"chain d={d:4d} H={H:2d} {B}x{T}: before {res['before']:6.2f} ms, after {res['after']:6.2f} ms, "
          f"after/before {res['after'] / res['before']:.3f}; peak GB {res['before_gb']:.2f} / {res['after_gb']:.2f}",
          flush=True)
    json.dump(record, open(out, "w"), indent=1)

VARIANTS = ("baseline", "mhar_fused", "attnres_fused", "mhar_block8")
VARIANTS = tuple(next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--variants=")), VARIANTS))
assert VARIANTS[0] == "baseline", f"--variants={','.join(VARIANTS)}: the ratios are to the baseline; name it first"
STEPS = int(next((a.split("=")[1] for a in sys.argv if a.startswith("--steps=")), 20))


def ratios_of(rows, key, keys, scale):
    """Each variant's tok/s over its round's baseline, for every value of `key` in `keys`: {k: {variant: [ratios]}}."""
    out = {k: {v: [] for v in VARIANTS[1:]} for k in keys}
    for k in keys:
        for r in range(rounds):
            got = {x["variant"]: x["tok_s"] for x in rows if (x[key], x["scale"], x["round"]) == (k, scale, r)}
            for v in VARIANTS[1:]:
                out[k][v].append(got[v] / got["baseline"])
    return out


def say_ratios(scale, label, ratios):
    print(f"ratio {scale} {label} " + ", ".join(
        f"{v} {sum(x) / len(x):.4f}x (rounds {', '.join(f'{y:.3f}' for y in x)})" for v, x in ratios.items()), flush=True)


def eager_step(tree, scale, variant, device="cuda", compile_model=True):
    """bench.bench_one's step without a CUDA graph (alike in both trees), built from the tree's own modules: (step,
    tokens a step). A step runs with the tree's modules in place (use)."""
    bench, train = use(tree)["bench"], tree["train"]
    model, opt, B = bench.build(scale, variant, device, compile_model, bench.PAPER_VOCAB)
    x = torch.randint(0, model.cfg.vocab_size, (B, model.cfg.block_size + 1), generator=torch.Generator().manual_seed(0))
    x = x.to(device)
    rt = SimpleNamespace(ddp=False, device=device, say=print,
                         autocast=torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"))
    params, zero_grad = [p for p in model.parameters() if p.requires_grad], functools.partial(opt.zero_grad, set_to_none=True)

    def step():
        loss, _ = train.run_microbatches(lambda micro: (x[:, :-1], x[:, 1:]), 1, model, None, rt)
        train.optimizer_step(opt, params, 1.0, zero_grad=zero_grad)
        return loss
    return step, B * model.cfg.block_size


def interleaved(scale, variant, steps, warmup=5, device="cuda", compile_model=True):
    """Both trees' eager steps of one variant, alternated step by step: {tree: [seconds]}."""
    torch._dynamo.reset()
    if device == "cuda":
        after["bench"].fresh_memory(device)   # the last variant's models go (their compiled modules hold each other)
    trees = {"before": before, "after": after}
    made = {k: eager_step(t, scale, variant, device, compile_model) for k, t in trees.items()}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = {k: [] for k in trees}
    for i in range(warmup + steps):
        for k in (("before", "after") if i % 2 == 0 else ("after", "before")):
            use(trees[k])
            sync()
            t0 = time.perf_counter()
            loss = made[k][0]()
            sync()
            seconds = time.perf_counter() - t0
            if not torch.isfinite(loss):
                raise RuntimeError(f"{scale}/{variant} {k}: non-finite loss {loss.item()}")
            if i >= warmup:
                times[k].append(seconds)
            trees[k].update({n: sys.modules[n] for n in NAMES if n in sys.modules})   # what a step imported lazily
    return times, made["after"][1]


def median(xs):
    return sorted(xs)[len(xs) // 2]


if "--interleave" in sys.argv:
    record["interleaved"] = []
    for scale in scales:
        for variant in VARIANTS:
            times, tokens = interleaved(scale, variant, STEPS)
            pairs = sorted(a / b for a, b in zip(times["after"], times["before"]))
            row = dict(scale=scale, variant=variant, tokens=tokens, before_ms=1e3 * median(times["before"]),
                       after_ms=1e3 * median(times["after"]), paired=median(pairs),
                       paired_iqr=(pairs[len(pairs) // 4], pairs[3 * len(pairs) // 4]),
                       each_ms={k: [round(1e3 * t, 3) for t in v] for k, v in times.items()})
            record["interleaved"].append(row)
            print(f"interleaved {scale} {variant:14s} before {row['before_ms']:7.2f} ms, after {row['after_ms']:7.2f} "
                  f"ms: after/before {row['after_ms'] / row['before_ms']:.3f} (steps paired: median {row['paired']:.3f},"
                  f" quartiles {row['paired_iqr'][0]:.3f}-{row['paired_iqr'][1]:.3f}; {STEPS} steps each)", flush=True)
            json.dump(record, open(out, "w"), indent=1)
        base = {r["variant"]: r for r in record["interleaved"] if r["scale"] == scale}
        for variant in VARIANTS[1:]:   # the ratio to the baseline, each tree's: its two medians come from two pairings
            print(f"interleaved {scale} {variant} to the baseline: before "
                  f"{base['baseline']['before_ms'] / base[variant]['before_ms']:.4f}x, after "
                  f"{base['baseline']['after_ms'] / base[variant]['after_ms']:.4f}x", flush=True)

# (3) both trees' steps at their defaults (the ratios to the baseline before and after), the order alternating by round
record["trees"] = []
for i, (r, scale) in enumerate((r, s) for r in range(rounds) for s in ([] if "--skip-trees" in sys.argv else scales)):
    for name in (("before", "after") if i % 2 == 0 else ("after", "before")):
        bench = use(before if name == "before" else after)["bench"]
        for variant in VARIANTS:
            row = bench.bench_one(scale, variant, "cuda", STEPS, 5, True, bench.PAPER_VOCAB, None, graphed)
            record["trees"].append(dict(tree=name, round=r, **row))
            print(f"tree {scale} {variant:14s} {name:6s} {row['tok_s']:>10,.0f} tok/s {row['step_ms']:7.2f} ms", flush=True)
            json.dump(record, open(out, "w"), indent=1)
for scale in ([] if "--skip-trees" in sys.argv else scales):
    for name, ratios in ratios_of(record["trees"], "tree", ("before", "after"), scale).items():
        say_ratios(scale, name, ratios)

json.dump(record, open(out, "w"), indent=1)
print("done", flush=True)
