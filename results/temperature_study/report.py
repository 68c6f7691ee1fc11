"""
The temperature study's report, from run.sh's logs (NAME.log.jsonl, NAME = SHAPE_MODE_sSEED[_xSCALE]): per-run
metrics, the pre-registered paired comparisons (README.md: fixed before the runs), the s sweep, plots.

  python results/temperature_study/report.py      # logs/: prints the markdown tables, writes curves_SHAPE.png and
                                                  # scale_sweep.png here
  python results/temperature_study/report.py results/temperature_study/logs_paper   # BUDGET=paper's runs; the
                                                  # figures go into that folder (--fig_dir to choose)

Metrics: tail-5 = the mean of the last 5 evals (the primary metric: steps 1600-2000 at the reduced budget, 18k-20k at
the paper's), final = the last eval. A comparison A - B pairs the runs of one seed (same initialisation of the shared
weights, same data order): per-seed deltas, their mean, standard error (sd / sqrt(n)), t = mean / SE with the
two-sided 95% critical value of Student's t for n - 1 degrees of freedom, and how many seeds agree in sign.
"""
import glob
import math
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from checkpoint import read_log  # noqa: E402
# Student's t, two-sided 95%: critical values for 1..10 degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
# the comparisons, fixed before the runs (README.md): (shape, A, B), a config = MODE or MODE_xSCALE
PLAN = [("100m", "attnres_x0.5", "mhar"),       # the decisive one: single head at H = 4's temperature against MHAR
        ("100m", "attnres", "mhar"),            # the paper's claim at this budget
        ("100m", "attnres", "attnres_x0.5"),    # what the temperature alone buys
        ("100m", "mhar", "baseline"), ("100m", "attnres", "baseline"), ("100m", "attnres_x0.5", "baseline"),
        ("124m", "attnres_x0.5", "mhar"), ("124m", "attnres", "mhar"), ("124m", "attnres", "attnres_x0.5"),
        ("350m", "attnres_x0.354", "mhar"), ("350m", "attnres", "mhar"), ("350m", "attnres", "attnres_x0.354")]
# comparisons added after the planned runs were seen: printed apart, as descriptions (their t is shown, not tested)
ADDED = [("124m", "mhar", "baseline"), ("124m", "attnres", "baseline"), ("124m", "attnres_x0.5", "baseline")]


def load(path):
    recs = read_log(path)   # checkpoint.py's reader: a partial last line is left out
    evals = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
    steps = sorted(evals)
    return dict(evals=evals, last=steps[-1], final=evals[steps[-1]], tail=statistics.mean(evals[s] for s in steps[-5:]))


def runs(log_dir):
    """{(shape, config, seed): metrics} of every finished run."""
    out = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "*.log.jsonl"))):
        m = re.fullmatch(r"(\w+?)_(baseline|attnres|mhar)_s(\d+)(_x[\d.]+)?", os.path.basename(path)[:-len(".log.jsonl")])
        if m:
            out[(m[1], m[2] + (m[4] or ""), int(m[3]))] = load(path)
    return out


def paired(rs, shape, a, b, metric):
    """(per-seed deltas A - B, mean, SE, t, critical t) over the seeds both configs have."""
    seeds = sorted(s for (sh, c, s) in rs if sh == shape and c == a and (shape, b, s) in rs)
    d = [rs[(shape, a, s)][metric] - rs[(shape, b, s)][metric] for s in seeds]
    if len(d) < 2:
        return seeds, d, None
    mean, se = statistics.mean(d), statistics.stdev(d) / math.sqrt(len(d))
    return seeds, d, dict(mean=mean, se=se, t=mean / se if se > 0 else float("inf"), t95=T95.get(len(d) - 1, 1.96))


def tables(rs):
    lines = ["| shape | config | seed | steps | final | tail-5 |", "|---|---|---|---|---|---|"]
    for (shape, cfg, seed), r in sorted(rs.items()):
        lines.append(f"| {shape} | {cfg} | {seed} | {r['last']} | {r['final']:.4f} | {r['tail']:.4f} |")
    for title, pairs in (("planned", PLAN), ("added after the runs: descriptions, no test", ADDED)):
        rows = [pair_row(rs, *p) for p in pairs]
        if any(rows):
            lines += ["", f"Comparisons, {title}:", "",
                      "| shape | A - B | seeds | per-seed deltas, tail-5 | mean +- SE, tail-5 | \\|mean\\| / SE (95%: >) | "
                      "same sign | mean +- SE, final |", "|---|---|---|---|---|---|---|---|"] + [r for r in rows if r]
    return "\n".join(lines)


