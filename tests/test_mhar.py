"""
The method and its kernels: model.py's routing against a float64 oracle and the method's invariants
(configs, generation), then the fused Triton kernels (routing_call.py, routing_kernel.py, routing_block.py,
routing_config.py) against the reference: outputs and every gradient, fp32 and bf16, awkward shapes. On a CPU the
kernels run in Triton's interpreter.
"""

import functools
import math
import os
import re
import shutil
import subprocess
import sys
import types
from dataclasses import replace

import pytest
import torch

import bench_routing
import checkpoint
import convert
import export
import metrics
import routing_call
import routing_config as rc
import routing_kernel as rk
from bench_routing import run_chain
from generation import KVCache
from graphs import DecodeGraph
from model import GPT, BlockDepthHistory, GPTConfig, fused_router, route_reference
from support import DEVICE, HERE, HF_CONFIGS, MODES, randomize_routing, rel_err, tiny_cfg, write_hf_checkpoint


def route_oracle(sources, q, g, H, eps):
    """Per-head loops in float64, written from the paper's Eq. 3 without sharing code with model.py."""
    s, q, g = sources.double(), q.double(), g.double()
    N, B, T, d = s.shape
    dh = d // H
    r = 1.0 / torch.sqrt((s * s).mean(-1, keepdim=True) + eps)
    out = torch.empty(B, T, d, dtype=torch.float64)
    for h in range(H):
        sl = slice(h * dh, (h + 1) * dh)
        logit = torch.einsum("nbtk,k->nbt", s[..., sl] * r * g[sl], q[sl])
        w = torch.exp(logit - logit.max(0).values)
        w = w / w.sum(0)
        out[..., sl] = torch.einsum("nbt,nbtk->btk", w, s[..., sl])
    return out


@pytest.mark.parametrize("N,B,T,d,H", [(1, 2, 3, 32, 2), (5, 2, 7, 96, 4), (9, 1, 5, 40, 5), (4, 3, 1, 64, 1)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
def test_route_reference_matches_oracle(N, B, T, d, H, dtype, tol):
    torch.manual_seed(N * 100 + d)
    sources = torch.randn(N, B, T, d).mul(torch.rand(N, 1, 1, 1) * 3 + 0.1).to(dtype)   # sources of unequal scale
    q, g = torch.randn(d), 1 + 0.3 * torch.randn(d)
    out, alpha = route_reference(sources, q, g, H, return_alpha=True)
    ref = route_oracle(sources, q, g, H, 1e-6)
    assert out.dtype == dtype and out.shape == (B, T, d) and alpha.shape == (N, B, T, H)
    assert ((out.double() - ref).norm() / ref.norm()).item() < tol
    assert torch.allclose(alpha.sum(0), torch.ones(B, T, H))


def test_zero_query_is_uniform_mean():
    sources = torch.randn(6, 2, 3, 32)
    out = route_reference(sources, torch.zeros(32), torch.randn(32), 4)
    torch.testing.assert_close(out, sources.mean(0))


def test_single_head_mhar_is_attnres_exactly():
    torch.manual_seed(0)
    a = GPT(tiny_cfg(residual="attnres"))
    torch.manual_seed(0)
    m = GPT(tiny_cfg(residual="mhar", route_heads=1))
    randomize_routing(a)
    randomize_routing(m)
    idx = torch.randint(0, 96, (2, 16))
    assert torch.equal(a(idx)[0], m(idx)[0])


def test_shared_weights_identical_across_modes():
    states = {}
    for mode in MODES:
        torch.manual_seed(3)
        states[mode] = GPT(tiny_cfg(residual=mode)).state_dict()
    base = states["baseline"]
    for mode in MODES[1:]:
        extra = set(states[mode]) - set(base)
        assert all(k.startswith(("routes.", "hyper.")) for k in extra), extra
        assert all(torch.equal(base[k], states[mode][k]) for k in base)


def test_random_init_queries_keep_the_pairing():
    """route_init_std draws the queries N(0, std^2) from a generator of their own, seeded from the run's seed: the
    shared weights stay bitwise those of every mode at that seed (zero-init and baseline runs included), the queries
    have the asked std, another seed draws other ones, and the default keeps every query exactly 0."""
    cfg = dict(n_layer=4, n_embd=96, n_head=4, n_kv_head=2)
    states = {}
    for name, kw in (("baseline", dict(residual="baseline")), ("mhar", dict(residual="mhar")),
                     ("mhar_random", dict(residual="mhar", route_init_std=0.02)),
                     ("attnres_random", dict(residual="attnres", route_init_std=0.02))):
        torch.manual_seed(3)
        states[name] = GPT(tiny_cfg(**cfg, **kw)).state_dict()
    base = states["baseline"]
    for name, state in states.items():
        assert all(torch.equal(base[k], state[k]) for k in base), name
    queries = lambda state: torch.cat([v for k, v in state.items() if k.endswith(".q")])   # noqa: E731
    assert torch.count_nonzero(queries(states["mhar"])) == 0
    q = queries(states["mhar_random"])
    assert q.numel() == 9 * 96 and abs(q.std().item() - 0.02) < 0.002 and abs(q.mean().item()) < 0.002
    assert torch.equal(q, queries(states["attnres_random"]))   # the same draws: H only splits the same vector
    torch.manual_seed(4)
    assert not torch.equal(q, queries(GPT(tiny_cfg(**cfg, residual="mhar", route_init_std=0.02)).state_dict()))


@pytest.mark.parametrize("mode,H", [("attnres", None), ("mhar", 2)])
def test_block_routing_sources(mode, H):
    """route_blocks = n (block routing, n blocks of P = 2L / n sublayers): every site's sources, as the routing sees
    them, are the embedding, each completed block's sum and the open block's partial sum, built here from the
    sublayer outputs with the same additions in the same order (bitwise), never more than n + 1; n = 2L (one sublayer
    a block) is full routing, bitwise: the same loss and every gradient."""
    idx, L = torch.randint(0, 96, (2, 11)), 3
    for n in (1, 2, 3, 6):   # P = 6 (one block), 3 (blocks split a layer), 2 (one layer each), 1 (full routing)
        torch.manual_seed(0)
        m = GPT(tiny_cfg(residual=mode, route_heads=H, route_blocks=n, route_init_std=0.3, n_layer=L))
        seen, outs, P = [], [], 2 * L // n
        m.routing_observer = lambda site, stacked: seen.append(stacked)
        for sub in m.sublayers():
            sub.register_forward_hook(lambda mod, args, out: outs.append(out))
        m(idx)
        emb = m.wte(idx)
        assert len(seen) == 2 * L + 1 and len(outs) == 2 * L
        for j, stacked in enumerate(seen):   # site j + 1 reads the outputs of sublayers 1..j
            want = [emb] + [functools.reduce(torch.add, outs[i:min(i + P, j)]) for i in range(0, j, P)]
            assert stacked.shape[0] == len(want) <= n + 1 and torch.equal(stacked, torch.stack(want)), (n, j)
    runs = []
    for blocks in (None, 2 * L):
        torch.manual_seed(0)
        m = GPT(tiny_cfg(residual=mode, route_heads=H, route_blocks=blocks, route_init_std=0.3, n_layer=L))
        loss = m(idx, idx)[1]
        loss.backward()
        runs.append([loss] + [p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("mode", ["attnres", "mhar", "hyper"])
def test_zero_queries_reproduce_baseline(mode):
    # With q = 0 a site returns the mean of its N sources = (additive residual stream) / N, and the next
    # RMSNorm removes the 1/N: rms_norm(x / N) = x / sqrt(mean(x^2) + N^2 eps). So the functions agree
    # only up to eps scaled by N^2 (N up to 2L+1); with activations of scale ~0.02 the default eps of 1e-6
    # would shift the logits visibly, hence a tiny eps here. Hyper-connections at init keep n identical
    # streams and read out their sum (n x the stream), the same argument with n^2.
    torch.manual_seed(0)
    base = GPT(tiny_cfg(residual="baseline", norm_eps=1e-12))
    other = GPT(tiny_cfg(residual=mode, norm_eps=1e-12))
    missing, unexpected = other.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith(("routes.", "hyper.")) for k in missing)
    idx = torch.randint(0, 96, (2, 24))
    torch.testing.assert_close(other(idx)[0], base(idx)[0], atol=2e-5, rtol=1e-4)


def test_parameter_counts():
    n = {mode: GPT(tiny_cfg(residual=mode)).num_params() for mode in MODES}
    L, d = 2, 48
    assert n["mhar"] - n["baseline"] == (2 * L + 1) * 2 * d
    assert n["attnres"] == n["mhar"]
    assert n["hyper"] > n["baseline"]
    assert len(GPT(tiny_cfg()).routing_sites()) == 2 * L + 1


@pytest.mark.parametrize("mode", MODES)
def test_causal_and_finite_gradients(mode):
    torch.manual_seed(1)
    model = GPT(tiny_cfg(residual=mode, hc_dynamic=True))
    randomize_routing(model)
    idx = torch.randint(0, 96, (2, 20))
    logits, loss = model(idx, idx)
    idx2 = idx.clone()
    idx2[:, 12] = (idx2[:, 12] + 1) % 96
    logits2, _ = model(idx2)
    assert torch.equal(logits[:, :12], logits2[:, :12]), "a future token changed an earlier prediction"
    assert not torch.equal(logits[:, 12:], logits2[:, 12:])
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
    if mode in ("attnres", "mhar"):   # routing parameters learn (site 0 has one source: softmax of one is 1)
        sites = model.routing_sites()
        assert sites[0].q.grad.abs().sum() == 0
        assert all(s.q.grad.abs().sum() > 0 and s.g.grad.abs().sum() > 0 for s in sites[1:])


def test_static_hyper_connections_run():
    model = GPT(tiny_cfg(residual="hyper", hc_dynamic=False, hc_streams=3))
    _, loss = model(torch.randint(0, 96, (1, 8)), torch.randint(0, 96, (1, 8)))
    loss.backward()
    assert {n.split(".")[-1] for n, _ in model.named_parameters() if n.startswith("hyper.")} == {"alpha", "beta"}


@pytest.mark.parametrize("H", [1, 2, 6])
def test_return_routing_shapes_and_sums(H):
    model = GPT(tiny_cfg(residual="mhar", route_heads=H))
    randomize_routing(model)
    B, T = 2, 9
    logits, loss, routing = model(torch.randint(0, 96, (B, T)), return_routing=True)
    assert loss is None and logits.shape == (B, T, 96)
    assert len(routing) == 2 * 2 + 1
    for j, alpha in enumerate(routing, start=1):
        assert alpha.shape == (j, B, T, H)
        torch.testing.assert_close(alpha.sum(0), torch.ones(B, T, H))


def live_model(residual, impl):
    """A tiny model of this mode in eval mode, seeded, its routing live (random queries; delta's alpha at 0.7); the
    test is skipped where the fused kernels cannot run."""
    if impl == "fused" and not rk.available(DEVICE):
        pytest.skip("the fused kernels need CUDA or TRITON_INTERPRET=1")
    torch.manual_seed(0)
    m = GPT(tiny_cfg(residual=residual, routing_impl=impl, num_blocks=2, **({"route_heads": 2} if residual == "delta"
                                                                              else {}))).to(DEVICE).eval()
    randomize_routing(m)
    with torch.no_grad():
        for site in m.routing_sites():
            if hasattr(site, "alpha"):
                site.alpha.fill_(0.7)
    return m


@pytest.mark.parametrize("residual,impl", [("baseline", "reference"), ("hyper", "reference"), ("mhar", "reference"),
                                           ("mhar", "fused"), ("attnres", "reference"), ("delta", "reference")])
def test_a_padded_batch_computes_each_row_alone(residual, impl):
    """attention_mask (0 at padding, on the left or the right, Hugging Face's convention): each row's logits at its
    tokens are the row's alone (its positions count its own tokens), and greedy generation through the KV cache with
    the mask extended by each new token gives each row's own continuation (every residual mode, fp32)."""
    m = live_model(residual, impl)
    rows = [torch.randint(0, 96, (n,), device=DEVICE) for n in (5, 9, 7)]
    with torch.no_grad():
        alone = [m(r[None])[0][0] for r in rows]
        for left in (False, True):   # (the left-padded batch last: generation below starts from it)
            idx = torch.zeros(3, 9, dtype=torch.long, device=DEVICE)
            mask = torch.zeros(3, 9, dtype=torch.long, device=DEVICE)
            for i, r in enumerate(rows):
                where = slice(9 - len(r), 9) if left else slice(0, len(r))
                idx[i, where], mask[i, where] = r, 1
            logits = m(idx, attention_mask=mask)[0]
            for i, r in enumerate(rows):
                got = logits[i, 9 - len(r):] if left else logits[i, :len(r)]
                assert (got - alone[i]).abs().max().item() < 1e-5 * alone[i].abs().max().item(), (left, i)
        want = [m.generate(r[None], 6, temperature=0, use_cache=False)[0, len(r):] for r in rows]
        cache = KVCache(m, 3)
        out = []
        logits = m(idx, cache=cache, attention_mask=mask)[0]
        for _ in range(6):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            logits = m(nxt, cache=cache, attention_mask=mask)[0]
        assert all(torch.equal(torch.cat(out, 1)[i], want[i]) for i in range(3))


@pytest.mark.parametrize("residual,impl", [("baseline", "reference"), ("hyper", "reference"), ("attnres", "reference"),
                                           ("mhar", "reference"), ("mhar", "fused"), ("attnres", "fused"),
                                           ("delta", "reference"), ("delta", "fused")])
def test_kv_cache_gives_the_uncached_logits(residual, impl):
    """Generation with the KV cache: a prefill, single tokens, a chunk after cached tokens and DecodeGraph's
    fixed-shape steps (run eagerly: the position on the device, the whole cache read under a mask) give the logits
    of the whole sequence run without a cache (fp32, every residual mode, fused routing in the interpreter, B = 3)."""
    m = live_model(residual, impl)
    with torch.no_grad():
        seq = torch.randint(0, 96, (3, 24), device=DEVICE)
        full, _ = m(seq)
        cache = KVCache(m, 3)
        pieces = [m(seq[:, :6], cache=cache)[0]]                          # prefill 0..5
        pieces += [m(seq[:, t:t + 1], cache=cache)[0] for t in range(6, 12)]   # one token at a time
        pieces.append(m(seq[:, 12:20], cache=cache)[0])                   # a chunk after cached tokens
        step = DecodeGraph(m, cache, seq[:, 20:21])
        pieces += [step(seq[:, t:t + 1]).clone() for t in range(20, 24)]  # the graphed decode's step, eagerly
        assert cache.pos == 24 and cache.step_pos is None
        assert (torch.cat(pieces, 1) - full).abs().max().item() < 1e-5 * full.abs().max().item()


def test_generate_with_cache_matches_without_and_crops_long_prompts():
    """generate: the cached greedy tokens are the uncached ones while the context fits; a prompt longer than
    block_size keeps its last block_size tokens; past block_size the cache restarts from the last block_size / 2."""
    torch.manual_seed(0)
    m = GPT(tiny_cfg(residual="mhar")).eval()
    randomize_routing(m)
    prompt = torch.randint(0, 96, (2, 5))
    assert torch.equal(m.generate(prompt, 20, temperature=0), m.generate(prompt, 20, temperature=0, use_cache=False))
    long = torch.randint(0, 96, (2, 40))   # block_size 32
    out = m.generate(long, 30, temperature=0)   # runs past the window: cache restarts, no error
    assert out.shape == (2, 70) and torch.equal(out[:, :40], long)
    first = m.generate(long, 1, temperature=0)
    assert torch.equal(first, m.generate(long, 1, temperature=0, use_cache=False))   # both see the last 32 tokens
    stopped = m.generate(prompt, 20, temperature=0, stop=lambda idx: idx.size(1) >= 8)
    assert stopped.shape == (2, 8)


def test_generate_and_mfu():
    model = GPT(tiny_cfg())
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), 5, temperature=0.7, top_k=5)
    assert out.shape == (2, 8)
    greedy = model.generate(torch.zeros(1, 40, dtype=torch.long), 2, temperature=0)   # crops to block_size
    assert greedy.shape == (1, 42)
    assert metrics.mfu(model, 1e5, "Some Unknown Accelerator") is None
    assert metrics.peak_flops("NVIDIA H100 PCIe") == 756e12 and metrics.peak_flops("NVIDIA H200") == 989e12
    assert 0 < metrics.mfu(model, 1e5, "NVIDIA H200") < 1


def test_optimizer_groups():
    model = GPT(tiny_cfg())
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["weight_decay"] == 0.1
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), decay_all=False)
    decay, no_decay = opt.param_groups
    assert all(p.dim() == 2 for p in decay["params"]) and no_decay["weight_decay"] == 0
    assert any(p is model.wte.weight for p in no_decay["params"])
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_params()


