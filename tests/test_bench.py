"""
bench.py and bench_routing.py: the benchmarks' own checks and options.
"""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import types

import pytest
import torch

import bench
import bench_routing
import configurator
import routing_config as rc
from model import route_reference
from support import DEVICE, HERE, refusal, rel_err, together


def test_bench_smoke(tmp_path):
    """bench.py end to end on a tiny shape: every variant runs, the JSON holds the table's fields."""
    out, bench_py = str(tmp_path / "bench.json"), os.path.join(HERE, "bench.py")
    r, unknown = together(
        lambda: subprocess.run([sys.executable, bench_py, "--scales=tiny", "--device=cpu", "--steps=2", "--warmup=1",
                                "--compile=False", f"--output={out}"], capture_output=True, text=True, timeout=600),
        lambda: subprocess.run([sys.executable, bench_py, "--scales=2b"], capture_output=True, text=True), cores_each=1)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.load(open(out))["rows"]
    assert [row["variant"] for row in rows] == list(bench.VARIANTS)
    assert all(row["tok_s"] > 0 and math.isfinite(row["loss"]) for row in rows)
    assert "| baseline | 1.00x" in r.stdout
    assert unknown.returncode != 0 and "bench.py: error: --scales=2b must be one or more of 100m," in unknown.stderr
    for bad, said in ((["--new=0"], "--new=0 must be a whole number in [1, 65,536]"),
                      (["--batch=1,x"], "--batch=1,x must be one or more whole numbers in [1, 4,096], comma-separated"),
                      (["--prompt=-3"], "--prompt=-3 must be a whole number")):
        assert refusal(lambda: bench.generate_main(["--scale=tiny", "--device=cpu", *bad])).startswith(
            f"bench.py generate: error: {said}")
    for bad, said in ((["--ways=none,x"], "--ways=none,x"), (["--variants=,"], "--variants=,")):
        assert refusal(lambda: bench.ddp_main(["--device=cpu", *bad])).startswith(
            f"bench.py ddp: error: {said} must be one or more of")


def test_bench_scales_are_the_configs_shapes():
    """Each bench.py scale is its config files' shape; 124m is config/repro_124m.py's d768 at the 100M microbatch."""
    for scale, spec in bench.SCALES.items():
        kw, micro = bench.scale_config(scale, 151936)
        assert kw["vocab_size"] == (1024 if scale == "tiny" else 151936) and micro > 0
        if isinstance(spec, tuple):
            cfg = configurator.parse_args([os.path.join(HERE, f) for f in spec], paths=False)
            assert (kw["n_embd"], kw["n_layer"], kw["block_size"], micro) == (cfg.n_embd, cfg.n_layer, cfg.block_size,
                                                                               cfg.micro_batch)
    w, w_micro = bench.scale_config("124m", 50304)
    b, b_micro = bench.scale_config("100m", 50304)
    assert (w["n_embd"], w["n_kv_head"], w["n_layer"]) == (768, 4, 12)
    assert (w["block_size"], w_micro) == (b["block_size"], b_micro) == (2048, 8)


def test_bench_routing_blocks_option(monkeypatch):
    """bench.py routing --blocks=n: block routing's chain at every shape; n must divide every shape's sublayers and
    --tune-train takes the block chain's settings (by default all three), each a one-line error before anything runs. The pair
    count behind its GB/s is the block chain's own (routing_block.BlockChain.sources), and the tune times block chains
    without forcing a backward (the block chain has one)."""
    from routing_block import BlockChain
    for argv, msg in ((["--blocks=5"], r"--blocks=5 must divide every chain shape's sublayers \(2 x n_layer: 24, 48, "
                                       r"72\): give a divisor of 24"),
                      (["--blocks=0"], r"--blocks=0 must be a whole number in \[1, 2,048\]"),
                      (["--blocks=8", "--tune-train=fwd"], r"--tune-train=fwd: unknown setting fwd; choose from "
                                                           r"block_fwd, block_bwd, block_waves$"),
                      (["--tune-train=site"], r"--tune-train=site must be one or more of fwd,"),
                      (["--blocks=8", "--delta"], r"--blocks times this repo's block chain alone: drop --authors")):
        assert re.search(msg, refusal(lambda: bench_routing.main(argv))), (argv, msg)
    for n in (5, 0):   # the chain itself refuses blocks of unequal length
        with pytest.raises(ValueError, match=rf"blocks={n} must be a positive divisor of the 12 sublayers \(13 sites\)"):
            BlockChain(13, 4, 32, 2, 1e-6, torch.float32, "cpu", False, blocks=n)
    for N, n in ((49, 8), (73, 8), (25, 4), (13, 12)):
        chain = BlockChain(N, 4, 32, 2, 1e-6, torch.float32, "cpu", False, blocks=n)
        assert bench_routing.chain_pairs(N, n) == sum(chain.sources(j)[0] for j in range(1, N + 1)), (N, n)
    assert bench_routing.chain_pairs(13, 12) == bench_routing.chain_pairs(13) == 13 * 14 // 2   # one sublayer a block: full routing
    # each design's byte floor: full routing 2 passes a pair + 5 a site; block routing c + 3 forward, 3c + 2 backward
    assert bench_routing.chain_bytes(13, 10, 32) == (2 * 91 + 5 * 13) * 2 * 10 * 32
    chain = BlockChain(25, 4, 32, 2, 1e-6, torch.float32, "cpu", False, blocks=4)
    assert bench_routing.chain_bytes(25, 10, 32, 4) == sum(4 * chain.sources(j)[0] + 5 for j in range(1, 26)) * 2 * 10 * 32
    trials = []

    def fake_time(cfg, L, d, H, B, T):
        trials.append(cfg.block_waves)
        if (cfg.block_bwd, cfg.block_waves) == ((1024, 2, 3), 8):   # best, but not at the other's best
            return 0.5
        return 1.0 + 0.1 * (cfg.block_bwd != (4096, 4, 3)) + 0.01 * (cfg.block_waves != 4)
    shape = [("tiny-train", 2, 64, 4, 1, 16)]
    (cfg,) = rc.tune(["block_waves"], shape, fake_time)   # alone: its own best at the tile
    assert trials == list(rc.CHOICES["block_waves"]) and cfg.block_waves == 4
    trials.clear()   # together: the tile x waves product, where one at a time would stop at ((4096, 4, 3), 4)
    (cfg,) = rc.tune(["block_bwd", "block_waves"], shape, fake_time, candidates=[(1024, 2, 3), (4096, 4, 3)])
    assert trials == 2 * list(rc.CHOICES["block_waves"]) and (cfg.block_bwd, cfg.block_waves) == ((1024, 2, 3), 8)


