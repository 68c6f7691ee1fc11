"""
The temperature study's report, from run.sh's logs (NAME.log.jsonl, NAME = SHAPE_MODE_sSEED[_xSCALE][_hH][_qINIT]):
per-run metrics, the pre-registered paired comparisons (README.md: fixed before the runs), the s sweep, plots.

  python results/temperature_study/report.py      # logs/: prints the markdown tables, writes curves_SHAPE.png,
                                                  # scale_sweep.png and head_vs_scale.png here
  python results/temperature_study/report.py results/temperature_study/logs_paper   # BUDGET=paper's runs; the
                                                  # figures go into that folder (--fig_dir to choose)

Metrics: tail-5 = the mean of the last 5 evals (the primary metric: steps 1600-2000 at the reduced budget, 18k-20k at
the paper's), final = the last eval, last-11 = the mean of the last 11 evals (the paper's metric: steps 15k-20k of its
20k; steps 1000-2000 at the reduced budget, which evaluates every 100 steps). A comparison A - B pairs the runs of one
seed (same initialisation of the shared weights, same data order): per-seed deltas, their mean, standard error (sd /
sqrt(n)), t = mean / SE with the two-sided 95% critical value of Student's t for n - 1 degrees of freedom, how many
seeds agree in sign, and how many seeds a test at 95% would need for 80% power if the true delta were this mean at
this spread (power by the exact noncentral t, integrated numerically: t_power). The third study adds an equivalence
test (two one-sided t-tests at 5%: the 90% interval inside +-MARGIN) and the power to find a delta of MARGIN at the
measured spread.
"""
import glob
import math
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from metrics import read_log  # noqa: E402
# Student's t, two-sided 95%: critical values for 1..10 degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
# ... and one-sided 95% (two-sided 90%), the equivalence test's
T90 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812}
# the comparisons, fixed before the runs (README.md): (shape, A, B), a config = MODE[_xSCALE][_hH][_qINIT]
PLAN = [("100m", "attnres_x0.5", "mhar"),       # the decisive one: single head at H = 4's temperature against MHAR
        ("100m", "attnres", "mhar"),            # the paper's claim at this budget
        ("100m", "attnres", "attnres_x0.5"),    # what the temperature alone buys
        ("100m", "mhar", "baseline"), ("100m", "attnres", "baseline"), ("100m", "attnres_x0.5", "baseline"),
        ("124m", "attnres_x0.5", "mhar"), ("124m", "attnres", "mhar"), ("124m", "attnres", "attnres_x0.5")]
# the second study, fixed before its runs (README.md: "The paper's condition and the router's speed")
PLAN2 = [  # 100M, zero init: MHAR's H against the single head's s, under s = 1/H and s = 1/sqrt(H)
         ("100m", "attnres_x0.5", "mhar_h2"), ("100m", "attnres_x0.25", "mhar"), ("100m", "attnres_x0.125", "mhar_h8"),
         ("100m", "attnres_x0.0625", "mhar_h16"), ("100m", "attnres_x0.25", "mhar_h16"),
         # does a faster router take back what 16 heads lose?
         ("100m", "mhar_h16", "mhar"), ("100m", "mhar_x2_h16", "mhar_h16"), ("100m", "mhar_x4_h16", "mhar_h16"),
         ("100m", "mhar_x4_h16", "mhar"),
         # 124M, the paper's random-init queries (std 0.02); then the 1/H match with zero init
         ("124m", "attnres_q0.02", "mhar_q0.02"), ("124m", "attnres_x0.5_q0.02", "mhar_q0.02"),
         ("124m", "attnres_q0.02", "attnres"), ("124m", "mhar_q0.02", "mhar"), ("124m", "attnres_x0.25", "mhar"),
         # 350M, random init (optional; 2 seeds: a direction only)
         ("350m", "attnres_q0.02", "mhar_q0.02"), ("350m", "attnres_x0.354_q0.02", "mhar_q0.02"),
         ("350m", "attnres_q0.02", "baseline"), ("350m", "mhar_q0.02", "baseline")]
# the third study, fixed before its runs (README.md: "The third study"): 350M, zero init, MHAR H = 8 (the KV heads,
# run.sh's default there) against the single head at its router speed under s = 1/H (the primary comparison, which
# alone decides), then the plain single head against each (the secondary two, Holm-corrected)
PLAN3 = [("350m", "attnres_x0.125", "mhar"), ("350m", "attnres", "mhar"), ("350m", "attnres", "attnres_x0.125")]
PLAN3_LABELS = ["single head s = 1/8 - MHAR H = 8 (primary)",
                "single head s = 1 - MHAR H = 8 (the paper's comparison, here at LR 1e-3; its draft's at 5e-4)",
                "single head s = 1 - s = 1/8 (router speed alone)"]
PLAN3_SEEDS = (0, 1, 2, 3)   # every PLAN3 config's seeds
EXTENSION = (4, 5)           # the primary pair's seeds 4-5, run and analysed (n = 6, t(5)) only when ...
EXTEND_SD = 0.011            # ... the SD of its four tail-5 deltas (seeds 0-3) is above this; nothing else adds seeds
# the fourth study, fixed before its runs (README.md: "The fourth study"): 350M, zero init, LR 1e-3, seeds 0-3 of the
# baseline, MHAR H = 8 at s = 2 (its router twice as fast) and MHAR H = 4 at s = 1, read beside the third study's arms.
# G8 alone decides (tested alone); the other four are one Holm family. The decision rules read G8 and G4 (PLAN4_RULES).
PLAN4 = [("350m", "attnres_x0.125", "mhar_x2"),   # G8 (primary): the single head at s = 1/8 - MHAR H = 8 at s = 2
         ("350m", "mhar", "baseline"),            # the paper's Table 1 claim: MHAR H = 8 ahead of the baseline
         ("350m", "attnres", "baseline"),         # ... and the single head at s = 1 behind it (regresses)?
         ("350m", "attnres_x0.125", "mhar_h4"),   # G4: the single head at s = 1/8 - MHAR H = 4
         ("350m", "mhar_h4", "mhar_x2")]          # D: MHAR H = 4 - MHAR H = 8 at s = 2
