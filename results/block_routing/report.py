"""
Block routing's reduced-budget comparison (README.md, the analyses fixed before the runs): block runs (run.sh with
EXTRA=--route_blocks=N, named as full runs are; n = 4 in logs/, n = 8 in logs_n8/) against the temperature study's
full-routing runs of the same seeds; the arithmetic is the study's (results/temperature_study/report.py: paired
deltas, SE, t, intervals).

  python results/block_routing/report.py [--blocks=N] [BLOCK_LOG_DIR [FULL_LOG_DIR]]
"""
import argparse
import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("study", os.path.join(HERE, "..", "temperature_study", "report.py"))
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)
LOGS = {4: "logs", 8: "logs_n8"}   # each block count's runs: the names do not show n


def plan(n):
    """The comparisons fixed before the runs, the same for every n: (planned pairs, interactions, descriptions)."""
    m, a = f"mhar_block{n}", f"attnres_block{n}"
    return ([("100m", m, "mhar"), ("100m", a, "attnres"),   # 1. what blocking costs each
             ("100m", a, m)],                                # 2. heads under blocking
            [("100m", (a, "attnres"), (m, "mhar"))],         # 3. does blocking hurt one more?
            [("100m", m, "baseline"), ("100m", a, "baseline")])   # 4. descriptions


def merged(block_dir, full_dir, n=4):
    """The study's runs, with the block runs' configs renamed CONFIG_blockN (only zero-init, s = 1 runs are used)."""
    rs = {k: v for k, v in study.runs(full_dir).items() if k[1] in ("baseline", "attnres", "mhar")}
    rs.update({(shape, f"{cfg}_block{n}", seed): v for (shape, cfg, seed), v in study.runs(block_dir).items()
               if cfg in ("attnres", "mhar")})
    return rs


def report(rs, n=4):
    pairs, interactions, added = plan(n)
    head = ["| shape | A - B | seeds | per-seed deltas, tail-5 | mean +- SE, tail-5 | \\|mean\\| / SE (95%: >) | "
            "same sign | mean +- SE, final | 95% interval, tail-5 | seeds for 80% power |", "|" + "---|" * 10]
    lines = ["| config | seed | tail-5 | final |", "|---|---|---|---|"]
    lines += [f"| {c} | {s} | {r['tail']:.4f} | {r['final']:.4f} |" for (sh, c, s), r in sorted(rs.items())
              if c.endswith(f"_block{n}")]
    for title, rows in (("planned", [study.pair_row(rs, *p) for p in pairs]
                         + [study.interaction_row(rs, *i) for i in interactions]),
                        ("descriptions, no test", [study.pair_row(rs, *p) for p in added])):
        lines += ["", f"Comparisons, {title}:", ""] + head + [r for r in rows if r]
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=4, choices=sorted(LOGS), help="the runs' --route_blocks")
    ap.add_argument("block_dir", nargs="?", help="the block runs' logs (default: logs/ for n = 4, logs_n8/ for 8)")
    ap.add_argument("full_dir", nargs="?", default=os.path.join(HERE, "..", "temperature_study", "logs"),
                    help="full routing's logs (default: the temperature study's)")
    args = ap.parse_args()
    block_dir = args.block_dir or os.path.join(HERE, LOGS[args.blocks])
    rs = merged(block_dir, args.full_dir, args.blocks)
    if not any(c.endswith(f"_block{args.blocks}") for _, c, _ in rs):
        raise SystemExit(f"no finished block runs in {block_dir}: see README.md for the run.sh command")
    print(report(rs, args.blocks))
