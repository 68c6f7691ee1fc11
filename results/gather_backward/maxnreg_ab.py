# Register caps (Triton's maxnreg launch option) on the chain's kernels: ptxas (Triton 3.6, the H200's, on the CPU) keeps
# the non-leading forward at d 512 / 1024 at 128 registers without spilling under a cap of 128 (158 / 162 uncapped: 12 ->
# 16 warps a multiprocessor), the leading gather at d 768 at 168 without spilling (239: 8 -> 12 warps); others spill a
# little (d 1024's leading gather 192 + 176 B stack, d 512's 96 + 136 B). Chain GPU time per shape with each category's
# caps, one at a time, then the best of each together; the shipped chain first and last; checks of the combination.
#   python results/gather_backward/maxnreg_ab.py [SHAPE ...]
import os, sys
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
import torch
import bench, routing_config, routing_kernel as rk
from bench import CHAIN_SHAPES

CAPS, REGS = {}, {}


def category(kernel, key):
    if key[0] == "fwd":
        return "fwd_lead" if key[1] else "fwd_other"
    if key[0] == "gather_bwd":
        return "gb_lead" if key[1] else "gb_other"
    return None


def launch(self, kernel, key, grid, warps, fresh, varying, fixed):
    cap = CAPS.get(category(kernel, key))
    key = (key, *[t.dtype for t in fresh], cap)
    aligned = not any([t.data_ptr() & 15 for t in fresh])
    bound = self.bound.get(key) if aligned and self.direct else None
    if bound is not None:
        launcher, function, meta, args, slots = bound
        for i, v in zip(slots, varying.values()):
            args[i] = v
        launcher(*grid, *(1,) * (3 - len(grid)), self._stream(self.device), function, meta, None, None, None, *args)
        for i in slots:
            args[i] = None
        return
    args = {**fixed(), **varying}
    compiled = kernel[grid](**args, num_warps=warps, **({"maxnreg": cap} if cap else {}))
    compiled = getattr(compiled, "result", lambda: compiled)()
    REGS[(category(kernel, key[0]), cap)] = (getattr(compiled, "n_regs", "?"), getattr(compiled, "n_spills", "?"))
    if aligned and self.direct:
        names = kernel.arg_names
        self.bound[key] = (compiled.run, compiled.function, compiled.packed_metadata, [args[n] for n in names],
                           [names.index(k) for k in varying])
        for i in self.bound[key][4]:
            self.bound[key][3][i] = None


routing_config.Launcher.launch = launch
GRID = {512: dict(fwd_other=[128, 112], fwd_lead=[168, 128], gb_lead=[96], gb_other=[64]),
        768: dict(fwd_lead=[80], gb_lead=[168, 128], gb_other=[96]),
        1024: dict(fwd_other=[128], fwd_lead=[128], gb_lead=[192, 168], gb_other=[128]),
        1280: dict(fwd_other=[168], fwd_lead=[80], gb_other=[128])}
train = [s for s in CHAIN_SHAPES if s[0].endswith("-train")]
rows = train + [("100M-train/H1", 12, 512, 1, 8, 2048), ("350M-train/H1", 24, 1024, 1, 4, 1024)]
if sys.argv[1:]:
    rows = [r for r in rows if r[0] in sys.argv[1:]]


def chain(name, L, d, H, B, T, caps):
    CAPS.clear(); CAPS.update(caps)
    REGS.clear()
    ms = min(bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=rk.config_for(d, H))[0]
             for _ in range(2))
    regs = ", ".join(f"{c} {r[0]}/{r[1]}" for (c, cap), r in sorted(REGS.items(), key=str) if c)
    print(f"chain {name:14s} caps {str(caps):60s} {ms:6.3f} ms   regs/spills: {regs}", flush=True)
    return ms


for name, L, d, H, B, T in rows:
    base = chain(name, L, d, H, B, T, {})
    best = {}
    for cat, caps in GRID[d].items():
        for cap in caps:
            ms = chain(name, L, d, H, B, T, {cat: cap})
            if ms < min(base, best.get(cat, (None, 1e9))[1]) * 0.995:
                best[cat] = (cap, ms)
    combo = {c: v[0] for c, v in best.items()}
    if len(combo) > 1:
        chain(name, L, d, H, B, T, combo)
    chain(name, L, d, H, B, T, {})
    if combo:
        CAPS.clear(); CAPS.update(combo)
        for dt in (torch.float32, torch.bfloat16):
            e = bench.check_against_reference(2 * L + 1, 1, T, d, H, dt, "cuda", config=rk.config_for(d, H))
            CAPS.clear()
            e0 = bench.check_against_reference(2 * L + 1, 1, T, d, H, dt, "cuda", config=rk.config_for(d, H))
            CAPS.update(combo)
            print(f"check {name} {combo} {dt}: capped {e}  uncapped {e0}", flush=True)
    CAPS.clear()
# d 768's non-leading forward: DEFAULT's (4096, 4, 4) tile holds 255 registers + 88 B of spill (Triton 3.6); smaller tiles
from dataclasses import replace
for name, L, d, H, B, T in [r for r in rows if r[2] == 768]:
    base = rk.config_for(d, H)
    for t in [base.fwd, (512, 1, 3), (512, 1, 4), (1024, 2, 3), (1024, 2, 4), (2048, 4, 3), base.fwd]:
        ms = min(bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True, config=replace(base, fwd=t))[0]
                 for _ in range(2))
        print(f"chain {name:14s} fwd {str(t):16s} {ms:6.3f} ms", flush=True)
