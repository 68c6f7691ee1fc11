"""
Tables and plots of the reduced-budget reproduction from the run logs in logs/ (NAME.log.jsonl, NAME = MODE_sSEED[_hH]).

  python results/repro_100m/report.py          # prints the markdown tables, writes val_curves.png and h_sweep.png

Final = the validation loss at the last eval; tail = the mean of the last 5 evals (steps 1600-2000); the paired
delta is mode minus baseline at the same seed (same initialisation of the shared weights, same data order).
Runs whose log stops early (NAME.partial.log.jsonl) are shown with their last step and left out of the deltas.
"""
import glob
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from metrics import read_log  # noqa: E402
MODES = ("baseline", "hyper", "attnres", "mhar")


def load(path):
    recs = read_log(path)   # checkpoint.py's reader: a partial last line is left out
    evals = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
    speeds = [r["tok_per_s"] for r in recs if "tok_per_s" in r][3:]   # the first windows hold compilation
    steps = sorted(evals)
    return dict(evals=evals, last=steps[-1], final=evals[steps[-1]], tail=statistics.mean(evals[s] for s in steps[-5:]),
                tok_s=statistics.median(speeds) if speeds else float("nan"))


def runs(log_dir):
    out = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "*.log.jsonl"))):
        name = os.path.basename(path)[:-len(".log.jsonl")]
        m = re.fullmatch(r"(\w+?)_s(\d+)(?:_h(\d+))?(\.partial)?", name)
        if m:
            out[name] = dict(load(path), mode=m[1], seed=int(m[2]), heads=int(m[3]) if m[3] else None, partial=bool(m[4]))
    return out


def tables(rs):
    lines = ["| run | steps | final val | tail-5 val | paired delta final | paired delta tail | tok/s |", "|---|---|---|---|---|---|---|"]
    deltas = {}
    for name, r in sorted(rs.items(), key=lambda kv: (kv[1]["heads"] or 0, MODES.index(kv[1]["mode"]), kv[1]["seed"])):
        base = rs.get(f"baseline_s{r['seed']}")
        paired = base is not None and r["mode"] != "baseline" and not r["partial"] and r["heads"] is None
        df, dt = (r["final"] - base["final"], r["tail"] - base["tail"]) if paired else (None, None)
        if paired:
            deltas.setdefault(r["mode"], []).append((df, dt))
        fmt = lambda x: "-" if x is None else f"{x:+.4f}"
        lines.append(f"| {name} | {r['last']} | {r['final']:.4f} | {r['tail']:.4f} | {fmt(df)} | {fmt(dt)} | {r['tok_s']:,.0f} |")
    lines += ["", "| mode | seeds | mean paired delta, final | mean paired delta, tail-5 | spread (max - min), tail-5 |",
              "|---|---|---|---|---|"]
    for mode, ds in deltas.items():
        tails = [d[1] for d in ds]
        lines.append(f"| {mode} | {len(ds)} | {statistics.mean(d[0] for d in ds):+.4f} | {statistics.mean(tails):+.4f} | "
                     f"{max(tails) - min(tails):.4f} |")
    return "\n".join(lines)


def head_sweep(rs):
    """(H, final, tail) of the seed-0 runs that differ only in routing heads: attnres is H = 1, mhar's default 4."""
    sweep = [((r["heads"] or 4) if r["mode"] == "mhar" else 1, r["final"], r["tail"]) for r in rs.values()
             if r["mode"] in ("attnres", "mhar") and r["seed"] == 0 and not r["partial"]]
    return sorted(sweep)


def sweep_table(rs):
    base = rs.get("baseline_s0")
    lines = ["| routing heads H | final val | tail-5 val | tail-5 vs baseline s0 |", "|---|---|---|---|"]
    for h, final, tail in head_sweep(rs):
        lines.append(f"| {h}{' (attnres)' if h == 1 else ''} | {final:.4f} | {tail:.4f} | "
                     + (f"{tail - base['tail']:+.4f} |" if base else "- |"))
    return "\n".join(lines)


def plots(rs, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = dict(baseline="tab:gray", hyper="tab:green", attnres="tab:blue", mhar="tab:red")
    fig, (ax, gap) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    for name, r in sorted(rs.items()):
        if r["heads"] is not None:
            continue
        style = dict(color=colors[r["mode"]], marker=".", linestyle="-" if r["seed"] == 0 else "--")
        steps = [s for s in sorted(r["evals"]) if s >= 300]
        ax.plot(steps, [r["evals"][s] for s in steps], label=name + (" (stopped early)" if r["partial"] else ""), **style)
        base = rs.get(f"baseline_s{r['seed']}")
        if base and r["mode"] != "baseline":   # the paired gap: same initialisation and data order
            steps = [s for s in steps if s in base["evals"]]
            gap.plot(steps, [r["evals"][s] - base["evals"][s] for s in steps], label=name, **style)
    ax.set(xlabel="step", ylabel="validation loss", title="100M, 2,000 steps x 32k tokens (books+Wikipedia, GPT-2 BPE)")
    gap.set(xlabel="step", ylabel="validation loss - baseline (same seed)", title="paired gap to the baseline")
    gap.axhline(0, color="tab:gray", linestyle=":")
    for a in (ax, gap):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.savefig(os.path.join(out_dir, "val_curves.png"), dpi=110)
    plt.close(fig)
    sweep = head_sweep(rs)
    if len(sweep) > 1:
        fig, ax = plt.subplots(figsize=(5, 3.5), layout="constrained")
        ax.plot([h for h, _, _ in sweep], [t for _, _, t in sweep], marker="o", color="tab:red")
        base = rs.get("baseline_s0")
        if base:
            ax.axhline(base["tail"], color="tab:gray", linestyle=":", label="baseline")
            ax.legend(fontsize=8)
        ax.set(xscale="log", xlabel="routing heads H", ylabel="tail-5 validation loss", title="MHAR head sweep, seed 0")
        ax.set_xticks([h for h, _, _ in sweep], [str(h) for h, _, _ in sweep])
        fig.savefig(os.path.join(out_dir, "h_sweep.png"), dpi=110)
        plt.close(fig)


def main(argv):
    log_dir = argv[0] if argv else os.path.join(HERE, "logs")
    rs = runs(log_dir)
    if not rs:
        sys.exit(f"report.py: no MODE_sSEED[_hH].log.jsonl files in {log_dir}")
    print(tables(rs))
    print()
    print(sweep_table(rs))
    plots(rs, os.path.dirname(os.path.abspath(log_dir)))


if __name__ == "__main__":
    main(sys.argv[1:])
