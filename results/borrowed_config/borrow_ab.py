"""Widths without a tuned launch entry: DEFAULT's settings against the whole entry of the same width's nearest head
count (what config_for borrowed at f216cba, block routing's settings too), one process on one GPU, the chain forward +
backward replayed from a CUDA graph, order A B B A, the better of two readings each; errors of both against the
reference (not bitwise against each other: the tiles change the dots' order).
    python results/borrowed_config/borrow_ab.py            # six shapes, full routing then block routing at n = 8
    python results/borrowed_config/borrow_ab.py d768       # d 768 / 8 heads, block routing, three rounds"""
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch  # noqa: E402
import bench_routing as br  # noqa: E402
import routing_config as rc  # noqa: E402

# (d, heads, batch, T, sites N, the tuned head count borrowed from)
SHAPES = [(1024, 4, 4, 1024, 49, 8), (512, 8, 8, 2048, 25, 4), (512, 2, 8, 2048, 25, 4), (512, 16, 8, 2048, 25, 4),
          (768, 8, 8, 2048, 25, 4), (1280, 4, 2, 1024, 73, 8)]
torch.backends.cuda.matmul.allow_tf32 = True


def configs(d, H, near):
    return {"default": rc.DEFAULT, "borrowed": replace(rc.DEFAULT, name=f"H200 d={d} H={near}, for H={H}",
                                                       **rc.TUNED_H200[d, near])}


if sys.argv[1:] == ["d768"]:
    c = configs(768, 8, 4)
    for _ in range(3):
        out = [(k, round(br.time_chain("fused", 25, 8, 2048, 768, 8, "cuda", graph=True, config=c[k], blocks=8)[0], 3))
               for k in ("default", "borrowed", "borrowed", "default")]
        print("d768 H8 blocks8", out, flush=True)
    sys.exit()
print(br.header("cuda"), flush=True)
for d, H, B, T, N, near, blocks in [(*s, b) for b in (None, 8) for s in SHAPES]:
    cfg = configs(d, H, near)
    res = {}
    for k in ("default", "borrowed", "borrowed", "default"):
        ms, gb = br.time_chain("fused", N, B, T, d, H, "cuda", graph=True, config=cfg[k], blocks=blocks)
        res[k] = min(res.get(k, ms), ms)
    gen = torch.Generator().manual_seed(d + H)
    src0 = torch.randn(1, 256, d, generator=gen).to("cuda", torch.bfloat16)
    qs = [torch.randn(d, generator=gen).cuda() * 0.3 for _ in range(N)]
    gs = [(1 + 0.2 * torch.randn(d, generator=gen)).cuda() for _ in range(N)]
    up = torch.randn(1, 256, d, generator=gen).to("cuda", torch.bfloat16)
    sub = lambda j, x: torch.tanh(x)  # noqa: E731
    ref = br.chain_grads("reference", src0, qs, gs, sub, up, H, blocks=blocks)
    errs = {k: max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in
                   zip(br.chain_grads("fused", src0, qs, gs, sub, up, H, config=c, blocks=blocks), ref))
            for k, c in cfg.items()}
    print(f"d={d:4d} H={H:2d} {B}x{T} N={N} blocks={blocks}: default {res['default']:6.2f} ms, borrowed "
          f"({cfg['borrowed'].name}) {res['borrowed']:6.2f} ms, borrowed/default {res['borrowed'] / res['default']:.3f}; "
          f"max rel err vs reference (bf16): default {errs['default']:.1e}, borrowed {errs['borrowed']:.1e}", flush=True)