PLAN4_LABELS = ["G8: single head s = 1/8 - MHAR H = 8 at s = 2 (primary)",
                "T1: MHAR H = 8 - baseline (the paper's Table 1: MHAR ahead)",
                "T2: single head s = 1 - baseline (the paper's FineWeb Table 1: the single head behind)",
                "G4: single head s = 1/8 - MHAR H = 4",
                "D: MHAR H = 4 - MHAR H = 8 at s = 2"]
PLAN4_SEEDS = (0, 1, 2, 3)   # every PLAN4 config's seeds; G8 extends to seeds 4-5 by PLAN3's rule (EXTEND_SD)
PLAN4_BAND = 0.02            # "inside +-0.02": a comparison's 90% interval (the equivalence test's) inside +-PLAN4_BAND
PLAN4_COST = -0.04           # "below -0.04": a comparison's 95% upper bound below PLAN4_COST
PLAN4_KL_STEPS = (300, 1000)  # the manipulation check: MHAR H = 8 at s = 2's mean KL from uniform over these evals ...
PLAN4_KL_RANGE = (0.7, 1.4)   # ... over the single head at s = 1/8's (same seeds and evals) lies in this range
PLAN4_RULES = """outcomes, in this order (G8 and G4: tail-5, n = 4 unless G8 extends):
  manipulation check: MHAR H = 8 at s = 2's routing KL from uniform at steps 300-1,000 is 0.7-1.4x the single head's at
    s = 1/8; if not, (b) is not matched and G8 is read only as one dose point (the closure below), never as
    'speed account' or 'head cost'
  speed account: G8 and G4 both inside +-0.02 (90% intervals): the third study's gap is router speed; its head-cost
    reading is withdrawn
  head cost: G8's 95% upper bound below -0.04 and G4 inside +-0.02: eight heads cost more than a matched router speed
  scale or regime: G4's 95% upper bound below -0.04 (four heads trail the single head at s = 1/8 too; read whether or
    not the manipulation check passes)
  otherwise (and for a dose point): the closure 1 - G8 / C1, C1 the third study's primary mean, with its range as G8
    runs over its 95% interval"""
# the paper's 350M numbers (tail-mean of its last 11 evals, 20k steps, Qwen3 tokenizer), both versions, each with its
# conditions: T1 and T2 there are MHAR - baseline and single head - baseline
PAPER_350M = {"FineWeb-Edu version (its Table 1: LR 1e-3, random-init queries as its later draft says)":
              dict(baseline=3.290, hyper=3.260, attnres=3.345, mhar=3.210),
              "later draft (its anneal corpus, zero-init queries, LR 5e-4, MHAR H = 8)":
              dict(baseline=2.997, hyper=2.931, attnres=2.876, mhar=2.848)}
# the router's speed as the runs measured it (router_speed): each arm beside a reference arm at these steps, paired by
# seed; a description, no test
SPEED_STEPS = (100, 300, 500, 1000, 2000)
SPEED_TABLES = [("350m", "attnres_x0.125", ["attnres", "mhar", "mhar_x2", "mhar_h4"])]   # --speed adds others
MARGIN = 0.028   # the later draft's 350M gap, MHAR - single head (zero init, its anneal corpus, LR 5e-4, one seed)
# differences of paired differences: does random init hurt the single head more than MHAR (the later draft's claim)?
INTERACTIONS = [("124m", ("attnres_q0.02", "attnres"), ("mhar_q0.02", "mhar")),
                ("124m", ("attnres_x0.5_q0.02", "attnres_x0.5"), ("mhar_q0.02", "mhar"))]
# comparisons added after the planned runs were seen: printed apart, as descriptions (their t is shown, not tested)
ADDED = [("124m", "mhar", "baseline"), ("124m", "attnres", "baseline"), ("124m", "attnres_x0.5", "baseline"),
         ("124m", "attnres_x0.25", "attnres_x0.5"),   # the 1/H match against the 1/sqrt(H) one, single heads
         # MHAR H = 16 at s against the single head at s / 16, its router speed under s = 1/H
         ("100m", "mhar_x2_h16", "attnres_x0.125"), ("100m", "mhar_x4_h16", "attnres_x0.25")]


CONFIG = re.compile(r"(baseline|attnres|mhar)(?:_x([\d.]+))?(?:_h(\d+))?(?:_q([\d.]+))?")


def parse(cfg):
    """(mode, route_scale, route_heads or None, route_init_std) of a config name MODE[_xSCALE][_hH][_qINIT]."""
    m = CONFIG.fullmatch(cfg)
    return m[1], float(m[2] or 1), int(m[3]) if m[3] else None, float(m[4] or 0)


def family(cfg):
    """A config without its route_scale: one curve of the s sweep."""
    mode, _, heads, init = parse(cfg)
    return mode + (f"_h{heads}" if heads else "") + (f"_q{init:g}" if init else "")


def t95(df):
    """Student's two-sided 95% critical value: the table, else the Cornish-Fisher expansion (error < 0.002)."""
    return T95.get(df) or cornish_fisher(1.959964, df)


def t90(df):
    """Student's one-sided 95% (two-sided 90%) critical value, the same way."""
    return T90.get(df) or cornish_fisher(1.644854, df)


