"""
results/: the study drivers and report scripts.
"""

import json
import math
import os
import re
import subprocess
import sys

import pytest

from support import HERE, TRAIN_ARGS, load_module, together


def write_eval_log(path, v):
    """A finished run's log.jsonl: evals every 100 steps to 2,000, falling to v (the tail-5 is v + 0.2)."""
    with open(path, "w") as f:
        for step in range(0, 2001, 100):
            f.write(json.dumps({"step": step, "val_loss": v + (2000 - step) / 1000}) + "\n")


def test_study_run_tables_agree_with_their_logs():
    """Every run row of the temperature study's README (| name | card | tree | complete (...) |) against the run's own
    records in logs/: its eval count, tail-5 (the mean of the last five validation losses, to 4 digits) and lowest-loss
    step from log.jsonl (as report.py reads them), its median tok/s and peak memory from the console log's `done:` line.
    A number typed from the wrong field (a last eval for a tail-5) fails here, whichever row it is in."""
    study = load_module(os.path.join(HERE, "results", "temperature_study", "report.py"))
    logs = os.path.join(HERE, "results", "temperature_study", "logs")
    with open(os.path.join(HERE, "results", "temperature_study", "README.md")) as f:
        rows = re.findall(r"^\| (\d+m_[\w.]+) \| [^|]+ \| \w+ \| (complete [^|]*)\|", f.read(), re.M)
    assert len(rows) >= 19, len(rows)   # (the rows at the time of writing; more come as runs finish)
    for name, note in rows:
        run = study.load(os.path.join(logs, f"{name}.log.jsonl"))
        count = re.search(r"\((\d+) evals\)", note)
        assert count and int(count[1]) == len(run["evals"]), (name, note)
        tail5 = re.search(r"tail-5 (\d\.\d{4})", note)
        assert tail5 and f"{run['tail']:.4f}" == tail5[1], (name, tail5 and tail5[1])
        lowest = re.search(r"lowest val loss at step ([\d,]+)", note)
        if lowest:
            assert run["best"] == int(lowest[1].replace(",", "")), (name, lowest[1])
        speed, peak = re.search(r"([\d,]+) tok/s median", note), re.search(r"([\d.]+) GB peak allocated", note)
        if speed or peak:
            with open(os.path.join(logs, f"{name}.txt")) as f:
                done = [ln for ln in f if ln.startswith("done:")][-1]
            assert not speed or f"median {speed[1]} tok/s" in done, (name, done)
            assert not peak or f"peak mem {peak[1]} GB" in done, (name, done)


def test_study_power_is_the_noncentral_t():
    """report.py's power of the paired t-test, by integrating the noncentral t numerically, against reference values
    of scipy.stats.nct (effect in standard deviations, seeds, the exact two-sided 95% critical t): the size of the
    test at effect 0, a small and a heavy-tailed (1 degree of freedom) case; and the seeds needed for 80% power (for
    the study's single head s = 0.25 - MHAR H = 4 at 100M, 9; the normal approximation it replaced said 8)."""
    study = load_module(os.path.join(HERE, "results", "temperature_study", "report.py"))
    for effect, n, crit, scipy_power in ((1.5, 4, 3.1824463052837078, 0.5327926072613415),
                                         (0.8, 9, 2.306004135204166, 0.5590961236283124),
                                         (0.0, 5, 2.7764451051977934, 0.05),
                                         (1.2, 2, 12.706204736174694, 0.10823635440349615)):
        assert abs(study.t_power(effect, n, crit) - scipy_power) < 1e-6, (effect, n)
    assert study.seeds_for_power(1.0, 1.0) == 10 and study.t_power(1.0, 10) >= 0.8 > study.t_power(1.0, 9)
    assert study.seeds_for_power(0.0052, 0.0026 * 3 ** 0.5) == 9   # single head s = 0.25 - MHAR H = 4 at 100M