@pytest.mark.parametrize("kw,msg", [
    (dict(n_embd=50, n_head=4), r"n_embd=50 must be divisible by n_head=4"),
    (dict(n_head=4, n_kv_head=3), r"n_head=4 must be divisible by n_kv_head=3"),
    (dict(route_heads=5), r"n_embd=48 must be divisible by route_heads=5"),
    (dict(route_heads=0), r"route_heads=0"),
    (dict(residual="mhar2"), r"residual='mhar2' is not one of"),
    (dict(residual="attnres", route_heads=4), r"single-head"),
    (dict(routing_impl="cuda"), r"routing_impl='cuda'"),
    (dict(route_scale=0.0), r"route_scale=0.0 must be a finite number > 0"),
    (dict(route_scale=float("nan")), r"route_scale=nan must be a finite number > 0"),
    (dict(route_init_std=-0.1), r"route_init_std=-0.1 must be a finite number >= 0"),
    (dict(route_init_std=float("inf")), r"route_init_std=inf must be a finite number >= 0"),
    (dict(residual="delta", num_blocks=2, route_init_std=0.02), r"route_init_std=0.02 is for attnres and mhar, not residual='delta'"),
    (dict(residual="baseline", route_init_std=0.02), r"route_init_std=0.02 is for attnres and mhar"),
    (dict(n_layer=0), r"n_layer=0 must be a positive integer"),
    (dict(n_embd=36, n_head=4), r"head_dim=9 must be an even positive integer"),
    (dict(residual="delta", n_layer=3, num_blocks=2), r"num_blocks=2 must divide n_layer=3"),
    (dict(rope_scaling={"rope_type": "yarn"}), r"only rope_type .llama3."),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),   # its other keys missing: named, no KeyError
     r"needs factor, low_freq_factor, high_freq_factor, original_max_position_embeddings.*\(low_freq_factor, "),
    (dict(rope_scaling={"rope_type": "llama3", "factor": "8", "low_freq_factor": 1, "high_freq_factor": 4,
                        "original_max_position_embeddings": 32}), r"\(factor missing or not that\)"),
    (dict(route_scale=float("inf")), r"route_scale=inf must be a finite number > 0"),
    (dict(rope_theta=0.0), r"rope_theta=0.0 must be a finite number > 0"),
    (dict(norm_eps=float("nan")), r"norm_eps=nan must be a finite number > 0"),
])
def test_bad_model_configs(kw, msg):
    with pytest.raises(ValueError, match=msg):
        tiny_cfg(**kw)


@pytest.mark.parametrize("residual", ["attnres", "mhar", "delta"])
def test_route_scale_is_a_scaled_query(residual):
    """route_scale s multiplies every routing logit: the model with s computes what the same model with s = 1 and
    every query times s computes (forward); s = 1 hands the routing the gain g itself (bitwise the paper's)."""
    kw = dict(residual=residual, num_blocks=2, **({"route_heads": 2} if residual == "delta" else {}))
    torch.manual_seed(0)
    scaled = GPT(tiny_cfg(route_scale=0.35, **kw))
    plain = GPT(tiny_cfg(**kw))
    plain.load_state_dict(scaled.state_dict())
    randomize_routing(scaled)
    randomize_routing(plain)
    with torch.no_grad():
        for site in plain.routing_sites():
            site.q.mul_(0.35)
            if hasattr(site, "alpha"):
                site.alpha.fill_(0.7)
        for site in scaled.routing_sites():
            if hasattr(site, "alpha"):
                site.alpha.fill_(0.7)
    idx = torch.randint(0, 96, (2, 11))
    a, b = scaled(idx)[0], plain(idx)[0]
    assert rel_err(a.double(), b.double()) < 1e-6
    assert all(site.gain() is site.g for site in plain.routing_sites())