def pair_row(rs, shape, a, b):
    """One comparison's table row, or None when no seed has both configs."""
    seeds, d, st = paired(rs, shape, a, b, "tail")
    if not seeds:
        return None
    _, _, fin = paired(rs, shape, a, b, "final")
    same = max(sum(x > 0 for x in d), sum(x < 0 for x in d))
    return (f"| {shape} | {a} - {b} | {','.join(map(str, seeds))} | {' '.join(f'{x:+.4f}' for x in d)} | "
            + (f"{st['mean']:+.4f} +- {st['se']:.4f} | {abs(st['t']):.2f} ({st['t95']:.2f}) | {same}/{len(d)} | "
               f"{fin['mean']:+.4f} +- {fin['se']:.4f} |" if st else "- | - | - | - |"))


def scale_of(cfg):
    return float(cfg.split("_x")[1]) if "_x" in cfg else 1.0


def common_seeds(rs, shape):
    """The seeds every routed config of a shape has: the s sweep compares its points on these only, so no point's
    mean moves by which seeds it happens to have (seed-to-seed spread ~0.02 is larger than the sweep's steps)."""
    sets = [{sd for (sh, c, sd) in rs if sh == shape and c == cfg}
            for cfg in {c for (sh, c, _) in rs if sh == shape and c != "baseline"}]
    return sorted(set.intersection(*sets)) if sets else []


def sweep(rs):
    """The s sweep as a table: each routed config's tail-5 on the common seeds, its paired gap to MHAR at s = 1 on
    the same seeds, and its mean +- SE over every seed it has (a description, not one of the planned comparisons)."""
    lines = ["| shape | config | s | tail-5 per common seed | mean, common seeds | - MHAR s = 1, same seeds | "
             "every seed: n, mean +- SE |", "|---|---|---|---|---|---|---|"]
    for shape in sorted({k[0] for k in rs}):
        seeds = common_seeds(rs, shape)
        if not seeds:
            continue
        for cfg in sorted({c for (sh, c, _) in rs if sh == shape and c != "baseline"},
                          key=lambda c: (c.split("_x")[0], -scale_of(c))):
            ts = [rs[(shape, cfg, sd)]["tail"] for sd in seeds]
            gap = (" ".join(f"{t - rs[(shape, 'mhar', sd)]['tail']:+.4f}" for t, sd in zip(ts, seeds))
                   if cfg != "mhar" and all((shape, "mhar", sd) in rs for sd in seeds) else "-")
            every = [r["tail"] for (sh, c, _), r in rs.items() if sh == shape and c == cfg]
            se = f" +- {statistics.stdev(every) / math.sqrt(len(every)):.4f}" if len(every) > 1 else ""
            lines.append(f"| {shape} | {cfg.split('_x')[0]} | {scale_of(cfg):g} | "
                         f"{' '.join(f'{t:.4f}' for t in ts)} (seeds {','.join(map(str, seeds))}) | "
                         f"{statistics.mean(ts):.4f} | {gap} | {len(every)}, {statistics.mean(every):.4f}{se} |")
    return "\n".join(lines)


def legend(ax):
    if ax.get_legend_handles_labels()[0]:   # a panel with nothing drawn yet gets none
        ax.legend(fontsize=7)