def test_study_equivalence_and_last11(tmp_path):
    """report.py's third-study reading: one-sided 95% critical t against scipy.stats.t.ppf (the table, and the
    Cornish-Fisher expansion past it), the 90% interval and the equivalence test within +-MARGIN, the four outcomes,
    and last-11 (the paper's metric: the mean of the last 11 evals) on hand-made logs: a test of the arithmetic."""
    study = load_module(os.path.join(HERE, "results", "temperature_study", "report.py"))
    for df, scipy_t in ((3, 2.3533634348018233), (10, 1.8124611228116756), (30, 1.697260886593957)):
        assert abs(study.t90(df) - scipy_t) < 2e-3, df
    st = study.stats([0.001, -0.002, 0.003, 0.0])
    half = study.t90(3) * st["se"]
    assert abs(st["hi90"] - st["lo90"] - 2 * half) < 1e-12 and st["hi90"] < study.MARGIN
    assert study.outcome(st) == f"within +-{study.MARGIN:g} (equivalent)"
    assert study.outcome(study.stats([0.030, 0.031, 0.029, 0.032])) == "B ahead, separated"
    assert study.outcome(study.stats([0.030, 0.031, 0.029, 0.032]), p=0.06).startswith("not separated")   # Holm's p
    assert study.outcome(study.stats([-0.010, -0.011, -0.009, -0.012])) == \
        f"A ahead, separated; within +-{study.MARGIN:g} (equivalent)"
    assert study.outcome(study.stats([0.05, -0.05, 0.04, -0.03])).startswith("not separated, not shown within")
    wide = study.stats([0.02, -0.02, 0.01, -0.01])   # the power to find MARGIN falls with the seeds' spread
    assert wide["power_margin"] == study.t_power(study.MARGIN / wide["sd"], 4) and wide["power_margin"] < 0.8
    assert st["power_margin"] > 0.99
    # p values against scipy.stats.t.sf (two-sided): 100M's MHAR H = 8 row, p = 0.042 at 2 degrees of freedom, and 3
    for d, scipy_p in (([-0.0111, -0.0242, -0.0218], 0.04196114243987934),
                       ([0.01, 0.02, 0.015, 0.005], 0.030466291662170977)):
        assert abs(study.p_value(study.stats(d)) - scipy_p) < 1e-6
    for seed, gap in enumerate([0.01, 0.02, 0.015, 0.005]):
        for name, v in ((f"attnres_s{seed}_x0.125", 3.5 + gap), (f"mhar_s{seed}", 3.5),
                        (f"attnres_s{seed}", 3.5 + gap + (0.03, 0.05, 0.02, 0.06)[seed])):
            with open(tmp_path / f"350m_{name}.log.jsonl", "w") as f:
                for step in range(0, 2001, 100):   # 21 evals; the last 11 are steps 1000-2000
                    f.write(json.dumps({"step": step, "val_loss": v + step / 1e5}) + "\n")
            tree = "def5678+dirty" if name == "attnres_s3_x0.125" else "abc1234"   # it ran on another tree
            tree = "abc1234" + "f" * 33 if name == "mhar_s2" else tree   # a full id (MHAR_REVISION) is one tree too
            (tmp_path / f"350m_{name}.txt").write_text(f"run.sh: python train.py\ngit 0000000 | torch\nstopped\n"
                                                       f"run.sh: python train.py\ngit {tree} | torch\ndone\n")
    rs = study.runs(str(tmp_path))
    assert rs[("350m", "mhar", 3)]["tree"] == rs[("350m", "mhar", 2)]["tree"] == "abc1234"
    assert rs[("350m", "attnres_x0.125", 3)]["tree"] == "def5678+dirty"
    assert abs(rs[("350m", "mhar", 0)]["last11"] - (3.5 + 0.015)) < 1e-12   # mean of steps 1000..2000 / 1e5
    assert abs(rs[("350m", "mhar", 0)]["tail"] - (3.5 + 0.018)) < 1e-12     # mean of steps 1600..2000 / 1e5
    table = study.third_study(rs)
    assert "(primary): attnres_x0.125 - mhar | tail-5 | 0,1,2,3 | +0.0100 +0.0200 +0.0150 +0.0050 |" in table
    assert "| attnres_x0.125 - mhar | last-11 (described) |" in table and "B ahead, separated" in table
    assert table.count("| descriptive |") == 3 and "here at LR 1e-3; its draft's at 5e-4" in table
    assert table.count("| s3: def5678+dirty / abc1234 |") == 2   # the last attempt's tree, each metric's row
    ps = [study.p_value(study.paired(rs, "350m", a, b, "tail")[2]) for _, a, b in study.PLAN3[1:]]
    holm = sorted([min(1, 2 * min(ps)), max(min(1, 2 * min(ps)), max(ps))])   # Holm over the two secondary rows
    assert all(f"(Holm {h:.3f})" in table for h in holm) and table.count("(Holm") == 4
    assert "SD of the four primary tail-5 deltas is 0.0065, not above 0.011: the primary is analysed at n = 4" in table
    c1, c2 = 0.0125, 0.0125 + 0.04                        # comparison 1's and 2's means: the closure 1 - c1 / c2
    assert f"closure: {1 - c1 / c2:.0%} of MHAR's gain" in table
    assert study.third_study({}) == ""


def write_study_runs(folder, values):
    """Hand-made 350M logs: {name: tail-5 target}, 21 evals each, falling to the value."""
    os.makedirs(folder, exist_ok=True)
    for name, v in values.items():
        with open(folder / f"350m_{name}.log.jsonl", "w") as f:
            for step in range(0, 2001, 100):
                f.write(json.dumps({"step": step, "val_loss": v + (2000 - step) / 1e5}) + "\n")