def cornish_fisher(z, df):
    """Student's t quantile from the normal one, z, to the second order in 1 / df."""
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_power(effect, n, crit=None, points=4000):
    """Power of the two-sided paired t-test at 95% with n seeds when the true mean delta is `effect` per-seed standard
    deviations: T = (Z + lam) / S with lam = effect sqrt(n) and S = sqrt(V / nu), V ~ chi-square(nu = n - 1) (the
    noncentral t), so P(|T| > c) = E_S[Phi(lam - c S) + Phi(-lam - c S)], the expectation over S's density (a scaled
    chi) by the midpoint rule on [0, S_max]."""
    nu, lam, c = n - 1, abs(effect) * math.sqrt(n), crit or t95(n - 1)
    top = math.sqrt((nu + 12 * math.sqrt(2 * nu) + 40) / nu)   # S beyond this holds < 1e-12 of the mass
    log_norm = math.log(2) + (nu / 2) * math.log(nu / 2) - math.lgamma(nu / 2)   # S's density: chi(nu) / sqrt(nu)
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    total = 0.0
    for i in range(points):
        s = (i + 0.5) * top / points
        density = math.exp(log_norm + (nu - 1) * math.log(s) - nu * s * s / 2)
        total += density * (phi(lam - c * s) + phi(-lam - c * s))
    return total * top / points


def seeds_for_power(mean, sd, power=0.8):
    """Seeds a paired test at 95% needs for this power if the true delta is `mean` at per-seed spread `sd`."""
    if not sd or not mean:
        return None
    for n in range(2, 1000):
        if t_power(mean / sd, n) >= power:
            return n
    return None


def load(path):
    recs = read_log(path)   # checkpoint.py's reader: a partial last line is left out
    evals = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
    speed = {r["step"]: router_speed(r["routing"]) for r in recs if r.get("routing")}
    steps = sorted(evals)
    return dict(evals=evals, last=steps[-1], final=evals[steps[-1]], tail=statistics.mean(evals[s] for s in steps[-5:]),
                last11=statistics.mean(evals[s] for s in steps[-11:]), best=min(steps, key=evals.get), speed=speed)


def router_speed(routing):
    """How far routing has moved at one eval, from its log record (metrics.routing_stats): (the KL from uniform of the
    token-averaged weights, the spread of the token-averaged logits over the sources or None where the log predates
    it), each the mean over heads and over the sites with more than one source. A log without "kl" (written before it
    was logged) gives it as ln N - entropy, N = j at full routing's site j (the embedding and j - 1 sublayer outputs;
    every run of this study routes over the full history)."""
    kl = routing.get("kl") or [[math.log(j) - e for e in heads] for j, heads in enumerate(routing["entropy"], 1)]
    mean = lambda sites: statistics.mean(x for heads in sites[1:] for x in heads)  # noqa: E731  (site 1: one source)
    return mean(kl), mean(routing["logit_sd"]) if "logit_sd" in routing else None


def runs(log_dir):
    """{(shape, config, seed): metrics} of every finished run."""
    out = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "*.log.jsonl"))):
        m = re.fullmatch(r"(\w+?)_(baseline|attnres|mhar)_s(\d+)((?:_x[\d.]+)?(?:_h\d+)?(?:_q[\d.]+)?)",
                         os.path.basename(path)[:-len(".log.jsonl")])
        if m:
            out[(m[1], m[2] + m[4], int(m[3]))] = dict(load(path), tree=tree(path[:-len(".log.jsonl")] + ".txt"))
    return out


def tree(console):
    """The tree a run trained on: the last `git REV` header in its console log (run.sh appends every attempt's
    output, and the log.jsonl is the last attempt's), or None without one. A full commit id (MHAR_REVISION may give
    one) is shortened to git's 7 characters, so one tree reads the same in every header."""
    if not os.path.exists(console):
        return None
    with open(console, errors="replace") as f:
        revs = [re.sub(r"^([0-9a-f]{7})[0-9a-f]{33}", r"\1", m[1]) for m in re.finditer(r"^git (\S+)", f.read(), re.M)]
    return revs[-1] if revs else None


def paired(rs, shape, a, b, metric):
    """(per-seed deltas A - B, mean, SE, t, critical t) over the seeds both configs have."""
    seeds = sorted(s for (sh, c, s) in rs if sh == shape and c == a and (shape, b, s) in rs)
    d = [rs[(shape, a, s)][metric] - rs[(shape, b, s)][metric] for s in seeds]
    if len(d) < 2:
        return seeds, d, None
    return seeds, d, stats(d)


def stats(d):
    """mean, SE, t, the 95% critical t, the 95% and 90% intervals, the seeds for 80% power, and the power to find a
    delta of MARGIN at this spread, of per-seed deltas d."""
    mean, sd = statistics.mean(d), statistics.stdev(d)
    se, crit, crit90 = sd / math.sqrt(len(d)), t95(len(d) - 1), t90(len(d) - 1)
    return dict(n=len(d), mean=mean, sd=sd, se=se, t=mean / se if se > 0 else float("inf"), t95=crit,
                lo=mean - crit * se, hi=mean + crit * se, lo90=mean - crit90 * se, hi90=mean + crit90 * se,
                n80=seeds_for_power(mean, sd), power_margin=t_power(MARGIN / sd, len(d)) if sd > 0 else 1.0)


def p_value(st):
    """The two-sided p value of a paired t: P(|T| > |t|) for Student's t with n - 1 degrees of freedom, which is
    t_power at effect 0 with |t| as the critical value."""
    return t_power(0.0, st["n"], abs(st["t"])) if math.isfinite(st["t"]) else 0.0


def outcome(st, p=None, margin=MARGIN):
    """The third study's reading of a comparison A - B, fixed before its runs: separated from 0 (p below 0.05: its own
    p, or the Holm-adjusted one where given; lower loss is better, so a positive delta puts B ahead), equivalent
    within +-margin (both one-sided t-tests at 5% reject a delta of margin or more: the 90% interval lies inside
    +-margin), both, or neither."""
    said = []
    if (p_value(st) if p is None else p) < 0.05:
        said.append(("B" if st["mean"] > 0 else "A") + " ahead, separated")
    if -margin < st["lo90"] and st["hi90"] < margin:
        said.append(f"within +-{margin:g} (equivalent)")
    return "; ".join(said) or f"not separated, not shown within +-{margin:g}"


