# How much of full routing could hide behind the sublayers, measured before anything is built, in one process on one
# GPU. At each scale:
#   step   the baseline's microbatch, forward and backward, replayed from its CUDA graph (graphs.GraphedMicrostep, as
#          training replays it; the sublayers compiled);
#   chain  the MHAR chain of the same shape (N = 2L + 1 sources of B x T x d, H the KV heads; bench_routing's chain:
#          the fused routing forward and backward, a one-add sublayer), replayed from its CUDA graph;
#   both   the two replays launched at once on two streams.
# hidden = (step + chain - both) / chain: the share of the chain's time that disappears beside the step when nothing
# orders the two. Only part of the chain may run early: a site's reads of sources older than the newest (and, in the
# backward, its contributions to them) do not wait for the sublayer just before it; `older` is that share of the
# chain's source reads (site j of N reads j sources: 1 - 2 / (N + 1)), an upper bound on what respects the dependencies.
# Then bench.py's step (baseline and mhar_fused, graphed, this process) and the ratio predicted if h = hidden x older
# of the chain's in-step cost (mhar step - baseline step) went: baseline / (mhar - h x cost).
#   python results/overlap/bound.py OUT.json [--rounds=R] [SCALE ...]     (default: 100m 350m 1b)
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.getcwd())
import bench  # noqa: E402
import bench_routing  # noqa: E402
import graphs  # noqa: E402
from model import GPTConfig  # noqa: E402

out = sys.argv[1]
scales = [a for a in sys.argv[2:] if not a.startswith("--")] or ["100m", "350m", "1b"]
rounds = int(next((a.split("=")[1] for a in sys.argv if a.startswith("--rounds=")), 1))
torch.backends.cuda.matmul.allow_tf32 = True
record = dict(header=bench_routing.header("cuda"), rows=[])


def step_graph(scale):
    """The baseline's microbatch as training replays it: (replay, model)."""
    model, _, B = bench.build(scale, "baseline", "cuda", True, bench.PAPER_VOCAB)
    T = model.cfg.block_size
    x = torch.randint(0, model.cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0)).cuda()
    micro = graphs.GraphedMicrostep(model, torch.autocast("cuda", dtype=torch.bfloat16))
    micro(x[:, :-1], x[:, 1:])   # warm-up and capture
    return micro.graphs[(True, False)].replay, micro


def on_two_streams(a, b):
    """a and b launched at once, each on a stream of its own, joined on the current one."""
    cur, s1, s2 = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        with torch.cuda.stream(s1):
            a()
        with torch.cuda.stream(s2):
            b()
        cur.wait_stream(s1)
        cur.wait_stream(s2)
    return both


for scale in scales:
    kw, B = bench.scale_config(scale, bench.PAPER_VOCAB)
    cfg = GPTConfig(**kw, residual="mhar")
    N, T, d, H = 2 * cfg.n_layer + 1, cfg.block_size, cfg.n_embd, cfg.heads
    older = sum(j - 1 for j in range(1, N + 1)) / sum(range(1, N + 1))   # site j reads j sources; the newest is one
    for r in range(rounds):
        bench.fresh_memory("cuda")
        step, held = step_graph(scale)
        chain = bench_routing.graphed(bench_routing.chain_step("fused", N, B, T, d, H, "cuda"))
        t = {}
        for name, fn in (("step", step), ("chain", chain), ("both", on_two_streams(step, chain)),
                         ("both_again", on_two_streams(chain, step))):
            t[name] = do_bench(fn, warmup=25, rep=200, return_mode="median")
        del step, held, chain
        bench.fresh_memory("cuda")
        both = min(t["both"], t["both_again"])
        hidden = (t["step"] + t["chain"] - both) / t["chain"]
        steps = {v: bench.bench_one(scale, v, "cuda", 20, 5, True, bench.PAPER_VOCAB, None, True)
                 for v in ("baseline", "mhar_fused")}
        base, mhar = (steps[v]["step_ms"] for v in ("baseline", "mhar_fused"))
        cost, h = mhar - base, hidden * older
        row = dict(scale=scale, round=r, N=N, B=B, T=T, d=d, H=H, step_ms=t["step"], chain_ms=t["chain"],
                   both_ms=both, both_orders_ms=[t["both"], t["both_again"]], hidden=hidden, older=older,
                   baseline_step_ms=base, mhar_step_ms=mhar, ratio_now=base / mhar,
                   ratio_predicted=base / (mhar - h * cost), ratio_all_hidden=base / (mhar - hidden * cost))
        record["rows"].append(row)
        print(f"{scale} round {r}: step {t['step']:.2f} ms, chain {t['chain']:.2f} ms, both {both:.2f} ms -> hidden "
              f"{hidden:.2f}, older {older:.2f}; bench step baseline {base:.2f} ms, mhar {mhar:.2f} ms: ratio "
              f"{base / mhar:.3f} now, {row['ratio_predicted']:.3f} predicted ({row['ratio_all_hidden']:.3f} if every "
              "source could go early)", flush=True)
        json.dump(record, open(out, "w"), indent=1)
print("done", flush=True)