def test_tune_train_rows_time_the_tuned_entries(monkeypatch):
    """After --tune-train the shapes' rows time the settings the tuner chose, named for it ('tuned d= H='), not the
    table the process began from; a shape it did not tune runs its card's table."""
    seen = []
    monkeypatch.setattr(bench_routing, "time_chain", lambda impl, N, B, T, d, H, device, ref=None, graph=False,
                        config=None, blocks=None: seen.append((impl, graph, config)) or (1.0, 0.0))
    (cfg,) = rc.tune(["fwd"], [("tiny-train", 2, 64, 4, 1, 16)], lambda c, *shape: 1.0 + (c.fwd != (512, 1, 4)),
                     candidates=[(4096, 4, 4), (512, 1, 4)])
    assert cfg.name == "tuned d=64 H=4" and cfg.fwd == (512, 1, 4) and rc.config_for(64, 4).fwd != (512, 1, 4)
    args = types.SimpleNamespace(blocks=None, profile=False)
    rows = bench_routing.time_shapes(args, [("tiny-train", 2, 64, 4, 1, 16), ("other-train", 2, 64, 4, 1, 16)], 1.0,
                                     "cpu", {"tiny-train": cfg})
    assert seen == [("fused", False, cfg), ("fused", True, cfg), ("fused", False, None), ("fused", True, None)]
    assert [r["shape"] for r in rows] == ["tiny-train"] * 2 + ["other-train"] * 2


def test_bench_ddp_smoke(tmp_path):
    """bench.py ddp under torchrun (2 CPU processes, gloo): the step with no average, one all-reduce after, and the
    overlapped buckets, and the share table."""
    out = tmp_path / "ddp.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.join(HERE, "bench.py"), "ddp", "--scales=tiny", "--variants=baseline", "--steps=2",
                        "--warmup=1", "--compile=False", "--bucket_mb=0.01", "--device=cpu", f"--output={out}"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(row["grad_sync"], row["world"], row["accum"]) for row in rows] == [(None, 2, 1), ("after", 2, 1), ("overlap", 2, 1)]
    assert rows[1]["allreduce_ms"] > 0 and all(math.isfinite(row["loss"]) for row in rows)
    assert re.search(r"\| tiny \| baseline \| [\d.]+, [\d.]+, [\d.]+ \| -?[\d.]+% \| [\d.]+x \|", r.stdout), r.stdout
    r = subprocess.run([sys.executable, os.path.join(HERE, "bench.py"), "ddp"], capture_output=True, text=True)
    assert r.returncode != 0 and "run it under torchrun" in r.stderr


def test_bench_generate_smoke(tmp_path):
    """bench.py generate (the KV cache's speed against uncached generation): runs on the CPU at the tiny scale."""
    rows = bench.generate_main(["--scale=tiny", "--device=cpu", "--prompt=8", "--new=4", "--batch=1,2",
                                f"--output={tmp_path / 'g.json'}"])
    assert [(r["batch"], r["way"]) for r in rows] == [(b, w) for b in (1, 2) for w in ("cache, eager", "no cache")]
    assert all(r["tok_s"] > 0 for r in rows) and json.load(open(tmp_path / "g.json"))["rows"] == rows


def test_bench_authors_file_errors(tmp_path):
    """bench.py routing --authors=PATH loads the user's copy of the authors' kernel file; a wrong path or file is a
    one-line error naming it."""
    with pytest.raises(SystemExit, match="no such file"):
        bench_routing.load_authors(str(tmp_path / "missing.py"))
    (tmp_path / "other.py").write_text("x = 1\n")
    with pytest.raises(SystemExit, match="has no MHARFusedContext, _FusedMHARFn"):
        bench_routing.load_authors(str(tmp_path / "other.py"))


