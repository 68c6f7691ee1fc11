# MHAR's gathers loading the forward's logits from the token-major layout ([P, M, H]: a token's H logits of a pair in
# one row) against recomputing them, one process, the same tree: chain GPU time (off, on, on, off; three rounds) at the
# training microbatches and the 1B Table 5 shape, checks of both against the reference, then the step at the scales
# named (TUNED_H200's MHAR entries patched in memory to gather_logits=True for "on").
#   python results/gather_backward/logits_token_major_ab.py [SCALE ...]
import os, sys
sys.path.insert(0, "."); os.environ.setdefault("PYTHONUNBUFFERED", "1")
from dataclasses import replace
import torch
import bench, routing_config, routing_kernel as rk
from bench import CHAIN_SHAPES
shapes = [s for s in CHAIN_SHAPES if s[0].endswith("-train") or s[0] == "1B"]
for name, L, d, H, B, T in shapes:
    cfg = rk.config_for(d, H)
    t = {False: [], True: []}
    for _ in range(3):
        for on in (False, True, True, False):
            t[on].append(bench.time_chain("fused", 2 * L + 1, B, T, d, H, "cuda", graph=True,
                                          config=replace(cfg, gather_logits=on))[0])
    off, on = min(t[False]), min(t[True])
    print(f"chain {name:11s} H={H} recomputed {off:6.3f} ms  loaded {on:6.3f} ms  loaded/recomputed {on / off:.3f}   "
          f"(recomputed {' '.join(f'{x:.3f}' for x in t[False])}; loaded {' '.join(f'{x:.3f}' for x in t[True])})",
          flush=True)
for name, L, d, H, B, T in [s for s in shapes if s[0] in ("100M-train", "1B-train")]:
    cfg = rk.config_for(d, H)
    for dt in (torch.float32, torch.bfloat16):
        e = {on: bench.check_against_reference(2 * L + 1, 1, T, d, H, dt, "cuda", config=replace(cfg, gather_logits=on))
             for on in (False, True)}
        print(f"check {name} H={H} {dt}: loaded {e[True]}  recomputed {e[False]}", flush=True)
torch.backends.cuda.matmul.allow_tf32 = True
mhar = [k for k in routing_config.TUNED_H200 if k[1] > 1]
plain = {k: dict(routing_config.TUNED_H200[k]) for k in mhar}
for scale in sys.argv[1:]:
    for variant, on in (("baseline", False), ("mhar_fused", False), ("mhar_fused", True), ("mhar_fused", True),
                        ("mhar_fused", False)):
        for k in mhar:
            routing_config.TUNED_H200[k] = {**plain[k], "gather_logits": on}
        row = bench.bench_one(scale, variant, "cuda", 20, 5, True, bench.PAPER_VOCAB, None, True)
        print(f"step {scale} {variant:11s} {'loaded' if on else 'recomputed':10s} {row['tok_s']:>10,.0f} tok/s "
              f"{row['step_ms']:7.1f} ms peak {row['peak_gb']:.1f} GB", flush=True)