def test_study_plan_analyses_exactly_the_planned_seeds(tmp_path):
    """report.py's third study uses the plan's seeds alone: 0-3 for every comparison, seeds 4-5 of the primary pair only
    when the SD of its four tail-5 deltas is above EXTEND_SD (then n = 6 against t(5)); a comparison missing a planned
    run is pending, with the runs it waits for; runs of any other seed are left out by name; no closure until
    comparison 2 puts MHAR ahead. The extension's simulated false-positive rate stays near 5% at a small spread."""
    study = load_module(os.path.join(HERE, "results", "temperature_study", "report.py"))
    gaps = [0.01, 0.04, -0.01, 0.02, 0.03, 0.0]   # primary deltas: seeds 0-3 have SD 0.021, above 0.011
    runs = {f"mhar_s{sd}": 3.5 for sd in range(4)}
    runs.update({f"attnres_s{sd}_x0.125": 3.5 + gaps[sd] for sd in range(4)})
    runs.update({f"attnres_s{sd}": 3.5 for sd in range(3)} | {"mhar_s7": 3.4, "attnres_s7_x0.125": 3.3})
    write_study_runs(tmp_path, runs)
    table = study.third_study(study.runs(str(tmp_path)))
    assert "SD of the four primary tail-5 deltas is 0.0208, above 0.011: seeds 4-5 of the pair are run" in table
    assert "attnres_x0.125 - mhar: pending, 4 planned run(s) missing: 350m_attnres_x0.125_s4 350m_mhar_s4" in table
    assert "attnres - mhar: pending, 1 planned run(s) missing: 350m_attnres_s3" in table
    assert "left out, not in the plan's seeds: 350m_attnres_x0.125_s7 350m_mhar_s7" in table
    assert table.count("| pending |") == 3 and "closure" not in table
    write_study_runs(tmp_path, {"mhar_s4": 3.5, "mhar_s5": 3.5, "attnres_s4_x0.125": 3.53, "attnres_s5_x0.125": 3.5,
                                "attnres_s3": 3.45})
    table = study.third_study(study.runs(str(tmp_path)))
    assert "attnres_x0.125 - mhar | tail-5 | 0,1,2,3,4,5 |" in table and "(2.571)" in table
    assert "| attnres - mhar | last-11 (described) | 0,1,2,3 |" in table and "left out" in table
    assert "closure: not defined: comparison 2" in table   # the plain single head is not behind MHAR here
    # the primary decided at n = 4 while comparisons 2-3 wait: their present runs are planned, not left out
    write_study_runs(tmp_path / "n4", {f"mhar_s{sd}": 3.5 for sd in range(4)} | {"attnres_s0": 3.45}
                     | {f"attnres_s{sd}_x0.125": 3.4 + sd / 1000 for sd in range(4)})
    table = study.third_study(study.runs(str(tmp_path / "n4")))
    assert "not above 0.011: the primary is analysed at n = 4" in table and "left out" not in table
    assert "attnres - mhar: pending, 3 planned run(s) missing: 350m_attnres_s1 350m_attnres_s2 350m_attnres_s3" in table
    fp, extended = study.simulate_extension(0.006, runs=20000)
    assert 0.04 < fp < 0.06 and extended < 0.1


def write_routed_log(path, v, kl, heads=1, sites=4, logged=False):
    """A 350M-style log: 21 evals falling to v (tail-5 v + 0.002), each with routing records whose KL from uniform is
    kl at every site with more than one source and every head: entropy ln j - kl at site j (site 1: 0); logged=True
    also writes kl and logit_sd themselves, as runs of the fourth study on do (logit_sd: 10 kl)."""
    with open(path, "w") as f:
        for step in range(0, 2001, 100):
            k = 0.0 if step == 0 else kl
            ent = [[0.0] * heads] + [[math.log(j) - k] * heads for j in range(2, sites + 1)]
            routing = {"entropy": ent} | ({"kl": [[0.0] * heads] + [[k] * heads] * (sites - 1),
                                           "logit_sd": [[0.0] * heads] + [[10 * k] * heads] * (sites - 1)} if logged else {})
            f.write(json.dumps({"step": step, "val_loss": v + (2000 - step) / 1e5, "routing": routing}) + "\n")


