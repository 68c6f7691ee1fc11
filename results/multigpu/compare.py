"""
DDP parity of two train.py logs of the same config: per-step training loss and per-eval validation loss
of run A (1 GPU) and run B (N GPUs, same global batch), and B's scaling efficiency when N is given. Two 1-GPU
runs (again, or another micro_batch) give the noise floor that the N-GPU difference is judged against.

  python results/multigpu/compare.py out/ddp_1gpu/log.jsonl out/ddp_2gpu/log.jsonl 2
  python results/multigpu/compare.py results/multigpu/logs/ddp_1gpu.log.jsonl results/multigpu/logs/ddp_1gpu_again.log.jsonl
"""
import json
import os
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


def main(a, b, n=None):
    (ta, va, sa), (tb, vb, sb), la, lb = load(a), load(b), label(a), label(b)
    steps = sorted(set(ta) & set(tb))
    diffs = [abs(ta[s] - tb[s]) for s in steps]
    worst = max(range(len(steps)), key=lambda i: diffs[i])
    print(f"{la} vs {lb}: training loss, {len(steps)} common steps: max |diff| {diffs[worst]:.4f} at step "
          f"{steps[worst]} ({ta[steps[worst]]:.4f} vs {tb[steps[worst]]:.4f}), mean |diff| {statistics.mean(diffs):.4f}")
    for s in sorted(set(va) & set(vb)):
        print(f"val step {s}: {va[s]:.4f} vs {vb[s]:.4f}, diff {vb[s] - va[s]:+.4f}")
    print(f"tokens/s: {sa:,.0f} ({la}), {sb:,.0f} ({lb})"
          + (f": {sb / sa:.2f}x on {n} GPUs, scaling efficiency {sb / (n * sa):.1%}" if n else ""))


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) == 4 else None)
