# The H100's table against the H200's at each width the H100's table holds, in one process: the fused chain's output
# and every gradient (the first source's, every dq, every dg) under each card's entry, both against a float64 oracle
# (the reference routing run in float64 on the same inputs), fp32 and bf16, full routing and block routing at n = 8.
# A new entry changes which tokens a program sums (dq, dg) and how the forward's leads group sites, so the two need not
# be bitwise equal: the check is that the new entry's errors are the fused path's own (the H200 entry's, same inputs).
# --reference: no fused path: the reference routing in the same dtype against the same oracle, at the real depths on
# any device (the CPU too): the error the inputs' conditioning makes by itself, which a fused path can at best match.
#   python results/h100_table/oracle.py [T] [--reference]   (T tokens a chain, 384 unless told; from the repository root)
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
import bench_routing   # noqa: E402  (the repository's modules, from its root)
import routing_config as rc   # noqa: E402

DEPTH = {512: 12, 768: 12, 1024: 24, 1280: 36}
given = [a for a in sys.argv[1:] if not a.startswith("--")]
T = int(given[0]) if given else 384
reference = "--reference" in sys.argv
device = "cuda" if torch.cuda.is_available() else "cpu"
runs = [("reference", None)] if reference else [("H200 entry", "H200"), ("H100 entry", "H100")]
print(bench_routing.header(device), flush=True)
worst = {}
for d, H in rc.TUNED_H100:
    N = 2 * DEPTH.get(d, 2) + 1 if device == "cuda" or reference else 7   # (the interpreter: a short chain)
    gen = torch.Generator().manual_seed(d + H)
    src0 = torch.randn(1, T, d, generator=gen, dtype=torch.float64)
    qs = [torch.randn(d, generator=gen, dtype=torch.float64) * 0.3 for _ in range(N)]
    gs = [1 + 0.2 * torch.randn(d, generator=gen, dtype=torch.float64) for _ in range(N)]
    up = torch.randn(1, T, d, generator=gen, dtype=torch.float64)
    shift = [torch.randn(1, T, d, generator=gen, dtype=torch.float64) for _ in range(N)]
    for dtype in (torch.float32, torch.bfloat16):
        for blocks in (None, 8 if (N - 1) % 8 == 0 else 2):
            # the oracle: the same rounded inputs, every operation in float64
            x0, u = src0.to(dtype).double().to(device), up.to(device)
            sh = [s.to(dtype).double().to(device) for s in shift]
            q64, g64 = [q.to(device) for q in qs], [g.to(device) for g in gs]
            oracle = bench_routing.chain_grads("reference", x0, q64, g64, lambda j, x: torch.tanh(x) + sh[j], u, H,
                                               blocks=blocks)
            row, sd = [], [s.to(dtype) for s in sh]   # the inputs each entry (or the reference) routes
            q32, g32 = [q.float() for q in q64], [g.float() for g in g64]
            for label, card in runs:
                got = bench_routing.chain_grads("reference" if reference else "fused", x0.to(dtype), q32, g32,
                                                lambda j, x: torch.tanh(x) + sd[j].to(x.dtype), u, H,
                                                card and rc.config_for(d, H, card), blocks)
                errs = [((a - b).norm() / b.norm()).item() for a, b in zip(got, oracle)]
                row.append(f"{label} " + " ".join(f"{e:.2e}" for e in errs))
                key = (str(dtype), label)
                worst[key] = max(worst.get(key, 0.0), *errs)
            print(f"d={d} H={H} N={N} T={T} {str(dtype):15s} blocks={blocks}: relative errors (out, d_source0, dq, dg) "
                  + " | ".join(row), flush=True)
for (dtype, label), e in sorted(worst.items()):
    print(f"worst {dtype} {label}: {e:.2e}")