def test_fourth_study_reads_router_speed_and_its_rules(tmp_path):
    """report.py's fourth study on hand-made logs (a test of its arithmetic and rules, not a result): the router's speed
    from logged entropies (ln N - entropy) and from logged kl alike, the manipulation check's ratio over steps
    300-1,000, each outcome of PLAN4_RULES (speed account, head cost, scale or regime, a dose point with the closure
    against the third study's primary), Holm over the family of four with a pending comparison counted in, the drift
    and regime checks, and each run's lowest-loss step."""
    study = load_module(os.path.join(HERE, "results", "temperature_study", "report.py"))

    def write(folder, g8, g4, kl_b=0.1, c1=-0.05):
        """ref = the single head at s = 1/8 at 3.5 (KL 0.1, old-style log); MHAR H = 8 at s = 2 (logged kl_b) and
        H = 4 at ref - g8 / ref - g4 per seed; MHAR H = 8 at s = 1 at ref - c1; the plain single head; the baseline."""
        folder.mkdir()
        jitter = [0.002, -0.001, 0.0, -0.001]
        for sd in range(4):
            write_routed_log(folder / f"350m_attnres_s{sd}_x0.125.log.jsonl", 3.5, 0.1)
            write_routed_log(folder / f"350m_mhar_s{sd}_x2.log.jsonl", 3.5 - g8 - jitter[sd], kl_b, 8, logged=True)
            write_routed_log(folder / f"350m_mhar_s{sd}_h4.log.jsonl", 3.5 - g4 + jitter[sd], 0.08, 4, logged=True)
            write_routed_log(folder / f"350m_mhar_s{sd}.log.jsonl", 3.5 - c1 + jitter[sd], 0.05, 8)
            write_routed_log(folder / f"350m_attnres_s{sd}.log.jsonl", 3.48 + jitter[sd], 0.3)
            if sd < 3:   # the baseline's seed 3 is pending
                write_eval_log(folder / f"350m_baseline_s{sd}.log.jsonl", 3.55 + jitter[sd] / 2)
        return study.runs(str(folder))

    rs = write(tmp_path / "speed", g8=0.0, g4=0.001)
    assert study.router_speed({"entropy": [[0.0], [math.log(2) - 0.1], [math.log(3) - 0.1]]})[0] == pytest.approx(0.1)
    assert rs[("350m", "mhar_x2", 0)]["speed"][500] == pytest.approx((0.1, 1.0))   # logged kl and logit_sd
    assert rs[("350m", "mhar_x2", 0)]["best"] == 2000
    assert study.kl_ratio(rs, "350m", "mhar_x2", "attnres_x0.125", [0, 1, 2, 3]) == pytest.approx(1.0)
    text = study.fourth_study(rs, str(tmp_path / "no_drift"))
    assert "manipulation check: mhar_x2's KL from uniform at steps 300-1000 is 1.00x attnres_x0.125's" in text
    assert "outcome: speed account" in text and "mhar_h4's KL at the same steps, described: 0.80x" in text
    assert "mhar - baseline: pending, 1 planned run(s) missing: 350m_baseline_s3" in text
    assert "| G4: single head s = 1/8 - MHAR H = 4: attnres_x0.125 - mhar_h4 | tail-5 | 0,1,2,3 |" in text
    ps = {(a, b): study.p_value(study.paired(rs, "350m", a, b, "tail")[2]) for _, a, b in study.PLAN4[3:]}
    holm = sorted(ps.values())   # the family of four, two of them pending (p = 1): m = 4 for the smallest
    assert f"(Holm {study.fmt_p(min(1, 4 * holm[0]))})" in text and f"(Holm {study.fmt_p(min(1, max(4 * holm[0], 3 * holm[1])))})" in text
    assert "the step of each run's lowest val loss: 350m_attnres_x0.125_s0 2000" in text
    assert "MHAR - baseline -0.080, single head - baseline +0.055" in text and "drift check: pending" in text
    table = study.speed_table(rs, "350m", "attnres_x0.125", ["mhar", "mhar_x2", "mhar_h4"])
    assert "| mhar | 0,1,2,3 | 0.0500 (0.50x: 0.50-0.50) |" in table and "| mhar_x2 | 0,1,2,3 | 1.000 |" in table
    text = study.fourth_study(write(tmp_path / "cost", g8=-0.06, g4=0.001), None)
    assert "outcome: head cost" in text and "drift check" not in text
    text = study.fourth_study(write(tmp_path / "scale", g8=-0.06, g4=-0.06), None)
    assert "outcome: scale or regime" in text
    rs = write(tmp_path / "dose", g8=-0.03, g4=0.001, kl_b=0.05, c1=-0.06)   # the check not met: a dose point
    text = study.fourth_study(rs, None)
    assert "is 0.50x attnres_x0.125's (the rule: 0.7-1.4x): not met, so mhar_x2 is read as a dose point" in text
    assert "outcome: a dose point (the manipulation check not met): the closure 1 - G8 / C1 (C1 = -0.0600" in text
    g8 = study.paired(rs, "350m", "attnres_x0.125", "mhar_x2", "tail")[2]   # ref - (ref - g8 - jitter): mean g8
    assert abs(g8["mean"] + 0.03) < 1e-9 and "is 50%, " in text
    assert f"{1 - g8['lo'] / -0.06:.0%} to {1 - g8['hi'] / -0.06:.0%} over G8's 95% interval" in text
    drift = tmp_path / "dose_drift"   # the drift check: the reference arm's seed 0 again, 0.005 higher
    drift.mkdir()
    write_routed_log(drift / "350m_attnres_s0_x0.125.log.jsonl", 3.505, 0.1)
    (drift / "350m_attnres_s0_x0.125.txt").write_text("git abc1234 | torch\n")
    assert "drift check: 350m_attnres_x0.125_s0 on tree abc1234 ends at tail-5 3.5070, its log's (tree None) 3.5020: " \
        "+0.0050, within +-0.01" in study.fourth_study(rs, str(drift))
    regime = tmp_path / "regime"   # the regime check: the third study's primary pair, seed 0, on other text
    regime.mkdir()
    write_routed_log(regime / "350m_attnres_s0_x0.125.log.jsonl", 3.40, 0.1)
    assert "regime check: pending (350m_attnres_x0.125_s0, 350m_mhar_s0 in" in study.fourth_study(rs, None, str(regime))
    write_routed_log(regime / "350m_mhar_s0.log.jsonl", 3.43, 0.05, 8)
    text = study.fourth_study(rs, None, str(regime))
    here = rs[("350m", "attnres_x0.125", 0)]["tail"] - rs[("350m", "mhar", 0)]["tail"]
    assert f"attnres_x0.125 - mhar tail-5 -0.0300; on books_wiki, seed 0: {here:+.4f}; " in text
    assert "350m_mhar_s0 tail-5 3.4320, lowest at step 2000 (books_wiki: 2000)" in text
    assert study.fourth_study({}) == ""