def interaction(rs, shape, first, second, metric):
    """(seeds, per-seed (A1 - B1) - (A2 - B2), stats or None) over the seeds that have all four configs."""
    seeds = sorted(s for (sh, c, s) in rs if sh == shape and c == first[0]
                   and all((shape, c2, s) in rs for c2 in (*first[1:], *second)))
    d = [(rs[(shape, first[0], s)][metric] - rs[(shape, first[1], s)][metric])
         - (rs[(shape, second[0], s)][metric] - rs[(shape, second[1], s)][metric]) for s in seeds]
    return seeds, d, stats(d) if len(d) > 1 else None


def tables(rs):
    lines = ["| shape | config | seed | steps | final | tail-5 | lowest val loss at step |", "|---|---|---|---|---|---|---|"]
    for (shape, cfg, seed), r in sorted(rs.items()):
        lines.append(f"| {shape} | {cfg} | {seed} | {r['last']} | {r['final']:.4f} | {r['tail']:.4f} | {r['best']} |")
    head = ["| shape | A - B | seeds | per-seed deltas, tail-5 | mean +- SE, tail-5 | \\|mean\\| / SE (95%: >) | "
            "same sign | mean +- SE, final | 95% interval, tail-5 | seeds for 80% power |", "|" + "---|" * 10]
    for title, pairs in (("planned", PLAN), ("the second study, planned", PLAN2),
                         ("added after the runs: descriptions, no test", ADDED)):
        rows = [pair_row(rs, *p) for p in pairs]
        if any(rows):
            lines += ["", f"Comparisons, {title}:", ""] + head + [r for r in rows if r]
    rows = [interaction_row(rs, *i) for i in INTERACTIONS]
    if any(rows):
        lines += ["", "Interactions, planned ((A1 - B1) - (A2 - B2), paired by seed):", ""] + head + [r for r in rows if r]
    return "\n".join(lines)


def pair_row(rs, shape, a, b):
    """One comparison's table row, or None when no seed has both configs."""
    seeds, d, st = paired(rs, shape, a, b, "tail")
    return row(shape, f"{a} - {b}", seeds, d, st, paired(rs, shape, a, b, "final")[2]) if seeds else None


def interaction_row(rs, shape, first, second):
    seeds, d, st = interaction(rs, shape, first, second, "tail")
    name = f"({first[0]} - {first[1]}) - ({second[0]} - {second[1]})"
    return row(shape, name, seeds, d, st, interaction(rs, shape, first, second, "final")[2]) if seeds else None


def row(shape, name, seeds, d, st, fin):
    same = max(sum(x > 0 for x in d), sum(x < 0 for x in d))
    return (f"| {shape} | {name} | {','.join(map(str, seeds))} | {' '.join(f'{x:+.4f}' for x in d)} | "
            + (f"{st['mean']:+.4f} +- {st['se']:.4f} | {abs(st['t']):.2f} ({st['t95']:.2f}) | {same}/{len(d)} | "
               f"{fin['mean']:+.4f} +- {fin['se']:.4f} | {st['lo']:+.4f} to {st['hi']:+.4f} | {st['n80'] or '-'} |"
               if st else "- | - | - | - | - | - |"))


def plan_seeds(rs, plan, base):
    """The seeds each comparison of a plan (its first, the primary, extends) is analysed on: the base seeds; the
    primary's base + EXTENSION when the SD of its tail-5 deltas on the base seeds is above EXTEND_SD. -> ({(a, b):
    seeds, or None while a planned run is missing}, [lines: what is pending, which rule applied, which present runs of
    the plan's configs are left out])."""
    notes, use, wants = [], {}, {}
    for i, (shape, a, b) in enumerate(plan):
        want = base
        have = [sd for sd in want if (shape, a, sd) in rs and (shape, b, sd) in rs]
        if i == 0 and have == list(base):
            sd4 = statistics.stdev(rs[(shape, a, x)]["tail"] - rs[(shape, b, x)]["tail"] for x in base)
            if sd4 > EXTEND_SD:
                want = base + EXTENSION
                have = [sd for sd in want if (shape, a, sd) in rs and (shape, b, sd) in rs]
            notes.append(f"the extension rule: the SD of the four primary tail-5 deltas is {sd4:.4f}, "
                         + (f"above {EXTEND_SD:g}: seeds 4-5 of the pair are run and the primary is analysed at n = 6"
                            if sd4 > EXTEND_SD else f"not above {EXTEND_SD:g}: the primary is analysed at n = 4"))
        wants[(a, b)] = list(want)
        use[(a, b)] = list(want) if have == list(want) else None
        if use[(a, b)] is None:
            missing = [f"{shape}_{c}_s{sd}" for sd in want for c in (a, b) if (shape, c, sd) not in rs]
            notes.append(f"{a} - {b}: pending, {len(missing)} planned run(s) missing: {' '.join(missing)}")
    if use[plan[0][1:]] is None:   # the extension is not decided yet: the pair's seeds 4-5 may still be planned
        wants[plan[0][1:]] = list(base + EXTENSION)
    planned = {(c, sd) for pair, seeds in wants.items() for c in pair for sd in seeds}
    configs = {c for pair in wants for c in pair}
    extra = sorted(k for k in rs if k[0] == plan[0][0] and k[1] in configs and k[1:] not in planned)
    if extra:
        notes.append("left out, not in the plan's seeds: " + " ".join(f"{sh}_{c}_s{sd}" for sh, c, sd in extra))
    return use, notes


def fmt_p(p):
    """A p value to three decimals, or its bound below 0.001 (where "0.000" would read as zero)."""
    return f"{p:.3f}" if p >= 0.0005 else "< 0.001"