def test_bench_peers(monkeypatch, capsys):
    """bench.py routing --peers: an unknown or uninstalled peer is a one-line error naming the fix; fla, which
    autotunes minutes a shape, is announced with how to run fewer shapes; the chain each peer runs calls it as its
    package does (fla: query, the list of sources, key-norm weight; Liger: the stacked sources, query, weight, eps),
    checked with stand-ins that route by the reference: the chain's output is the reference's."""
    with pytest.raises(SystemExit, match=r"unknown peer 'triton'; choose from fla, liger"):
        bench_routing.load_peers("fla,triton")
    package, module, call = bench_routing.PEERS["fla"]
    with monkeypatch.context() as m:   # a stand-in fla for this check only (below: fla as this machine has it)
        m.setitem(sys.modules, module, types.SimpleNamespace(**{call: print}))
        assert bench_routing.load_peers("fla") == {"fla": print} and "--shapes=NAMES runs fewer" in capsys.readouterr().err
    for name, (package, module, _) in bench_routing.PEERS.items():
        if importlib.util.find_spec(module.split(".")[0]) is None:
            with pytest.raises(SystemExit, match=rf"--peers={name}: cannot import {module} .*pip install {package}"):
                bench_routing.load_peers(name)
    stand_ins = {"fla": lambda q, sources, g, rms_eps: route_reference(torch.stack(sources), q, g, 1, rms_eps),
                 "liger": types.SimpleNamespace(apply=lambda stacked, q, g, eps: route_reference(stacked, q, g, 1, eps))}
    ref = bench_routing.chain_step("reference", 4, 2, 5, 32, 1, DEVICE)
    ref()
    for name, call in stand_ins.items():
        step = bench_routing.chain_step(name, 4, 2, 5, 32, 1, DEVICE, authors=call)
        step()
        assert torch.equal(step.out, ref.out), name


def test_bench_block_chain():
    """bench.py's routing chain under block routing (what routing_ms times for the *_block8 variants): the fused block
    chain (routing_block.py) against the reference over the same block sources; one sublayer a block is the full
    chain, bitwise."""
    N, B, T, d, H = 9, 2, 5, 32, 2
    run = lambda impl, blocks: (lambda st: st() or st.out.float())(bench_routing.chain_step(impl, N, B, T, d, H, DEVICE, blocks=blocks))
    full = run("reference", None)
    assert torch.equal(run("reference", N - 1), full)
    for blocks in (1, 2, 4):
        ref = run("reference", blocks)
        assert rel_err(run("fused", blocks), ref) < 1e-2 and rel_err(ref, full) > 1e-3, blocks   # bf16 sources


def test_bench_routing_heads_option():
    """bench.py routing --heads=H times and tunes every chain shape with H heads (1: the single head); an H that does not
    split a shape's width is a one-line error naming it before anything runs; so is an unknown --shapes name."""
    with pytest.raises(SystemExit, match=r"--heads=3 does not fit the 100M shape's width d=512"):
        bench_routing.main(["--heads=3"])
    with pytest.raises(SystemExit, match=r"--heads=64 does not fit the 100M shape's width d=512 .*d/H >= 16"):
        bench_routing.main(["--heads=64"])
    # --shapes picks the chain shapes, in the order given (1B-train's d=1280 takes 64 heads, so 100M-train is the first
    # to fail; with 3 heads 350M-train fails first); an unknown name lists the choices
    with pytest.raises(SystemExit, match=r"--heads=64 does not fit the 100M-train shape's width d=512"):
        bench_routing.main(["--heads=64", "--shapes=1B-train, 100M-train"])
    with pytest.raises(SystemExit, match=r"--heads=3 does not fit the 350M-train shape's width d=1024"):
        bench_routing.main(["--heads=3", "--shapes=350M-train,100M-train,350M-train"])
    assert refusal(lambda: bench_routing.main(["--shapes=2B"])).startswith(
        "bench.py routing: error: --shapes=2B must be one or more of 100M,350M,1B,100M-train,")


@pytest.mark.parametrize("blocks,heads", [(None, None), (4, None), (None, 1)])
def test_bench_routing_check(blocks, heads):
    """bench.py routing --check-only: the fused chain against the reference (fp32 at an awkward shape; on a GPU also
    bf16 at the paper's shapes), in Triton's interpreter on a CPU; --blocks=4: block routing's chain (13 sites);
    --heads=1: every check with the single head."""
    r = subprocess.run([sys.executable, os.path.join(HERE, "bench.py"), "routing", "--check-only"] +
                       ([f"--blocks={blocks}"] if blocks else []) + ([f"--heads={heads}"] if heads else []),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"check N=%d .* H=%d .*%s out (\S+) d_source0 (\S+) dq (\S+) dg (\S+)"
                  % ((13, heads or 4, " blocks=4") if blocks else (5, heads or 4, "")), r.stdout)
    assert m and all(float(v) < 1e-5 for v in m.groups()), r.stdout
