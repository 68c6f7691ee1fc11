"""
metrics.py: what a run reports (val_bpb, routing statistics, gradient norms, the tracker).
"""

import contextlib
import glob
import json
import math
import os
import re
import struct
import weakref

import numpy as np
import pytest
import torch

import metrics
from model import GPT
from support import randomize_routing, run_train, tiny_cfg, together


def test_runs_report_bpb_routing_statistics_and_grad_norm(tmp_path, data_dir):
    """Every eval record holds val_bpb = val_loss / ln 2 x (tokens / bytes) of the evaluated validation targets (recomputed
    here from val.bin and tiktoken: each token's bytes, the end-of-text separator none); attnres and mhar records hold
    routing statistics per site and head (entropy in [0, ln N], weights in [0, 1]; at init, q = 0, the uniform
    mix: entropy ln N exactly), the baseline's none; every step record its gradient norm."""
    import tiktoken
    outs = {m: str(tmp_path / m) for m in ("mhar", "attnres", "baseline")}
    runs = together(*[lambda m=m: run_train(outs[m], data_dir, f"--residual={m}", "--route_heads=2" if m == "mhar" else
                                            "--seed=42", "--max_steps=4", "--eval_interval=2") for m in outs])
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    enc, val = tiktoken.get_encoding("gpt2"), np.fromfile(os.path.join(data_dir, "val.bin"), dtype=np.uint16)
    targets = val[1:32 * 64 + 1]   # eval_tokens 2048 = 32 sequences of 64: the tokens each eval predicts
    n_bytes = sum(0 if t == enc.eot_token else len(enc.decode_single_token_bytes(int(t))) for t in targets)
    assert re.search(r"eval step 4 \| val_loss \d+\.\d+ \| val_bpb \d+\.\d+ .* \| routing entropy [\d.]+, kl [\d.]+, embedding", runs[0].stdout)
    for m, out in outs.items():
        records = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
        evals, steps = [r for r in records if "val_loss" in r], [r for r in records if "loss" in r]
        assert [r["step"] for r in evals] == [0, 2, 4] and all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
                                                             for r in steps)
        for r in evals:
            assert r["val_bpb"] == pytest.approx(r["val_loss"] / math.log(2) * len(targets) / n_bytes, rel=1e-6)
            if m == "baseline":
                assert "routing" not in r
                continue
            heads = 2 if m == "mhar" else 1
            assert len(r["routing"]["entropy"]) == 5 and all(len(site) == heads for site in r["routing"]["entropy"])
            stats = ("entropy", "kl", "logit_sd", "w_first", "w_newest")
            for j, (ent, kl, sd, first, newest) in enumerate(zip(*(r["routing"][k] for k in stats)), 1):
                assert all(-1e-6 <= e <= math.log(j) + 1e-6 for e in ent) and all(-1e-6 <= w <= 1 + 1e-6 for w in first + newest)
                assert kl == pytest.approx([max(math.log(j) - e, 0.0) for e in ent], abs=1e-12) and all(x >= 0 for x in kl + sd)
                if r["step"] == 0:   # zero queries: every source weighs 1/j, every logit is 0
                    assert ent == pytest.approx([math.log(j)] * heads, abs=1e-6) and first == pytest.approx([1 / j] * heads)
                    assert kl == pytest.approx([0.0] * heads, abs=1e-6) and sd == pytest.approx([0.0] * heads, abs=1e-6)