def test_temperature_study_report_pairs_seeds(tmp_path):
    """results/temperature_study/report.py: runs parsed from their names, paired per-seed deltas, mean, SE and t
    (here on three hand-made logs per config: a test of the arithmetic, not a result)."""
    study = load_module(os.path.join(HERE, "results", "temperature_study", "report.py"))
    for seed, (a, b) in enumerate([(3.10, 3.00), (3.20, 3.05), (3.00, 2.95)]):
        for name, v in ((f"attnres_s{seed}_x0.5", a), (f"mhar_s{seed}", b)):   # run.sh's names
            with open(tmp_path / f"100m_{name}.log.jsonl", "w") as f:
                for step in range(0, 2001, 100):
                    f.write(json.dumps({"step": step, "val_loss": v + (2000 - step) / 1000}) + "\n")
    rs = study.runs(str(tmp_path))
    assert set(rs) == {("100m", c, s) for c in ("attnres_x0.5", "mhar") for s in range(3)}
    seeds, d, st = study.paired(rs, "100m", "attnres_x0.5", "mhar", "tail")
    assert seeds == [0, 1, 2] and [round(x, 6) for x in d] == [0.1, 0.15, 0.05]
    assert abs(st["mean"] - 0.1) < 1e-9 and abs(st["se"] - 0.05 / math.sqrt(3)) < 1e-9 and st["t95"] == 4.303
    assert "| 100m | attnres_x0.5 - mhar | 0,1,2 |" in study.tables(rs) and "added after" not in study.tables(rs)
    study.ADDED = [("100m", "mhar", "attnres_x0.5")]   # a comparison added after the runs: printed apart, below the plan's
    planned, added = study.tables(rs).split("Comparisons, added after the runs")
    assert "| 100m | mhar - attnres_x0.5 | 0,1,2 | -0.1000 -0.1500 -0.0500 |" in added and "mhar - attnres" not in planned
    # the s sweep: each config on the seeds all routed configs share (tail-5 = value + 0.2 here), its gap to MHAR
    assert study.common_seeds(rs, "100m") == [0, 1, 2]
    assert "| 100m | attnres | 0.5 | 3.3000 3.4000 3.2000 (seeds 0,1,2) | 3.3000 | +0.1000 +0.1500 +0.0500 |" in study.sweep(rs)
    study.plots(rs, str(tmp_path))   # the figures draw from the same runs (seed curves, means, the sweep)
    assert all(os.path.getsize(tmp_path / f) > 0 for f in ("curves_100m.png", "scale_sweep.png"))
    os.remove(tmp_path / "100m_mhar_s0.log.jsonl")
    os.remove(tmp_path / "100m_attnres_s1_x0.5.log.jsonl")
    os.remove(tmp_path / "100m_attnres_s2_x0.5.log.jsonl")   # no seed has both configs now
    rs = study.runs(str(tmp_path))
    assert study.common_seeds(rs, "100m") == [] and study.paired(rs, "100m", "attnres_x0.5", "mhar", "tail")[0] == []
    study.plots(rs, str(tmp_path / "figs"))   # still draws (the paired panel empty), into a new folder
    assert os.path.getsize(tmp_path / "figs" / "scale_sweep.png") > 0


def test_temperature_study_report_second_study(tmp_path):
    """report.py on the second study's names (heads, random init): configs parsed, the planned comparisons and the
    interaction (a difference of paired differences) with their 95% intervals and seeds for 80% power, and the
    heads-against-router-speed figure (hand-made logs: a test of the arithmetic, not a result)."""
    study = load_module(os.path.join(HERE, "results", "temperature_study", "report.py"))
    assert study.parse("mhar_x2_h16") == ("mhar", 2.0, 16, 0.0) and study.parse("attnres_x0.5_q0.02") == ("attnres", 0.5, None, 0.02)
    assert study.family("attnres_x0.5_q0.02") == "attnres_q0.02" and study.family("mhar_h16") == "mhar_h16"
    assert study.seeds_for_power(0.005, 0.0091) == 28 and abs(study.t95(27) - 2.052) < 0.002   # noncentral t: 28
    values = {"124m_attnres_s{}_q0.02": [3.30, 3.35, 3.28], "124m_mhar_s{}_q0.02": [3.20, 3.22, 3.21],
              "124m_attnres_s{}": [3.25, 3.27, 3.24], "124m_mhar_s{}": [3.20, 3.21, 3.19],
              "100m_mhar_s{}_h16": [3.50, 3.52, 3.51], "100m_mhar_s{}": [3.45, 3.46, 3.44],
              "100m_attnres_s{}_x0.0625": [3.49, 3.53, 3.50], "100m_attnres_s{}_x0.25": [3.44, 3.47, 3.45]}
    for name, vs in values.items():
        for seed, v in enumerate(vs):
            with open(tmp_path / f"{name.format(seed)}.log.jsonl", "w") as f:
                for step in range(0, 2001, 100):
                    f.write(json.dumps({"step": step, "val_loss": v + (2000 - step) / 1000}) + "\n")
    rs = study.runs(str(tmp_path))
    assert ("124m", "attnres_q0.02", 1) in rs and ("100m", "mhar_h16", 2) in rs and ("100m", "attnres_x0.0625", 0) in rs
    seeds, d, st = study.interaction(rs, "124m", ("attnres_q0.02", "attnres"), ("mhar_q0.02", "mhar"), "tail")
    assert seeds == [0, 1, 2] and [round(x, 6) for x in d] == [0.05, 0.07, 0.02]   # (0.05, 0.08, 0.04) - (0, 0.01, 0.02)
    assert abs(st["lo"] - (st["mean"] - 4.303 * st["se"])) < 1e-9 and st["n80"] == study.seeds_for_power(st["mean"],
                                                                                                     st["se"] * math.sqrt(3))
    table = study.tables(rs)
    assert "Comparisons, the second study, planned:" in table and "| 100m | attnres_x0.0625 - mhar_h16 | 0,1,2 |" in table
    assert "| 124m | (attnres_q0.02 - attnres) - (mhar_q0.02 - mhar) | 0,1,2 | +0.0500 +0.0700 +0.0200 |" in table
    study.plots(rs, str(tmp_path))
    assert os.path.getsize(tmp_path / "head_vs_scale.png") > 0


