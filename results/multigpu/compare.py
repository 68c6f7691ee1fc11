"""
DDP parity of two train.py logs of the same config: per-step training loss and per-eval validation loss
of run A (1 GPU) and run B (N GPUs, same global batch), and B's scaling efficiency when N is given. Two 1-GPU
runs (again, or another micro_batch) give the noise floor that the N-GPU difference is judged against.

  python results/multigpu/compare.py out/ddp_1gpu/log.jsonl out/ddp_2gpu/log.jsonl 2
  python results/multigpu/compare.py results/multigpu/logs/ddp_1gpu.log.jsonl results/multigpu/logs/ddp_1gpu_again.log.jsonl

--table DIR N: the scaling table of `run.sh scaling`'s logs in DIR (SCALE_MODE_1gpu, SCALE_MODE_Ngpu[_overlap],
SCALE_MODE_1gpu_again), one row per N-GPU run: tokens/s on 1 and N GPUs, scaling efficiency, and the loss
difference to the 1-GPU run beside the 1-GPU run-to-run difference where a repeat was run.

  python results/multigpu/compare.py --table results/multigpu/logs 8
"""
import glob
import json
import os
import re
import statistics
import sys


def load(path):
    recs = [json.loads(line) for line in open(path)]
    train = {r["step"]: r["loss"] for r in recs if "loss" in r}
    val = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
    speed = statistics.median([r["tok_per_s"] for r in recs if "tok_per_s" in r][5:])   # after compilation
    return train, val, speed


def label(path):
    name = os.path.basename(path).removesuffix(".jsonl").removesuffix(".log")
    return os.path.basename(os.path.dirname(os.path.abspath(path))) if name == "log" else name


def differences(a, b):
    """(steps in common, |training loss difference| per step, val-loss difference b - a at the last common eval)."""
    (ta, va, _), (tb, vb, _) = a, b
    steps = sorted(set(ta) & set(tb))
    last = max(set(va) & set(vb))
    return steps, [abs(ta[s] - tb[s]) for s in steps], vb[last] - va[last]


def table(folder, n):
    runs = {m.group(1, 2, 3, 4): path for path in glob.glob(os.path.join(folder, "*.log.jsonl"))
            if (m := re.fullmatch(r"(\w+?)_(\w+?)_(\d+)gpu(_\w+)?\.log\.jsonl", os.path.basename(path)))}
    lines = [f"| scale | mode | gradient average | tok/s: 1 GPU, {n} GPUs | speedup, scaling efficiency | "
             f"train loss, max / mean abs. diff: {n} GPUs vs 1 | the same, 1 GPU again vs 1 | final val diff: {n} GPUs, again |",
             "|---|---|---|---|---|---|---|---|"]
    size = lambda scale: float(scale[:-1]) * (1e3 if scale.endswith("b") else 1) if re.fullmatch(r"[\d.]+[mb]", scale) else 0
    for (scale, mode, gpus, extra), path in sorted(runs.items(), key=lambda kv: (size(kv[0][0]), kv[0][1], kv[0][3] or "")):
        one = runs.get((scale, mode, "1", None))
        if gpus == "1" or one is None:
            continue
        a, b = load(one), load(path)
        _, diffs, val = differences(a, b)
        again = runs.get((scale, mode, "1", "_again"))
        if again:
            _, spread, val_again = differences(a, load(again))
        noise = f"{max(spread):.4f} / {statistics.mean(spread):.4f}" if again else "-"
        lines.append(f"| {scale} | {mode} | {(extra or '_after')[1:]} | {a[2]:,.0f}, {b[2]:,.0f} | {b[2] / a[2]:.2f}x, "
                     f"{b[2] / (int(gpus) * a[2]):.1%} | {max(diffs):.4f} / {statistics.mean(diffs):.4f} | {noise} | "
                     f"{val:+.4f}, " + (f"{val_again:+.4f}" if again else "-") + " |")
    print("\n".join(lines))


def main(a, b, n=None):
    (ta, va, sa), (tb, vb, sb), la, lb = load(a), load(b), label(a), label(b)
    steps, diffs, _ = differences((ta, va, sa), (tb, vb, sb))
    worst = max(range(len(steps)), key=lambda i: diffs[i])
    print(f"{la} vs {lb}: training loss, {len(steps)} common steps: max |diff| {diffs[worst]:.4f} at step "
          f"{steps[worst]} ({ta[steps[worst]]:.4f} vs {tb[steps[worst]]:.4f}), mean |diff| {statistics.mean(diffs):.4f}")
    for s in sorted(set(va) & set(vb)):
        print(f"val step {s}: {va[s]:.4f} vs {vb[s]:.4f}, diff {vb[s] - va[s]:+.4f}")
    print(f"tokens/s: {sa:,.0f} ({la}), {sb:,.0f} ({lb})"
          + (f": {sb / sa:.2f}x on {n} GPUs, scaling efficiency {sb / (n * sa):.1%}" if n else ""))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--table"] and len(sys.argv) == 4:
        table(sys.argv[2], int(sys.argv[3]))
    elif len(sys.argv) in (3, 4):
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) == 4 else None)
    else:
        sys.exit(__doc__)