def third_study(rs):
    """The third study's table, on exactly the planned seeds (plan_seeds): each PLAN3 comparison on tail-5, which
    decides, with its p (Holm-adjusted over the secondary comparisons, PLAN3[1:]; the primary one is tested alone), its
    95% interval, the 90% interval the equivalence test reads, the power to find MARGIN at the measured spread, the
    plan's outcome, and the seeds whose two runs trained on different trees (a rerun of one seed moved a run's tail-5
    by ~0.005: README.md); last-11 below each, described (no outcome); then the closure. "" without any 350M run."""
    if not any(k[0] == PLAN3[0][0] and k[1] in {c for _, a, b in PLAN3 for c in (a, b)} for k in rs):
        return ""
    use, notes = plan_seeds(rs, PLAN3, PLAN3_SEEDS)
    holm = holm_family(rs, PLAN3[1:], use)   # the secondary comparisons get Holm-adjusted p values, per metric
    lines, results = plan_table(rs, PLAN3, PLAN3_LABELS, use, holm, MARGIN)
    c1, c2 = results.get(("tail", *PLAN3[0][1:])), results.get(("tail", *PLAN3[1][1:]))
    if c1 and c2:
        notes.append("closure: " + closure(c1, c2, holm[("tail", *PLAN3[1][1:])]))
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


def plan_table(rs, plan, labels, use, holm, margin):
    """A planned study's table: each comparison (shape, A, B) on its seeds (use) on tail-5, which decides, with its p
    (Holm's where holm has it; the primary is tested alone), its 95% and 90% intervals, the power to find a delta of
    margin at the measured spread, the outcome (separated; equivalent within +-margin), and the seeds whose two runs
    trained on different trees; last-11 below it, described. -> (lines, {(metric, A, B): stats})."""
    lines = [f"| A - B | metric | seeds | per-seed deltas | mean +- SE | \\|t\\| (95%: >) | p | 95% interval "
             f"| 90% interval | power for {margin:g} | outcome | pairs from two trees |", "|" + "---|" * 12]
    results = {}
    for (shape, a, b), label in zip(plan, labels):
        if not use[(a, b)]:
            lines.append(f"| {label}: {a} - {b} | tail-5 | pending | - | - | - | - | - | - | - | - | - |")
            continue
        for metric, name in (("tail", "tail-5"), ("last11", "last-11 (described)")):
            seeds = use[(a, b)]
            d = [rs[(shape, a, x)][metric] - rs[(shape, b, x)][metric] for x in seeds]
            st = stats(d)
            adjusted = holm.get((metric, a, b))
            results[(metric, a, b)] = st
            p = fmt_p(p_value(st)) + (f" (Holm {fmt_p(adjusted)})" if adjusted is not None else "")
            power = t_power(margin / st["sd"], len(d)) if st["sd"] > 0 else 1.0
            mixed = [f"s{x}: {rs[(shape, a, x)]['tree']} / {rs[(shape, b, x)]['tree']}" for x in seeds
                     if rs[(shape, a, x)]["tree"] != rs[(shape, b, x)]["tree"]]
            lines.append(f"| {label if metric == 'tail' else ''}{': ' if metric == 'tail' else ''}"
                         f"{a} - {b} | {name} | {','.join(map(str, seeds))} | {' '.join(f'{x:+.4f}' for x in d)} | "
                         f"{st['mean']:+.4f} +- {st['se']:.4f} | {abs(st['t']):.2f} ({st['t95']:.3f}) | {p} | "
                         f"{st['lo']:+.4f} to {st['hi']:+.4f} | {st['lo90']:+.4f} to {st['hi90']:+.4f} | "
                         f"{power:.2f} | {outcome(st, adjusted, margin) if metric == 'tail' else 'descriptive'} | "
                         f"{', '.join(mixed) or 'none'} |")
    return lines, results


def fourth_study(rs, drift_dir=None, regime_dir=None):
    """The fourth study's reading (PLAN4, fixed before its runs): the table of its five comparisons (G8 tested alone,
    the other four one Holm family; equivalence within +-PLAN4_BAND), the manipulation check, the outcome by
    PLAN4_RULES, the closure against the third study's primary, the paper's two versions beside T1 and T2, and the
    drift check (the single head at s = 1/8, seed 0, rerun into drift_dir) and the regime check (regime_check, in
    regime_dir). "" before any of its runs."""
    shape = PLAN4[0][0]
    if not any(k[0] == shape and k[1] in ("baseline", "mhar_x2", "mhar_h4") for k in rs):
        return ""
    use, notes = plan_seeds(rs, PLAN4, PLAN4_SEEDS)
    holm = holm_family(rs, PLAN4[1:], use)
    lines, results = plan_table(rs, PLAN4, PLAN4_LABELS, use, holm, PLAN4_BAND)
    (_, ref, b), (_, _, c) = PLAN4[0], PLAN4[3]
    check = kl_ratio(rs, shape, b, ref, use[(ref, b)] or PLAN4_SEEDS)
    lo, hi = PLAN4_KL_RANGE
    if check is not None:
        notes.append(f"manipulation check: {b}'s KL from uniform at steps {PLAN4_KL_STEPS[0]}-{PLAN4_KL_STEPS[1]} is "
                     f"{check:.2f}x {ref}'s (the rule: {lo:g}-{hi:g}x): "
                     + ("met" if lo <= check <= hi else f"not met, so {b} is read as a dose point, not a matched arm"))
    c_ratio = kl_ratio(rs, shape, c, ref, use[(ref, c)] or PLAN4_SEEDS)
    if c_ratio is not None:
        notes.append(f"{c}'s KL at the same steps, described: {c_ratio:.2f}x {ref}'s")
    g8, g4 = results.get(("tail", ref, b)), results.get(("tail", ref, c))
    use3, _ = plan_seeds(rs, PLAN3, PLAN3_SEEDS)
    c1 = use3[PLAN3[0][1:]] and statistics.mean(rs[(shape, PLAN3[0][1], x)]["tail"] - rs[(shape, PLAN3[0][2], x)]["tail"]
                                                for x in use3[PLAN3[0][1:]])
    if g8 and g4 and check is not None:
        notes.append("outcome: " + plan4_outcome(g8, g4, lo <= check <= hi, c1))
    for version, v in PAPER_350M.items():
        notes.append(f"the paper at 350M, {version}: MHAR - baseline {v['mhar'] - v['baseline']:+.3f}, single head - "
                     f"baseline {v['attnres'] - v['baseline']:+.3f} (T1 and T2 there)")
    minima = [f"{shape}_{cfg}_s{sd} {rs[(shape, cfg, sd)]['best']}" for cfg in dict.fromkeys(x for p in PLAN4 for x in p[1:])
              for sd in PLAN4_SEEDS if (shape, cfg, sd) in rs]
    notes.append("the step of each run's lowest val loss: " + ", ".join(minima))
    notes += [x for x in (drift_check(rs, drift_dir), regime_check(rs, regime_dir)) if x]
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