def test_routing_statistics_read_a_forced_query():
    """A site whose query points at one source reads entropy ~0 there and all its weight on that source: every token's
    embedding is one vector e, the first sublayer's output is zeroed, and site 2's query is 50 e."""
    model = GPT(tiny_cfg(residual="mhar", route_heads=2)).eval()
    e = torch.randn(48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.wte.weight.copy_(e.expand_as(model.wte.weight))
        model.blocks[0].attn.o_proj.weight.zero_()
        model.routes[1].q.copy_(50 * e)
        _, _, alpha = model(torch.randint(0, 96, (2, 9)), return_routing=True)
    stats = metrics.routing_stats([(a / 18, b / 18) for a, b in metrics.token_sums(alpha)])   # 2 x 9 tokens
    assert stats["entropy"][1] == pytest.approx([0.0, 0.0], abs=1e-6) and stats["w_first"][1] == pytest.approx([1.0, 1.0])
    assert stats["entropy"][0] == [0.0, 0.0] and stats["entropy"][2] == pytest.approx([math.log(3)] * 2)   # q = 0
    assert stats["kl"][1] == pytest.approx([math.log(2)] * 2, abs=1e-6) and stats["kl"][2] == pytest.approx([0, 0])


def test_router_speed_statistics_equal_a_hand_computation():
    """kl and logit_sd, the router's speed as a run logs it, against a hand computation in float64 (numpy) from the
    sources themselves: site 2 of a tiny MHAR model (H = 2) routes over the embedding e (one vector for every token)
    and the first sublayer's output, zeroed, with the query 0.3 e at route_scale 1.5. Per head h the logits are
    1.5 * 0.3 * sum over the head's channels of e * g * RMSNorm(e) for the embedding and 0 for the zero source, so
    logit_sd is half their difference and kl = ln 2 - the entropy of softmax((l, 0)). A third site with a random
    query checks logit_sd against the logits route_reference computes (its token-averaged logits' spread)."""
    model = GPT(tiny_cfg(residual="mhar", route_heads=2, route_scale=1.5)).eval()
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(48, generator=gen)
    with torch.no_grad():
        model.wte.weight.copy_(e.expand_as(model.wte.weight))
        model.blocks[0].attn.o_proj.weight.zero_()
        model.routes[1].q.copy_(0.3 * e)
        model.routes[1].g.copy_(1 + 0.1 * torch.randn(48, generator=gen))
        model.routes[2].q.copy_(torch.randn(48, generator=gen))
        sources = []
        model.routing_observer = lambda site, stacked: sources.append(stacked.double())
        idx = torch.randint(0, 96, (2, 9), generator=gen)
        _, _, alpha = model(idx, return_routing=True)
    stats = metrics.routing_stats([(a / idx.numel(), b / idx.numel()) for a, b in metrics.token_sums(alpha)])
    ed, g = e.double().numpy(), model.routes[1].g.detach().double().numpy()
    normed = ed / np.sqrt((ed ** 2).mean() + 1e-6)
    logit = 1.5 * (0.3 * ed * g * normed).reshape(2, 24).sum(1)      # per head; the zero source's logit is 0
    p = np.exp(logit) / (np.exp(logit) + 1)                            # the embedding's weight, every token alike
    entropy = -(p * np.log(p) + (1 - p) * np.log(1 - p))
    assert stats["logit_sd"][1] == pytest.approx(np.abs(logit) / 2, rel=1e-5)
    assert stats["kl"][1] == pytest.approx(np.log(2) - entropy, rel=1e-5)
    s = sources[2]                                                     # site 3: (3, B, T, 48), a random query
    site = model.routes[2]
    keys = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * site.gain().detach().double()
    logits = (keys * site.q.detach().double()).view(3, 2, 9, 2, 24).sum(-1)       # (N, B, T, H)
    assert stats["logit_sd"][2] == pytest.approx(logits.mean((1, 2)).std(0, correction=0).tolist(), rel=1e-5)
    mean = torch.softmax(logits, 0).mean((1, 2))
    assert stats["kl"][2] == pytest.approx((math.log(3) + (mean * mean.log()).sum(0)).tolist(), rel=1e-5)


class PeakLiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The peak bytes held at once by tensors that ops create inside the mode: each storage counted once, from the op
    that makes it until its last tensor goes; storages in `skip` (parameters, inputs) are not counted."""

    def __init__(self, skip):
        super().__init__()
        self.skip, self.live, self.now, self.peak = skip, {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                key = t.untyped_storage().data_ptr()
                if key in self.skip:
                    continue
                if key not in self.live:
                    self.live[key] = [t.untyped_storage().nbytes(), 0]
                    self.now += self.live[key][0]
                    self.peak = max(self.peak, self.now)
                self.live[key][1] += 1
                weakref.finalize(t, self._drop, key)
        return out

    def _drop(self, key):
        self.live[key][1] -= 1
        if not self.live[key][1]:
            self.now -= self.live.pop(key)[0]


def test_routing_statistics_stay_within_the_fused_source_buffer():
    """The eval's routing statistics (metrics.routing_statistics) run the reference routing in pieces of the microbatch:
    what they hold at once stays under the fused chain's source buffer of the whole microbatch (N x B x T x d elements,
    which a training step holds), where one forward of the whole microbatch with the weights recorded holds 3x more; the
    statistics and the loss equal that forward's."""
    torch.manual_seed(0)
    model = GPT(tiny_cfg(residual="mhar", route_heads=2, n_layer=6)).eval()
    randomize_routing(model)
    x, y = torch.randint(0, 96, (16, 32)), torch.randint(0, 96, (16, 32))
    buffer = model.cfg.n_sites * x.numel() * model.cfg.n_embd * 4                 # fp32 sources, the whole microbatch
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), x, y)}
    peaks, results = {}, {}
    for name, run in (("pieces", lambda: metrics.routing_statistics(model, x, y, contextlib.nullcontext())),
                      ("whole", lambda: model(x, y, return_routing=True))):
        with torch.no_grad(), PeakLiveBytes(skip) as mode:
            results[name] = run()
        peaks[name] = mode.peak
    assert peaks["pieces"] < buffer < peaks["whole"] / 3, (peaks, buffer)
    stats, loss_sum = results["pieces"]
    _, loss, alpha = results["whole"]
    whole = metrics.routing_stats([(a / y.numel(), b / y.numel()) for a, b in metrics.token_sums(alpha)])
    for key in whole:
        assert np.allclose(stats[key], whole[key], rtol=0, atol=1e-6), key
    assert loss_sum.item() == pytest.approx(loss.item() * y.numel(), rel=1e-5)