def test_block_routing_report(tmp_path):
    """results/block_routing/report.py: block runs (hand-made logs, named as run.sh names full runs) paired with the
    temperature study's full-routing logs of the same seeds, by the study's arithmetic (a test of it, not a result)."""
    rep = load_module(os.path.join(HERE, "results", "block_routing", "report.py"))
    full = tmp_path / "full"
    full.mkdir()
    for name, vs in {"100m_mhar_s{}": [3.80, 3.82], "100m_attnres_s{}": [3.83, 3.84], "100m_baseline_s{}": [3.9, 3.9],
                     "100m_attnres_s{}_x0.5": [1.0, 1.0]}.items():   # the last: not a full single head, left out
        for seed, v in enumerate(vs):
            write_eval_log(full / f"{name.format(seed)}.log.jsonl", v)
    for seed, (m, a) in enumerate([(3.81, 3.85), (3.84, 3.87)]):
        write_eval_log(tmp_path / f"100m_mhar_s{seed}.log.jsonl", m)
        write_eval_log(tmp_path / f"100m_attnres_s{seed}.log.jsonl", a)
    rs = rep.merged(str(tmp_path), str(full))
    assert ("100m", "mhar_block4", 1) in rs and ("100m", "attnres_x0.5", 0) not in rs
    text = rep.report(rs)
    assert "| 100m | mhar_block4 - mhar | 0,1 | +0.0100 +0.0200 |" in text
    assert "| 100m | (attnres_block4 - attnres) - (mhar_block4 - mhar) | 0,1 | +0.0100 +0.0100 |" in text
    assert "| 100m | attnres_block4 - baseline | 0,1 | -0.0500 -0.0300 |" in text
    assert "\n|" + "---|" * 10 + "\n" in text   # the comparison tables' separator row: ten columns
    rs8 = rep.merged(str(tmp_path), str(full), n=8)   # the same runs read as n = 8's: their configs say so
    assert ("100m", "mhar_block8", 1) in rs8 and "| 100m | attnres_block8 - mhar_block8 | 0,1 | +0.0400 +0.0300 |" in \
        rep.report(rs8, n=8)
    here = os.path.join(HERE, "results", "block_routing")   # the committed report recomputes from the committed logs
    committed = rep.report(rep.merged(os.path.join(here, "logs"), os.path.join(HERE, "results", "temperature_study",
                                                                                "logs")))
    with open(os.path.join(here, "report.md")) as f:
        assert f.read().strip() == committed.strip()