def plan4_outcome(g8, g4, matched, c1):
    """PLAN4_RULES on G8 and G4 (tail-5 stats): 'inside' = the 90% interval within +-PLAN4_BAND, 'below' = the 95%
    upper bound under PLAN4_COST; matched: the manipulation check met; c1: the third study's primary mean."""
    inside = lambda st: -PLAN4_BAND < st["lo90"] and st["hi90"] < PLAN4_BAND  # noqa: E731
    below = lambda st: st["hi"] < PLAN4_COST  # noqa: E731
    if matched and inside(g8) and inside(g4):
        return "speed account: G8 and G4 inside +-0.02; the third study's head-cost reading is withdrawn"
    if matched and below(g8) and inside(g4):
        return "head cost: G8 below -0.04 and G4 inside +-0.02"
    if below(g4):
        return "scale or regime: G4 below -0.04"
    head = "a dose point (the manipulation check not met)" if not matched else "none of the three"
    if not c1:
        return f"{head}; the closure waits for the third study's primary"
    f = lambda g: 1 - g / c1  # noqa: E731
    return (f"{head}: the closure 1 - G8 / C1 (C1 = {c1:+.4f}, the third study's primary) is {f(g8['mean']):.0%}, "
            f"{min(f(g8['lo']), f(g8['hi'])):.0%} to {max(f(g8['lo']), f(g8['hi'])):.0%} over G8's 95% interval")


def kl_ratio(rs, shape, arm, ref, seeds, steps=PLAN4_KL_STEPS):
    """arm's KL from uniform (router_speed) averaged over the seeds and the evals at steps[0]..steps[1], over ref's on
    the same seeds and evals; None while a run is missing."""
    if not all((shape, c, x) in rs for c in (arm, ref) for x in seeds):
        return None
    total = lambda c: sum(kl for x in seeds for step, (kl, _) in rs[(shape, c, x)]["speed"].items()  # noqa: E731
                          if steps[0] <= step <= steps[1])
    return total(arm) / total(ref)


def drift_check(rs, drift_dir, name=("350m", "attnres_x0.125", 0), tolerance=0.01):
    """The drift check: a run of the plan repeated on a later tree into drift_dir, its tail-5 against its log's."""
    if not drift_dir:
        return ""
    shape, cfg, seed = name
    again = runs(drift_dir).get(name)
    if again is None or name not in rs:
        return f"drift check: pending ({shape}_{cfg}_s{seed} in {drift_dir})"
    d = again["tail"] - rs[name]["tail"]
    return (f"drift check: {shape}_{cfg}_s{seed} on tree {again['tree']} ends at tail-5 {again['tail']:.4f}, its log's "
            f"(tree {rs[name]['tree']}) {rs[name]['tail']:.4f}: {d:+.4f}, "
            + ("within" if abs(d) <= tolerance else "outside") + f" +-{tolerance:g}")


def regime_check(rs, regime_dir, seed=0):
    """The regime check (descriptive, one seed): the third study's primary pair (PLAN3's first row) trained on other
    text without repeating a document, validated on the same books_wiki documents, in regime_dir: its tail-5 delta
    beside the same seed's on books_wiki, each run's tail-5 and the step of its lowest val loss (and on books_wiki)."""
    if not regime_dir:
        return ""
    shape, a, b = PLAN3[0]
    again = runs(regime_dir)
    names = [(shape, c, seed) for c in (a, b)]
    if not all(n in again for n in names):
        return f"regime check: pending ({', '.join(f'{shape}_{c}_s{seed}' for _, c, _ in names)} in {regime_dir})"
    d = again[names[0]]["tail"] - again[names[1]]["tail"]
    here = (f"; on books_wiki, seed {seed}: {rs[names[0]]['tail'] - rs[names[1]]['tail']:+.4f}"
            if all(n in rs for n in names) else "")
    runs_said = ", ".join(f"{shape}_{n[1]}_s{seed} tail-5 {again[n]['tail']:.4f}, lowest at step {again[n]['best']}"
                          + (f" (books_wiki: {rs[n]['best']})" if n in rs else "") for n in names)
    return (f"regime check (one seed, described; no document repeated, validated on books_wiki's documents): {a} - {b} "
            f"tail-5 {d:+.4f}{here}; {runs_said}")