def test_routing_lr_scale_trains_the_route_scale_model():
    """route_scale = s is a router learning rate as much as a temperature: from q = 0, training with route_scale = s
    and training with route_scale = 1 and the queries' LR times s (routing_lr_scale, which keeps their decay per step)
    give the same routing after 20 AdamW steps (no clip): Adam's step ignores the gradient's scale."""
    s = 0.25
    torch.manual_seed(0)
    scaled = GPT(tiny_cfg(route_scale=s))
    fast = GPT(tiny_cfg())
    fast.load_state_dict(scaled.state_dict())
    runs = [(scaled, scaled.configure_optimizers(0.1, 3e-3, (0.9, 0.95))),
            (fast, fast.configure_optimizers(0.1, 3e-3, (0.9, 0.95), routing_lr_scale=s))]
    assert len(runs[0][1].param_groups) == 1 and runs[1][1].param_groups[-1]["weight_decay"] == pytest.approx(0.1 / s)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 96, (4, 17), generator=gen) for _ in range(20)]
    for model, opt in runs:
        for group in opt.param_groups:
            group["lr"] = 3e-3 * group.get("lr_scale", 1.0)
        for b in batches:
            model(b[:, :-1], b[:, 1:])[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    q_scaled = torch.cat([site.q.detach() for site in scaled.routing_sites()])
    q_fast = torch.cat([site.q.detach() for site in fast.routing_sites()])
    assert q_fast.abs().max() > 1e-3   # the routers trained
    assert (s * q_scaled - q_fast).abs().max() < 1e-5   # the same logits: s <q, key> = <q', key>
    idx = batches[0][:, :-1]
    alpha_a, alpha_b = scaled(idx, return_routing=True)[2], fast(idx, return_routing=True)[2]
    assert max((a - b).abs().max().item() for a, b in zip(alpha_a, alpha_b)) < 1e-5


def test_compiled_hyper_connections_match_eager():
    """compile_sublayers also compiles the hyper-connections' stream read and write (one graph each for every
    layer): same loss and gradients as eager, with non-zero dynamic weights."""
    torch.manual_seed(0)
    eager = GPT(tiny_cfg(residual="hyper")).to(DEVICE)
    with torch.no_grad():
        for hc in eager.hyper:
            hc.w_alpha.normal_(0, 0.1)
            hc.w_beta.normal_(0, 0.1)
    compiled = GPT(tiny_cfg(residual="hyper")).to(DEVICE)
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_sublayers()
    idx = torch.randint(0, 96, (2, 16), device=DEVICE)
    losses = [m(idx, idx)[1] for m in (eager, compiled)]
    for loss in losses:
        loss.backward()
    assert abs(losses[0].item() - losses[1].item()) < 1e-5
    assert_grads_close({n: p.grad for n, p in compiled.named_parameters()}, {n: p.grad for n, p in eager.named_parameters()})


def test_logits_beside_a_loss_are_detached():
    """model(idx, targets) returns the logits detached (the loss carries the gradient), so a compiled head never
    fills a zero gradient for the whole (B, T, vocab) logits in backward; model(idx) keeps them differentiable."""
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=64, ffn_hidden=128, block_size=32, vocab_size=500))
    idx = torch.randint(0, 500, (2, 32))
    logits, loss = model(idx, idx)
    assert loss.requires_grad and not logits.requires_grad
    assert model(idx)[0].requires_grad
    # AOT autograd is where an unused output's zero gradient gets filled: its eager backend shows the fill (checked
    # with a head that returns the logits undetached) without the minutes of inductor's C++ compilation
    model.compile_sublayers(backend="aot_eager")
    for _ in range(2):   # compile, then a clean step
        model(idx, idx)[1].backward()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        model(idx, idx)[1].backward()
    fills = [e.input_shapes for e in prof.key_averages(group_by_input_shape=True)
             if e.key in ("aten::zero_", "aten::fill_", "aten::zeros") and [2, 32, 500] in e.input_shapes]
    assert not fills, f"a (B, T, vocab) fill in the compiled step: {fills}"


def test_auto_routing_picks_reference_on_cpu_and_says_so(capsys):
    """routing_impl='auto' (the default) takes the reference routing on a CPU, even under TRITON_INTERPRET=1 (the
    interpreter is for tests), and says so once; explicit 'fused' runs the kernels there under the interpreter."""
    GPT._said.clear()
    m = GPT(tiny_cfg(routing_impl="auto"))
    assert m.cfg.routing_impl == "auto" and GPTConfig.routing_impl == "auto"
    assert m.routing_path("cpu") == "reference" and m.routing_path("cpu") == "reference"
    assert capsys.readouterr().err.count("routing (routing_impl='auto'): the reference PyTorch routing, since the "
                                         "model is on cpu") == 1
    if rk.available("cpu"):
        assert GPT(tiny_cfg(routing_impl="fused")).routing_path("cpu") == "fused"
    if torch.cuda.is_available() and rk.triton is not None:
        assert m.routing_path("cuda") == "fused"
        assert GPT(tiny_cfg(routing_impl="auto", n_embd=48, route_heads=4)).routing_path("cuda") == "reference"   # D 12
        assert "head width d/H = 48/4 = 12 is below 16" in capsys.readouterr().err


SMALL_BLOCKS = rc.RoutingConfig(max_block_m=16)   # many token blocks per launch, the last one partial


def chain_grads(impl, src0, qs, gs, shift, up, H, dtype, config=None):
    """N routing sites with tanh sublayers between them: out and every gradient (float64), bench_routing.chain_grads."""
    return bench_routing.chain_grads(impl, src0.to(dtype), qs, gs, lambda j, x: torch.tanh(x) + shift[j].to(x.dtype), up, H,
                             config)


def chain_inputs(N, B, T, d, seed):
    """Random inputs of an N-site chain: source 0, every site's q and g, the sublayer shifts, the upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    src0 = torch.randn(B, T, d, generator=gen).to(DEVICE)
    qs = [torch.randn(d, generator=gen).to(DEVICE) for _ in range(N)]
    gs = [(1 + 0.3 * torch.randn(d, generator=gen)).to(DEVICE) for _ in range(N)]
    shift = [torch.randn(B, T, d, generator=gen).to(DEVICE) for _ in range(N)]
    return src0, qs, gs, shift, torch.randn(B, T, d, generator=gen, dtype=torch.float64).to(DEVICE)


def check_fused_chain(N, B, T, d, H, dtype, config=None):
    src0, qs, gs, shift, up = chain_inputs(N, B, T, d, seed=N * 1000 + T)
    fused = chain_grads("fused", src0, qs, gs, shift, up, H, dtype, config)
    names = ["out", "d_source", "dq", "dg"]
    if N == 1:   # one source: alpha = 1, so dq and dg are 0 by the math; the fused path leaves rounding noise
        scale = fused[1].abs().max() * B * T          # (exp(logit - lse) is 1 only up to a few ulp on a GPU)
        assert fused[2].abs().max() < 1e-5 * scale and fused[3].abs().max() < 1e-5 * scale
        names, fused = names[:2], fused[:2]
    if dtype == torch.float32:
        ref = chain_grads("reference", src0, qs, gs, shift, up, H, dtype)
        for name, a, b in zip(names, fused, ref):
            assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))
    else:   # bf16: no worse than 1.5x the reference's own bf16 error, both against a float64 truth
        # the truth runs the same bf16 inputs in float64 (src0 rounded to bf16 first, like both paths see it)
        truth = chain_grads("reference", src0.to(dtype).double(), [x.double() for x in qs], [x.double() for x in gs],
                            [x.to(dtype).double() for x in shift], up, H, torch.float64)
        ref = chain_grads("reference", src0, qs, gs, shift, up, H, dtype)
        for name, a, b, t in zip(names, fused, ref, truth):
            assert rel_err(a, t) <= 1.5 * rel_err(b, t) + 1e-6, (name, rel_err(a, t), rel_err(b, t))


def tiny_pair(routing_config=None, gate=None, randomize=True, **kw):
    """The same tiny MHAR model with reference and fused routing (launch settings routing_config), non-trivial queries
    (randomize=False: the model's own, e.g. drawn by route_init_std); gate: delta mode's alpha at every site (0 at
    init, which keeps routing from the output and its gradients)."""
    models = []
    for impl in ("reference", "fused"):
        torch.manual_seed(0)
        m = GPT(tiny_cfg(routing_impl=impl, **kw)).to(DEVICE)
        m.routing_config = routing_config
        if randomize:
            randomize_routing(m)
        if gate is not None:
            with torch.no_grad():
                for site in m.routing_sites():
                    site.alpha.fill_(gate)
        models.append(m)
    return models


def fused_model_vs_reference(**kw):
    """Logits and every parameter gradient of a tiny model, fused against reference routing; returns the fused model."""
    ref, fused = tiny_pair(**kw)
    idx = torch.randint(0, 96, (2, 19), device=DEVICE)
    outs = []
    for m in (ref, fused):
        logits, loss = m(idx, idx)
        loss.backward()
        outs.append((logits, {n: p.grad for n, p in m.named_parameters()}))
    assert rel_err(outs[1][0].double(), outs[0][0].double()) < 1e-5
    assert_grads_close(outs[1][1], outs[0][1])
    return fused


@pytest.mark.parametrize("kw", [dict(residual="attnres"), dict(residual="mhar", route_heads=2),
                                dict(residual="mhar", route_heads=2, route_blocks=2),
                                dict(residual="attnres", route_blocks=2),
                                dict(residual="delta", route_heads=2, num_blocks=2)],
                         ids=["single head", "mhar", "mhar blocks", "single head blocks", "delta"])
def test_every_routing_parameter_is_checked_fused_against_reference(kw):
    """Every parameter of the routing sites, found rather than named (a parameter a variant adds to Route is in without
    a line here), moved away from its init by the same draw in both models, then the logits and each parameter's
    gradient (all sites' as one vector: site 0 mixes one source, whose gradient is 0 in the reference and rounding
    noise in the fused path), fused against reference, in every routed mode: full and block routing, one head and
    several, delta (its null sources and gates too)."""
    if not rk.available(DEVICE):
        pytest.skip("the fused kernels need CUDA or TRITON_INTERPRET=1")
    check_every_routing_parameter(kw)


def check_every_routing_parameter(kw):
    """test_every_routing_parameter_is_checked_fused_against_reference's check (a worked test runs it on a copy of
    the files changed as ROUTING.md says); -> the names of the parameters it compared."""
    ref, fused = tiny_pair(randomize=False, **kw)
    names = sorted({n.split(".", 2)[2] for n, _ in ref.named_parameters() if n.startswith("routes.")})
    assert {"q", "g"} <= set(names) and (kw["residual"] != "delta" or {"null", "alpha"} <= set(names)), names
    for m in (ref, fused):
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for site in m.routing_sites():
                for p in site.parameters():   # away from every init (0, 1): a gradient of any of them shows
                    p.copy_(0.6 * torch.randn(p.shape, generator=gen).to(p) + (1.0 if p is getattr(site, "g") else 0.0))
    idx = torch.randint(0, 96, (2, 19), device=DEVICE)
    outs = []
    for m in (ref, fused):
        logits, loss = m(idx, idx)
        loss.backward()
        outs.append((logits, {n: p.grad for n, p in m.named_parameters() if n.startswith("routes.")}))
    assert rel_err(outs[1][0].double(), outs[0][0].double()) < 1e-5
    for name in names:
        keys = [n for n in outs[0][1] if n.split(".", 2)[2] == name]
        missing = [k for o in outs for k in keys if o[1][k] is None]
        assert not missing, (name, "no gradient reaches", missing[:3])
        ref_grad, fused_grad = (torch.cat([o[1][k].flatten() for k in keys]).double() for o in outs)
        assert ref_grad.abs().max() > 0 and rel_err(fused_grad, ref_grad) < 1e-4, (name, rel_err(fused_grad, ref_grad))
    return names


def assert_backward_repeats_bitwise(model, idx):
    """Two backward passes of the same batch give bitwise the same gradients."""
    grads = []
    for _ in range(2):
        model.zero_grad()
        model(idx, idx)[1].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def assert_grads_close(fused, ref, tol=1e-4):
    """Every parameter gradient; the routing q and g of all sites compared as one vector each (site 0 mixes
    one source, so its q and g get exactly 0 in the reference and rounding noise in the fused path)."""
    for name, grad in ref.items():
        if not name.startswith("routes."):
            assert rel_err(fused[name].double(), grad.double()) < tol, name
    for p in ("q", "g"):
        names = [n for n in ref if n.startswith("routes.") and n.endswith("." + p)]
        if not names:   # a mode without routing
            continue
        a, b = torch.cat([fused[n] for n in names]), torch.cat([ref[n] for n in names])
        assert rel_err(a.double(), b.double()) < tol, p


def test_chain_backward_needs_only_the_gather():
    """The routing chain's backward from one pass over (source n, later site j) pairs reading G_j, the site's output
    gradient, with no pass over each site's sources: per site only c_j = <G_j, out_j> per head (= sum_n alpha da) and
    the forward's log-sum-exp; per pair alpha, da = <G_j, s_n> and dlogit = alpha (da - c_j) recomputed beside s_n.
    Every gradient equals autograd's through route_reference (whose math is fp32; here float64 inputs and sums),
    site j routing over sources 0..j-1."""
    gen = torch.Generator().manual_seed(0)
    N, B, T, d, H, eps = 5, 2, 3, 24, 3, 1e-6
    S = torch.randn(N, B, T, d, generator=gen, dtype=torch.float64).requires_grad_(True)
    q = (torch.randn(N, d, generator=gen, dtype=torch.float64) * 0.7).requires_grad_(True)
    g = (1 + 0.3 * torch.randn(N, d, generator=gen, dtype=torch.float64)).requires_grad_(True)
    G = torch.randn(N, B, T, d, generator=gen, dtype=torch.float64)
    outs = [route_reference(S[:j], q[j - 1], g[j - 1], H, eps) for j in range(1, N + 1)]
    sum((o * G[j]).sum() for j, o in enumerate(outs)).backward()
    heads = lambda x: x.view(*x.shape[:-1], H, d // H)
    s, w = heads(S.detach()), heads(q.detach() * g.detach())        # w_j = q_j g_j: logit = r_n <w_j, s_n>
    r = torch.rsqrt(S.detach().pow(2).mean(-1) + eps)               # (N, B, T)
    lse = [torch.logsumexp(r[:j, ..., None] * (s[:j] * w[j - 1]).sum(-1), 0) for j in range(1, N + 1)]
    c = [(heads(G[j]) * heads(o.detach())).sum(-1) for j, o in enumerate(outs)]   # (B, T, H) per site
    dS, dq, dg = torch.zeros_like(S), torch.zeros_like(q), torch.zeros_like(g)
    for n in range(N):   # the gather: source n, then every later site j that routes over it
        for j in range(n + 1, N + 1):
            Gj = heads(G[j - 1])
            logit = r[n, ..., None] * (s[n] * w[j - 1]).sum(-1)         # (B, T, H)
            alpha = torch.exp(logit - lse[j - 1])
            dlogit = alpha * ((Gj * s[n]).sum(-1) - c[j - 1])
            dS[n] += (alpha[..., None] * Gj + r[n, ..., None, None] * dlogit[..., None] * w[j - 1]).flatten(-2)
            dS[n] -= (r[n] ** 2 / d * (dlogit * logit).sum(-1))[..., None] * S[n].detach()
            dw = (dlogit[..., None] * r[n, ..., None, None] * s[n]).flatten(-2).sum((0, 1))   # d logit / d w_j
            dq[j - 1] += dw * g[j - 1].detach()
            dg[j - 1] += dw * q[j - 1].detach()
    for ours, autograd in ((dS, S.grad), (dq, q.grad), (dg, g.grad)):
        assert rel_err(ours, autograd) < 1e-6, rel_err(ours, autograd)


@pytest.mark.parametrize("null", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_stack_matches_reference(null, dtype):
    """Rung 1, the stateless call: route_stack over stacked sources (and a null source first, as delta mode calls it)
    gives route_reference's output and every gradient: sources, null, q, g."""
    gen = torch.Generator().manual_seed(11)
    N, B, T, d, H = 4, 2, 19, 112, 4
    src0 = torch.randn(N, B, T, d, generator=gen).mul(torch.rand(N, 1, 1, 1, generator=gen) * 2 + 0.2)
    q0, g0 = torch.randn(d, generator=gen), 1 + 0.3 * torch.randn(d, generator=gen)
    n0, up = torch.randn(d, generator=gen) * 0.5, torch.randn(B, T, d, generator=gen, dtype=torch.float64)
    results = []
    for impl, run_dtype in (("fused", dtype), ("reference", dtype), ("truth", torch.float64)):
        src = src0.to(dtype).to(DEVICE, run_dtype).clone().requires_grad_(True)
        q, g, nul = (t.to(DEVICE, torch.float64 if impl == "truth" else torch.float32).clone().requires_grad_(True)
                     for t in (q0, g0, n0))
        if impl == "fused":
            out = routing_call.route_stack(src, q, g, H, 1e-6, null=nul if null else None, config=SMALL_BLOCKS)
        else:
            full = torch.cat([nul.to(src.dtype).expand(1, B, T, d), src]) if null else src
            out = route_reference(full, q, g, H, 1e-6)
        (out.double() * up.to(DEVICE)).sum().backward()
        results.append([out.double(), src.grad.double(), q.grad.double(), g.grad.double()]
                       + ([nul.grad.double()] if null else []))
    fused, ref, truth = results
    for k, (a, b, t) in enumerate(zip(fused, ref, truth)):
        if dtype == torch.float32:
            assert rel_err(a, b) < 1e-5, (k, rel_err(a, b))
        else:   # no worse than 1.5x the reference's own bf16 error against the float64 truth
            assert rel_err(a, t) <= 1.5 * rel_err(b, t) + 1e-6, (k, rel_err(a, t), rel_err(b, t))


