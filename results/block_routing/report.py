"""
Block routing's reduced-budget comparison (README.md, the analysis fixed before the runs): block runs from logs/
(run.sh with EXTRA=--route_blocks=4, named as full runs are) against the temperature study's full-routing runs of the
same seeds; the arithmetic is the study's (results/temperature_study/report.py: paired deltas, SE, t, intervals).

  python results/block_routing/report.py [BLOCK_LOG_DIR [FULL_LOG_DIR]]
"""
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("study", os.path.join(HERE, "..", "temperature_study", "report.py"))
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)
SUFFIX = "_block4"   # the block runs' configs, beside the full ones: mhar_block4 against mhar
PLAN = [("100m", "mhar_block4", "mhar"), ("100m", "attnres_block4", "attnres"),   # 1. what blocking costs each
        ("100m", "attnres_block4", "mhar_block4")]                                 # 2. heads under blocking
INTERACTIONS = [("100m", ("attnres_block4", "attnres"), ("mhar_block4", "mhar"))]  # 3. blocking hurts one more?
ADDED = [("100m", "mhar_block4", "baseline"), ("100m", "attnres_block4", "baseline")]   # 4. descriptions


def merged(block_dir, full_dir):
    """The study's runs, with the block runs' configs renamed CONFIG_block4 (only zero-init, s = 1 runs are used)."""
    rs = {k: v for k, v in study.runs(full_dir).items() if k[1] in ("baseline", "attnres", "mhar")}
    rs.update({(shape, cfg + SUFFIX, seed): v for (shape, cfg, seed), v in study.runs(block_dir).items()
               if cfg in ("attnres", "mhar")})
    return rs


def report(rs):
    head = ["| shape | A - B | seeds | per-seed deltas, tail-5 | mean +- SE, tail-5 | \\|mean\\| / SE (95%: >) | "
            "same sign | mean +- SE, final | 95% interval, tail-5 | seeds for 80% power |", "|" + "---|" * 10]
    lines = ["| config | seed | tail-5 | final |", "|---|---|---|---|"]
    lines += [f"| {c} | {s} | {r['tail']:.4f} | {r['final']:.4f} |" for (sh, c, s), r in sorted(rs.items())
              if c.endswith(SUFFIX)]
    for title, rows in (("planned", [study.pair_row(rs, *p) for p in PLAN]
                         + [study.interaction_row(rs, *i) for i in INTERACTIONS]),
                        ("descriptions, no test", [study.pair_row(rs, *p) for p in ADDED])):
        lines += ["", f"Comparisons, {title}:", ""] + head + [r for r in rows if r]
    return "\n".join(lines)


if __name__ == "__main__":
    block_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "logs")
    full_dir = sys.argv[2] if len(sys.argv) > 2 else os.path.join(HERE, "..", "temperature_study", "logs")
    rs = merged(block_dir, full_dir)
    if not any(c.endswith(SUFFIX) for _, c, _ in rs):
        raise SystemExit(f"no finished block runs in {block_dir}: see README.md for the run.sh command")
    print(report(rs))