def plots(rs, out_dir):
    """curves_SHAPE.png: validation loss and the paired gap to MHAR, one colour per config (thin: each seed, thick: the
    mean over seeds); scale_sweep.png: tail-5 against route_scale, the mean +- SE over each point's seeds (dots: the
    seeds, n beside), and beside it the mean over the seeds every routed config of the shape has."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    configs = sorted({k[1] for k in rs})
    colour = {c: plt.get_cmap("tab10")(i % 10) for i, c in enumerate(configs)}
    for shape in sorted({k[0] for k in rs}):
        fig, (ax, gap) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
        for cfg in configs:
            seeds = sorted(sd for (sh, c, sd) in rs if sh == shape and c == cfg)
            if not seeds:
                continue
            steps = [st for st in sorted(rs[(shape, cfg, seeds[0])]["evals"]) if st >= 300]
            curves = [[rs[(shape, cfg, sd)]["evals"][st] for st in steps] for sd in seeds]
            with_mhar = [sd for sd in seeds if cfg != "mhar" and (shape, "mhar", sd) in rs]
            gaps = [[rs[(shape, cfg, sd)]["evals"][st] - rs[(shape, "mhar", sd)]["evals"][st] for st in steps]
                    for sd in with_mhar]
            for panel, ys, label in ((ax, curves, f"{cfg} (seeds {','.join(map(str, seeds))})"),
                                     (gap, gaps, f"{cfg} - mhar (seeds {','.join(map(str, with_mhar))})")):
                if not ys:
                    continue
                for y in ys:
                    panel.plot(steps, y, color=colour[cfg], lw=0.7, alpha=0.35)
                panel.plot(steps, [statistics.mean(v) for v in zip(*ys)], color=colour[cfg], lw=2, label=label)
        ax.set(xlabel="step", ylabel="validation loss", title=f"{shape}: validation loss (thick: mean over seeds)")
        gap.axhline(0, color="k", lw=0.5)
        gap.set(xlabel="step", ylabel="loss - MHAR's (same seed)", title=f"{shape}: paired gap to MHAR")
        legend(ax)
        legend(gap)
        fig.savefig(os.path.join(out_dir, f"curves_{shape}.png"), dpi=120)
        plt.close(fig)
    fig, (every, common) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained", sharey=True)
    scales = set()
    for shape in sorted({k[0] for k in rs}):
        seeds = common_seeds(rs, shape)
        for mode in sorted({k[1].split("_x")[0] for k in rs if k[0] == shape and k[1] != "baseline"}):
            pts = {}   # scale -> {seed: tail-5}
            for (sh, cfg, seed), r in rs.items():
                if sh == shape and cfg.split("_x")[0] == mode:
                    pts.setdefault(scale_of(cfg), {})[seed] = r["tail"]
            xs = sorted(pts)
            scales |= set(xs)
            ys = [list(pts[x].values()) for x in xs]
            bar = every.errorbar(xs, [statistics.mean(y) for y in ys], marker="o", capsize=3, label=f"{shape} {mode}",
                                 yerr=[statistics.stdev(y) / math.sqrt(len(y)) if len(y) > 1 else 0 for y in ys])
            for x, y in zip(xs, ys):
                every.plot([x] * len(y), y, ".", color=bar[0].get_color(), alpha=0.35)
                every.annotate(f"n={len(y)}", (x, statistics.mean(y)), textcoords="offset points", xytext=(6, -3),
                               fontsize=7)
            if seeds:   # none when no seed has every routed config of the shape yet
                common.plot(xs, [statistics.mean(pts[x][sd] for sd in seeds) for x in xs], marker="o",
                            color=bar[0].get_color(), label=f"{shape} {mode}, seeds {','.join(map(str, seeds))}")
    every.set(ylabel="tail-5 validation loss", title="s sweep: mean +- SE over each point's seeds (the plan's)")
    common.set(title="s sweep: mean over the seeds every routed config has (paired)")
    for ax in (every, common):
        ax.set(xscale="log", xlabel="route_scale s")
        ax.set_xticks(sorted(scales), [f"{x:g}" for x in sorted(scales)])
        ax.minorticks_off()
        legend(ax)
    fig.savefig(os.path.join(out_dir, "scale_sweep.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log_dir", nargs="?", default=os.path.join(HERE, "logs"),
                    help="run.sh's log folder (default: logs/, the reduced budget; BUDGET=paper writes logs_paper/)")
    ap.add_argument("--fig_dir", help="where the figures go (default: this folder for logs/, else the log folder)")
    args = ap.parse_args()
    rs = runs(args.log_dir)
    if not rs:
        raise SystemExit(f"no finished runs in {args.log_dir}: bash results/temperature_study/run.sh SPEC ...")
    print(tables(rs))
    print()
    print(sweep(rs))
    here = os.path.join(HERE, "logs")
    plots(rs, args.fig_dir or (HERE if os.path.isdir(here) and os.path.samefile(args.log_dir, here) else args.log_dir))
