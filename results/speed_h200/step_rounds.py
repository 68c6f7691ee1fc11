"""The 100M training step, baseline against MHAR and the single head, in rounds of alternating order, one process.

Each round times the three variants with bench.bench_one at bench.py's paper settings (graphed, compiled, the paper's
vocabulary, 20 timed steps after 5 warm-up steps, median); even rounds run baseline, MHAR, single head, odd rounds the
reverse, so a drift of the GPU's capped clock over the process favours neither side. A round's ratio is the variant's
tokens/s over the same round's baseline. Rounds run until the time budget (seconds) is spent.

    python results/speed_h200/step_rounds.py OUT.json [budget_s] [scale]
"""
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import bench  # noqa: E402

VARIANTS = ("baseline", "mhar_fused", "attnres_fused")


def main(out, budget_s=360.0, scale="100m"):
    start, rounds = time.time(), []
    while time.time() - start < budget_s:
        order = VARIANTS if len(rounds) % 2 == 0 else VARIANTS[::-1]
        row = {}
        for variant in order:
            r = bench.bench_one(scale, variant, "cuda", 20, 5, True, bench.PAPER_VOCAB, None, True)
            row[variant] = r["tok_s"]
            print(f"round {len(rounds)} {scale} {variant:14s} {r['tok_s']:10,.0f} tok/s  {r['step_ms']:6.2f} ms",
                  flush=True)
        rounds.append(row)
        print(f"round {len(rounds) - 1}: " + ", ".join(f"{v} {row[v] / row['baseline']:.4f}x" for v in VARIANTS[1:]),
              flush=True)
    summary = {}
    for v in VARIANTS[1:]:
        ratios = [row[v] / row["baseline"] for row in rounds]
        summary[v] = dict(ratios=ratios, mean=statistics.mean(ratios),
                          sd=statistics.stdev(ratios) if len(ratios) > 1 else None)
        print(f"{v}: mean {summary[v]['mean']:.4f}x over {len(ratios)} rounds"
              + (f", sd {summary[v]['sd']:.4f}" if summary[v]['sd'] is not None else ""))
    with open(out, "w") as f:
        json.dump(dict(scale=scale, rounds=rounds, summary=summary), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], *(float(a) for a in sys.argv[2:3]), *sys.argv[3:4])