def speed_table(rs, shape, ref, arms, steps=SPEED_STEPS):
    """The router's speed: each arm's KL from uniform at the given steps (mean over its seeds), and beside it its ratio
    to ref's on the same seeds (per seed, paired: the mean and the range); then the logits' spread where the logs
    carry it. "" when ref has no run of the shape."""
    ref_seeds = {x for (sh, c, x) in rs if sh == shape and c == ref and rs[(sh, c, x)]["speed"]}
    if not ref_seeds:   # (the first studies' 100M and 124M logs were written before evals logged routing)
        return ""
    head = "| arm | seeds | " + " | ".join(f"step {st}" for st in steps) + " |"
    kl_lines = [f"{shape}: KL from uniform, mean over seeds (ratio to {ref}, paired by seed: mean, range)", "",
                head, "|---|---|" + "---|" * len(steps)]
    sd_lines = [f"{shape}: the logits' spread over the sources, mean over seeds (logged by runs of the fourth study "
                "on)", "", head, "|---|---|" + "---|" * len(steps)]
    for arm in [ref] + arms:
        seeds = sorted(x for (sh, c, x) in rs if sh == shape and c == arm and x in ref_seeds and rs[(sh, c, x)]["speed"])
        if not seeds:
            continue
        cells, sds = [], []
        for st in steps:
            kl = [rs[(shape, arm, x)]["speed"].get(st, (None, None)) for x in seeds]
            base = [rs[(shape, ref, x)]["speed"].get(st, (None, None))[0] for x in seeds]
            if any(k is None for k, _ in kl) or any(b is None or b <= 0 for b in base):
                cells.append("-")
            else:
                ratio = [k / b for (k, _), b in zip(kl, base)]
                cells.append(f"{statistics.mean(k for k, _ in kl):.4f} ({statistics.mean(ratio):.2f}x: "
                             f"{min(ratio):.2f}-{max(ratio):.2f})")
            sds.append(f"{statistics.mean(v for _, v in kl):.3f}" if all(v is not None for _, v in kl) else "-")
        label = f"{arm} (reference)" if arm == ref else arm
        kl_lines.append(f"| {label} | {','.join(map(str, seeds))} | " + " | ".join(cells) + " |")
        if any(x != "-" for x in sds):
            sd_lines.append(f"| {label} | {','.join(map(str, seeds))} | " + " | ".join(sds) + " |")
    return "\n".join(kl_lines + ([""] + sd_lines if len(sd_lines) > 4 else []))


def holm_family(rs, family, use):
    """Holm-adjusted p values {(metric, A, B): p} of a family of comparisons (shape, A, B), each on its seeds in
    use[(A, B)]: the step-down rule, the k-th smallest of the family's m p values times (m - k + 1), never below the
    one before. A pending comparison (its seeds None) gets none and counts as p = 1, so m stays the plan's."""
    holm = {}
    for metric in ("tail", "last11"):
        ps = {(a, b): p_value(stats(d)) for shape, a, b in family if use[(a, b)]
              for d in [[rs[(shape, a, x)][metric] - rs[(shape, b, x)][metric] for x in use[(a, b)]]]}
        running = 0.0
        for i, (key, p) in enumerate(sorted(ps.items(), key=lambda kv: kv[1])):
            running = max(running, min(1.0, (len(family) - i) * p))   # m: the whole family, a pending one as p = 1
            holm[(metric, *key)] = running
    return holm


def closure(c1, c2, p2):
    """How much of MHAR's gain over the plain single head (comparison 2, tail-5) the single head at s = 1/8 closes:
    1 - comparison 1 / comparison 2, and its range as comparison 1 runs over its 95% interval (comparison 2 at its
    mean). Defined only where comparison 2 puts MHAR ahead, separated (Holm-adjusted p below 0.05)."""
    if not (c2["mean"] > 0 and p2 < 0.05):
        return (f"not defined: comparison 2 ({c2['mean']:+.4f}, Holm p {p2:.3f}) does not put MHAR ahead of the plain "
                "single head, separated")
    f = lambda c: 1 - c / c2["mean"]  # noqa: E731
    return (f"{f(c1['mean']):.0%} of MHAR's gain over the plain single head ({c2['mean']:+.4f}) closed by the single "
            f"head at s = 1/8; over comparison 1's 95% interval {f(c1['hi']):.0%} to {f(c1['lo']):.0%}")


def simulate_extension(sd, mean=0.0, runs=200000, seed=0):
    """The extension rule's operating characteristics, simulated: per-seed deltas drawn N(mean, sd); the four of seeds
    0-3 tested at n = 4 against t(3), or, when their SD is above EXTEND_SD, all six against t(5). -> (the share of
    draws the primary test separates from 0: the false-positive rate at mean 0, the power elsewhere; the share
    extended)."""
    import numpy as np
    d = np.random.default_rng(seed).normal(mean, sd, (runs, 6))
    sd4, sd6 = d[:, :4].std(1, ddof=1), d.std(1, ddof=1)
    extended = sd4 > EXTEND_SD
    t = np.where(extended, np.abs(d.mean(1)) / (sd6 / math.sqrt(6)), np.abs(d[:, :4].mean(1)) / (sd4 / 2))
    return float(np.mean(t > np.where(extended, T95[5], T95[3]))), float(extended.mean())


