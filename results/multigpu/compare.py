"""
DDP parity of two train.py logs of the same config (issue 8): per-step training loss and per-eval validation loss
of a 1-GPU and an N-GPU run at the same global batch, and the N-GPU run's scaling efficiency.

  python results/multigpu/compare.py out/ddp_1gpu/log.jsonl out/ddp_2gpu/log.jsonl 2
"""
import json
import statistics
import sys


def load(path):
    recs = [json.loads(line) for line in open(path)]
    train = {r["step"]: r["loss"] for r in recs if "loss" in r}
    val = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
    speed = statistics.median([r["tok_per_s"] for r in recs if "tok_per_s" in r][5:])   # after compilation
    return train, val, speed


def main(one, many, n):
    (t1, v1, s1), (tn, vn, sn) = load(one), load(many)
    steps = sorted(set(t1) & set(tn))
    diffs = [abs(t1[s] - tn[s]) for s in steps]
    worst = max(range(len(steps)), key=lambda i: diffs[i])
    print(f"training loss, {len(steps)} common steps: max |diff| {diffs[worst]:.4f} at step {steps[worst]} "
          f"({t1[steps[worst]]:.4f} vs {tn[steps[worst]]:.4f}), mean |diff| {statistics.mean(diffs):.4f}")
    for s in sorted(set(v1) & set(vn)):
        print(f"val step {s}: {v1[s]:.4f} (1 GPU) vs {vn[s]:.4f} ({n} GPUs), diff {vn[s] - v1[s]:+.4f}")
    print(f"tokens/s: {s1:,.0f} on 1 GPU, {sn:,.0f} on {n} GPUs: {sn / s1:.2f}x, scaling efficiency {sn / (n * s1):.1%}")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