@pytest.mark.parametrize("N,B,T,d,H", [
    (1, 2, 5, 64, 2),      # one source: the readout of a model with no layers
    (5, 3, 1, 96, 4),      # T = 1 (generation), d/H = 24 not a power of two
    (7, 1, 67, 80, 5),     # tokens not a multiple of the block, d/H = 16 = d/16 (largest H)
    (6, 2, 37, 48, 1),     # H = 1: attention residuals
    (4, 2, 19, 112, 4),    # d/H = 28: the kernels' second column part (16 + 12) has padded lanes
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_routing_matches_reference(N, B, T, d, H, dtype):
    check_fused_chain(N, B, T, d, H, dtype, SMALL_BLOCKS)


def test_fused_routing_config_for_and_launch():
    """config_for gives a tuned width its table entry; several heads without one the entry of the same width with the
    nearest head count (never the single head's) for the full routing, DEFAULT for block routing, named for both; every
    other width DEFAULT; what torch.compile traces whole. A chain launches each kernel with its config's (tile, warps,
    stages), and a custom config is what runs."""
    for (d, H), tuned in rc.TUNED_H200.items():   # (the H200's table named: an H100 running this test has its own)
        cfg = rc.config_for(d, H, card="H200")
        assert all(getattr(cfg, k) == v for k, v in tuned.items()) and cfg.call_site == rc.DEFAULT.call_site
    several = {(d, H) for d, H in rc.TUNED_H200 if H > 1}
    for d, H in [(d, H) for d, _ in several for H in (2, 4, 8, 16, 32) if (d, H) not in rc.TUNED_H200]:
        cfg, nearest = rc.config_for(d, H, "H200"), min((abs(math.log2(h / H)), h) for w, h in several if w == d)[1]
        full = {k: v for k, v in rc.TUNED_H200[(d, nearest)].items() if not k.startswith("block_")}
        assert cfg == replace(rc.DEFAULT, name=f"H200 d={d} H={nearest}, for H={H}", **full)
        assert all(getattr(cfg, f) == getattr(rc.DEFAULT, f) for f in ("block_fwd", "block_bwd", "block_waves"))
    assert rc.config_for(512, 8, "H200").name == "H200 d=512 H=4, for H=8"
    assert rc.config_for(1024, 4, "H200").name == "H200 d=1024 H=8, for H=4"   # (1024, 1), a single head, not nearer
    assert rc.config_for(96, 4) is rc.DEFAULT and rc.config_for(2048, 16) is rc.DEFAULT
    assert rc.config_for(2048, 1) is rc.DEFAULT and rc.config_for(640, 1) is rc.DEFAULT   # a single head borrows none
    traced = torch.compile(lambda x: x * rc.config_for(1024, 4).fwd[0] * rc.config_for(96, 2).fwd[0], fullgraph=True)
    assert traced(torch.ones(2)).tolist() == [rc.config_for(1024, 4).fwd[0] * rc.DEFAULT.fwd[0]] * 2
    config = rc.RoutingConfig(max_block_m=16, fwd=(1024, 2, 2), gather=(256, 1, 1))
    mine = rk.RoutingChain(3, 10, 96, 4, 1e-6, torch.float32, DEVICE, training=True, config=config)
    default = rk.RoutingChain(3, 10, 96, 4, 1e-6, torch.float32, DEVICE, training=True)
    def settings(launch):   # (warps, stages)
        return launch.num_warps, launch.bound["STAGES"]
    assert settings(mine.fwd_launch[False]) == (2, 2) and settings(mine.gather_launch[False]) == (1, 1)
    assert settings(default.fwd_launch[False]) == rc.DEFAULT.fwd[1:]
    assert settings(default.gather_launch[True]) == rc.DEFAULT.gather_lead[1:]
    check_fused_chain(5, 1, 33, 96, 4, torch.float32, config)


def test_launch_binds_a_pass_once_and_passes_every_argument_in_the_kernels_order(monkeypatch):
    """routing_config.Launch: the bound and per-call arguments reach the kernel positionally in its signature's order,
    with the grid and warps; a name missing, unknown or given twice fails when the launch is made, a call that names
    other per-call arguments fails before it launches. On a GPU (faked here: no interpreter, a current device) the
    first call of each key goes through Triton and later ones call the kernel it returned, the key being what Triton
    can specialise on: a tensor's dtype and 16-byte alignment, any other value itself; another Launch of the same
    kernel, warps and bound arguments calls it too. Under the interpreter, or on Triton before 3.3, every call is
    Triton's."""
    calls = []

    class Kernel:   # what Launch reads of a Triton kernel: its argument names and [grid](*args, num_warps)
        __name__, arg_names = "k", ["A", "n", "B", "FLAG"]

        def __getitem__(self, grid):
            return lambda *args, num_warps: calls.append(("triton", grid, args, num_warps)) or Compiled()

    class Compiled:   # what Triton's launch returns, a CompiledKernel: [grid](*args) launches it
        def __getitem__(self, grid):
            return lambda *args: calls.append(("compiled", grid, args))

    monkeypatch.setattr(rc, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(rc.Launch, "COMPILED", {})
    kernel = Kernel()
    launch = rc.Launch(kernel, (3,), 2, ("B", "n"), A="a", FLAG=True)
    launch(n=5, B="b")
    launch(B="c", n=6)
    assert calls == [("triton", (3,), ("a", 5, "b", True), 2), ("triton", (3,), ("a", 6, "c", True), 2)]
    launch(n=6, B="c")
    assert calls[-1] == ("compiled", (3, 1, 1), ("a", 6, "c", True))   # (a compiled kernel takes 3 axes)
    buf, other = torch.zeros(9), torch.zeros(8, dtype=torch.float64)
    for B, path in [(buf[:8], "triton"), (buf[4:], "compiled"), (buf[1:], "triton"), (buf[5:], "compiled"),
                    (other, "triton"), (buf[:4], "compiled")]:   # (aligned, aligned, off by 4 bytes, ...; float64)
        launch(B=B, n=7)
        assert calls[-1][0] == path and calls[-1][2][2] is B, (B.data_ptr() % 16, B.dtype, calls[-1][0])
    # another Launch of the kernel with the same warps and bound arguments (another pass's chain) calls what Triton
    # returned to the first, at its own grid; other warps or another bound value are another kernel
    for grid, warps, flag, path in [((4,), 2, True, "compiled"), ((4,), 4, True, "triton"), ((4,), 2, False, "triton")]:
        rc.Launch(kernel, grid, warps, ("B", "n"), A="a", FLAG=flag)(B="c", n=6)
        assert calls[-1][:3] == (path, (4,) if path == "triton" else (4, 1, 1), ("a", 6, "c", flag))
    monkeypatch.setattr(rc.Launch, "COMPILED_MAX", len(rc.Launch.COMPILED))   # full: the next new key starts it again
    rc.Launch(kernel, (4,), 2, ("B", "n"), A="b", FLAG=True)(B="c", n=6)
    assert calls[-1][0] == "triton" and len(rc.Launch.COMPILED) == 1
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)   # another device: its own kernels
    launch(B=buf[:4], n=7)
    assert calls[-1][0] == "triton"
    for interpret, version in [(True, (3, 3)), (False, (3, 2))]:
        monkeypatch.setattr(rc, "INTERPRET", interpret)
        monkeypatch.setattr(rc, "triton_version", lambda: version)
        every = rc.Launch(Kernel(), (1,), 1, ("B", "n"), A="a", FLAG=False)
        every(B="b", n=1)
        every(B="b", n=1)
        assert [c[0] for c in calls[-2:]] == ["triton", "triton"]
    n_calls = len(calls)
    for per_call, bound, says in [(("B",), dict(A=1, FLAG=1), "missing ['n']"), (("B", "n", "X"), dict(A=1, FLAG=1),
                                  "unknown ['X']"), (("B", "n"), dict(A=1, n=1, FLAG=1), "per call ['n']")]:
        with pytest.raises(TypeError, match=re.escape(says)):
            rc.Launch(Kernel(), (1,), 1, per_call, **bound)
    with pytest.raises(TypeError, match=re.escape("given ['B'], expected ['B', 'n']")):
        launch(B="b")
    assert len(calls) == n_calls


@pytest.mark.skipif(DEVICE == "cpu" or rc.triton_version() < (3, 3), reason="compiled kernels are a GPU's, "
                    "called again from Triton 3.3 on: else every launch is Triton's (the Launch test above checks the "
                    "keys on the CPU)")
@pytest.mark.parametrize("blocks", [None, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chains_later_passes_launch_the_compiled_kernels_with_the_same_results(monkeypatch, dtype, blocks):
    """After a chain's first pass every launch of a second pass calls a kernel Triton compiled in the first (Triton's
    own launch is made to fail), and both passes' outputs and gradients are bitwise equal; so do the launches of a
    pass without a backward, whose chain is made anew each pass; sources off 16-byte alignment are new keys, which go
    through Triton once and give the same values."""
    import routing_block
    monkeypatch.setattr(rc.Launch, "COMPILED", {})
    N, B, T, d, H = 5, 2, 33, 96, 4
    src0, qs, gs, shift, up = chain_inputs(N, B, T, d, seed=11)
    router = bench_routing.fused_router(N, H, 1e-6, None, blocks)
    sublayer = lambda j, x: torch.tanh(x) + shift[j].to(x.dtype)
    run = lambda sub: bench_routing.chain_grads("fused", src0.to(dtype), qs, gs, sub, up, H, blocks=blocks,
                                                router=router)
    first = run(sublayer)
    launches = [x for v in vars(router.chain).values() for x in (v.values() if isinstance(v, dict) else [v])
                if isinstance(x, rc.Launch)]
    assert any(launch.compiled for launch in launches)
    triton_calls, own = [], [launch.kernel for launch in launches]
    for launch in launches:
        launch.kernel = lambda *args, num_warps: pytest.fail("a second pass's launch went through Triton")
    assert all(torch.equal(a, b) for a, b in zip(first, run(sublayer)))

    @torch.no_grad()
    def no_backward():   # a chain of its own (FusedRouter.start)
        chain = router.start(src0.to(dtype))
        return run_chain(lambda j, x: chain.route(j, x, qs[j - 1], gs[j - 1]), src0.to(dtype), N, sublayer)
    inference = no_backward()

    class NoTriton(rc.Launch):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.kernel = lambda *args, num_warps: pytest.fail("a second pass's launch went through Triton")
    with monkeypatch.context() as m:
        m.setattr(rk, "Launch", NoTriton)
        m.setattr(routing_block, "Launch", NoTriton)
        assert torch.equal(inference, no_backward())

    def counted(triton_launch):
        return lambda *args, num_warps: triton_calls.append(args) or triton_launch(*args, num_warps=num_warps)
    for launch, triton_launch in zip(launches, own):
        launch.kernel = counted(triton_launch)

    def off_16_bytes(x):   # the same values, one element past an aligned start
        return torch.cat([x.new_zeros(1), x.flatten()])[1:].view_as(x)
    unaligned = run(lambda j, x: off_16_bytes(sublayer(j, x)))   # (a kernel compiled for it: its vector widths, and
    for a, b in zip(first, unaligned):                           # with them its sums' order, may differ)
        assert rel_err(b, a) < (1e-6 if dtype == torch.float32 else 1e-2), rel_err(b, a)
    assert triton_calls and any(a.data_ptr() % 16 for args in triton_calls for a in args if isinstance(a, torch.Tensor))


def test_fused_routing_announces_its_config():
    code = ("import torch, routing_config as rc, routing_kernel as rk; c = rc.RoutingConfig(max_block_m=16, lead_min=3); "
            "[rk.RoutingChain(3, 10, 96, 4, 1e-6, torch.float32, 'cpu', True, c) for _ in range(2)]; "
            "rk.RoutingChain(3, 10, 512, 4, 1e-6, torch.float32, 'cpu', True)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("fused routing")]
    assert len(lines) == 2, r.stderr   # once per config and width
    assert "(d=96, H=4): launch config 'default' (lead_min=3, max_block_m=16)" in lines[0]
    assert "launch config 'H200 d=512 H=4'" in lines[1] and "fwd_lead_sites=2" in lines[1]


def fake_gpu(monkeypatch, gpu):
    """What routing_config sees of a GPU named gpu (this process computes on the CPU)."""
    monkeypatch.setattr(rc, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(name=gpu))


@pytest.mark.parametrize("gpu", ["NVIDIA A100-SXM4-80GB", "NVIDIA H200"])
def test_the_launch_line_names_the_card_of_its_table(monkeypatch, capsys, gpu):
    """A tuned width on a GPU without a table of its own says that the table it runs is the H200's (not a wrong
    detection)."""
    fake_gpu(monkeypatch, gpu)
    assert rc.table_card() == "H200"
    rc.announce.__wrapped__(rc.config_for(512, 4), 512, 4)
    line = capsys.readouterr().err
    assert "launch config 'H200 d=512 H=4'" in line
    assert (f"the H200's table on this {gpu}, which has no table of its own" in line) == ("A100" in gpu)


def test_an_h100_runs_the_h100_table_and_the_h200s_where_it_has_no_entry(monkeypatch, capsys):
    """The H100's own table (tuned on an H100 80GB HBM3) runs on any H100; a width it lacks, the single head's at d
    1024, runs the H200's entry and says so."""
    fake_gpu(monkeypatch, "NVIDIA H100 PCIe")
    assert rc.table_card() == "H100"
    for (d, H), tuned in rc.TUNED_H100.items():
        assert rc.config_for(d, H) == replace(rc.DEFAULT, name=f"H100 d={d} H={H}", **tuned)
    rc.announce.__wrapped__(rc.config_for(1024, 1), 1024, 1)
    line = capsys.readouterr().err.rstrip()
    assert "launch config 'H200 d=1024 H=1'" in line
    assert line.endswith("; the H200's table on this NVIDIA H100 PCIe, whose own (H100) has no entry here")


ENTRIES = [(card, d, H) for card, table in rc.TABLES.items() for d, H in table]


@pytest.mark.parametrize("card,d,H", ENTRIES, ids=[f"{c}-{d}x{H}" for c, d, H in ENTRIES])
def test_every_table_entry_routes_as_the_reference(card, d, H):
    """Every tuned entry of every card's table, at its own width (its tiles over d, its leading sites, its block
    routing settings): the chain's output and every gradient as the reference's, fp32, full and block routing, a short
    chain whose sites read enough sources to lead (lead_min) and a token count no tile divides."""
    cfg = rc.config_for(d, H, card)
    assert cfg.name == f"{card} d={d} H={H}"
    for blocks in (None, 2):
        errs = bench_routing.check_against_reference(9, 1, 7, d, H, torch.float32, DEVICE, config=cfg, blocks=blocks)
        assert max(errs.values()) < 1e-5, (blocks, errs)


def test_a_card_runs_its_own_table_and_the_h200s_for_what_it_lacks(monkeypatch, capsys):
    """A card with a table of its own (TABLES, under a word of its name) runs its entries, named for it; a width it
    lacks takes the H200's entry (as a card without a table does), and borrowing looks in its own table first; the
    H200 still runs the H200's. The launch line says whose table ran, and the tuner which table its entry is for."""
    own = {(1024, 8): dict(fwd=(512, 1, 4), gather=(1024, 2, 3)), (512, 16): dict(gather=(2048, 4, 3))}
    monkeypatch.setitem(rc.TABLES, "H100", own)
    fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    assert rc.table_card() == "H100"
    assert rc.config_for(1024, 8) == replace(rc.DEFAULT, name="H100 d=1024 H=8", **own[1024, 8])
    assert rc.config_for(1024, 16) == replace(rc.DEFAULT, name="H100 d=1024 H=8, for H=16", **own[1024, 8])
    assert rc.config_for(512, 4) == replace(rc.DEFAULT, name="H200 d=512 H=4", **rc.TUNED_H200[512, 4])
    assert rc.config_for(512, 8).name == "H100 d=512 H=16, for H=8"   # its own table's before the H200's (H = 4)
    assert rc.config_for(768, 8).name == "H200 d=768 H=4, for H=8" and rc.config_for(96, 4) is rc.DEFAULT
    assert rc.config_for(1024, 8, card="H200").name == "H200 d=1024 H=8"
    rc.announce.__wrapped__(rc.config_for(1024, 8), 1024, 8)
    rc.announce.__wrapped__(rc.config_for(512, 4), 512, 4)
    first, second = capsys.readouterr().err.splitlines()
    assert "launch config 'H100 d=1024 H=8'" in first and "table" not in first
    assert second.endswith("the H200's table on this NVIDIA H100 80GB HBM3, whose own (H100) has no entry here")
    rc.tune(["fwd"], [("tiny-train", 2, 1024, 8, 1, 16)], lambda cfg, *shape: 1.0, candidates=[(512, 1, 4)])
    assert "tuned (1024, 8) on this NVIDIA H100 80GB HBM3, for TABLES['H100']:" in capsys.readouterr().out
    fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB")
    rc.tune(["fwd"], [("tiny-train", 2, 1024, 8, 1, 16)], lambda cfg, *shape: 1.0, candidates=[(512, 1, 4)])
    assert ("on this NVIDIA A100-SXM4-80GB, for a table of its own (TABLES[<a word of 'NVIDIA A100-SXM4-80GB'>], "
            "beside the H200's)") in capsys.readouterr().out
    fake_gpu(monkeypatch, "NVIDIA H200")
    assert rc.table_card() == "H200" and rc.config_for(1024, 8).name == "H200 d=1024 H=8"


def led_outputs(N, dtype, config):
    """The routed output of an N-site chain (B 2, T 19, d 112, H 4, tanh sublayers), same inputs, with `config` in
    training and under no_grad, and with no site leading; and the first run's chain."""
    gen = torch.Generator().manual_seed(N)
    s0 = torch.randn(2, 19, 112, generator=gen).to(DEVICE, dtype)
    qs = [torch.randn(112, generator=gen).to(DEVICE) for _ in range(N)]
    gs = [torch.ones(112, device=DEVICE) for _ in range(N)]
    outs, chains = [], []
    for cfg, grad in [(config, True), (config, False), (replace(config, fwd_lead=None, gather_lead=None), True)]:
        with torch.set_grad_enabled(grad):
            chains.append(rk.FusedRouter(N, 4, 1e-6, cfg).start(s0.requires_grad_(grad), qs, gs))
            outs.append(run_chain(lambda j, x: chains[-1].route(j, x, qs[j - 1], gs[j - 1]), s0, N,
                                  lambda j, x: torch.tanh(x)).detach())
    assert chains[2].fwd_lead == set()
    return outs, chains[0]


@pytest.mark.parametrize("least", [1, 3])   # 1: every other site leads (both ways); 3: some lead, some run alone
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_routing_shared_reads(least, dtype):
    """Neighbouring sites sharing reads (lead_schedule): a forward that also runs the next site's softmax over the
    older sources and one that resumes it, a gather that also sums the previous source's terms on every gradient tile
    it loads and hands them on, and the next gather that starts from them and reads only its own gradient; heads of two
    column parts (28 = 16 + 12 masked), a single head. The forward is the same arithmetic as one launch per site, so
    its output is bitwise the unpaired one, in training and under no_grad."""
    config = rc.RoutingConfig(max_block_m=16, lead_min=least)
    fwd, gather = rc.lead_schedule(7, least)
    assert (fwd, gather) == (({2, 4, 6}, {2, 4, 6}) if least == 1 else ({4, 6}, {2, 4}))
    check_fused_chain(7, 2, 19, 112, 4, dtype, config)
    check_fused_chain(6, 2, 5, 40, 1, dtype, config)
    outs, chain = led_outputs(7, dtype, config)
    assert chain.fwd_lead == fwd and chain.gather_lead == gather and chain.gather_launch[True].bound["BLOCK_M"] >= 1
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_routing_wider_lead(dtype):
    """A leading forward that runs the next 2 sites' softmax (fwd_lead_sites): the sites it leads resume their states
    and read only the sources since; every pair's logit stored (heads of two column parts). Against the reference, and
    bitwise the unpaired forward's output, in training and under no_grad."""
    config = rc.RoutingConfig(max_block_m=16, stored_logits=True, lead_min=1, fwd_lead_sites=2)
    check_fused_chain(9, 2, 19, 112, 4, dtype, config)
    outs, chain = led_outputs(9, dtype, config)
    assert chain.fwd_lead == {7, 4, 1}
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    with pytest.raises(ValueError, match="fwd_lead_sites=3"):
        rc.RoutingConfig(fwd_lead_sites=3)


@pytest.mark.parametrize("N,T,d,H", [(5, 19, 96, 4), (4, 7, 40, 1), (6, 5, 112, 4), (3, 9, 48, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gather_backward_matches_reference(N, T, d, H, dtype):
    """The chain's backward (one gather a site, dw by a product over the tokens, every dq and dg at site 1): out and
    every gradient against the reference; heads of two column parts (24 = 16 + 8, 40 = 32 + 8, 28 as 16 + 16 masked),
    of one (16), a single head, three heads (padded to 4)."""
    check_fused_chain(N, 2, T, d, H, dtype, SMALL_BLOCKS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gather_backward_dw_programs(dtype):
    """dw's product, one launch over every pair once the gathers are done: a source read by more sites than a program's
    block (37 sites, blocks of 32: a second block, empty for the later sources) and tokens in several splits (1,030
    tokens: three, the last one short), against the reference."""
    assert rk.dw_launch(37, 6, 2, 16)[0] < 37 and rk.dw_launch(3, 1030, 2, 16)[3] == 3
    check_fused_chain(37, 2, 3, 32, 2, dtype, SMALL_BLOCKS)
    check_fused_chain(3, 1, 1030, 32, 2, dtype, SMALL_BLOCKS)


@pytest.mark.parametrize("precision", ["ieee", "tf32x2"])
def test_fused_gather_backward_dw_product_precision(precision):
    """dw's product (_dw_terms) against a float64 one at fp32's accuracy, every pair of 4 sources, tokens in several
    splits: "tf32x2" (what 16-bit sources get on tensor cores: dw_precision) splits the fp32 dlogit r_n into its tf32
    bits and the rest; without the rest it would be off by ~2^-11."""
    import triton
    if precision == "tf32x2" and DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("tf32 products need sm_80+")
    assert rk.dw_precision(torch.bfloat16, "cpu") == "ieee"
    if DEVICE == "cuda" and not rc.INTERPRET and torch.cuda.get_device_capability() >= (8, 0):
        assert [rk.dw_precision(x, DEVICE) for x in (torch.bfloat16, torch.float16, torch.float32)] == \
            ["tf32x2", "tf32x2", "tf32x3"]
    N, M, H, D = 4, 1100, 2, 16
    d, P = H * D, N * (N + 1) // 2
    g = torch.Generator().manual_seed(0)
    dlr = (torch.randn(P, H, M, generator=g) * torch.logspace(-3, 3, M)).to(DEVICE)   # magnitudes over 6 decades
    s = torch.randn(N, M, d, generator=g).to(torch.bfloat16).to(DEVICE)
    bj, bt, bc, splits, warps = rk.dw_launch(N, M, H, D)
    pdw = torch.zeros(splits, P + 1, d, device=DEVICE)
    per_split = triton.cdiv(triton.cdiv(M, splits), bt) * bt
    rk._dw_terms[(H * triton.cdiv(D, bc), N * triton.cdiv(N, bj), splits)](
        dlr, s, pdw, N, M, per_split, P + 1, DM=d, H=H, D=D, BLOCK_J=bj, BLOCK_T=bt, BLOCK_C=bc, PRECISION=precision,
        num_warps=warps)
    got = pdw.sum(0)[:P].double().cpu()
    rows = [n for n in range(N) for _ in range(N - n)]   # each pair row's source (source-major: n, sites n+1..N)
    want = torch.einsum("phm,pmhc->phc", dlr.double().cpu(), s.double().cpu()[rows].view(P, M, H, D)).reshape(P, d)
    assert splits > 1 and rel_err(got, want) < 4e-6, rel_err(got, want)


@pytest.mark.parametrize("least", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_routing_stored_logits(least, dtype):
    """stored_logits: the forward stores every pair's logit (site-major) and the gathers, leading, following and alone,
    load it instead of recomputing it: a single head over two column parts, four heads, one-token programs, against
    the reference; without it, or in a pass without a backward, the forward stores none."""
    config = rc.RoutingConfig(max_block_m=16, lead_min=least, stored_logits=True)
    check_fused_chain(6, 2, 5, 40, 1, dtype, config)
    check_fused_chain(7, 2, 19, 112, 4, dtype, config)
    check_fused_chain(5, 1, 7, 96, 1, dtype, rc.RoutingConfig(max_block_m=1, lead_min=least, stored_logits=True))
    x = torch.randn(2, 3, 112, device=DEVICE, requires_grad=True)
    qs, gs = [torch.zeros(112, device=DEVICE)] * 7, [torch.ones(112, device=DEVICE)] * 7
    for cfg, stored in ((config, True), (SMALL_BLOCKS, False)):
        chain = rk.FusedRouter(7, 4, 1e-6, cfg).start(x, qs, gs)
        assert chain.stored_logits == stored and (chain.LG.shape == (28, 4, 6)) == stored
    assert not rk.RoutingChain(3, 10, 112, 4, 1e-6, torch.float32, DEVICE, training=False, config=config).stored_logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_chain_one_token_programs(dtype):
    """One token a program (what the one-warp tiles TUNED_H200 ships give at d >= 512 on a GPU): read sharing on, a
    single head and four heads, against the reference."""
    config = rc.RoutingConfig(max_block_m=1, lead_min=1)
    check_fused_chain(5, 2, 7, 40, 1, dtype, config)
    check_fused_chain(4, 1, 5, 96, 4, dtype, config)


@pytest.mark.parametrize("mode,H,logits", [("mhar", 2, False), ("attnres", None, False), ("attnres", None, True)])
def test_fused_gather_backward_in_a_model(mode, H, logits):
    """The chain in a model, with route_scale 0.5 (its gains are not leaves), the single head also with stored
    logits: logits and every parameter gradient match the reference, and a second backward gives bitwise the same
    gradients."""
    config = rc.RoutingConfig(max_block_m=16, stored_logits=logits)
    fused = fused_model_vs_reference(residual=mode, route_heads=H, route_scale=0.5, routing_config=config)
    assert type(fused._router.chain) is rk.RoutingChain
    assert_backward_repeats_bitwise(fused, torch.randint(0, 96, (2, 19), device=DEVICE))


def test_fused_gather_backward_needs_every_query():
    """Site 1's backward returns every site's dq and dg, so a chain started without them refuses the first site."""
    x = torch.randn(1, 3, 32, device=DEVICE, requires_grad=True)
    chain = rk.FusedRouter(2, 2, 1e-6, SMALL_BLOCKS).start(x)
    with pytest.raises(RuntimeError, match=r"start the chain with every site's queries and gains"):
        chain.route(1, x, torch.zeros(32, device=DEVICE, requires_grad=True), torch.ones(32, device=DEVICE))


@pytest.mark.skipif(DEVICE == "cpu" and not os.environ.get("MHAR_SLOW_TESTS"),
                    reason="145 sites take ~4 min in Triton's CPU interpreter: runs on CUDA or with MHAR_SLOW_TESTS=1")
def test_fused_routing_145_sources():
    N, B, T, d, H = 145, 1, 3, 32, 2
    src0, qs, gs, shift, up = chain_inputs(N, B, T, d, seed=145)
    fused = chain_grads("fused", src0, qs, gs, shift, up, H, torch.float32)
    ref = chain_grads("reference", src0, qs, gs, shift, up, H, torch.float32)
    for name, a, b in zip(["out", "d_source", "dq", "dg"], fused, ref):
        assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))


@pytest.mark.parametrize("mode,H", [("mhar", 2), ("attnres", None), ("mhar", 3)])
def test_fused_model_matches_reference(mode, H):
    fused_model_vs_reference(residual=mode, route_heads=H)


@pytest.mark.parametrize("mode,H", [("attnres", None), ("mhar", 2)])
@pytest.mark.parametrize("n", [1, 2, 8])
def test_fused_block_routing_matches_reference(mode, H, n):
    """Block routing's fused path (routing_block.BlockChain) against the reference: logits and every gradient, L = 4 in
    n = 1, 2 (L / 2) and 8 (2L: full routing's sources) blocks. Its backward keeps no stacked copy of a site's sources
    (the reference keeps one per site, which the check sees)."""
    fused = fused_model_vs_reference(residual=mode, route_heads=H, route_blocks=n, n_layer=4)
    ref = GPT(tiny_cfg(residual=mode, route_heads=H, route_blocks=n, n_layer=4)).to(DEVICE)
    idx = torch.randint(0, 96, (2, 19), device=DEVICE)
    for model, stacks_kept in ((fused, False), (ref, True)):
        stacks = []

        def pack(t):   # a stack of several sources: (k, 2, 19, 48) or (k, 2 * 19, 48), k > 1
            if t.dim() >= 3 and t.shape[-1] == 48 and t.shape[0] > 1 and t.numel() == t.shape[0] * 2 * 19 * 48:
                stacks.append(t.shape)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(idx, idx)[1].backward()
        assert bool(stacks) == stacks_kept, (stacks, n)


def test_fused_model_shared_reads():
    """model.py hands the router every site's query and gain: with every other site leading (forward and gather),
    the fused model still matches the reference (fails if a leading site reads its own query for the next site)."""
    chain = fused_model_vs_reference(residual="mhar", route_heads=2,
                                     routing_config=rc.RoutingConfig(lead_min=1))._router.chain
    assert chain.fwd_lead == {2, 4} and chain.gather_lead == {2, 4}   # 2 layers: 5 sites


def test_fused_gradients_bitwise_deterministic():
    assert_backward_repeats_bitwise(tiny_pair()[1], torch.randint(0, 96, (3, 21), device=DEVICE))


def test_fused_composes_with_checkpointing_and_no_grad():
    ref, fused = tiny_pair()
    fused.checkpoint_sublayers = True
    idx = torch.randint(0, 96, (2, 16), device=DEVICE)
    for m in (ref, fused):
        m(idx, idx)[1].backward()
    assert_grads_close({n: p.grad for n, p in fused.named_parameters()}, {n: p.grad for n, p in ref.named_parameters()})
    with torch.no_grad():   # evaluation between a forward and its backward uses its own buffers
        _, loss = fused(idx, idx)
        eval_logits = fused(idx)[0]
        loss2 = fused(idx, idx)[1]
    torch.testing.assert_close(eval_logits, ref(idx)[0], rtol=1e-4, atol=1e-5)
    assert torch.equal(loss, loss2)


def test_fused_composes_with_compiled_sublayers():
    ref, fused = tiny_pair()
    fused.compile_sublayers()
    idx = torch.randint(0, 96, (2, 16), device=DEVICE)
    for m in (ref, fused):
        m(idx, idx)[1].backward()
    assert_grads_close({n: p.grad for n, p in fused.named_parameters()}, {n: p.grad for n, p in ref.named_parameters()})


def test_fused_contract_errors():
    _, fused = tiny_pair()
    idx = torch.randint(0, 96, (2, 8), device=DEVICE)
    _, loss = fused(idx, idx)
    with pytest.raises(RuntimeError, match="second forward started before the first forward's backward"):
        fused(idx, idx)
    loss.backward()
    _, loss = fused(idx, idx)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward already finished"):   # a second backward through one graph
        loss.backward()
    # a loss built from an intermediate routing output: backward starts at the wrong site
    sites = fused.routing_sites()
    x = fused.wte(idx)
    chain = fused._router.start(x, [s.q for s in sites], [s.g for s in sites])
    h1 = chain.route(1, x, sites[0].q, sites[0].g)
    h2 = chain.route(2, h1 * 2, sites[1].q, sites[1].g)
    with pytest.raises(RuntimeError, match="backward reached site 2, expected"):
        h2.sum().backward()
    # a routing call inside activation checkpointing runs a site's forward during backward
    fused._router.chain = None
    chain = fused._router.start(x, [s.q for s in sites], [s.g for s in sites])
    n = len(sites)

    def checkpointed(inp, j):
        return chain.route(j, inp, sites[j - 1].q, sites[j - 1].g)
    h = checkpointed(x, 1)
    for j in range(2, n + 1):
        h = torch.utils.checkpoint.checkpoint(checkpointed, torch.tanh(h), j, use_reentrant=False)
    with pytest.raises(RuntimeError, match="Activation checkpointing may wrap sublayers, never routing calls"):
        h.sum().backward()


def test_fused_envelope_errors():
    with pytest.raises(ValueError, match=r"head width d/H = 48/4 = 12 is below 16"):
        rc.check_envelope(48, 4, torch.bfloat16)
    with pytest.raises(ValueError, match="float64.*routing_impl='reference'"):
        rc.check_envelope(64, 2, torch.float64)


def test_fused_falls_back_loudly_without_triton_device():
    code = ("import torch; from model import GPT, GPTConfig; torch.manual_seed(0); "
            "m = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, "
            "ffn_hidden=32, routing_impl='fused')); m(torch.zeros(1, 4, dtype=torch.long)); "
            "m(torch.zeros(1, 4, dtype=torch.long)); print('ok')")
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    assert r.stderr.count("routing_impl='fused' cannot run") == 1 and "routing_impl='reference'" in r.stderr


@pytest.mark.parametrize("mode,H", [("mhar", 2), ("attnres", None)])
def test_fused_matches_reference_with_random_init_queries(mode, H):
    """The paper's random-init condition (route_init_std): the fused and the reference routing agree from the first
    step, logits and every gradient, on the same drawn queries."""
    fused = fused_model_vs_reference(residual=mode, route_heads=H, route_init_std=0.5, randomize=False)
    assert fused.routes[3].q.abs().max() > 0.1   # the drawn queries, not zeros


@pytest.mark.parametrize("residual", ["attnres", "mhar", "delta"])
def test_fused_route_scale_matches_reference(residual):
    """With route_scale != 1 the fused paths (the chain; delta mode's per-call kernels) give the reference's logits
    and every gradient."""
    if not rk.available(DEVICE):
        pytest.skip("the fused kernels need CUDA or TRITON_INTERPRET=1")
    fused_model_vs_reference(residual=residual, route_scale=0.5, num_blocks=2,
                             **(dict(route_heads=2, gate=0.7) if residual == "delta" else {}))


@pytest.mark.parametrize("kw", [dict(residual="mhar", route_heads=2), dict(residual="attnres"),
                                dict(residual="mhar", route_heads=2, route_blocks=2),
                                dict(residual="delta", route_heads=2, num_blocks=2)],
                         ids=["mhar", "attnres", "blocks", "delta"])
def test_fused_routing_traces_whole_under_torch_compile(kw):
    """torch.compile(model) on a model with the fused routing (full, single head, block, delta): each site is an
    operator (routing_kernel.route_site; delta's per-call routing, routing_call.route_call), so torch._dynamo.explain
    finds one graph and no break, and a fullgraph compile (aot_eager: AOTAutograd's forward and backward graphs)
    trains two steps with the loss and every gradient of the eager fused path, bitwise."""
    if not rk.available(DEVICE):
        pytest.skip("the fused kernels need CUDA or TRITON_INTERPRET=1")
    import torch._dynamo
    torch.manual_seed(0)
    m = GPT(tiny_cfg(routing_impl="fused", n_embd=64, **kw)).to(DEVICE)
    randomize_routing(m)
    if kw["residual"] == "delta":   # routing live: the gates open, the null sources away from 0
        with torch.no_grad():
            for site in m.routing_sites():
                site.alpha.fill_(0.7)
                site.null.normal_()
    idx, y = (torch.randint(0, 96, (2, 16), device=DEVICE) for _ in range(2))
    explained = torch._dynamo.explain(m)(idx, y)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        runs = []
        for model in (m, compiled):
            loss = model(idx, y)[1]
            loss.backward()
            runs.append((loss.detach(), [p.grad.clone() for p in m.parameters()]))
            m.zero_grad()
        (l1, g1), (l2, g2) = runs
        assert torch.equal(l1, l2) and all(torch.equal(a, b) for a, b in zip(g1, g2))


# ROUTING.md's examples, done in a copy of the model's files: each edit (old, new) replaces
# text that occurs once; python: the same logit in plain PyTorch, to check the change took
CHANGES = {
    "bias": {   # a fixed bias of 0.5 toward the newest source: _logit, _logit_grad (r d logit / dr = logit - the bias;
        "edits": {"routing_call.py": [   # left as it was, the gradients are off by up to ~1%) and route_logit
            ("        return r * dot\n", "        return r * dot + 0.5 * (n == count - 1)\n"),
            ("        return dlogit * r, dlogit * logit\n", "        return dlogit * r, dlogit * (logit - 0.5 * (n == count - 1))\n")],
                  "model.py": [("    return r * dot\n", "    return r * dot + 0.5 * (n == count - 1)\n")]},
        "python": lambda r, dot, n, count: r * dot + 0.5 * (n == count - 1)},
    "no_key_norm": {   # the raw <q g, s>, no RMS factor: _logit, _logit_grad (d logit / d dot = 1, none through r),
        "edits": {"routing_call.py": [("        return r * dot\n", "        return dot\n"),   # and route_logit
                                      ("        return dlogit * r, dlogit * logit\n", "        return dlogit, 0.0 * dlogit\n")],
                  "model.py": [("    return r * dot\n", "    return dot\n")]},
        "python": lambda r, dot, n, count: dot + 0.0 * r}}


def edited_copy(tmp_path, edits):
    """The model's files (export.model_modules) copied to tmp_path, with `edits` made as CHANGES holds them."""
    for name in export.model_modules():
        shutil.copy(os.path.join(HERE, name + ".py"), tmp_path)
    for name, pairs in edits.items():
        text = (tmp_path / name).read_text()
        for old, new in pairs:   # the expected failure once the routing itself is changed: edit a copy of the original
            assert text.count(old) == 1, f"{name} no longer holds {old.strip()!r}: update ROUTING.md and this test"
            text = text.replace(old, new)
        (tmp_path / name).write_text(text)


ROUTED_CHAIN = """
import torch
from model import fused_router, route_reference
def chain(route, N, H, blocks=None):   # N sites with x -> tanh(x) + shift between them; out and every gradient
    g = torch.Generator().manual_seed(N + H)
    src = torch.randn(2, 7, 96, generator=g).to(device).requires_grad_(True)
    qs = [(torch.randn(96, generator=g) * 0.5).to(device).requires_grad_(True) for _ in range(N)]
    gs = [(1 + 0.2 * torch.randn(96, generator=g)).to(device).requires_grad_(True) for _ in range(N)]
    shift, up = torch.randn(2, 7, 96, generator=g).to(device), torch.randn(2, 7, 96, generator=g).to(device)
    hist, x = [], src
    ch = fused_router(N, H, 1e-6, None, blocks).start(src, qs, gs) if route == "fused" else None
    for j in range(1, N + 1):
        if ch is not None:
            x = ch.route(j, x, qs[j - 1], gs[j - 1])
        else:
            hist.append(x)
            srcs = hist if not blocks else [hist[0]] + [sum(hist[1 + b * (N - 1) // blocks: 1 + (b + 1) * (N - 1) // blocks])
                                                        for b in range((len(hist) - 2) // ((N - 1) // blocks) + 1)]
            x = route(torch.stack(srcs), qs[j - 1], gs[j - 1], H)
        x = torch.tanh(x) + shift if j < N else x
    x.backward(up)
    return [x.detach(), src.grad] + [t.grad for t in qs + gs]
"""


CHANGED_ROUTING = ROUTED_CHAIN + """
import sys
from routing_call import route_stack
device, errs = sys.argv[1], []
rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()
for N, H, blocks in ((5, 1, None), (7, 2, None), (5, 4, 2)):
    fused, ref = chain("fused", N, H, blocks), chain(route_reference, N, H, blocks)
    # out, d source, every site's dq as one vector, every dg as one: site 1 mixes one source, so its dq and dg are 0 in
    # the reference and rounding noise in the fused chain (on a GPU); alone they would divide by 0
    parts = lambda t: [t[0], t[1], torch.cat(t[2:2 + N]), torch.cat(t[2 + N:])]
    errs += [rel(a, b) for a, b in zip(parts(fused), parts(ref))]
    torch.save([t.cpu() for t in fused], f"fused_{N}_{H}.pt")
s = torch.randn(4, 2, 5, 96, device=device).requires_grad_(True)
q, gain = (torch.randn(96, device=device) * 0.5).requires_grad_(True), torch.ones(96, device=device)
null = (torch.randn(96, device=device) * 0.5).requires_grad_(True)   # delta mode's null source: the first of five
for null_ in (None, null):   # the per-call kernels, with and without the null source, against the reference
    grads = []
    for route in (route_stack, route_reference):
        if route is route_stack:
            out = route_stack(s, q, gain, 2, 1e-6, null=null_)
        else:
            out = route_reference(s if null_ is None else torch.cat([null_.expand(1, 2, 5, 96), s]), q, gain, 2, 1e-6)
        out.backward(torch.ones_like(out))
        grads.append([out.detach()] + [t.grad.clone() for t in (s, q) + ((null,) if null_ is not None else ())])
        s.grad = q.grad = null.grad = None
    errs += [rel(a, b) for a, b in zip(*grads)]
print("worst relative difference", max(errs) if all(e == e for e in errs) else float("nan"))   # NaN never hides
"""


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_changing_the_logit_as_the_readme_says(tmp_path, monkeypatch, change):
    """ROUTING.md: its examples of a logit change (a bias toward the newest source, no key norm:
    three places each), each made as it says in a copy of the model's files. In the copy the fused chain, block routing
    and the per-call kernels (with and without delta's null source) still equal the reference, output and every
    gradient (fp32, 1e-4 of the largest), and the change took: the copy's output is this repository's reference with
    the changed route_logit, not the unchanged routing's."""
    edited_copy(tmp_path, CHANGES[change]["edits"])
    r = subprocess.run([sys.executable, "-c", CHANGED_ROUTING, DEVICE], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1" if DEVICE == "cpu" else "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert float(r.stdout.split()[-1]) < 1e-4, r.stdout
    scope = {"device": "cpu"}
    exec(ROUTED_CHAIN, scope)
    copied, unchanged = torch.load(tmp_path / "fused_7_2.pt"), scope["chain"](route_reference, 7, 2)
    monkeypatch.setattr("model.route_logit", CHANGES[change]["python"])   # route_reference reads it when called
    changed = scope["chain"](route_reference, 7, 2)
    assert (copied[0] - changed[0]).abs().max() < 1e-4 * changed[0].abs().max() < (copied[0] - unchanged[0]).abs().max()


# ROUTING.md's learned per-head temperature: one place, Route, whose gain() every path takes (no kernel edit)
LEARNED_TEMPERATURE = [
    ("        self.g = nn.Parameter(torch.ones(dim))\n",
     "        self.g = nn.Parameter(torch.ones(dim))\n        self.temp = nn.Parameter(torch.ones(heads))   # per head\n"),
    ("        return self.g if self.scale == 1.0 else self.g * self.scale\n",
     "        return (self.g if self.scale == 1.0 else self.g * self.scale) * self.temp.repeat_interleave(\n"
     "            self.g.numel() // self.heads)\n")]


def test_a_learned_temperature_as_the_readme_says(tmp_path):
    """ROUTING.md: a learned per-head temperature made as it says, in Route alone (two edits of a
    copy of model.py), and the every-parameter check run on the copy in every routed mode: the new parameter is found
    without naming it, and its gradient, like every other, is the reference's in the fused paths."""
    edited_copy(tmp_path, {"model.py": LEARNED_TEMPERATURE})
    run = (f"import sys; sys.path[:0] = [{str(tmp_path)!r}]; sys.path += [{HERE!r}, {os.path.join(HERE, 'tests')!r}]\n"
           "import test_mhar\n"
           "for kw in ({'residual': 'attnres'}, {'residual': 'mhar', 'route_heads': 2}, {'residual': 'mhar', "
           "'route_heads': 2, 'route_blocks': 2}, {'residual': 'delta', 'route_heads': 2, 'num_blocks': 2}):\n"
           "    print(test_mhar.check_every_routing_parameter(kw))\n")
    r = subprocess.run([sys.executable, "-c", run], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1" if DEVICE == "cpu" else "0"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("'temp'") == 4, r.stdout


@pytest.mark.parametrize("checkpointed", [False, True])
def test_fused_delta_matches_reference(tmp_path, checkpointed):
    hf_dir, out = str(tmp_path / "hf"), str(tmp_path / "out")
    write_hf_checkpoint(hf_dir, HF_CONFIGS["qwen3"])
    convert.main([f"--hf_dir={hf_dir}", f"--out_dir={out}", "--dtype=float32", "--num_blocks=2", "--route_heads=2",
                  "--check_batches=0", "--tokenizer=gpt2"])
    models = []
    gen = torch.Generator().manual_seed(1)
    for impl in ("reference", "fused"):
        m = checkpoint.load_model(out).to(DEVICE)
        m.cfg.routing_impl = impl
        m.checkpoint_sublayers = checkpointed
        gen.manual_seed(1)
        with torch.no_grad():   # live routing: alpha, queries and null vectors away from their initial values
            for site in m.routing_sites():
                site.alpha.fill_(0.7)
                site.q.copy_(torch.randn(site.q.shape, generator=gen).to(DEVICE))
                site.null.copy_(0.3 * torch.randn(site.null.shape, generator=gen).to(DEVICE))
        models.append(m)
    idx = torch.randint(0, 300, (2, 37), device=DEVICE)
    outs = []
    for m in models:
        logits, loss = m(idx, idx)
        loss.backward()
        outs.append((logits, {n: p.grad for n, p in m.named_parameters()}))
    assert rel_err(outs[1][0].double(), outs[0][0].double()) < 1e-5
    for name, grad in outs[0][1].items():
        assert rel_err(outs[1][1][name].double(), grad.double()) < 1e-4, name


def test_tune_picks_each_settings_best():
    """--tune-train's coordinate descent (routing_config.tune) from the width's entry: each setting's candidates timed
    with the settings found so far, the fastest kept; a _lead setting may also be None (no sharing); a candidate that
    fails to launch is skipped."""
    trials = []

    def fake_time(cfg, L, d, H, B, T):
        trials.append((cfg.gather, cfg.gather_lead, cfg.stored_logits))
        if cfg.gather_lead == (4096, 4, 3):
            raise RuntimeError("out of resources")
        return 1.0 + 0.5 * (cfg.gather != (4096, 4, 3)) + 0.1 * (cfg.gather_lead is not None) - 0.05 * cfg.stored_logits
    (cfg,) = rc.tune(["gather", "gather_lead", "stored_logits"], [("tiny-train", 2, 64, 4, 1, 16)], fake_time,
                     candidates=[(1024, 2, 3), (4096, 4, 3)])
    assert [t[0] for t in trials] == [(1024, 2, 3), (4096, 4, 3)] + [(4096, 4, 3)] * 5
    assert [t[1] for t in trials[2:5]] == [(1024, 2, 3), (4096, 4, 3), None]
    assert (cfg.gather, cfg.gather_lead, cfg.stored_logits) == ((4096, 4, 3), None, True)


def test_tune_candidates_cover_the_configs():
    """bench.py routing --tune-train can find every config shipped (else a retune silently drops a best)."""
    for name in rc.TUNABLE + rc.BLOCK_TUNABLE:
        used = {getattr(rc.DEFAULT, name)} | {w[name] for t in rc.TABLES.values() for w in t.values() if name in w}
        choices = rc.CHOICES.get(name, rc.CANDIDATES + ([None] if name.endswith("_lead") else []))
        assert used <= set(choices), (name, used - set(choices))


@pytest.mark.parametrize("blocks,config,given", [(1, None, False), (3, None, True), (12, None, False),
                                                 (3, rc.RoutingConfig(max_block_m=4, block_waves=1), True)])
def test_block_chain_bf16_gradients(blocks, config, given):
    """Block routing's fused chain in bf16 (13 sites, d 48, H 3: awkward shapes): its output and every gradient (the
    first source's, every q and g) as close to a float64 reference as the bf16 reference itself is, the gradients
    summed in the sources' dtype as autograd sums the reference's. dq and dg come at each site, or at site 1 for every
    site when start() is given the queries and gains; with 4-token blocks and 2 programs each backward program
    visits two token blocks, the last one partial (14 tokens)."""
    N, B, T, d, H = 13, 2, 7, 48, 3
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(B, T, d, generator=gen).bfloat16()
    qs, gs = torch.randn(N, d, generator=gen) * 0.5, 1 + 0.1 * torch.randn(N, d, generator=gen)
    shifts, up = torch.randn(N, B, T, d, generator=gen).bfloat16(), torch.randn(B, T, d, generator=gen).double()

    def run(impl, dtype):
        s0, q, g = (t.to(DEVICE, dtype).clone().requires_grad_(True) for t in (src, qs.to(dtype), gs.to(dtype)))
        if impl == "fused":
            chain = fused_router(N, H, 1e-6, config, blocks).start(s0, *((list(q), list(g)) if given else ()))
            if DEVICE == "cpu":   # (the interpreter counts 2 multiprocessors; on a GPU, bench.py routing --blocks checks
                assert (chain.programs, chain.tiles) == ((2, 4) if config else (1, 1))   # a shape with ~30 blocks each)
            route = lambda j, x: chain.route(j, x, q[j - 1], g[j - 1])
        else:
            hist = BlockDepthHistory(range(N), (N - 1) // blocks,
                                     lambda j, srcs: route_reference(torch.stack(srcs), q[j], g[j], H, 1e-6))
            route = lambda j, x: hist.route(x)
        x = s0
        for j in range(1, N + 1):
            x = route(j, x)
            x = x * 1.5 + shifts[j - 1].to(x) if j < N else x
        (x.double() * up.to(x.device)).sum().backward()
        return [x.double(), s0.grad.double(), q.grad.double(), g.grad.double()]
    exact, ref, fused = run("reference", torch.float64), run("reference", torch.bfloat16), run("fused", torch.bfloat16)
    for name, e, r, f in zip(("out", "d src", "dq", "dg"), exact, ref, fused):
        assert rel_err(f, e) < 1.2 * rel_err(r, e) + 1e-3, (name, rel_err(f, e), rel_err(r, e))
