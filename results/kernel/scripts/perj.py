"""Per-site kernel durations of every candidate config at the 100M / 350M training shapes, the best site-range
table (up to 3 ranges per kernel), and its chain GPU time against the current SHAPE_CONFIG. usage: python carry/perj.py OUTDIR"""
import sys, os, json, copy, itertools, tempfile
sys.path.insert(0, os.getcwd())
import torch
import routing_kernel as rk
out = sys.argv[1]
CANDS = rk.TUNE_CANDIDATES + [(1024, 2, 4), (2048, 4, 4), (2048, 2, 3), (512, 1, 3)]
SHAPES = [("100M-train", 12, 512, 4, 8, 2048), ("350M-train", 24, 1024, 8, 4, 1024)]
KERNELS = {"fwd": "_route_fwd", "site": "_route_bwd_site", "gather": "_route_bwd_gather"}
base_cfg = copy.deepcopy(rk.SHAPE_CONFIG)

def per_launch(N, B, T, d, H):
    from torch.profiler import ProfilerActivity, profile
    step = rk._fused_step(N, B, T, d, H, "cuda")
    step(); step(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(); torch.cuda.synchronize()
    f = tempfile.mktemp(suffix=".json"); prof.export_chrome_trace(f)
    ev = sorted([e for e in json.load(open(f))["traceEvents"] if e.get("cat") == "kernel"], key=lambda e: e["ts"])
    os.remove(f)
    res = {}
    for k, name in KERNELS.items():
        d_ = [e["dur"] for e in ev if e["name"] == name]
        assert len(d_) == N, (k, len(d_))
        res[k] = d_ if k == "fwd" else d_[::-1]   # index j-1 (the backward runs sites N..1)
    return res

def best_ranges(table, N, max_ranges=3):
    """table: cand -> [dur per site]; the best split of sites 1..N into <= max_ranges ranges, one cand each."""
    cands = list(table)
    pre = {c: [0.0] for c in cands}
    for c in cands:
        for x in table[c]:
            pre[c].append(pre[c][-1] + x)
    seg = lambda a, b: min((pre[c][b] - pre[c][a], c) for c in cands)   # sites a+1..b
    best = (float("inf"), None)
    for k in range(1, max_ranges + 1):
        for cuts in itertools.combinations(range(1, N), k - 1):
            bounds = (0,) + cuts + (N,)
            parts = [seg(a, b) for a, b in zip(bounds, bounds[1:])]
            tot = sum(p[0] for p in parts)
            if tot < best[0] - 1e-9:
                best = (tot, [(a + 1, p[1]) for a, p in zip(bounds, parts)])
    # merge neighbours with the same config
    merged = []
    for first, c in best[1]:
        if not merged or merged[-1][1] != c:
            merged.append((first, c))
    return best[0], merged

report = {}
for sname, L, d, H, B, T in SHAPES:
    N = 2 * L + 1
    key = (d, H)
    cur = {k: rk._site_configs(k, d, H, N) for k in KERNELS}
    table = {k: {} for k in KERNELS}
    for k in KERNELS:
        for cand in CANDS:
            rk.SHAPE_CONFIG = copy.deepcopy(base_cfg)
            rk.SHAPE_CONFIG.setdefault(key, {})[k] = cand
            try:
                table[k][cand] = per_launch(N, B, T, d, H)[k]
            except Exception as e:
                print(sname, k, cand, "failed", str(e)[:100], flush=True)
                continue
            print(f"{sname} {k:6s} {str(cand):18s} total {sum(table[k][cand]) / 1e3:6.3f} ms  sites 1,5,13,{N}: "
                  + " ".join(f"{table[k][cand][i]:6.1f}" for i in (0, 4, 12, N - 1)), flush=True)
    new = copy.deepcopy(base_cfg)
    for k in KERNELS:
        cur_total = sum(table[k][cur[k][0]]) if cur[k][0] in table[k] else None
        tot, ranges = best_ranges(table[k], N)
        print(f"{sname} {k}: current {cur[k][0]} {cur_total / 1e3 if cur_total else None} ms; best ranges {ranges} {tot / 1e3:.3f} ms", flush=True)
        new.setdefault(key, {})[k] = ranges if len(ranges) > 1 else ranges[0][1]
    report[sname] = dict(table={k: {str(c): v for c, v in t.items()} for k, t in table.items()}, new={k: str(v) for k, v in new[key].items()})
    # chain GPU time: current vs site ranges, alternating
    for rep in range(3):
        for name, cfg in (("current", base_cfg), ("ranges", new)):
            rk.SHAPE_CONFIG = copy.deepcopy(cfg)
            ms, _ = rk.time_chain("fused", N, B, T, d, H, "cuda", None, graph=True)
            print(f"{sname} chain {name:8s} rep {rep}: {ms:.3f} ms", flush=True)
    base_cfg = new   # the next shape starts from this one (other widths are untouched)
print("SHAPE_CONFIG =", repr(base_cfg), flush=True)
json.dump(report, open(os.path.join(out, "perj.json"), "w"))
open(os.path.join(out, "shape_config.py"), "w").write("SHAPE_CONFIG = " + repr(base_cfg) + "\n")