def test_wandb_log_offline_and_without_wandb(tmp_path, data_dir):
    """--wandb_log=True with WANDB_MODE=offline writes a local run holding the step, eval and routing records, per site
    and head too (read back from its file); a resume continues the same W&B run (its id kept in out_dir); without wandb
    installed: one line naming the fix, exit 1, nothing trained."""
    pytest.importorskip("wandb", reason="optional: pip install wandb (CI installs it)")
    from wandb.proto import wandb_internal_pb2
    fake = tmp_path / "no_wandb"
    fake.mkdir()
    (fake / "wandb.py").write_text("raise ImportError(\"No module named 'wandb'\")\n")
    out, missing = tmp_path / "w", tmp_path / "m"
    r, m = together(lambda: run_train(str(out), data_dir, "--wandb_log=True", "--max_steps=4", "--eval_interval=2",
                                      "--route_heads=1", env={"WANDB_MODE": "offline"}),
                    lambda: run_train(str(missing), data_dir, "--wandb_log=True", env={"PYTHONPATH": str(fake)}))
    assert r.returncode == 0, r.stderr[-3000:]
    raw = open(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))[0], "rb").read()
    rows, pos, chunk = {}, 7, b""   # the run file: W&B's header, then LevelDB-style records of protobuf Records
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0:
            pos += 32768 - pos % 32768
            continue
        chunk, pos = (b"" if kind in (1, 2) else chunk) + raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record.FromString(chunk)
            if rec.WhichOneof("record_type") == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                rows.setdefault(row["_step"], {}).update(row)
    assert sorted(rows) == [0, 1, 2, 3, 4]
    assert all({"loss", "grad_norm", "lr"} <= set(rows[s]) for s in (1, 2, 3, 4))
    assert all({"val_loss", "val_bpb", "routing/entropy", "routing/w_first", "routing/entropy_site5",
                "routing_heads/entropy/site5/head0", "routing_heads/w_newest/site3/head0"} <= set(rows[s])
               for s in (0, 2, 4))
    log = [json.loads(line) for line in open(out / "log.jsonl")]
    assert rows[4]["val_loss"] == [x for x in log if "val_loss" in x][-1]["val_loss"]
    run_id = (out / "wandb_run_id").read_text()   # a resumed run continues its own W&B run
    r = run_train(str(out), data_dir, "--wandb_log=True", "--max_steps=6", "--eval_interval=2", "--route_heads=1",
                  "--init_from=resume", env={"WANDB_MODE": "offline"})
    assert r.returncode == 0 and (out / "wandb_run_id").read_text() == run_id, r.stderr[-2000:]
    runs = sorted(glob.glob(str(out / "wandb" / "offline-run-*")))
    assert len(runs) == 2 and all(d.endswith("-" + run_id) for d in runs), runs
    assert m.returncode == 1 and "--wandb_log=True needs Weights & Biases: pip install wandb" in m.stderr
    assert "Traceback" not in m.stderr and not missing.exists()