def scale_of(cfg):
    return parse(cfg)[1]


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
                          key=lambda c: (family(c), -scale_of(c))):
            ts = [rs[(shape, cfg, sd)]["tail"] for sd in seeds]
            gap = (" ".join(f"{t - rs[(shape, 'mhar', sd)]['tail']:+.4f}" for t, sd in zip(ts, seeds))
                   if cfg != "mhar" and all((shape, "mhar", sd) in rs for sd in seeds) else "-")
            every = [r["tail"] for (sh, c, _), r in rs.items() if sh == shape and c == cfg]
            se = f" +- {statistics.stdev(every) / math.sqrt(len(every)):.4f}" if len(every) > 1 else ""
            lines.append(f"| {shape} | {family(cfg)} | {scale_of(cfg):g} | "
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
    # ten colours, then the same ten dashed, then dotted: every config of a panel tells apart from the others
    style = {c: dict(color=plt.get_cmap("tab10")(i % 10), ls=("-", "--", ":")[i // 10 % 3])
             for i, c in enumerate(configs)}
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
                    panel.plot(steps, y, **style[cfg], lw=0.7, alpha=0.35)
                panel.plot(steps, [statistics.mean(v) for v in zip(*ys)], **style[cfg], lw=2, label=label)
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
        for mode in sorted({family(k[1]) for k in rs if k[0] == shape and k[1] != "baseline"}):
            pts = {}   # scale -> {seed: tail-5}
            for (sh, cfg, seed), r in rs.items():
                if sh == shape and family(cfg) == mode:
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
    head_vs_scale(rs, out_dir, plt)


def head_vs_scale(rs, out_dir, plt, shape="100m"):
    """head_vs_scale.png: zero-init MHAR's tail-5 against its head count H (s = 1; H = 1 is the single head), and the
    single head's against its route_scale s, drawn at the H that s matches under s = 1/H and under s = 1/sqrt(H):
    mean +- SE over each point's seeds. The curves coincide where a head count is only a router speed or scale. MHAR
    at other s (H = 16 at s = 2 and 4: a faster router for many heads) is drawn at its H, labelled with s."""
    def points(select):
        pts = {}
        for (sh, cfg, seed), r in rs.items():
            mode, s, heads, init = parse(cfg)
            x = select(mode, s, heads) if sh == shape and not init else None
            if x is not None:
                pts.setdefault(x, []).append(r["tail"])
        return sorted(pts.items())
    series = [("MHAR, s = 1: H", lambda m, s, h: (h or 4) if m == "mhar" and s == 1 else 1 if m == "attnres" and s == 1 else None),
              ("single head at s, drawn at H = 1/s", lambda m, s, h: 1 / s if m == "attnres" else None),
              ("single head at s, drawn at H = 1/s^2", lambda m, s, h: 1 / s**2 if m == "attnres" else None)]
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    for (label, select), marker in zip(series, "osD"):
        pts = points(select)
        if pts:
            xs, ys = [x for x, _ in pts], [y for _, y in pts]
            ax.errorbar(xs, [statistics.mean(y) for y in ys], marker=marker, capsize=3, label=label,
                        yerr=[statistics.stdev(y) / math.sqrt(len(y)) if len(y) > 1 else 0 for y in ys])
    other = {}   # MHAR at s != 1: (H, s) -> tail-5 per seed, each point labelled with its s
    for (sh, cfg, seed), r in rs.items():
        mode, s, heads, init = parse(cfg)
        if sh == shape and mode == "mhar" and s != 1 and not init:
            other.setdefault((heads or 4, s), []).append(r["tail"])
    for i, ((h, s), y) in enumerate(sorted(other.items())):
        ax.errorbar([h], [statistics.mean(y)], yerr=[statistics.stdev(y) / math.sqrt(len(y)) if len(y) > 1 else 0],
                    marker="^", color="k", capsize=3, ls="none", label="MHAR at s != 1 (labelled)" if i == 0 else None)
        ax.annotate(f"s={s:g}, n={len(y)}", (h, statistics.mean(y)), textcoords="offset points", xytext=(6, -3),
                    fontsize=7)
    ax.set(xscale="log", xlabel="routing heads H (or the H a single head's s matches)", ylabel="tail-5 validation loss",
           title=f"{shape}, zero-init queries: heads against router speed (mean +- SE over seeds)")
    ticks = [2**i for i in range(9)]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    legend(ax)
    fig.savefig(os.path.join(out_dir, "head_vs_scale.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log_dir", nargs="?", default=os.path.join(HERE, "logs"),
                    help="run.sh's log folder (default: logs/, the reduced budget; BUDGET=paper writes logs_paper/)")
    ap.add_argument("--fig_dir", help="where the figures go (default: this folder for logs/, else the log folder)")
    ap.add_argument("--simulate_plan", action="store_true", help="the third study's extension rule, simulated: its "
                    "false-positive rate and power at a range of per-seed spreads (the numbers its plan quotes)")
    ap.add_argument("--speed", action="append", default=[], metavar="SHAPE:REF:ARM,ARM",
                    help="another router-speed table: each ARM's KL from uniform and its ratio to REF's, paired by seed "
                    "(configs as the logs name them, e.g. 350m:attnres_x0.125:mhar,attnres); repeatable")
    args = ap.parse_args()
    for x in args.speed:
        if x.count(":") != 2 or not all(x.split(":")):
            ap.error(f"--speed={x} is not SHAPE:REF:ARM[,ARM...], e.g. --speed=350m:attnres_x0.125:mhar,attnres")
    if args.simulate_plan:
        print("| per-seed SD | false positives (mean 0) | power for 0.028 | power for 0.014 | extended (mean 0) |\n"
              "|---|---|---|---|---|")
        for sd in (0.004, 0.006, 0.008, 0.011, 0.014, 0.016, 0.020):
            (fp, ext), (p28, _), (p14, _) = (simulate_extension(sd, m) for m in (0.0, MARGIN, MARGIN / 2))
            print(f"| {sd:g} | {fp:.3f} | {p28:.3f} | {p14:.3f} | {ext:.2f} |")
        raise SystemExit
    rs = runs(args.log_dir)
    if not rs:
        raise SystemExit(f"no finished runs in {args.log_dir}: bash results/temperature_study/run.sh SPEC ...")
    print(tables(rs))
    if third_study(rs):
        print(f"\nThe third study (350M, planned; A ahead = A's loss lower; equivalent = within +-{MARGIN:g}):\n")
        print(third_study(rs))
    if fourth_study(rs):
        print(f"\nThe fourth study (350M, planned; A ahead = A's loss lower; equivalent = within +-{PLAN4_BAND:g}):\n")
        checks = (os.path.relpath(os.path.join(os.path.dirname(os.path.abspath(args.log_dir)), x))
                  for x in ("logs_drift", "logs_regime"))   # the log folder's siblings, named as from here
        print(fourth_study(rs, *checks))
    speeds = [speed_table(rs, shape, ref, arms) for shape, ref, arms in SPEED_TABLES
              + [(sh, ref, arms.split(",")) for sh, ref, arms in (x.split(":") for x in args.speed)]]
    if any(speeds):
        print("\nThe router's speed, measured (a description; report.py's router_speed):\n\n"
              + "\n\n".join(x for x in speeds if x))
    print()
    print(sweep(rs))
    here = os.path.join(HERE, "logs")
    plots(rs, args.fig_dir or (HERE if os.path.isdir(here) and os.path.samefile(args.log_dir, here) else args.log_dir))
