# The fourth redesign before and after, in one process on one GPU: the before tree (a folder holding the .py files of
# the commit before it) against this tree. (1) at every tuned width and two untuned, the chain's output and every
# gradient bitwise equal, bf16 and fp32, full routing and block routing (n = 8 where it divides); (2) the chain's GPU
# time (CUDA-graph replay, the better of two readings each, order before, after, after, before) at 12 widths;
# (3) bench.py's step, every variant, both trees at their defaults, alternating, at the scales named, in R rounds: the
# ratios to the baseline before and after. --eager: part 3 launches every kernel from Python (bench.py
# --cuda_graph=False), as FSDP and --cuda_graph=False training do. Part (4), the direct launcher on and off in one
# tree (launcher_h100.*), ran at 0df7054, the last tree with the launcher: `git show 0df7054:results/redesign4/ab.py`.
#   python results/redesign4/ab.py BEFORE_DIR OUT.json [--rounds=R] [--skip-bitwise] [--skip-chain] [--skip-trees]
#       [--eager] [--widths=DxH,...] [--variants=baseline,V,...] [--steps=S] [SCALE ...]
#   (--widths: part 1 at these widths only, e.g. several processes at once; --variants: part 3's, the baseline first,
#   as each costs a compile a tree and round; --steps: timed steps a reading, 20 unless told: more, where the host's
#   jitter moves an eager step)
import importlib
import json
import os
import sys

import torch

HERE = os.getcwd()
BEFORE = os.path.abspath(sys.argv[1])
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