def test_temperature_study_driver(tmp_path, data_dir):
    """results/temperature_study/run.sh end to end on the CPU, at a tiny shape and budget (EXTRA's flags come last, so
    they override the configs'): every spec checked before any run, GPUS=2 workers sharing one list (each run made
    once, a repeated spec too), the names and flags of each run, a second call skipping finished runs, refusals, a
    stopped run resumed from its checkpoint (nothing deleted unless FRESH=1), a run of the same name logged elsewhere
    refused rather than resumed from another's checkpoint."""
    work, bin_, logs = tmp_path / "w", tmp_path / "bin", tmp_path / "logs"
    work.mkdir()
    bin_.mkdir()
    for f in ("train.py", "prepare_data.py", "config"):   # run.sh runs from the repository root: its layout, linked
        os.symlink(os.path.join(HERE, f), work / f)
    (bin_ / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')   # this test's Python, venv and all
    (bin_ / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: stub'\necho 'GPU 1: stub'\n")   # two GPUs to count
    for f in ("python", "nvidia-smi"):
        os.chmod(bin_ / f, 0o755)
    tiny = [a for a in TRAIN_ARGS if not a.startswith(("--residual", "--warmup", "--lr_decay"))]
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", DATA=data_dir, LOGS=str(logs), OMP_NUM_THREADS="1",
               EXTRA=" ".join(tiny + ["--max_steps=4", "--warmup_steps=1", "--lr_decay_steps=4", "--eval_interval=2"]))

    def run_sh(*specs, **more):
        return subprocess.run(["bash", os.path.join(HERE, "results", "temperature_study", "run.sh"), *specs], cwd=work,
                              env=dict(env, **more), capture_output=True, text=True, timeout=600)

    specs = ["100m:mhar:0", "100m:attnres:0:0.5", "124m:attnres:1", "100m:mhar:0", "100m:mhar:2:1:2:0.02"]
    for bad, why in ((specs + ["100m:mhar:x"], "seed 'x' in '100m:mhar:x'"), (specs + ["200m:mhar:0"], "unknown shape"),
                     (specs + ["100m:hyper:0"], "unknown mode"), (specs + ["100m:mhar:0:-1"], "positive number"),
                     (specs + ["100m:mhar:0:0.0"], "positive number"), (specs + ["100m:attnres:0:1:4"], "H '4' in"),
                     (specs + ["100m:mhar:0:1:0"], "H '0' in"), (specs + ["100m:baseline:0:1::0.02"], "INIT '0.02' in"),
                     (specs + ["100m:mhar:0:1:2:-1"], "INIT '-1' in"), ([], "usage: ")):
        r = run_sh(*bad)
        assert r.returncode == 2 and why in r.stdout, (bad, r.stdout, r.stderr)
    r = run_sh(*specs, GPUS="3")
    assert r.returncode == 2 and "GPUS=3 but nvidia-smi lists 2 GPUs" in r.stdout
    r = run_sh(*specs, BUDGET="paper", DATA=str(tmp_path / "fineweb"))
    assert r.returncode == 2 and "prepare_data.py --max_tokens=2.7e9" in r.stdout
    assert not logs.exists()   # nothing ran

    paper = dict(DATA=data_dir, BUDGET="paper", LOGS=str(tmp_path / "logs_paper"))
    r, first_paper = together(   # BUDGET=paper's first call (its own logs and runs folders) beside the reduced runs
        lambda: run_sh(*specs, GPUS="2"),
        lambda: run_sh("124m:mhar:0", **paper, EXTRA=env["EXTRA"].replace("--max_steps=4", "--max_steps=2")))
    assert r.returncode == 0, r.stdout + r.stderr
    names = {"100m_mhar_s0": ("mhar", 0, 1.0, None, 0.0), "100m_attnres_s0_x0.5": ("attnres", 0, 0.5, None, 0.0),
             "124m_attnres_s1": ("attnres", 1, 1.0, None, 0.0), "100m_mhar_s2_h2_q0.02": ("mhar", 2, 1.0, 2, 0.02)}
    for name, (mode, seed, scale, heads, init) in names.items():
        assert len(re.findall(rf"^gpu [01]: {name}: done: step 4 ", r.stdout, re.M)) == 1, r.stdout
        cfg = json.loads(next(line for line in open(logs / f"{name}.txt") if line.startswith("config: "))[8:])
        assert (cfg["residual"], cfg["seed"], cfg["route_scale"], cfg["max_steps"]) == (mode, seed, scale, 4)
        assert (cfg["route_heads"], cfg["route_init_std"]) == (heads, init)
        assert cfg["out_dir"] == f"out/study/{name}" and cfg["data_dir"] == data_dir
    before = {f: (logs / f).read_bytes() for f in os.listdir(logs)}
    r = run_sh(*specs)
    assert r.returncode == 0 and r.stdout.count("done, skipped") == 5, r.stdout
    assert {f: (logs / f).read_bytes() for f in os.listdir(logs)} == before   # nothing rewritten
    study = load_module(os.path.join(HERE, "results", "temperature_study", "report.py"))
    assert set(study.runs(str(logs))) == {("100m", "mhar", 0), ("100m", "attnres_x0.5", 0), ("124m", "attnres", 1),
                                          ("100m", "mhar_h2_q0.02", 2)}
    r = run_sh("100m:mhar:1", "100m:mhar:0", EXTRA=env["EXTRA"] + " --no_such_flag=1")   # a run that fails
    assert r.returncode == 1 and "run.sh: 1 run(s) failed: 100m_mhar_s1" in r.stdout, r.stdout
    assert not (logs / "100m_mhar_s1.log.jsonl").exists() and "no_such_flag" in (logs / "100m_mhar_s1.txt").read_text()
    # a reduced run that keeps its checkpoint (SAVE=True), stopped before its log was copied: the same command resumes
    # it, deleting nothing; each attempt's output appended; FRESH=1 alone starts it over
    r = run_sh("100m:mhar:1", SAVE="True")
    assert r.returncode == 0 and (work / "out" / "study" / "100m_mhar_s1" / "ckpt.pt").is_file(), r.stdout + r.stderr
    os.remove(logs / "100m_mhar_s1.log.jsonl")
    r = run_sh("100m:mhar:1", SAVE="True")
    assert r.returncode == 0 and "100m_mhar_s1: resuming out/study/100m_mhar_s1" in r.stdout, r.stdout
    txt = (logs / "100m_mhar_s1.txt").read_text()
    assert "no_such_flag" in txt and txt.count("config: ") == 2 and "--init_from=resume" in txt   # every attempt kept
    os.remove(logs / "100m_mhar_s1.log.jsonl")
    run_dir = work / "out" / "study" / "100m_mhar_s1"
    import common
    kept = sorted(os.listdir(run_dir))
    common.take_lock(str(run_dir / "train.lock"), "train.py")   # as if the run were still training (this process)
    try:
        r = run_sh("100m:mhar:1", SAVE="True", FRESH="1")
    finally:
        common.release_lock(str(run_dir / "train.lock"))
    assert r.returncode == 1 and "100m_mhar_s1: FRESH=1 but out/study/100m_mhar_s1 is in use by a running train.py" \
        in r.stdout and sorted(os.listdir(run_dir)) == kept, r.stdout   # a live run's folder is never removed
    r = run_sh("100m:mhar:1", SAVE="True", FRESH="1")
    assert r.returncode == 0 and "100m_mhar_s1: FRESH=1, starting from scratch" in r.stdout, r.stdout
    assert (logs / "100m_mhar_s1.txt").read_text().count("config: ") == 1
    # the same run logged elsewhere (a drift check's rerun): its name's folder belongs to logs/, so it is refused, not
    # resumed from that checkpoint; in a RUNS of its own it trains
    kept = {f: (run_dir / f).read_bytes() for f in os.listdir(run_dir) if (run_dir / f).is_file()}
    r = run_sh("100m:mhar:1", SAVE="True", LOGS=str(tmp_path / "logs_drift"))
    assert r.returncode == 1 and f"100m_mhar_s1: out/study/100m_mhar_s1 holds the run logged in {logs}, not in " \
        f"LOGS={tmp_path / 'logs_drift'}: not resumed" in r.stdout, r.stdout
    assert {f: (run_dir / f).read_bytes() for f in kept} == kept
    assert not (tmp_path / "logs_drift" / "100m_mhar_s1.log.jsonl").exists()
    r = run_sh("100m:mhar:1", SAVE="True", LOGS=str(tmp_path / "logs_drift"), RUNS="out/study_drift")
    assert r.returncode == 0 and (tmp_path / "logs_drift" / "100m_mhar_s1.log.jsonl").is_file(), r.stdout
    assert "--out_dir=out/study_drift/100m_mhar_s1" in (tmp_path / "logs_drift" / "100m_mhar_s1.txt").read_text()
    # BUDGET=paper: the paper's config files (their budget overridden here), checkpoints kept, a stopped run resumed
    assert first_paper.returncode == 0, first_paper.stdout
    assert (work / "out" / "study_paper" / "124m_mhar_s0" / "ckpt.pt").is_file(), first_paper.stdout
    os.remove(tmp_path / "logs_paper" / "124m_mhar_s0.log.jsonl")   # as if the call had stopped before copying it
    r = run_sh("124m:mhar:0", **paper)                                # ... and the run is given 4 steps now
    assert r.returncode == 0 and "124m_mhar_s0: resuming out/study_paper/124m_mhar_s0" in r.stdout, r.stdout
    txt = (tmp_path / "logs_paper" / "124m_mhar_s0.txt").read_text()
    assert "resumed from" in txt and txt.count("config: ") == 2   # both calls' output, kept
    assert "run.sh: python train.py config/train_100m.py config/repro_124m.py --residual=mhar --seed=0 " in txt
    assert "--out_dir=out/study_paper/124m_mhar_s0 --log_interval=10 --init_from=resume --n_layer=2 " in txt
    assert study.runs(str(tmp_path / "logs_paper"))[("124m", "mhar", 0)]["last"] == 4


def test_multigpu_scaling_table(tmp_path):
    """results/multigpu/compare.py --table: run.sh scaling's logs, by name, to the scaling table's rows (hand-made
    logs: a test of the arithmetic, not a result)."""
    def log(name, tok_s, bump):
        with open(tmp_path / f"{name}.log.jsonl", "w") as f:
            for step in range(1, 21):
                f.write(json.dumps({"step": step, "loss": 10 - step / 10 + bump * (step == 7), "tok_per_s": tok_s}) + "\n")
                if step % 10 == 0:
                    f.write(json.dumps({"step": step, "val_loss": 8 - step / 10 + bump}) + "\n")
    log("1b_mhar_1gpu", 1000.0, 0)
    log("1b_mhar_1gpu_again", 1010.0, 0.02)
    log("1b_mhar_8gpu", 7600.0, 0.01)
    log("1b_mhar_8gpu_overlap", 7900.0, 0.01)
    r = subprocess.run([sys.executable, os.path.join(HERE, "results", "multigpu", "compare.py"), "--table", str(tmp_path),
                        "8"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 1b")]
    assert rows == ["| 1b | mhar | after | 1,000, 7,600 | 7.60x, 95.0% | 0.0100 / 0.0005 | 0.0200 / 0.0010 | +0.0100, +0.0200 |",
                    "| 1b | mhar | overlap | 1,000, 7,900 | 7.90x, 98.8% | 0.0100 / 0.0005 | 0.0200 / 0.0010 | +0.0100, +0.0200 |"]
