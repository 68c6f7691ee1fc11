"""
Tests: the README's command, python -m pytest -q -rs -n auto --maxprocesses=16 --dist worksteal test_mhar.py
(pytest-xdist, one worker per core; plain `python -m pytest test_mhar.py` runs the same tests one by one)

One section per file under test, fixtures and helpers first. Uses ../shared/data (offline text and tiktoken cache)
when it is there; otherwise a small corpus built from Python's own documentation, and tiktoken's normal download.
"""
import contextlib
import errno
import filecmp
import functools
import glob
import hashlib
import importlib.util
import json
import lzma
import math
import os
import pydoc
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import types
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

# PyTorch's CPU allocator on transparent huge pages: the suite's small CPU trainings allocate a (tokens x 50,304)
# logit tensor at every micro-step, and on 4 KB pages the kernel faults and zeroes it page by page (a tiny run's step
# 1.7x faster with it on 2 cores). Set before torch is imported; train.py and the other launches inherit it.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():   # kernels run on the CPU through Triton's interpreter (set before importing it)
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the cores this process may keep busy: the machine's, shared among pytest-xdist's workers under pytest -n
CORES = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
torch.set_num_threads(min(torch.get_num_threads(), CORES))

HERE = os.path.dirname(os.path.abspath(__file__))
# The suite's subprocesses (train.py, torchrun, sample.py, ...) import torch afresh. Where Python cannot keep bytecode
# beside torch's sources (a read-only install, or PYTHONDONTWRITEBYTECODE), each launch compiles its ~1,800 modules
# again (5 s of every launch on a GPU host); a bytecode cache of the suite's own compiles them once.
_PYCACHE = os.path.join(os.path.dirname(torch.__file__), "__pycache__")
if sys.dont_write_bytecode or not os.access(_PYCACHE if os.path.isdir(_PYCACHE) else os.path.dirname(_PYCACHE), os.W_OK):
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ.setdefault("PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), "mhar-tests-pycache"))
SHARED = os.path.join(HERE, "..", "shared", "data")
if "TIKTOKEN_CACHE_DIR" not in os.environ and os.path.isdir(os.path.join(SHARED, "tiktoken_cache")):
    os.environ["TIKTOKEN_CACHE_DIR"] = os.path.realpath(os.path.join(SHARED, "tiktoken_cache"))

import bench  # noqa: E402
import convert  # noqa: E402
import eval as evaluate  # noqa: E402
import export  # noqa: E402
import metrics  # noqa: E402
import prepare_data  # noqa: E402
import sample  # noqa: E402
import bench_routing  # noqa: E402
import routing_call  # noqa: E402
import routing_config as rc  # noqa: E402
import routing_kernel as rk  # noqa: E402
import train  # noqa: E402
import checkpoint  # noqa: E402
import graphs  # noqa: E402
from bench_routing import run_chain  # noqa: E402   (N routing sites with a sublayer between them, like a model's)
from graphs import DecodeGraph  # noqa: E402
from model import GPT, BlockDepthHistory, GPTConfig, fused_router, route_reference  # noqa: E402
from generation import KVCache  # noqa: E402


MODES = ("baseline", "hyper", "attnres", "mhar")


# =====================================================================================================================
# fixtures and helpers that several sections use
# =====================================================================================================================

def tiny_cfg(**kw):
    # routing_impl: the reference unless a test asks (the default, auto, would take the fused chain on a GPU machine)
    base = dict(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=48, ffn_hidden=64,
                routing_impl="reference")
    base.update(kw)
    return GPTConfig(**base)


def randomize_routing(model, scale=0.5, seed=0):
    """Non-trivial routing (queries are zero at init, which hides bugs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for site in model.routing_sites():
            site.q.copy_(torch.randn(site.q.shape, generator=gen) * scale)
            site.g.copy_(1 + 0.1 * torch.randn(site.g.shape, generator=gen))


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A .jsonl.xz of real English documents: the shared offline text, or Python's own docs."""
    shared = os.path.join(SHARED, "text", "books_wiki_en_val.jsonl.xz")
    if os.path.isfile(shared):
        return shared
    path = str(tmp_path_factory.mktemp("corpus") / "docs.jsonl.xz")
    names = ["os", "re", "json", "pathlib", "collections", "itertools", "functools", "argparse", "typing",
             "subprocess", "threading", "logging", "unittest", "email", "http.client", "urllib.request"]
    with lzma.open(path, "wt") as f:
        for name in names:
            f.write(json.dumps({"text": pydoc.render_doc(name, renderer=pydoc.plaintext)}) + "\n")
    return path


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, corpus):
    out = str(tmp_path_factory.mktemp("data"))
    prepare_data.prepare(input=corpus, out_dir=out, val_fraction=0.05, workers=2, force=True)
    return out


def load_module(path):
    """A Python file outside the import path (a results/ script, a harness task file) as a module."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TRAIN_ARGS = ["--n_layer=2", "--n_head=2", "--n_kv_head=1", "--n_embd=64", "--ffn_hidden=128", "--block_size=64",
              "--batch_tokens=512", "--micro_batch=4", "--lr=3e-3", "--warmup_steps=5", "--lr_decay_steps=60",
              "--eval_tokens=2048", "--device=cpu", "--compile=False", "--residual=mhar"]


def launch_env(nproc=1):
    """A launched run's environment: 2 threads for one process, 1 each for several (not every core each)."""
    return dict(os.environ, OMP_NUM_THREADS="1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2"))


def run_train(out_dir, data_dir, *extra, nproc=1, wait=True, env=None):
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                    "--standalone", f"--nproc_per_node={nproc}"]
    cmd = launcher + [os.path.join(HERE, "train.py"), f"--data_dir={data_dir}", f"--out_dir={out_dir}", *TRAIN_ARGS, *extra]
    env = {**launch_env(nproc), **(env or {})}
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def together(*launches, cores_each=2):
    """Independent launches side by side, as many at once as this process's CORES hold (each launch a function of no
    arguments: lambda: run_train(...)); their results in order. cores_each: the cores one keeps busy, 2 for a training
    run (OMP_NUM_THREADS=2), 1 for one that stops before training. A launch spends ~4 s importing torch and
    torch._dynamo on one core before its first step: side by side, those seconds overlap (on 2 cores two training
    runs at once are slower than one after the other, so there they take turns)."""
    workers = max(1, min(len(launches), CORES // cores_each))
    with ThreadPoolExecutor(workers) as pool:
        return [f.result() for f in [pool.submit(launch) for launch in launches]]


def read_log(out_dir):
    """{step: record} for train lines and evals; a resumed run's repeated steps keep the last record."""
    train_, evals = {}, {}
    for line in open(os.path.join(out_dir, "log.jsonl")):
        rec = json.loads(line)
        (evals if "val_loss" in rec else train_)[rec["step"]] = rec
    return train_, evals


# =====================================================================================================================
# model.py: route_reference against a float64 oracle, the method's invariants, configs, generation
# =====================================================================================================================

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


@pytest.mark.parametrize("residual,impl", [("baseline", "reference"), ("hyper", "reference"), ("attnres", "reference"),
                                           ("mhar", "reference"), ("mhar", "fused"), ("attnres", "fused"),
                                           ("delta", "reference"), ("delta", "fused")])
def test_kv_cache_gives_the_uncached_logits(residual, impl):
    """Generation with the KV cache: a prefill, single tokens, a chunk after cached tokens and DecodeGraph's
    fixed-shape steps (run eagerly: the position on the device, the whole cache read under a mask) give the logits
    of the whole sequence run without a cache (fp32, every residual mode, fused routing in the interpreter, B = 3)."""
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


# =====================================================================================================================
# routing_call.py, routing_kernel.py, routing_config.py: the fused kernels against the reference (CPU: Triton's
# interpreter)
# =====================================================================================================================

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
    """config_for gives a tuned width its table entry and every other width DEFAULT; a chain launches each kernel with
    its config's (tile, warps, stages), and a custom config is what runs."""
    for (d, H), tuned in rc.TUNED_H200.items():
        cfg = rc.config_for(d, H)
        assert all(getattr(cfg, k) == v for k, v in tuned.items()) and cfg.call_site == rc.DEFAULT.call_site
    assert rc.config_for(96, 4) is rc.DEFAULT and rc.config_for(512, 8) is rc.DEFAULT
    config = rc.RoutingConfig(max_block_m=16, fwd=(1024, 2, 2), gather=(256, 1, 1))
    mine = rk.RoutingChain(3, 10, 96, 4, 1e-6, torch.float32, DEVICE, training=True, config=config)
    default = rk.RoutingChain(3, 10, 96, 4, 1e-6, torch.float32, DEVICE, training=True)
    assert mine.fwd_launch[False][2:4] == (2, 2) and mine.gather_launch[False][1:3] == (1, 1)
    assert default.fwd_launch[False][2:4] == rc.DEFAULT.fwd[1:] and default.gather_launch[True][1:3] == rc.DEFAULT.gather_lead[1:]
    check_fused_chain(5, 1, 33, 96, 4, torch.float32, config)


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


@pytest.mark.skipif(DEVICE != "cuda" or not rk.DIRECT_OK, reason="direct launches: CUDA and Triton >= 3.4 only")
def test_fused_direct_launches_match_tritons():
    """After a launch key's first launch, routing_config.Launcher calls the compiled kernel's launcher itself: the chain's
    output and every gradient are bitwise those of Triton's own launch path (leading and following sites included)."""
    N, B, T, d, H = 13, 2, 40, 128, 4
    src0, qs, gs, shift, up = chain_inputs(N, B, T, d, seed=5)
    runs = [chain_grads("fused", src0, qs, gs, shift, up, H, torch.bfloat16,
                        rc.RoutingConfig(direct=direct, lead_min=2)) for direct in (False, True)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


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
    assert chain.fwd_lead == fwd and chain.gather_lead == gather and chain.gather_launch[True][0] >= 1
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_routing_wider_lead(dtype):
    """A leading forward that runs the next 2 sites' softmax (fwd_lead_sites): the sites it leads resume their states
    and read only the sources since; every pair's logit stored (heads of two column parts). Against the reference, and
    bitwise the unpaired forward's output, in training and under no_grad (on a GPU this also checks that a led site's
    distance from its leader reaches the compiled kernel: direct launches)."""
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


def test_no_module_imports_in_a_circle():
    """The repository's modules import one another without a circle, imports inside functions counted: the routing
    files from the lowest up (routing_config <- routing_call <- routing_kernel <- routing_block), the choice between
    chains above them (model.fused_router)."""
    import ast
    own = {os.path.splitext(f)[0] for f in os.listdir(HERE) if f.endswith(".py")}
    graph = {}
    for name in own:
        deps = set()
        for node in ast.walk(ast.parse(open(os.path.join(HERE, name + ".py")).read())):
            if isinstance(node, ast.Import):
                deps |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                deps.add(node.module.split(".")[0])
        graph[name] = (deps & own) - {name}
    done, path = set(), []

    def visit(name):   # depth first; a module met again on the current path closes a circle
        assert name not in path, " -> ".join(path[path.index(name):] + [name])
        if name not in done:
            path.append(name)
            for dep in sorted(graph[name]):
                visit(dep)
            path.pop()
            done.add(name)
    for name in sorted(graph):
        visit(name)
    assert graph["routing_config"] == set() and graph["routing_call"] == {"routing_config"}
    assert "routing_block" not in graph["routing_kernel"] and "model" not in graph["routing_block"]


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


@pytest.mark.parametrize("checkpoint", [False, True])
def test_fused_delta_matches_reference(tmp_path, checkpoint):
    hf_dir, out = str(tmp_path / "hf"), str(tmp_path / "out")
    write_hf_checkpoint(hf_dir, HF_CONFIGS["qwen3"])
    convert.main([f"--hf_dir={hf_dir}", f"--out_dir={out}", "--dtype=float32", "--num_blocks=2", "--route_heads=2",
                  "--check_batches=0", "--tokenizer=gpt2"])
    models = []
    gen = torch.Generator().manual_seed(1)
    for impl in ("reference", "fused"):
        m = GPT.from_checkpoint(out).to(DEVICE)
        m.cfg.routing_impl = impl
        m.checkpoint_sublayers = checkpoint
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


# =====================================================================================================================
# prepare_data.py
# =====================================================================================================================

def read_docs(path):
    with lzma.open(path, "rt") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def test_prepare_data_counts_and_round_trip(data_dir, corpus):
    meta = json.load(open(os.path.join(data_dir, "meta.json")))
    docs = read_docs(corpus)
    enc = prepare_data.load_tokenizer("gpt2")
    train_tok = np.fromfile(os.path.join(data_dir, "train.bin"), dtype=np.uint16)
    val_tok = np.fromfile(os.path.join(data_dir, "val.bin"), dtype=np.uint16)
    assert meta["train_tokens"] == len(train_tok) and meta["val_tokens"] == len(val_tok)
    assert meta["train_docs"] + meta["val_docs"] == len(docs) and meta["vocab_size"] == 50257
    val_docs, train_docs = docs[::20], [d for i, d in enumerate(docs) if i % 20]   # val_fraction 0.05
    eot = "<|endoftext|>"
    assert enc.decode(val_tok.tolist()) == "".join(eot + d for d in val_docs)
    assert enc.decode(train_tok.tolist()) == "".join(eot + d for d in train_docs)
    assert (train_tok == enc.eot_token).sum() == len(train_docs)


def test_prepare_data_limits_and_refusals(tmp_path, corpus, data_dir):
    out = str(tmp_path / "d")
    meta = prepare_data.prepare(input=corpus, val_input=corpus, out_dir=out, max_tokens=5000, max_val_tokens=3000, workers=1)
    assert meta["train_tokens"] == 5000 and meta["val_tokens"] == 3000
    assert os.path.getsize(os.path.join(out, "train.bin")) == 10000
    with pytest.raises(FileExistsError, match="--force"):
        prepare_data.prepare(input=corpus, out_dir=out, workers=1)
    meta = prepare_data.prepare(input=corpus, out_dir=out, tokenizer="cl100k_base", max_tokens=2000, workers=1, force=True)
    assert meta["dtype"] == "uint32" and meta["train_tokens"] == 2000
    txt = tmp_path / "texts"
    txt.mkdir()
    (txt / "a.txt").write_text("Hello world. " * 50)
    (txt / "b.txt").write_text("Another document. " * 50)
    meta = prepare_data.prepare(input=str(txt), out_dir=str(tmp_path / "t"), val_fraction=0.5, workers=1)
    assert meta["train_docs"] == 1 and meta["val_docs"] == 1
    with pytest.raises(FileNotFoundError):
        prepare_data.prepare(input=str(tmp_path / "missing*.jsonl"), out_dir=str(tmp_path / "x"))


def test_lock_holder_reads_another_users_process_as_alive(tmp_path, monkeypatch):
    """prepare.lock's holder: gone (no such process) -> None; another user's live process (signalling it is refused)
    or a process on another host -> its pid: the folder stays refused. One pid_alive for train.lock and prepare.lock."""
    (tmp_path / "prepare.lock").write_text(f"4242 {socket.gethostname()}")
    for error, holder in ((ProcessLookupError, None), (PermissionError, 4242)):
        def kill(pid, sig, error=error):
            raise error
        monkeypatch.setattr(os, "kill", kill)
        assert prepare_data.lock_holder(str(tmp_path)) == holder and checkpoint.pid_alive(4242) == (holder is not None)
    (tmp_path / "prepare.lock").write_text("4242 another-host")
    assert prepare_data.lock_holder(str(tmp_path)) == 4242


def test_prepare_data_one_run_per_folder_and_checksums(tmp_path, corpus):
    """prepare_data.py holds out_dir/prepare.lock while it writes: a second prepare into the folder is refused naming the
    first (a lock whose process is gone is taken over); meta.json records each file's SHA-256, which --verify checks
    byte by byte."""
    out = tmp_path / "d"
    out.mkdir()
    lock = prepare_data.take_lock(str(out))   # this process is the first prepare
    r = subprocess.run([sys.executable, os.path.join(HERE, "prepare_data.py"), f"--input={corpus}", f"--out_dir={out}",
                        "--max_tokens=2000", "--workers=1"], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{out} is being prepared by another prepare_data.py (pid {os.getpid()})" in r.stderr.strip().splitlines()[-1]
    with pytest.raises(FileExistsError, match="being prepared"):
        prepare_data.take_lock(str(out))
    with open(lock, "w") as f:
        f.write(f"99999999 {socket.gethostname()}")   # its process is gone
    meta = prepare_data.prepare(input=corpus, out_dir=str(out), max_tokens=2000, workers=1)
    assert sorted(os.listdir(out)) == ["meta.json", "token_bytes.bin", "train.bin", "val.bin"]   # no lock, no staging
    assert meta["files"]["train.bin"]["sha256"] == hashlib.sha256((out / "train.bin").read_bytes()).hexdigest()
    prepare_data.main(["--verify", f"--out_dir={out}"])
    with open(out / "val.bin", "r+b") as f:   # one byte changed: the sampled blocks may miss it; --verify does not
        f.seek(len(f.read()) // 2 + 1)
        f.write(b"\xff")
    with pytest.raises(SystemExit, match=r"val.bin: its SHA-256 is not meta.json's: damaged"):
        prepare_data.main(["--verify", f"--out_dir={out}"])


@pytest.mark.parametrize("sig,code,said", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")])
def test_prepare_data_stopped_leaves_the_folder_as_it_was(tmp_path, corpus, sig, code, said):
    """SIGTERM or Ctrl-C while prepare_data.py --force rewrites a folder (its input a pipe that stalls mid-stream, so
    the signal lands mid-write): exit 143 / 130 with one line, its pool workers gone, no partial file, no lock, and the
    folder's files as they were."""
    out, src = tmp_path / "d", tmp_path / "src"
    prepare_data.prepare(input=corpus, out_dir=str(out), max_tokens=3000, workers=1)
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    src.mkdir()
    os.mkfifo(src / "docs.jsonl")
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "prepare_data.py"), f"--input={src}", f"--out_dir={out}",
                          "--force", "--workers=2", "--val_fraction=0.5"], stderr=subprocess.PIPE, text=True)
    with open(src / "docs.jsonl", "w") as pipe:
        words = " ".join(f"word{i}" for i in range(200))
        for i in range(3000):
            pipe.write(json.dumps({"text": f"document {i}: {words}"}) + "\n")
        pipe.flush()
        partial = out / ".incomplete" / "train.bin"
        deadline = time.time() + 120
        while not (partial.exists() and partial.stat().st_size > 0) and time.time() < deadline:
            time.sleep(0.1)
        assert partial.exists() and partial.stat().st_size > 0, "the prepare never wrote"
        workers = subprocess.run(["ps", "-o", "pid=", "--ppid", str(p.pid)], capture_output=True,
                                 text=True).stdout.split()
        assert len(workers) >= 2
        p.send_signal(sig)
        err = p.communicate(timeout=60)[1]
    assert p.returncode == code, err
    assert "Traceback" not in err and "Error" not in err, err
    assert err.strip().splitlines()[-1].startswith(f"prepare_data.py: stopped by {said}; the partial files were removed")
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before   # nothing half-written, no lock
    def alive(pid):   # (a zombie is dead: its parent has not reaped it yet)
        try:
            return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
        except FileNotFoundError:
            return False
    deadline = time.time() + 10
    while any(alive(w) for w in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(w) for w in workers), "a pool worker outlived the prepare"


def test_prepare_data_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")   # parquet input needs pyarrow (installed with datasets)
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["first document here"] * 30}), str(tmp_path / "x.parquet"))
    meta = prepare_data.prepare(input=str(tmp_path / "x.parquet"), out_dir=str(tmp_path / "p"), val_fraction=0.1, workers=1)
    assert meta["train_docs"] == 27 and meta["val_docs"] == 3


def test_tokenizer_error_is_actionable(monkeypatch, tmp_path):
    import tiktoken.load
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))   # empty cache

    def offline(*a, **k):
        raise ConnectionError("no network")
    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    import tiktoken.registry
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    with pytest.raises(RuntimeError, match="TIKTOKEN_CACHE_DIR"):
        prepare_data.load_tokenizer("o200k_base")


@pytest.mark.parametrize("line,msg", [
    ('{"text": "ok"}\n{"text": 123}\n', r"bad.jsonl:2: field 'text' holds int"),
    ('{"text": "ok"}\n\n{"text": "a" oops}\n', r"bad.jsonl:3: not a JSON object"),
    ('{"body": "no text field"}\n', r"bad.jsonl:1: no field 'text'"),
    (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"bad.jsonl:2: not UTF-8 text"),
])
def test_bad_input_documents_name_file_and_line(tmp_path, line, msg):
    src = tmp_path / "bad.jsonl"
    (src.write_bytes if isinstance(line, bytes) else src.write_text)(line)
    out = tmp_path / "prepared"
    with pytest.raises((ValueError, KeyError), match=msg):
        prepare_data.prepare(input=str(src), out_dir=str(out), workers=1)
    assert not out.exists()   # nothing left behind: no folder, no .tmp files


def test_hub_offline_gives_the_local_input_hint(tmp_path, monkeypatch):
    """No network: prepare_data.py's default (FineWeb-Edu from the Hub) fails with the --input= hint, leaving nothing."""
    datasets = pytest.importorskip("datasets")

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub (LocalEntryNotFoundError)")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    out = tmp_path / "fw"
    with pytest.raises(RuntimeError, match=r"without a network, pass local files: --input="):
        prepare_data.prepare(out_dir=str(out), workers=1)
    assert not out.exists()
    with pytest.raises(RuntimeError, match=r"pass --data_root=DIR"):
        evaluate.load_task("lambada")


# =====================================================================================================================
# train.py: options, runs as users run them (resume, DDP, FSDP2), non-finite states
# =====================================================================================================================

@pytest.mark.parametrize("argv,msg", [
    (["--n_layers=3"], r"unknown option 'n_layers'.*did you mean n_layer"),
    (["--max_steps=ten"], r"max_steps='ten' has type str, expected int"),
    (["--compile=1"], r"compile=1 has type int, expected bool"),
    (["--lr"], r"write options as --key=value"),
    (["--lr_schedule=cos"], r"lr_schedule='cos' is not one of cosine, linear, 1-sqrt"),
    (["--n_embd=512", "--route_heads=3"], r"n_embd=512 must be divisible by route_heads=3"),
    (["no_such_config.py"], r"config file 'no_such_config.py' not found"),
    (["--lr=-1"], r"lr=-1.0 must be a finite number > 0"),
    (["--min_lr_ratio=2"], r"min_lr_ratio=2.0 must be a finite number in \[0, 1\]"),
    (["--weight_decay=-0.1"], r"weight_decay=-0.1 must be a finite number >= 0"),
    (["--grad_clip=-1"], r"grad_clip=-1.0 must be a finite number >= 0"),
    (["--warmup_steps=-5"], r"warmup_steps=-5 must be a finite number >= 0"),
    (["--beta2=1"], r"beta2=1.0 must be a finite number in \[0, 1\)"),
    (["--device=gpu"], r"device='gpu' is not one of auto, cpu, cuda, cuda:N"),
    (["--grad_sync=ddp"], r"grad_sync='ddp' is not one of after, overlap"),
    (["--grad_bucket_mb=0"], r"grad_bucket_mb=0.0 must be a finite number > 0"),
    (["--routing_lr_scale=0"], r"routing_lr_scale=0.0 must be a finite number > 0"),
    (["--route_init_std=0.02", "--residual=hyper"], r"route_init_std=0.02 is for attnres and mhar, not residual='hyper'"),
    (["--route_blocks=5"], r"route_blocks=5 must be a positive divisor of the 24 sublayers \(2 x n_layer=12\)"),
    (["--route_blocks=0"], r"route_blocks=0 must be a positive divisor"),
    (["--route_blocks=2", "--residual=baseline"], r"route_blocks=2 is for attnres and mhar .*not residual='baseline'"),
    (["--route_blocks=2", "--residual=hyper"], r"route_blocks=2 is for attnres and mhar .*not residual='hyper'"),
    (["--route_blocks=2", "--residual=delta", "--num_blocks=4"], r"not residual='delta': drop it \(delta mode's blocks: num_blocks\)"),
    (["--keep_every=250"], r"keep_every=250 must be a multiple of eval_interval=500 .*e.g. --keep_every=500"),
    (["--keep_every=-500"], r"keep_every=-500 must be a finite number >= 0"),
    (["--route_scale=1e999"], r"route_scale=inf must be a finite number > 0"),       # inf is positive: finite is the rule
    (["--routing_lr_scale=1e999"], r"routing_lr_scale=inf must be a finite number > 0"),
    (["--lr=nan"], r"lr=nan must be a finite number > 0"),
    (["--ema_decay=1e999"], r"ema_decay=inf must be a finite number in \[0, 1\)"),
    (["--lr_decay_steps=0"], r"lr_decay_steps=0 must be a finite number > 0, or -1 \(= max_steps\)"),
    (["--rope_theta=-1"], r"rope_theta=-1.0 must be a finite number > 0"),
])
def test_bad_train_options(argv, msg):
    with pytest.raises(ValueError, match=msg):
        train.parse_args(argv)


@pytest.mark.parametrize("argv,said", [
    (["--residual=baseline", "--route_heads=2", "--num_blocks=4"],
     ["num_blocks=4 is unused by residual=baseline (it is for delta)", "route_heads=2 is unused by residual=baseline"]),
    (["--residual=hyper", "--route_scale=0.5", "--routing_lr_scale=2"],
     ["route_scale=0.5 is unused by residual=hyper", "routing_lr_scale=2.0 is unused by residual=hyper"]),
    (["--residual=mhar", "--hc_streams=2", "--hc_dynamic=False"],
     ["hc_dynamic=False is unused by residual=mhar (it is for hyper)", "hc_streams=2 is unused"]),
    (["--residual=baseline", "--route_scale=1", "--routing_impl=auto"], []),   # a default value changes nothing: not said
    (["--residual=mhar", "--route_heads=2", "--route_scale=0.5"], []),
])
def test_options_a_mode_does_not_read_are_said(argv, said):
    lines = train.unused_options(train.parse_args(argv))
    assert len(lines) == len(said) and all(s in line and line.endswith("; ignored") for s, line in zip(said, lines)), lines


def test_resume_refuses_another_route_blocks():
    """A checkpoint's model_config records route_blocks (train.py saves asdict of it); resuming with another value is
    refused, also against a checkpoint from before the field (its routing: full, None); the same value passes."""
    saved = vars(GPTConfig(route_blocks=2))
    older = {k: v for k, v in vars(GPTConfig()).items() if k != "route_blocks"}
    assert saved["route_blocks"] == 2 and GPTConfig.from_dict(older).route_blocks is None
    for model_config, was in ((saved, 2), (older, None)):
        with pytest.raises(SystemExit, match=rf"would be ignored: --route_blocks=4 \(checkpoint: {was}\)"):
            train.refuse_ignored_architecture(train.parse_args(["--route_blocks=4"]), model_config, "ckpt.pt")
    train.refuse_ignored_architecture(train.parse_args(["--route_blocks=2"]), saved, "ckpt.pt")


def test_config_file_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("n_layer = 4\nlr = (1e-3\n")
    with pytest.raises(ValueError, match=rf"config file {re.escape(str(bad))}, line 2: "):
        train.parse_args([str(bad)])
    bad.write_text("n_layer = undefined_name\n")
    with pytest.raises(ValueError, match=r"NameError: name 'undefined_name' is not defined"):
        train.parse_args([str(bad)])


def test_bad_data_and_eval_tokens_are_one_line_errors(tmp_path, data_dir):
    """Data folders that disagree with their meta.json (checked by size and sampled content at every start, fresh runs
    too), one being prepared, and a too-small --eval_tokens: exit 2 with one line naming the file and the fix."""
    def broken(name, edit):
        d = tmp_path / name
        shutil.copytree(data_dir, d)
        edit(d)
        return str(d)
    def cut(d):   # truncate -s: a fresh run used to train on what was left
        with open(d / "train.bin", "r+b") as f:
            f.truncate(os.path.getsize(d / "train.bin") // 3 * 2)

    def other_tokens(d):   # the same size, other bytes (e.g. another prepare wrote it, its meta.json lost)
        np.fromfile(d / "train.bin", dtype=np.uint16)[::-1].tofile(d / "train.bin")

    def being_prepared(d):   # a live prepare_data.py holds the folder (this process stands in for it)
        (d / "prepare.lock").write_text(f"{os.getpid()} {socket.gethostname()}")
    cases = [
        (broken("empty", lambda d: open(d / "val.bin", "w").close()), r"val.bin holds 0 tokens \(0 bytes\) but meta.json says"),
        (broken("odd", lambda d: open(d / "train.bin", "ab").write(b"x")), r"train.bin holds [\d,]+ tokens .* but meta.json says"),
        (broken("meta", lambda d: (d / "meta.json").write_text("{")), r"meta.json is not prepare_data.py's JSON"),
        (broken("noval", lambda d: os.remove(d / "val.bin")), r"val.bin not found: prepare the folder again: python "
                                                              r"prepare_data.py --input=\S+ .*--out_dir=\S+noval --force"),
        (broken("cut", cut), r"train.bin holds [\d,]+ tokens .* but meta.json says [\d,]+: the folder changed"),
        (broken("swapped", other_tokens), r"train.bin has meta.json's size but other bytes \(its sampled blocks differ\)"),
        (broken("locked", being_prepared), rf"is being written by prepare_data.py \(pid {os.getpid()}\)"),
    ]
    outs = [str(tmp_path / f"out{i}") for i in range(len(cases) + 1)]   # one out_dir each: they run side by side
    *results, small = together(*[lambda o=o, d=d: run_train(o, d, "--max_steps=1") for o, (d, _) in zip(outs, cases)],
                               lambda: run_train(outs[-1], data_dir, "--max_steps=1", "--eval_tokens=100"),
                               cores_each=1)
    for (d, msg), r in zip(cases, results):
        assert r.returncode != 0 and re.search(msg, r.stderr) and "Traceback" not in r.stderr, r.stderr
    assert small.returncode != 0 and "eval_tokens=100 is less than one eval batch" in small.stderr
    advice = re.search(r"prepare it again: (python prepare_data.py .*)$", results[4].stderr.strip()).group(1)
    subprocess.run([sys.executable, *advice.split()[1:]], cwd=HERE, check=True, capture_output=True)   # it works:
    meta = json.loads(open(os.path.join(cases[4][0], "meta.json")).read())                            # the same data
    assert prepare_data.check_files(cases[4][0], meta, full=True) and meta["files"] == json.load(
        open(os.path.join(data_dir, "meta.json")))["files"]
    assert not any(os.path.exists(os.path.join(o, "train.lock")) for o in outs)


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
    assert re.search(r"eval step 4 \| val_loss \d+\.\d+ \| val_bpb \d+\.\d+ .* \| routing entropy [\d.]+, embedding", runs[0].stdout)
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
            for j, (ent, first, newest) in enumerate(zip(*(r["routing"][k] for k in ("entropy", "w_first", "w_newest"))), 1):
                assert all(-1e-6 <= e <= math.log(j) + 1e-6 for e in ent) and all(-1e-6 <= w <= 1 + 1e-6 for w in first + newest)
                if r["step"] == 0:   # zero queries: every source weighs 1/j
                    assert ent == pytest.approx([math.log(j)] * heads, abs=1e-6) and first == pytest.approx([1 / j] * heads)


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
    stats = metrics.routing_stats([a.mean((1, 2)) for a in alpha])
    assert stats["entropy"][1] == pytest.approx([0.0, 0.0], abs=1e-6) and stats["w_first"][1] == pytest.approx([1.0, 1.0])
    assert stats["entropy"][0] == [0.0, 0.0] and stats["entropy"][2] == pytest.approx([math.log(3)] * 2)   # q = 0


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
    which a training step holds), where one forward of the whole microbatch with the weights recorded holds 4x more; the
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
    assert peaks["pieces"] < buffer < peaks["whole"] / 4, (peaks, buffer)
    stats, loss_sum = results["pieces"]
    _, loss, alpha = results["whole"]
    whole = metrics.routing_stats([a.double().mean((1, 2)) for a in alpha])
    for key in whole:
        assert np.allclose(stats[key], whole[key], rtol=0, atol=1e-6), key
    assert loss_sum.item() == pytest.approx(loss.item() * y.numel(), rel=1e-5)


def test_keep_every_keeps_checkpoints_through_a_resume(tmp_path, data_dir):
    """--keep_every=10: the step-10, 20 and 30 checkpoints stay beside ckpt.pt / ckpt.prev.pt (second names of those
    saves), a resume neither rotates nor replaces them, and each loads in sample.py, eval.py --probe and export.py."""
    out = tmp_path / "k"
    first = run_train(str(out), data_dir, "--max_steps=20", "--eval_interval=10", "--keep_every=10")
    assert first.returncode == 0 and "kept as" in first.stdout, first.stderr
    inode = os.stat(out / "ckpt-step10.pt").st_ino
    resumed = run_train(str(out), data_dir, "--max_steps=30", "--eval_interval=10", "--keep_every=10",
                        "--init_from=resume")
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(os.listdir(out)) == ["ckpt-step10.pt", "ckpt-step20.pt", "ckpt-step30.pt", "ckpt.prev.pt", "ckpt.pt",
                                       "log.jsonl"]
    assert os.stat(out / "ckpt-step10.pt").st_ino == inode
    for step in (10, 20, 30):
        assert torch.load(out / f"ckpt-step{step}.pt", weights_only=False, mmap=True)["step"] == step
        sample.main([f"--out_dir={out / f'ckpt-step{step}.pt'}", "--max_new_tokens=3", "--device=cpu"])
    evaluate.main([f"--out_dir={out / 'ckpt-step20.pt'}", "--probe", f"--data_dir={data_dir}", "--device=cpu"])
    assert (out / "probe-step20" / "probe.json").is_file() and not (out / "probe").exists()
    export.main([f"--out_dir={out / 'ckpt-step10.pt'}", f"--hf_dir={tmp_path / 'hf10'}", "--check=False"])
    assert json.load(open(tmp_path / "hf10" / "config.json"))["exported_from"]["step"] == 10


def test_a_hub_style_tokenizer_trains_and_an_offline_hub_name_fails(tmp_path, corpus, monkeypatch):
    """A Qwen3-style tokenizer.json (byte-level BPE with <|endoftext|> and chat tokens, built here) tokenizes and trains;
    a Hub model's name fetches its tokenizer.json into the data folder and records the model's own vocabulary, which the
    model takes (Qwen3: 151,936); offline, a Hub name is one line naming the fix, and nothing is written."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(read_docs(corpus)[:50], trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    monkeypatch.setattr(prepare_data, "hub_tokenizer", lambda name: (str(tmp_path / "tokenizer.json"), 640))
    data = str(tmp_path / "qwenish")
    meta = prepare_data.prepare(input=corpus, out_dir=data, tokenizer="Owner/Model-0.6B", max_tokens=20000, workers=1)
    assert meta["tokenizer"] == os.path.join(os.path.abspath(data), "tokenizer.json") and meta["model_vocab_size"] == 640
    assert meta["eot_token"] == tok.token_to_id("<|endoftext|>") == 0 and meta["tokenizer_source"] == "Owner/Model-0.6B"
    table = np.fromfile(os.path.join(data, "token_bytes.bin"), dtype=np.uint16)
    assert table[:3].tolist() == [0, 0, 0]   # special tokens weigh no bytes; the rest add up to a text's UTF-8 bytes
    for text in read_docs(corpus)[60:64] + ["naïve café, 東京 — ok"]:
        assert table[tok.encode(text).ids].sum() == len(text.encode()), text[:40]
    r = run_train(str(tmp_path / "run"), data, "--max_steps=2", "--eval_interval=2")
    assert r.returncode == 0 and "vocab 640 (" in r.stdout, r.stderr
    assert json.loads(open(tmp_path / "run" / "log.jsonl").readlines()[-1])["val_bpb"] > 0
    offline = subprocess.run([sys.executable, os.path.join(HERE, "prepare_data.py"), f"--input={corpus}",
                              "--tokenizer=Qwen/Qwen3-0.6B", f"--out_dir={tmp_path / 'hub'}"], capture_output=True,
                             text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=120)
    assert offline.returncode == 1 and "Traceback" not in offline.stderr and not (tmp_path / "hub").exists()
    assert re.search(r"--tokenizer=Qwen/Qwen3-0.6B: could not fetch its tokenizer.json .* pass "
                     r"--tokenizer=path/to/tokenizer.json", offline.stderr), offline.stderr


def test_wandb_log_offline_and_without_wandb(tmp_path, data_dir):
    """--wandb_log=True with WANDB_MODE=offline writes a local run holding the step, eval and routing records (read
    back from its file); without wandb installed: one line naming the fix, exit 1, nothing trained."""
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
    assert all({"val_loss", "val_bpb", "routing/entropy", "routing/w_first", "routing/entropy_site5"} <= set(rows[s])
               for s in (0, 2, 4))
    log = [json.loads(line) for line in open(out / "log.jsonl")]
    assert rows[4]["val_loss"] == [x for x in log if "val_loss" in x][-1]["val_loss"]
    assert m.returncode == 1 and "--wandb_log=True needs Weights & Biases: pip install wandb" in m.stderr
    assert "Traceback" not in m.stderr and not missing.exists()


def test_run_header_names_the_tree_without_git(monkeypatch):
    """A copy without .git, or with a .git that is not its own (a GPU host's, say), names its tree by $MHAR_REVISION,
    set where git runs: the variable, when set, wins over git."""
    monkeypatch.setenv("MHAR_REVISION", "0aa8bf0")
    assert train.git_revision() == "0aa8bf0 (MHAR_REVISION)"
    def no_git(*args, **kwargs):
        raise OSError("git: not found")
    monkeypatch.setattr(checkpoint.subprocess, "run", no_git)
    assert train.git_revision() == "0aa8bf0 (MHAR_REVISION)"
    monkeypatch.delenv("MHAR_REVISION")
    assert train.git_revision() == "unknown"


def test_train_options_parse():
    cfg = train.parse_args([os.path.join(HERE, "config", "tiny.py"), "--lr=1e-3", "--route_heads=2", "--residual=baseline"])
    assert cfg.lr == 1e-3 and cfg.route_heads == 2 and cfg.residual == "baseline" and cfg.n_layer == 4
    assert isinstance(train.parse_args(["--lr=1"]).lr, float)
    for path in glob.glob(os.path.join(HERE, "config", "*.py")):
        train.parse_args([path])   # every shipped config is valid


def test_training_loss_falls_and_sample(tmp_path, data_dir):
    out, ckpt_out = str(tmp_path / "o"), str(tmp_path / "ac")
    r, typo, ac = together(
        lambda: run_train(out, data_dir, "--max_steps=40", "--eval_interval=20"),
        lambda: run_train(str(tmp_path / "typo"), data_dir, "--max_steps=2", "--init_from=resumee"),
        lambda: run_train(ckpt_out, data_dir, "--max_steps=5", "--eval_interval=5", "--activation_checkpointing=True"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"step 40/40 \| loss \d+\.\d+ \| lr [\d.e+-]+ \| grad [\d.]+ \| \d+ ms \| [\d,]+ tok/s \| mfu n/a \| eta",
                     r.stdout)
    steps, evals = read_log(out)
    assert sorted(evals) == [0, 20, 40] and sorted(steps) == list(range(1, 41))
    assert set(steps[1]) == {"step", "loss", "lr", "grad_norm", "dt_ms", "tok_per_s"}
    assert set(evals[0]) == {"step", "val_loss", "val_bpb", "routing"}
    assert evals[40]["val_loss"] < evals[0]["val_loss"] - 2.0
    assert np.mean([steps[s]["loss"] for s in range(36, 41)]) < np.mean([steps[s]["loss"] for s in range(1, 6)]) - 2.0
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert ckpt["step"] == 40 and not any(k.startswith(("_orig_mod", "module.")) for k in ckpt["model"])
    model = GPT.from_checkpoint(out)
    assert model.cfg.residual == "mhar" and model.checkpoint_info["tokenizer"] == "gpt2"
    s, r = together(   # sample.py reads the checkpoint; starting over in the same out_dir would overwrite it: refused
        lambda: subprocess.run([sys.executable, os.path.join(HERE, "sample.py"), f"--out_dir={out}", "--device=cpu",
                                "--max_new_tokens=8", "--start=The"], capture_output=True, text=True),
        lambda: run_train(out, data_dir, "--max_steps=2"), cores_each=1)
    assert s.returncode == 0 and s.stdout.startswith("The"), s.stderr
    assert r.returncode != 0 and "--init_from=resume" in r.stderr
    assert typo.returncode != 0
    assert "init_from='resumee' is not scratch, resume, or the out_dir of convert.py" in typo.stderr
    # activation checkpointing recomputes sublayers: the same losses
    assert ac.returncode == 0, ac.stderr
    assert all(abs(read_log(ckpt_out)[0][s]["loss"] - steps[s]["loss"]) < 1e-5 for s in range(1, 6))


def kill_when_logged(proc, log, step, sig):
    """Send sig to a run once its log.jsonl holds a whole record at step or later; its output."""
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(log) and any(json.loads(l).get("step", 0) >= step for l in open(log) if l.endswith("\n")):
            proc.send_signal(sig)
            break
        time.sleep(0.02)
    return proc.communicate()[0]


def test_kill_and_resume_is_bitwise(tmp_path, data_dir):
    full, killed, short = str(tmp_path / "full"), str(tmp_path / "killed"), str(tmp_path / "short")
    short_args = ["--max_steps=5", "--eval_interval=3", "--init_from=resume"]

    def kill_mid_run():   # after the step-10 checkpoint
        proc = run_train(killed, data_dir, "--max_steps=30", "--eval_interval=10", wait=False)
        kill_when_logged(proc, os.path.join(killed, "log.jsonl"), 13, signal.SIGKILL)
        return proc.returncode

    # a schedule whose horizon follows max_steps: extending the run changes it unless the horizon is pinned
    def extend_short():
        assert run_train(short, data_dir, "--max_steps=3", "--eval_interval=3", "--lr_decay_steps=-1").returncode == 0
        return (run_train(short, data_dir, *short_args, "--lr_decay_steps=-1"),
                run_train(short, data_dir, *short_args, "--lr_decay_steps=3"))

    r, code, (refused, pinned) = together(
        lambda: run_train(full, data_dir, "--max_steps=30", "--eval_interval=10"), kill_mid_run, extend_short)
    assert r.returncode == 0, r.stderr
    assert code == -signal.SIGKILL, "the run finished before it could be killed"
    assert torch.load(os.path.join(killed, "ckpt.pt"), weights_only=False)["step"] in (10, 20)
    r = run_train(killed, data_dir, "--max_steps=30", "--eval_interval=10", "--init_from=resume")
    assert r.returncode == 0, r.stderr
    a, b = read_log(full), read_log(killed)
    assert a[0].keys() == b[0].keys() and a[1].keys() == b[1].keys()
    assert all(a[0][s]["loss"] == b[0][s]["loss"] for s in a[0]), "resumed losses differ from the uninterrupted run"
    assert all(a[1][s]["val_loss"] == b[1][s]["val_loss"] for s in a[1])
    # an incompatible config is refused, naming the keys
    r = run_train(killed, data_dir, "--max_steps=40", "--init_from=resume", "--residual=attnres", "--lr=1e-3")
    assert r.returncode != 0 and "residual: 'mhar' -> 'attnres'" in r.stderr and "lr: 0.003 -> 0.001" in r.stderr
    assert refused.returncode != 0 and "decay horizon" in refused.stderr and "--lr_decay_steps=3" in refused.stderr
    assert pinned.returncode == 0, pinned.stderr


def test_fused_training_curve_matches_reference(tmp_path, data_dir):
    def run(impl):
        return run_train(str(tmp_path / impl), data_dir, "--max_steps=30", "--eval_interval=30", f"--routing_impl={impl}",
                         "--route_heads=2", "--batch_tokens=256")   # one micro-step per step: the CPU interpreter is slow
    for r in together(lambda: run("reference"), lambda: run("fused")):
        assert r.returncode == 0, r.stdout + r.stderr
    a, b = read_log(str(tmp_path / "reference")), read_log(str(tmp_path / "fused"))
    diff = max(abs(a[0][s]["loss"] - b[0][s]["loss"]) for s in a[0])
    assert len(a[0]) == 30 and diff < 1e-4, diff


def test_cpu_run_with_defaults_says_why_graphs_and_fused_routing_are_off(tmp_path, data_dir):
    """The defaults (cuda_graph=True, routing_impl='auto') are the fast path on a GPU; on a CPU the run still works,
    and one line each says why graphs are off and which routing runs."""
    r = run_train(str(tmp_path / "g"), data_dir, "--max_steps=1", "--device=cpu")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "CUDA graphs: off (they need CUDA, the device is cpu)" in out
    assert out.count("routing (routing_impl='auto'): the reference PyTorch routing, since the model is on cpu") == 1
    assert "reference routing, routing_impl=auto" in out


def test_graph_plan():
    """Where CUDA graphs apply (train.graph_plan): CUDA without FSDP, unless --cuda_graph=False; else why not."""
    assert train.graph_plan(True, "cuda:0", False)[0] is True
    for args, why in [((True, "cuda:0", True), "FSDP"), ((True, "cpu", False), "need CUDA"),
                      ((False, "cuda:0", False), "--cuda_graph=False")]:
        on, reason = train.graph_plan(*args)
        assert on is False and why in reason, reason


def strict_log(out_dir):
    """Every line of log.jsonl as strict JSON (a bare NaN or Infinity is an error)."""
    def refuse(name):
        raise ValueError(f"{name} in log.jsonl")
    return [json.loads(line, parse_constant=refuse) for line in open(os.path.join(out_dir, "log.jsonl"))]


def all_finite(path):
    ckpt = torch.load(path, weights_only=False)
    return all(torch.isfinite(t).all() for t in ckpt["model"].values() if t.is_floating_point())


@pytest.mark.parametrize("extra", [["--max_steps=20", "--eval_interval=1"],    # a save at every step
                                   ["--max_steps=2"]],                          # the last step's save
                         ids=["every-step", "last-step"])
def test_nonfinite_weights_are_never_saved(tmp_path, data_dir, extra):
    """--lr=1e6: the losses stay finite a step longer than the weights. The run stops with exit 2 before saving
    non-finite weights, says truly which checkpoint is intact, and its log stays strict JSON."""
    out = str(tmp_path / "nan")
    r = run_train(out, data_dir, "--lr=1e6", "--warmup_steps=1", *extra)
    assert r.returncode == 2, r.stdout + r.stderr
    assert re.search(r"non-finite (weights|loss|gradient norm|validation loss)", r.stdout), r.stdout
    ckpt = os.path.join(out, "ckpt.pt")
    kept = re.search(r"The last checkpoint, \S+ \(step (\d+)\), is intact", r.stdout)
    if kept:
        assert torch.load(ckpt, weights_only=False)["step"] == int(kept.group(1)) and all_finite(ckpt)
    else:
        assert "This run has saved no checkpoint" in r.stdout and not os.path.exists(ckpt)
    for path in (ckpt, ckpt.replace("ckpt.pt", "ckpt.prev.pt")):
        assert not os.path.exists(path) or all_finite(path)
    strict_log(out)


def test_ddp_two_processes_match_one(tmp_path, data_dir):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    r1, r2 = together(lambda: run_train(one, data_dir, "--max_steps=12", "--eval_interval=6"),
                      lambda: run_train(two, data_dir, "--max_steps=12", "--eval_interval=6", "--grad_sync=overlap", nproc=2))
    assert r1.returncode == 0 and r2.returncode == 0, r2.stdout + r2.stderr
    assert "2 processes x 1 micro-steps" in r2.stdout and "1 processes x 2 micro-steps" in r1.stdout
    assert "gradients: one process, nothing to average" in r1.stdout
    assert "gradients: DDP's bucketed all-reduce during the backward (--grad_sync=overlap is for graphed" in r2.stdout
    a, b = read_log(one), read_log(two)
    diff = max(abs(a[0][s]["loss"] - b[0][s]["loss"]) for s in a[0])
    assert sorted(a[0]) == sorted(b[0]) and diff < 1e-4, diff
    assert max(abs(a[1][s]["val_loss"] - b[1][s]["val_loss"]) for s in a[1]) < 1e-4


def test_fsdp_two_processes_match_one(tmp_path, data_dir):
    """FSDP2 (gloo, 2 CPU processes) follows the single-process curve of the same bf16-compute model."""
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    r1, r2 = together(lambda: run_train(one, data_dir, "--max_steps=6", "--eval_interval=3", "--fsdp=True", nproc=1),
                      lambda: run_train(two, data_dir, "--max_steps=6", "--eval_interval=3", "--fsdp=True", nproc=2))
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stdout + r2.stderr
    assert "FSDP2 mixed precision" in r2.stdout
    a, b = read_log(one), read_log(two)
    assert max(abs(a[0][s]["loss"] - b[0][s]["loss"]) for s in a[0]) < 2e-2   # bf16 compute, other reduction order
    assert a[0][6]["loss"] < a[0][1]["loss"]
    # a checkpoint saved under FSDP resumes (full state dicts on rank 0, broadcast back)
    r = run_train(two, data_dir, "--max_steps=8", "--eval_interval=3", "--fsdp=True", "--init_from=resume", nproc=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(read_log(two)[0]) == list(range(1, 9))


# =====================================================================================================================
# checkpoint.py: what a run keeps in out_dir (checkpoints, log, lock) and its stops
# =====================================================================================================================

def test_log_with_a_partial_last_line_resumes_and_plots(tmp_path, data_dir):
    """A log.jsonl whose last line was cut short (disk full, power loss): resume cuts it (one line says so), moves the
    records past the checkpoint aside, and eval.py --plot reads the log; a bad line mid-file is an error naming it."""
    out = str(tmp_path / "o")
    assert run_train(out, data_dir, "--max_steps=6", "--eval_interval=3").returncode == 0
    log = os.path.join(out, "log.jsonl")
    with open(log, "a") as f:   # the stopped run went past its checkpoint (step 7), then died mid-line
        f.write(json.dumps({"step": 7, "loss": 5.0, "lr": 1e-3, "dt_ms": 1.0, "tok_per_s": 1.0}) + '\n{"step": 8, "lo')
    evaluate.main(["--plot", log, f"--output={tmp_path / 'c.png'}"])   # the partial line is left out
    r = run_train(out, data_dir, "--max_steps=9", "--eval_interval=3", "--init_from=resume")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "removed a partial last line" in r.stdout and "1 records after step 6" in r.stdout
    steps, evals = read_log(out)
    assert sorted(steps) == list(range(1, 10)) and sorted(evals) == [0, 3, 6, 9]
    assert len([rec for rec in strict_log(out) if "loss" in rec]) == 9   # no step twice
    assert [json.loads(l)["step"] for l in open(glob.glob(os.path.join(out, "log.after-step6.*.jsonl"))[0])] == [7]
    with open(log, "r+") as f:
        lines = f.readlines()
        f.seek(0)
        f.writelines(lines[:2] + ["not json\n"] + lines[2:])
    with pytest.raises(ValueError, match=r"log.jsonl, line 3: not JSON"):
        checkpoint.read_log(log)
    r = run_train(out, data_dir, "--max_steps=10", "--eval_interval=3", "--init_from=resume")
    assert r.returncode != 0 and "log.jsonl, line 3: not JSON" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_resume_checks_its_data(tmp_path, data_dir):
    """A resume on other tokens of the same count is refused, naming what changed; the same data in a moved folder
    resumes (other inputs named in its meta.json: one line); a checkpoint older than the data identity resumes with
    one line saying the data went unchecked."""
    out = str(tmp_path / "run")
    assert run_train(out, data_dir, "--max_steps=2", "--eval_interval=2").returncode == 0
    moved = tmp_path / "moved"
    shutil.copytree(data_dir, moved)
    meta = json.loads((moved / "meta.json").read_text())
    (moved / "meta.json").write_text(json.dumps({**meta, "inputs": ["elsewhere/the_same_docs.jsonl"]}))
    r = run_train(out, str(moved), "--max_steps=3", "--eval_interval=3", "--init_from=resume")
    assert r.returncode == 0 and "names other inputs" in r.stdout and "with the same tokens: resuming" in r.stdout, r.stderr
    swapped = tmp_path / "swapped"
    shutil.copytree(data_dir, swapped)
    tokens = np.fromfile(swapped / "train.bin", dtype=np.uint16)
    tokens[::-1].tofile(swapped / "train.bin")   # another corpus of the same token count, prepared as such:
    meta["files"]["train.bin"] = {"bytes": tokens.nbytes, "sampled_sha256": prepare_data.sampled_sha256(str(swapped / "train.bin"))}
    (swapped / "meta.json").write_text(json.dumps(meta))
    r = run_train(out, str(swapped), "--max_steps=4", "--init_from=resume")
    assert r.returncode != 0 and "data train.bin: the same size but other tokens" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    del ckpt["data"]["identity"]   # as a checkpoint written before the identity existed
    torch.save(ckpt, os.path.join(out, "ckpt.pt"))
    r = run_train(out, data_dir, "--max_steps=4", "--eval_interval=4", "--init_from=resume")
    assert r.returncode == 0 and "records no identity of its data" in r.stdout, r.stdout + r.stderr


def test_one_run_per_out_dir(tmp_path, data_dir):
    """A second run into a live out_dir is refused (the first run's log and checkpoint untouched); after the first
    dies (kill -9 leaves its lock), the next run takes the stale lock over."""
    out = str(tmp_path / "o")
    first = run_train(out, data_dir, "--max_steps=100000", "--eval_interval=100000", wait=False)   # never saves
    lock = os.path.join(out, "train.lock")
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.exists(lock) and os.path.exists(os.path.join(out, "log.jsonl"))):
        time.sleep(0.05)
    try:
        second = run_train(out, data_dir, "--max_steps=2")
        assert second.returncode != 0 and f"is in use by a running train.py (pid {first.pid}" in second.stderr, second.stderr
        assert first.poll() is None and not glob.glob(os.path.join(out, "log.2*.jsonl"))   # its log was not moved
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert json.load(open(lock))["pid"] == first.pid   # left behind by the killed run
    r = run_train(out, data_dir, "--max_steps=2", "--eval_interval=2", "--init_from=scratch")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"taking over {lock} from pid {first.pid}" in r.stdout and not os.path.exists(lock)
    with open(lock, "w") as f:   # a lock that cannot be read (cut short, or not a run's): taken over, saying so
        f.write('{"pid": 12')
    os.utime(lock, (time.time() - 60, time.time() - 60))
    r = run_train(str(tmp_path / "o"), data_dir, "--max_steps=2", "--eval_interval=2", "--init_from=resume")
    assert r.returncode == 0 and f"taking over {lock}, which cannot be read" in r.stdout, r.stdout + r.stderr


def test_unreadable_checkpoint_falls_back_to_the_previous(tmp_path, data_dir):
    """Each save keeps the checkpoint before it (ckpt.prev.pt). A truncated ckpt.pt, or one with 64 KB of its tensor
    bytes changed: resume takes ckpt.prev.pt with one line and moves the file aside; sample.py, eval.py, export.py and
    --init_from name the file and the fix; a step-6 checkpoint of a longer run resumed from step 3 gives the same
    losses."""
    full, out = str(tmp_path / "full"), str(tmp_path / "o")
    assert all(r.returncode == 0 for r in together(
        lambda: run_train(full, data_dir, "--max_steps=9", "--eval_interval=3"),
        lambda: run_train(out, data_dir, "--max_steps=6", "--eval_interval=3", "--lr_decay_steps=60")))
    ckpt, prev = os.path.join(out, "ckpt.pt"), os.path.join(out, "ckpt.prev.pt")
    assert torch.load(ckpt, weights_only=False)["step"] == 6 and torch.load(prev, weights_only=False)["step"] == 3
    damaged = {}
    for how, fill in (("zeroed", bytes(65536)), ("noise", np.random.default_rng(0).bytes(65536))):
        damaged[how] = str(tmp_path / how)
        shutil.copytree(out, damaged[how])
        with open(os.path.join(damaged[how], "ckpt.pt"), "r+b") as f:   # 64 KB of tensor bytes, the size kept
            f.seek(os.path.getsize(ckpt) // 2)
            f.write(fill)
    with open(ckpt, "r+b") as f:
        f.truncate(os.path.getsize(ckpt) // 2)
    with pytest.raises(ValueError, match=r"ckpt.pt is not a torch.save archive .*try the checkpoint before it, .*ckpt.prev.pt"):
        GPT.from_checkpoint(out)
    s = subprocess.run([sys.executable, os.path.join(HERE, "sample.py"), f"--out_dir={out}", "--device=cpu"],
                       capture_output=True, text=True)
    assert s.returncode != 0 and "ckpt.pt is not a torch.save archive" in s.stderr and "Traceback" not in s.stderr
    r = run_train(out, data_dir, "--max_steps=9", "--eval_interval=3", "--init_from=resume")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resuming from the checkpoint before it" in r.stdout and glob.glob(ckpt + ".set-aside-*")
    a, b = read_log(full), read_log(out)
    assert all(a[0][s]["loss"] == b[0][s]["loss"] for s in range(1, 10))
    for bad in (ckpt, prev):   # neither readable: one clear error
        with open(bad, "wb") as f:
            f.write(b"not a checkpoint")
    r = run_train(out, data_dir, "--max_steps=12", "--eval_interval=3", "--init_from=resume")
    assert r.returncode != 0 and "no checkpoint can be read" in r.stderr and "Traceback" not in r.stderr
    # damaged in place, the size kept: checked by content (zip CRC-32s), never called intact; a zeroed one resumes
    # from ckpt.prev.pt to the same losses, and every reader refuses it in one line
    r = run_train(damaged["zeroed"], data_dir, "--max_steps=9", "--eval_interval=3", "--init_from=resume")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"ckpt.pt is damaged: 1 of its \d+ records fail their CRC check .*resuming from the checkpoint "
                     r"before it, \S+ckpt.prev.pt \(step 3, checked\)", r.stdout), r.stdout
    assert glob.glob(os.path.join(damaged["zeroed"], "ckpt.pt.set-aside-*"))
    c = read_log(damaged["zeroed"])
    assert all(a[0][s]["loss"] == c[0][s]["loss"] for s in range(1, 10))
    noisy = os.path.join(damaged["noise"], "ckpt.pt")
    with pytest.raises(ValueError, match=r"ckpt.pt is damaged: .*try the checkpoint before it"):
        GPT.from_checkpoint(noisy)
    s = subprocess.run([sys.executable, os.path.join(HERE, "sample.py"), f"--out_dir={noisy}", "--device=cpu"],
                       capture_output=True, text=True)
    assert s.returncode == 1 and "ckpt.pt is damaged" in s.stderr and "Traceback" not in s.stderr, s.stderr
    for refuse in (lambda: evaluate.main([f"--out_dir={noisy}", "--device=cpu"]),
                   lambda: export.main([f"--out_dir={noisy}", f"--hf_dir={tmp_path / 'hf'}"])):
        with pytest.raises(SystemExit, match=r"ckpt.pt is damaged"):
            refuse()
    r = run_train(str(tmp_path / "from_noisy"), data_dir, "--max_steps=1", f"--init_from={noisy}")
    assert r.returncode != 0 and "ckpt.pt is damaged" in r.stderr and "Traceback" not in r.stderr


def test_save_failure_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A write error mid-save (here: the disk fills) removes the partial file, leaves ckpt.pt and ckpt.prev.pt as they
    were and says so in one line."""
    cfg = train.parse_args(["--device=cpu"])
    rt = train.setup_runtime(cfg)
    model = GPT(tiny_cfg())
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    path, extra = str(tmp_path / "ckpt.pt"), {"model_config": vars(model.cfg)}   # (train.py's extra has more)
    for step in (1, 2):
        checkpoint.save_checkpoint(path, model, opt, None, step, extra, cfg, rt)
    real_save = torch.save

    def full_disk(obj, f):
        real_save({"half": torch.zeros(1000)}, f)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(checkpoint.CheckpointWriteError) as e:
        checkpoint.save_checkpoint(path, model, opt, None, 3, extra, cfg, rt)
    assert "saving the step-3 checkpoint failed: no space left on the device of" in str(e.value)
    assert f"Intact: {path} (step 2), {tmp_path / 'ckpt.prev.pt'} (step 1)" in str(e.value)
    assert not os.path.exists(path + ".tmp")
    assert torch.load(path, weights_only=False)["step"] == 2
    # a file-size limit (ulimit -f: EFBIG), a read-only folder (EROFS): each error says what happened, and the free
    # space only where it is the cause
    for code, cause, advice in ((errno.EFBIG, "outgrew this process's file-size limit", "Raise it (ulimit -f unlimited)"),
                                (errno.EROFS, "is on a read-only file system", "Choose another --out_dir")):
        def failing(obj, f, code=code):
            real_save({"half": torch.zeros(1000)}, f)
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(torch, "save", failing)
        with pytest.raises(checkpoint.CheckpointWriteError) as e:
            checkpoint.save_checkpoint(path, model, opt, None, 3, extra, cfg, rt)
        assert cause in str(e.value) and advice in str(e.value) and "GB free" not in str(e.value), str(e.value)
        assert not os.path.exists(path + ".tmp") and torch.load(path, weights_only=False)["step"] == 2


def test_sigterm_saves_and_the_resumed_run_matches(tmp_path, data_dir):
    """SIGTERM (a cluster's preemption) mid-run: the current step finishes, a checkpoint is saved, exit 143; resuming
    from it gives the uninterrupted run's losses and evals exactly."""
    full, stopped = str(tmp_path / "full"), str(tmp_path / "stopped")

    def stop_mid_run():
        proc = run_train(stopped, data_dir, "--max_steps=24", "--eval_interval=12", wait=False)
        return proc, kill_when_logged(proc, os.path.join(stopped, "log.jsonl"), 14, signal.SIGTERM)

    r, (proc, out) = together(lambda: run_train(full, data_dir, "--max_steps=24", "--eval_interval=12"), stop_mid_run)
    assert r.returncode == 0, r.stdout + r.stderr
    assert proc.returncode == 143, out
    at = int(re.search(r"stopped by SIGTERM at step (\d+)", out).group(1))
    assert 14 <= at < 24 and torch.load(os.path.join(stopped, "ckpt.pt"), weights_only=False)["step"] == at
    r = run_train(stopped, data_dir, "--max_steps=24", "--eval_interval=12", "--init_from=resume")
    assert r.returncode == 0, r.stdout + r.stderr
    a, b = read_log(full), read_log(stopped)
    assert sorted(a[0]) == sorted(b[0]) and all(a[0][s]["loss"] == b[0][s]["loss"] for s in a[0])
    assert all(a[1][s]["val_loss"] == b[1][s]["val_loss"] for s in a[1])
    r = run_train(stopped, data_dir, "--max_steps=24", "--eval_interval=12", "--init_from=resume")   # nothing left
    assert r.returncode == 0 and "nothing to train" in r.stdout


# =====================================================================================================================
# graphs.py: CUDA graphs (training and decode steps) and the gradient average
# =====================================================================================================================

OVERLAP_WORKER = """
import sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import graphs
from model import GPT, GPTConfig
dist.init_process_group("gloo")
rank, residual, bucket_mb = dist.get_rank(), sys.argv[2], float(sys.argv[3])
torch.manual_seed(0)
cfg = GPTConfig(vocab_size=96, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, ffn_hidden=64, block_size=16, residual=residual)
models = [GPT(cfg), GPT(cfg)]
models[1].load_state_dict(models[0].state_dict())
for m in models:
    m.checkpoint_sublayers = sys.argv[5] == "True"   # recomputed sublayers: each gradient still completes once
ref_params, params = ([p for p in m.parameters() if p.requires_grad] for m in models)
sync = graphs.OverlappedGradSync(params, bucket_mb)
for step in range(3):   # the first step records the order, the others run the buckets
    batches = [torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(100 * step + 10 * rank + k))
               for k in range(2)]   # another batch on each process
    for p in ref_params:
        p.grad = None
    for b in batches:   # the reference: accumulate, then one all-reduce after
        (models[0](b[:, :-1], b[:, 1:])[1] / 2).backward()
    graphs.sync_grads(ref_params, 2)
    sync.zero_grad()
    for k, b in enumerate(batches):
        sync.begin(last=k == 1)
        (models[1](b[:, :-1], b[:, 1:])[1] / 2).backward()
        launched = sync.next   # buckets whose all-reduce the backward's hooks started
        sync.finish()
    diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(ref_params, params))
    views = all(p.grad.untyped_storage().data_ptr() == sync.flat.untyped_storage().data_ptr() for p in params)
    with open(f"{sys.argv[4]}/rank{rank}.txt", "a") as f:
        f.write(f"step {step} diff {diff:.3g} buckets {len(sync.buckets)} launched {launched} views {views}\\n")
dist.destroy_process_group()
"""


@pytest.mark.parametrize("residual,bucket_mb,checkpointing", [("mhar", 0.01, False), ("baseline", 25.0, False),
                                                              ("mhar", 0.01, True)])
def test_overlapped_grad_sync_matches_one_all_reduce(tmp_path, residual, bucket_mb, checkpointing):
    """--grad_sync=overlap's reducer (2 CPU processes, gloo; eager, where the graphed step captures the same hooks):
    the gradients averaged bucket by bucket during the backward equal graphs.sync_grads' one all-reduce after it, every
    bucket was launched by the backward's hooks, and every .grad is a view into the one buffer; also with many
    buckets and with recomputed (checkpointed) sublayers."""
    worker = tmp_path / "worker.py"
    worker.write_text(OVERLAP_WORKER)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker),
                        HERE, residual, str(bucket_mb), str(tmp_path), str(checkpointing)], capture_output=True,
                       text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = re.findall(r"step (\d) diff (\S+) buckets (\d+) launched (\d+) views (\w+)",
                       (tmp_path / "rank0.txt").read_text() + (tmp_path / "rank1.txt").read_text())
    assert len(lines) == 6, lines
    for step, diff, buckets, launched, views in lines:   # step 0's first microbatch recorded the order
        assert float(diff) <= 1e-7 and views == "True" and launched == buckets and (int(buckets) > 5) == (bucket_mb < 1)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device (run on a GPU machine)")
@pytest.mark.parametrize("residual,kw", [("baseline", {}), ("hyper", {}), ("attnres", dict(routing_impl="fused")),
                                         ("mhar", dict(routing_impl="fused")), ("mhar", dict(routing_impl="reference"))])
def test_cuda_graph_microstep_matches_eager(residual, kw):
    """4 optimizer steps of 2 accumulated microbatches: losses and final weights of the graphed and the eager
    step agree (same kernels; the graphs only remove the host launches). The first microbatch's graph must
    overwrite the gradients of the previous step, the second's add to them."""
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    runs = []
    for graphed in (False, True):
        torch.manual_seed(0)
        m = GPT(tiny_cfg(residual=residual, **kw)).cuda()
        randomize_routing(m)
        opt = m.configure_optimizers(0.1, 1e-3, (0.9, 0.95), fused=True)
        micro = graphs.GraphedMicrostep(m, autocast, loss_scale=0.5) if graphed else None
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(4):
            for k in range(2):
                x = torch.randint(0, 96, (2, 33), generator=gen).cuda()
                if micro is not None:
                    loss = micro(x[:, :-1], x[:, 1:], first=k == 0)
                else:
                    with autocast:
                        _, loss = m(x[:, :-1], x[:, 1:])
                    (loss * 0.5).backward()
                losses.append(loss.item())
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            if micro is None:   # the graphs' first microbatch overwrites the gradients
                opt.zero_grad(set_to_none=True)
        runs.append((losses, [p.detach().float().clone() for p in m.parameters()]))
    (eager, w_eager), (graph, w_graph) = runs
    assert np.allclose(eager, graph, rtol=1e-4, atol=1e-4), (eager, graph)
    assert len(set(round(l, 4) for l in eager)) > 1   # the steps changed the model
    for a, b in zip(w_graph, w_eager):
        assert rel_err(a, b) < 1e-4


CAPTURE_FAILURE_WORKER = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
import graphs
from model import GPT, GPTConfig
m = GPT(GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=48, ffn_hidden=64,
                  residual="baseline", routing_impl="reference")).cuda()
forward = m.forward
m.forward = lambda *a, **k: (forward(*a, **k)[0], forward(*a, **k)[1] + 0 * float(m.wte.weight[0, 0].item()))
micro = graphs.GraphedMicrostep(m, torch.autocast("cuda", dtype=torch.bfloat16), warmup=1)
x = torch.randint(0, 96, (2, 16), device="cuda")
try:
    micro(x, x)
    print("captured")
except graphs.GraphCaptureError as e:
    print("error:", e)
print("grads unset:", all(p.grad is None for p in m.parameters()))
_, loss = m(x, x)   # eager work goes on
loss.backward()
print("eager loss finite:", bool(torch.isfinite(loss)))
"""


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device (run on a GPU machine)")
def test_cuda_graph_capture_failure_is_reported_and_undone():
    """A model that cannot be captured (here: a host sync in forward) raises GraphCaptureError, with the
    gradients as before the attempt, so that train.py can run the microbatch eagerly and say why. In a process of its
    own: after a failed capture torch's CUDA random generator stays in capture state (torch 2.11), and a later CUDA
    random draw in the same process fails ("Offset increment outside graph capture")."""
    r = subprocess.run([sys.executable, "-c", CAPTURE_FAILURE_WORKER, HERE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "error: capturing the graph of the first microbatch failed" in r.stdout, r.stdout + r.stderr
    assert "grads unset: True" in r.stdout and "eager loss finite: True" in r.stdout, r.stdout


OVERLAP_GRAPH_WORKER = """
import sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import graphs
from model import GPT, GPTConfig
torch.cuda.set_device(0)
dist.init_process_group("nccl", device_id=torch.device("cuda:0"))
dist.barrier()
autocast = torch.autocast("cuda", dtype=torch.bfloat16)
runs = []
for overlap in (False, True):
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=96, n_layer=2, n_head=2, n_kv_head=1, n_embd=64, ffn_hidden=128, block_size=32,
                      residual="mhar", routing_impl="fused")).cuda()
    params = [p for p in m.parameters() if p.requires_grad]
    opt = m.configure_optimizers(0.1, 1e-3, (0.9, 0.95), fused=True)
    sync = graphs.OverlappedGradSync(params, bucket_mb=0.01) if overlap else None
    micro = graphs.GraphedMicrostep(m, autocast, loss_scale=0.5, grad_sync=sync)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        for k in range(2):
            x = torch.randint(0, 96, (2, 33), generator=gen).cuda()
            losses.append(micro(x[:, :-1], x[:, 1:], first=k == 0, last=k == 1).item())
        if sync is None:
            graphs.sync_grads(params, 1)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
    runs.append((losses, [p.detach().float().clone() for p in m.parameters()]))
    if overlap:
        print("graphs", sorted(micro.graphs), "buckets", len(sync.buckets), "launched", sync.next,
              "views", all(p.grad.untyped_storage().data_ptr() == sync.flat.untyped_storage().data_ptr() for p in params))
(a, wa), (b, wb) = runs
print("loss diff", max(abs(x - y) for x, y in zip(a, b)), "weight diff", max((x - y).abs().max().item() for x, y in zip(wa, wb)),
      "trained", len(set(round(l, 4) for l in a)) > 1)
dist.destroy_process_group()
"""


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device (run on a GPU machine)")
def test_overlapped_grad_sync_in_cuda_graphs(tmp_path):
    """--grad_sync=overlap's capture on one GPU (a process group of one, NCCL): the buckets' async all-reduces and
    their waits are captured inside the last microbatch's graph (the hooks run from autograd's thread), the first
    microbatch's graph zeroes the buffer, and 4 steps of 2 microbatches give the losses and weights of the graphed
    step without it. The averaging over several processes is the gloo test's (and the 2-GPU test's)."""
    worker = tmp_path / "worker.py"
    worker.write_text(OVERLAP_GRAPH_WORKER)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(worker),
                        HERE], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"graphs \[\(False, True\), \(True, False\)\] buckets (\d+) launched (\d+) views True", r.stdout)
    assert m and int(m.group(1)) > 5 and m.group(1) == m.group(2), r.stdout
    m = re.search(r"loss diff (\S+) weight diff (\S+) trained True", r.stdout)
    assert m and float(m.group(1)) < 1e-4 and float(m.group(2)) < 1e-4, r.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (run on a several-GPU machine)")
def test_ddp_cuda_graph_matches_ddp(tmp_path, data_dir):
    """Under torchrun the graphed step runs without the DDP wrapper and averages the gradients after the graphs
    (train.py sync_grads), or with --grad_sync=overlap inside the last microbatch's graph: 2 processes with graphs,
    either way, follow 2 processes with DDP (fp32, 2 micro-steps each)."""
    gpu = ["--device=cuda", "--dtype=float32", "--routing_impl=fused", "--batch_tokens=1024", "--max_steps=8",
           "--eval_interval=4"]
    runs = {}
    for name, flags in (("ddp", ["--cuda_graph=False"]), ("after", []), ("overlap", ["--grad_sync=overlap", "--grad_bucket_mb=0.05"])):
        out = str(tmp_path / name)
        r = run_train(out, data_dir, *gpu, *flags, nproc=2)
        assert r.returncode == 0 and "2 processes x 2 micro-steps" in r.stdout, r.stdout + r.stderr
        assert "CUDA graphs off" not in r.stdout, r.stdout   # no fallback to eager steps
        runs[name] = read_log(out)
    assert "bucketed all-reduces (0.05 MB) in the last microbatch's graph" in r.stdout
    (a, a_eval) = runs["ddp"]
    for b, b_eval in (runs["after"], runs["overlap"]):
        assert max(abs(a[s]["loss"] - b[s]["loss"]) for s in a) < 1e-3
        assert max(abs(a_eval[s]["val_loss"] - b_eval[s]["val_loss"]) for s in a_eval) < 1e-3
    # the same sums in another order of launches: within the kernels' run-to-run noise
    assert max(abs(runs["after"][0][s]["loss"] - runs["overlap"][0][s]["loss"]) for s in a) < 1e-4
    assert a[8]["loss"] < a[1]["loss"]   # the runs trained


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA (the step itself is tested above)")
@pytest.mark.parametrize("residual", ["baseline", "mhar", "delta"])
def test_decode_graph_replays_the_eager_steps(residual):
    """generate's CUDA-graphed decode gives the eager cached decode's greedy tokens (fp32, B = 2, fused routing), also
    after the cache restarts past block_size, and its captured logits are the eager step's."""
    torch.manual_seed(0)
    m = GPT(tiny_cfg(residual=residual, routing_impl="auto", num_blocks=2,
                     **({"route_heads": 2} if residual == "delta" else {}))).cuda().eval()
    randomize_routing(m)
    with torch.no_grad():
        for site in m.routing_sites():
            if hasattr(site, "alpha"):
                site.alpha.fill_(0.7)
        prompt = torch.randint(0, 96, (2, 7), device="cuda")
        eager = m.generate(prompt, 40, temperature=0, cuda_graph=False)   # block_size 32: restarts once
        assert torch.equal(m.generate(prompt, 40, temperature=0, cuda_graph=True), eager)
        cache = KVCache(m, 2)
        m(prompt, cache=cache)
        step = DecodeGraph.capture(m, cache, prompt[:, -1:])
        assert step and cache.pos == 7
        graphed = step(eager[:, 7:8]).clone()
        cache.pos = 7
        torch.testing.assert_close(graphed, DecodeGraph(m, cache, eager[:, 7:8])(eager[:, 7:8]), rtol=1e-5, atol=1e-5)


# =====================================================================================================================
# convert.py and delta mode: tiny checkpoints in Hugging Face layout, written here
# =====================================================================================================================

HF_CONFIGS = {
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=300, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1e6,
                  tie_word_embeddings=True, hidden_act="silu", attention_bias=False, torch_dtype="float32"),
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=259, hidden_size=64,
                  intermediate_size=112, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                  max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=5e5, tie_word_embeddings=False,
                  rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 32, "rope_type": "llama3"},
                  hidden_act="silu", attention_bias=False, mlp_bias=False, torch_dtype="float32"),
}


def write_hf_checkpoint(path, hf_config, seed=0, shards=2, rope_parameters=False):
    """Random weights in Hugging Face layout (config.json, sharded safetensors, index); returns the same
    weights as a model.py baseline, the reference for the conversion."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    cfg = convert.model_config(hf_config, num_blocks=1)
    torch.manual_seed(seed)
    base = GPT(GPTConfig.from_dict({**cfg.__dict__, "residual": "baseline"}))
    with torch.no_grad():   # norms away from 1 so a mis-mapped norm shows
        for name, p in base.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    hf_name = {}
    for hf, ours in convert.NAMES.items():
        for i in range(cfg.n_layer):
            hf_name[ours.format(i=i)] = hf.format(i=i)
    tensors = {hf_name[k]: v.contiguous() for k, v in base.state_dict().items()
               if not (k == "lm_head.weight" and cfg.tie_embeddings)}
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, os.path.join(path, fname))
        weight_map.update({n: fname for n in part})
    json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(path, "model.safetensors.index.json"), "w"))
    hf_config = dict(hf_config)
    if rope_parameters:   # the layout recent transformers versions write
        hf_config["rope_parameters"] = {"rope_theta": hf_config.pop("rope_theta"), **(hf_config.pop("rope_scaling", None) or {"rope_type": "default"})}
    json.dump(hf_config, open(os.path.join(path, "config.json"), "w"))
    return base


def write_tiny_tokenizer(path):
    """A byte-level BPE tokenizer.json with <|end_of_text|> (Llama 3's end-of-text name), 257 tokens."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=257, special_tokens=["<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world"], trainer)
    tok.save(path)
    return path


def corpus_gpt2(tmp_path, corpus):
    d = str(tmp_path / "gpt2data")
    prepare_data.prepare(input=corpus, out_dir=d, val_fraction=0.05, max_tokens=20000, workers=1)
    return d


@pytest.mark.parametrize("arch,rope_parameters", [("qwen3", False), ("llama", False), ("llama", True)])
def test_convert_is_bitwise_identity(tmp_path, arch, rope_parameters, capsys):
    hf_dir, out = str(tmp_path / "hf"), str(tmp_path / "out")
    base = write_hf_checkpoint(hf_dir, HF_CONFIGS[arch], rope_parameters=rope_parameters)
    convert.main([f"--hf_dir={hf_dir}", f"--out_dir={out}", "--dtype=float32", "--route_heads=4", "--num_blocks=2",
                  "--tokenizer=gpt2"])
    assert "identity check: 3 random batches" in capsys.readouterr().out
    model = GPT.from_checkpoint(out)
    assert model.cfg.residual == "delta" and model.cfg.qk_norm == (arch == "qwen3") and model.cfg.heads == 4
    assert model.cfg.tie_embeddings == (arch == "qwen3") and model.cfg.vocab_size == HF_CONFIGS[arch]["vocab_size"]
    assert (model.cfg.rope_scaling is not None) == (arch == "llama")
    idx = torch.randint(0, model.cfg.vocab_size, (2, 40))
    with torch.no_grad():
        assert torch.equal(model(idx)[0], base(idx)[0])   # fp32, alpha = 0: the pretrained function, bitwise
    n_new = sum(p.numel() for n, p in model.named_parameters() if n.startswith("routes."))
    assert n_new == 2 * 4 * (3 * 64 + 1)                   # per site: q, g, null (d each) and alpha


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_converted_model_matches_transformers(tmp_path, arch):
    transformers = pytest.importorskip("transformers", reason="optional: pip install transformers to compare with it")
    hf_dir = str(tmp_path / "hf")
    base = write_hf_checkpoint(hf_dir, HF_CONFIGS[arch])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    idx = torch.randint(0, HF_CONFIGS[arch]["vocab_size"], (2, 50))
    with torch.no_grad():
        ours, theirs = base(idx)[0], hf_model(idx).logits
    assert rel_err(ours.double(), theirs.double()) < 1e-4


def test_delta_routing_is_live_and_learns(tmp_path):
    hf_dir, out = str(tmp_path / "hf"), str(tmp_path / "out")
    base = write_hf_checkpoint(hf_dir, HF_CONFIGS["llama"])
    convert.main([f"--hf_dir={hf_dir}", f"--out_dir={out}", "--dtype=float32", "--num_blocks=4", "--route_heads=2",
                  "--check_batches=1", f"--tokenizer={write_tiny_tokenizer(str(tmp_path / 'tok.json'))}"])
    model = GPT.from_checkpoint(out)
    idx = torch.randint(0, 259, (2, 24))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for site in model.routing_sites():
            site.alpha.fill_(0.5)
            site.q.copy_(torch.randn(site.q.shape, generator=gen))
            site.null.copy_(0.1 * torch.randn(site.null.shape, generator=gen))
    logits, loss = model(idx, idx)
    assert not torch.allclose(logits, base(idx)[0])
    loss.backward()
    for k, site in enumerate(model.routing_sites()):
        for name in ("q", "g", "null", "alpha"):
            grad = getattr(site, name).grad
            assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, (k, name)
    # the routing sees null + embedding + the completed blocks only: sites of block b mix b + 2 sources
    _, _, routing = model(idx, return_routing=True)
    assert [a.shape[0] for a in routing] == [2, 2, 3, 3, 4, 4, 5, 5]
    # sampling decodes with the converted model's tokenizer.json, copied beside the checkpoint
    s = subprocess.run([sys.executable, os.path.join(HERE, "sample.py"), f"--out_dir={out}", "--device=cpu",
                        "--max_new_tokens=4", "--start=hello"], capture_output=True, text=True)
    assert s.returncode == 0 and s.stdout.startswith("hello"), s.stderr


def test_convert_bad_inputs_write_nothing(tmp_path):
    hf_dir = str(tmp_path / "hf")
    write_hf_checkpoint(hf_dir, HF_CONFIGS["qwen3"], shards=2)

    def fails(match, **config_changes):
        d = str(tmp_path / f"case{len(os.listdir(tmp_path))}")
        shutil.copytree(hf_dir, d)
        if config_changes:
            cfg = json.load(open(os.path.join(d, "config.json")))
            cfg.update(config_changes)
            json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
        return d, match

    cases = [fails("not supported: convert.py reads", architectures=["MistralForCausalLM"]),
             fails(r"n_head=4 must be divisible by n_kv_head=3", num_key_value_heads=3),
             fails(r"rope scaling 'yarn' is not supported", rope_scaling={"rope_type": "yarn", "factor": 4.0}),
             fails(r"attention_bias=true is not supported", attention_bias=True)]
    missing = str(tmp_path / "missing_shard")
    shutil.copytree(hf_dir, missing)
    os.remove(os.path.join(missing, "model-00002-of-00002.safetensors"))
    cases.append((missing, r"missing from .*model-00002-of-00002.safetensors"))

    def convert_into(d):
        return subprocess.run([sys.executable, os.path.join(HERE, "convert.py"), f"--hf_dir={d}",
                               f"--out_dir={os.path.join(d, 'out')}", "--num_blocks=2"], capture_output=True, text=True)
    results = together(*[lambda d=d: convert_into(d) for d, _ in cases], cores_each=1)
    for (d, match), r in zip(cases, results):
        assert r.returncode != 0 and re.search(match, r.stderr), (match, r.stderr)
        assert not os.path.exists(os.path.join(d, "out")), "a failed conversion wrote something"
    hf = json.load(open(os.path.join(hf_dir, "config.json")))
    for config, match in (({k: v for k, v in hf.items() if k != "num_attention_heads"}, r"config.json lacks "
                           r"num_attention_heads \(or gives a non-integer\)"),
                          ({**hf, "hidden_size": "64"}, r"config.json lacks hidden_size"),
                          ([hf], r"config.json holds a list, not a Hugging Face config")):
        with pytest.raises(ValueError, match=match):
            convert.model_config(config)
    bare = {**hf, "architectures": "Qwen3ForCausalLM"}   # a bare name, not a list
    assert convert.model_config(bare, num_blocks=2) == convert.model_config(hf, num_blocks=2)
    before = sorted(os.listdir(hf_dir))
    with pytest.raises(SystemExit, match=r"--out_dir=\S+ is --hf_dir: write the converted model to a folder of its own"):
        convert.main([f"--hf_dir={hf_dir}", f"--out_dir={hf_dir}/", "--num_blocks=2"])
    assert sorted(os.listdir(hf_dir)) == before


def test_convert_names_a_truncated_or_corrupt_file(tmp_path):
    """A shard cut short, a shard of garbage, a config.json that is not JSON: one line naming the file, nothing written."""
    hf_dir = str(tmp_path / "hf")
    write_hf_checkpoint(hf_dir, HF_CONFIGS["qwen3"], shards=2)
    shard = "model-00001-of-00002.safetensors"
    cases = []
    for name, edit, match in (
            ("cut", lambda d: os.truncate(os.path.join(d, shard), os.path.getsize(os.path.join(d, shard)) // 2),
             rf"{shard}.*(is not a readable safetensors file|cannot be read).*Download it again"),
            ("garbage", lambda d: open(os.path.join(d, shard), "wb").write(b"\x00" * 100),
             rf"{shard} is not a readable safetensors file"),
            ("config", lambda d: open(os.path.join(d, "config.json"), "w").write('{"architectures": ['),
             r"config.json is not JSON")):
        d = str(tmp_path / name)
        shutil.copytree(hf_dir, d)
        edit(d)
        cases.append((d, match))
    cases.append((str(tmp_path / "nothing_here"), r"--hf_dir=.*nothing_here: no such folder"))
    for d, match in cases:
        out = os.path.join(d, "out")
        with pytest.raises(SystemExit) as e:
            convert.main([f"--hf_dir={d}", f"--out_dir={out}", "--num_blocks=2"])
        assert re.search(match, str(e.value)), (match, e.value)
        assert not os.path.exists(out)
    with pytest.raises(SystemExit, match=r"--num_blocks=0 must be >= 1"):
        convert.main([f"--hf_dir={hf_dir}", f"--out_dir={tmp_path / 'o'}", "--num_blocks=0"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match=r"--device=cuda but CUDA is not available; use --device=cpu"):
            convert.main([f"--hf_dir={hf_dir}", f"--out_dir={tmp_path / 'o'}", "--num_blocks=2", "--device=cuda"])


def test_train_from_converted_checkpoint(tmp_path, corpus):
    hf_dir, conv = str(tmp_path / "hf"), str(tmp_path / "conv")
    write_hf_checkpoint(hf_dir, HF_CONFIGS["llama"])
    tok = write_tiny_tokenizer(os.path.join(hf_dir, "tokenizer.json"))
    convert.main([f"--hf_dir={hf_dir}", f"--out_dir={conv}", "--num_blocks=2", "--check_batches=1"])   # bf16 weights
    data = str(tmp_path / "data")
    prepare_data.prepare(input=corpus, out_dir=data, tokenizer=tok, val_fraction=0.05, max_tokens=60000, workers=1)
    out = str(tmp_path / "midtrain")
    args = ["--block_size=64", "--batch_tokens=512", "--micro_batch=4", "--lr=4e-4", "--warmup_steps=2", "--lr_decay_steps=10",
            "--lr_schedule=linear", "--min_lr_ratio=0.01", "--weight_decay=0.05", "--decay_all=False",
            "--z_loss=1e-4", "--ema_decay=0.9", "--routing_lr_scale=10", "--eval_tokens=2048", "--device=cpu",
            "--compile=False"]
    cmd = [sys.executable, os.path.join(HERE, "train.py"), f"--data_dir={data}", f"--out_dir={out}", f"--init_from={conv}", *args]
    gpt2_data = corpus_gpt2(tmp_path, corpus)

    def run(*argv):
        return subprocess.run(list(argv), capture_output=True, text=True, env=launch_env())
    r, bf16, gpt2, arch = together(   # the runs from the converted model, side by side
        lambda: run(*cmd, "--max_steps=4", "--eval_interval=2"),
        # the single-GPU 8B setting of BENCHMARKS.md: bf16 weights and AdamW states, no checkpoint written
        lambda: run(*cmd[:3], f"--out_dir={out}_bf16", f"--init_from={conv}", *args, "--max_steps=2",
                    "--param_dtype=bfloat16", "--ema_decay=0", "--save=False"),
        # a gpt2-tokenized data folder is refused
        lambda: run(sys.executable, os.path.join(HERE, "train.py"), f"--data_dir={gpt2_data}", f"--out_dir={out}2",
                    f"--init_from={conv}", *args, "--max_steps=1"),
        # architecture options a converted model would ignore are refused (here when starting; below when resuming)
        lambda: run(*cmd[:3], f"--out_dir={out}_arch", f"--init_from={conv}", *args, "--max_steps=8", "--n_layer=5"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "residual=delta" in r.stdout and "from " + os.path.join(conv, "ckpt.pt") in r.stdout
    assert '"n_layer"' not in r.stdout.split("config: ")[1].split("\n")[0]   # the ignored defaults are not shown
    assert 'architecture (from the checkpoint): {"vocab_size": 259' in r.stdout
    steps, evals = read_log(out)
    assert sorted(steps) == [1, 2, 3, 4] and all("val_loss_ema" in e for e in evals.values())
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert ckpt["ema"] is not None and ckpt["model_source"].endswith("ckpt.pt")
    groups = ckpt["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0, 0.0] and groups[2]["lr_scale"] == 10
    assert abs(groups[2]["lr"] - 10 * groups[0]["lr"]) < 1e-12
    assert bf16.returncode == 0, bf16.stdout + bf16.stderr
    assert "compute bfloat16 (the weights' dtype" in bf16.stdout
    assert not os.path.exists(os.path.join(f"{out}_bf16", "ckpt.pt")) and sorted(read_log(f"{out}_bf16")[0]) == [1, 2]
    assert gpt2.returncode != 0 and "tokenized with 'gpt2'" in gpt2.stderr
    # resume continues it
    r = run(*cmd[:4], "--init_from=resume", *args, "--max_steps=6", "--eval_interval=2")
    assert r.returncode == 0, r.stdout + r.stderr
    resumed = run(*cmd[:3], f"--out_dir={out}", "--init_from=resume", *args, "--max_steps=8", "--n_layer=5")
    for r in (arch, resumed):
        assert r.returncode != 0 and "would be ignored: --n_layer=5 (checkpoint: 4)" in r.stderr, r.stderr
    # the run keeps its tokenizer.json: the converted model's folder moved away, sample.py still reads it
    assert ckpt["tokenizer"] == "tokenizer.json" and filecmp.cmp(tok, os.path.join(out, "tokenizer.json"), shallow=False)
    os.rename(hf_dir, hf_dir + "_moved")
    s = run(sys.executable, os.path.join(HERE, "sample.py"), f"--out_dir={out}", "--device=cpu", "--max_new_tokens=3")
    assert s.returncode == 0 and "tokenizer: tokenizer.json" in s.stderr, s.stderr
    # a converted model's folder is a start, not a run to continue: the refusals name the command that works
    into_conv = [run(*cmd[:3], f"--out_dir={conv}", *args, "--max_steps=2", *how) for how in (["--init_from=resume"], [])]
    for r in into_conv:
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "is a converted model" in r.stderr and f"--init_from={conv} --out_dir=<a new folder>" in r.stderr


def test_checkpoint_without_tokenizer_is_refused(tmp_path):
    """A converted model whose folder holds no tokenizer (vocab 259, not GPT-2's) is never read through GPT-2:
    eval.py and sample.py refuse with the fix; --tokenizer= works and is recorded."""
    hf_dir, conv = str(tmp_path / "hf"), str(tmp_path / "conv")
    write_hf_checkpoint(hf_dir, HF_CONFIGS["llama"])
    tok = write_tiny_tokenizer(str(tmp_path / "tokenizer.json"))   # beside the model folder, not in it
    convert.main([f"--hf_dir={hf_dir}", f"--out_dir={conv}", "--num_blocks=2", "--check_batches=1"])
    sample = [sys.executable, os.path.join(HERE, "sample.py"), f"--out_dir={conv}", "--device=cpu", "--max_new_tokens=3"]
    r, named = together(lambda: subprocess.run(sample, capture_output=True, text=True),
                        lambda: subprocess.run(sample + [f"--tokenizer={tok}", "--start=a"], capture_output=True, text=True),
                        cores_each=1)
    assert r.returncode != 0 and "records no tokenizer and its vocabulary (259) is not GPT-2's" in r.stderr, r.stderr
    with pytest.raises(SystemExit, match=r"pass --tokenizer="):
        evaluate.main([f"--out_dir={conv}", "--device=cpu", "--tasks=lambada", f"--data_root={tmp_path}"])   # (refused first)
    assert named.returncode == 0 and f"tokenizer: {tok}" in named.stderr, named.stderr
    with pytest.raises(ValueError, match=r"has 100277 tokens, more than the model's vocabulary \(259\)"):
        evaluate.load_model(conv, "cpu", tokenizer="cl100k_base")


def test_fsdp_delta_saves_and_resumes(tmp_path, corpus):
    """The 8B mid-training path at toy size: a converted delta model under FSDP2 (2 CPU processes, gloo) with
    per-sublayer activation checkpointing saves and resumes, then resumes again in one process without FSDP. FSDP2
    shards no 0-dim parameters, so the delta gate is shape (1,)."""
    hf_dir, conv, data, out = (str(tmp_path / n) for n in ("hf", "conv", "data", "run"))
    write_hf_checkpoint(hf_dir, HF_CONFIGS["llama"])
    tok = write_tiny_tokenizer(os.path.join(hf_dir, "tokenizer.json"))
    convert.main([f"--hf_dir={hf_dir}", f"--out_dir={conv}", "--num_blocks=2", "--route_heads=4", "--check_batches=1"])
    prepare_data.prepare(input=corpus, out_dir=data, tokenizer=tok, val_fraction=0.05, max_tokens=30000, workers=1)
    args = [os.path.join(HERE, "config", "midtrain_8b_delta.py"), f"--data_dir={data}", f"--out_dir={out}",
            "--block_size=64", "--batch_tokens=256", "--micro_batch=1", "--warmup_steps=2", "--lr_decay_steps=8",
            "--eval_interval=3", "--eval_tokens=128", "--ema_decay=0.9", "--device=cpu", "--compile=False",
            "--routing_impl=reference"]
    dist = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", os.path.join(HERE, "train.py")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(dist + args + [f"--init_from={conv}", "--max_steps=3"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FSDP2 mixed precision" in r.stdout and "residual=delta" in r.stdout
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert ckpt["model"]["routes.0.alpha"].shape == (1,) and ckpt["step"] == 3
    r = subprocess.run(dist + args + ["--init_from=resume", "--max_steps=4"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stdout and sorted(read_log(out)[0]) == [1, 2, 3, 4]
    model = GPT.from_checkpoint(out)   # the FSDP run's checkpoint, resumed in one process
    assert model.routes[0].alpha.shape == (1,)
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *args, "--init_from=resume", "--max_steps=5"],
                       capture_output=True, text=True, env=launch_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(read_log(out)[0]) == [1, 2, 3, 4, 5]


# =====================================================================================================================
# export.py: a checkpoint as a Hugging Face folder (stock transformers, generate(), lm-evaluation-harness)
# =====================================================================================================================

EXPORTS = {"baseline": ["--residual=baseline"], "attnres": ["--residual=attnres"], "mhar": ["--residual=mhar"],
           "hyper": ["--residual=hyper"], "mhar_blocks": ["--residual=mhar", "--route_blocks=2"]}


def hf_offline_env():
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, data_dir, monkeypatch_module):
    """Tiny checkpoints trained 4 steps in each mode (and a delta model converted from a tiny Llama, its routing made
    live), each exported to a Hugging Face folder with export.py's own check: {name: (checkpoint dir, export dir)}."""
    for k, v in hf_offline_env().items():
        monkeypatch_module.setenv(k, v)
    root = tmp_path_factory.mktemp("export")
    runs = together(*[functools.partial(run_train, str(root / name), data_dir, *args, "--max_steps=4",
                                        "--eval_interval=4", "--eval_tokens=512") for name, args in EXPORTS.items()])
    assert all(r.returncode == 0 for r in runs), [r.stdout[-500:] + r.stderr[-2000:] for r in runs]
    hf_dir, delta = str(root / "llama"), str(root / "delta")
    write_hf_checkpoint(hf_dir, HF_CONFIGS["llama"])
    convert.main([f"--hf_dir={hf_dir}", f"--out_dir={delta}", "--dtype=float32", "--num_blocks=2", "--route_heads=2",
                  f"--tokenizer={write_tiny_tokenizer(str(root / 'tokenizer.json'))}"])
    ckpt = torch.load(os.path.join(delta, "ckpt.pt"), weights_only=False)
    gen = torch.Generator().manual_seed(0)
    for name, t in ckpt["model"].items():   # live routing: alpha, queries and null vectors away from their init
        if name.endswith((".alpha", ".q", ".null")):
            t.copy_(torch.randn(t.shape, generator=gen) * (0.5 if name.endswith(".alpha") else 1.0))
    torch.save(ckpt, os.path.join(delta, "ckpt.pt"))
    out = {}
    for name in [*EXPORTS, "delta"]:
        ckpt_dir = delta if name == "delta" else str(root / name)
        export.main([f"--out_dir={ckpt_dir}", f"--hf_dir={root / ('hf_' + name)}"])
        out[name] = (ckpt_dir, str(root / ("hf_" + name)))
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as m:
        yield m


@pytest.mark.parametrize("name", [*EXPORTS, "delta"])
def test_export_loads_in_transformers(exported, name):
    """AutoModelForCausalLM loads the folder offline (the baseline as a stock Qwen3 model, without remote code; every
    other mode through modeling_mhar.py): its logits are this repository's within 1e-5 (fp32), generate() gives the
    same greedy 12-token continuation as GPT.generate, through model.py's KV cache (one new token a forward after the
    prompt) and without it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ckpt_dir, hf_dir = exported[name]
    remote = name != "baseline"
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=remote, dtype=torch.float32).eval()
    assert type(hf).__name__ == ("Qwen3ForCausalLM" if name == "baseline" else "MHARForCausalLM")
    ours = GPT.from_checkpoint(ckpt_dir).eval()
    idx = torch.randint(0, 250, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ours(idx)[0], hf(idx).logits
    assert (a - b).abs().max().item() <= 1e-5 * max(1.0, a.abs().max().item())
    tok = AutoTokenizer.from_pretrained(hf_dir)
    prompt = torch.tensor([tok("The castle stood on a hill above the").input_ids])
    want = ours.generate(prompt, 12, temperature=0)
    lengths = []
    if remote:   # record the lengths the model's forward sees: the prompt, then one token a step
        hf.model.register_forward_pre_hook(lambda m, args, kwargs: lengths.append(args[0].size(1)), with_kwargs=True)
    got = hf.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want), (got, want)
    if remote:
        assert lengths == [prompt.size(1)] + [1] * 11, lengths
        assert torch.equal(hf.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False), want)


def test_export_tokenizer_is_the_checkpoints(exported):
    """The exported GPT-2 tokenizer (built from tiktoken's cached files) encodes and decodes as tiktoken's gpt2 does,
    with <|endoftext|> as its end-of-text (and beginning) token; a converted model's tokenizer.json is copied."""
    import tiktoken
    from transformers import AutoTokenizer
    tok, enc = AutoTokenizer.from_pretrained(exported["mhar"][1]), tiktoken.get_encoding("gpt2")
    for text in ("Hello world", "  leading spaces\nand tabs\t, naïve café 1,234.5!", "日本語のテキスト", "a<|endoftext|>b"):
        assert tok(text).input_ids == enc.encode(text, allowed_special="all"), text
        assert tok.decode(enc.encode(text, allowed_special="all")) == text
    assert tok.eos_token == tok.bos_token == "<|endoftext|>" and tok.eos_token_id == 50256
    delta_hf = exported["delta"][1]
    assert open(os.path.join(delta_hf, "tokenizer.json")).read() == \
        open(os.path.join(exported["delta"][0], "tokenizer.json")).read()
    assert AutoTokenizer.from_pretrained(delta_hf).eos_token == "<|end_of_text|>"


def test_export_of_a_baseline_converts_back(exported, tmp_path):
    """A baseline export is a Qwen3 folder, so convert.py reads it back: the weights are the original's bitwise, and
    the converted model (delta routing at alpha = 0) computes the original's logits bitwise."""
    ckpt_dir, hf_dir = exported["baseline"]
    out = str(tmp_path / "back")
    convert.main([f"--hf_dir={hf_dir}", f"--out_dir={out}", "--dtype=float32", "--num_blocks=1"])
    original, back = GPT.from_checkpoint(ckpt_dir).eval(), GPT.from_checkpoint(out).eval()
    state = back.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in original.state_dict().items())
    idx = torch.randint(0, 250, (2, 30))
    with torch.no_grad():
        assert torch.equal(original(idx)[0], back(idx)[0])


def test_export_scores_in_lm_eval_as_eval_py(exported, eval_root):
    """`lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True` on the local task files gives eval.py
    --harness's LAMBADA accuracy and perplexity and WikiText perplexities on the same checkpoint."""
    pytest.importorskip("lm_eval", reason="pip install lm-eval (requirements.txt)")
    ckpt_dir, hf_dir = exported["mhar"]
    evaluate.main([f"--out_dir={ckpt_dir}", "--harness", f"--data_root={eval_root}", "--tasks=lambada_openai,wikitext",
                   "--limit=3", "--batch_size=4"])
    ours = json.load(open(os.path.join(ckpt_dir, "eval_harness.limit3.json")))
    out = os.path.join(os.path.dirname(hf_dir), "lm_eval_out")
    r = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                        f"pretrained={hf_dir},trust_remote_code=True,dtype=float32", "--tasks",
                        "lambada_openai_local,wikitext_local", "--include_path", os.path.join(HERE, "harness_tasks"),
                        "--metadata", json.dumps({"data_root": eval_root}), "--limit", "3", "--device", "cpu",
                        "--batch_size", "4", "--output_path", out], capture_output=True, text=True, timeout=600,
                       env=launch_env())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    theirs = json.load(open(glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True)[0]))["results"]
    lam, wiki = theirs["lambada_openai_local"], theirs["wikitext_local"]
    assert lam["acc,none"] == ours["lambada_openai_local"]["acc"]
    assert lam["perplexity,none"] == pytest.approx(ours["lambada_openai_local"]["perplexity"], rel=1e-5)
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert wiki[f"{metric},none"] == pytest.approx(ours["wikitext_local"][metric], rel=1e-5), metric


def test_export_shards_its_weights(exported, tmp_path, monkeypatch):
    """Weights above the shard size go to several safetensors files with transformers' index (export.py's check then
    loads them back through it: the logits still match)."""
    monkeypatch.setattr(export, "SHARD_BYTES", 200_000)
    out = tmp_path / "sharded"
    export.main([f"--out_dir={exported['mhar'][0]}", f"--hf_dir={out}"])
    index = json.load(open(out / "model.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((out / f).is_file() for f in files) and not (out / "model.safetensors").exists()


def test_export_refusals(exported, tmp_path):
    """Bad input gets one line naming the value and the fix, and nothing is written: a file that is not a checkpoint, a
    torch file without this repository's weights, a folder without one, an existing export (until --force, which
    replaces it), the checkpoint's own folder, a tokenizer with no Hugging Face file, an unknown mode."""
    ckpt_dir, hf_dir = exported["mhar"]
    junk, foreign = tmp_path / "junk.pt", tmp_path / "foreign.pt"
    junk.write_bytes(os.urandom(4096))
    torch.save({"weights": torch.zeros(3)}, foreign)
    cl100k = tmp_path / "cl100k"
    cl100k.mkdir()
    ckpt = torch.load(os.path.join(ckpt_dir, "ckpt.pt"), weights_only=False)
    torch.save({**ckpt, "tokenizer": "cl100k_base"}, cl100k / "ckpt.pt")
    odd = tmp_path / "odd"
    odd.mkdir()
    torch.save({**ckpt, "model_config": {**ckpt["model_config"], "residual": "mystery"}}, odd / "ckpt.pt")
    target = tmp_path / "new_export"
    for args, msg in (([f"--out_dir={junk}"], r"is not a torch.save archive"),
                      ([f"--out_dir={foreign}"], r"is not a checkpoint of this repository"),
                      ([f"--out_dir={tmp_path}"], r"no checkpoint there"),
                      ([f"--out_dir={ckpt_dir}", f"--hf_dir={hf_dir}"], r"exists: pick another folder or pass --force"),
                      ([f"--out_dir={ckpt_dir}", f"--hf_dir={ckpt_dir}", "--force"], r"must not be the checkpoint's own"),
                      ([f"--out_dir={cl100k}"], r"tokenizer 'cl100k_base': export writes GPT-2's or a tokenizer.json"),
                      ([f"--out_dir={odd}"], r"residual='mystery' is not one of"),
                      ([f"--out_dir={ckpt_dir}", "--dtype=float16"], r"invalid choice: 'float16'")):
        argv = args if any(a.startswith("--hf_dir") for a in args) else [*args, f"--hf_dir={target}"]
        with pytest.raises(SystemExit) as e:
            export.main(argv)
        assert re.search(msg, str(e.value)) or e.value.code == 2, (args, e.value)
        assert not target.exists() and not glob.glob(str(tmp_path / ".export-*"))
    target.mkdir()
    (target / "old.txt").write_text("a previous export")
    export.main([f"--out_dir={ckpt_dir}", f"--hf_dir={target}", "--force", "--dtype=bfloat16", "--check=False"])
    assert json.load(open(target / "config.json"))["dtype"] == "bfloat16" and not (target / "old.txt").exists()


# =====================================================================================================================
# eval.py: every metric against a direct, unbatched computation in the test
# =====================================================================================================================

EVAL = os.path.join(SHARED, "eval")


@pytest.fixture(scope="session")
def eval_ckpt(tmp_path_factory):
    """Tiny MHAR (H = 2) and attention-residual (H = 1) checkpoints with the GPT-2 tokenizer, live routing."""
    paths = {}
    for residual, H in (("mhar", 2), ("attnres", 1)):
        torch.manual_seed(3)
        cfg = GPTConfig(vocab_size=50304, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, ffn_hidden=64,
                        block_size=32, residual=residual, route_heads=H)
        model = GPT(cfg)
        with torch.no_grad():
            for site in model.routing_sites():
                site.q.normal_(0.0, 1.0)
        out = tmp_path_factory.mktemp(f"eval_{residual}")
        torch.save({"model": model.state_dict(), "model_config": cfg.__dict__, "step": 0, "tokenizer": "gpt2",
                    "train_config": {"block_size": 32}}, out / "ckpt.pt")
        paths[residual] = str(out)
    return paths


@pytest.fixture(scope="session")
def eval_root(tmp_path_factory):
    """Small eval sets in --data_root layout: the shared files' first examples (or stand-ins without them)."""
    root = tmp_path_factory.mktemp("evaldata")
    wiki = os.path.join(EVAL, "wikitext-2-raw", "wiki.test.raw")
    text = open(wiki, encoding="utf-8").read()[:400] if os.path.isfile(wiki) else \
        " = Valkyria Chronicles = \n\n Senjo no Valkyria is a tactical role @-@ playing game developed by Sega . \n" * 3
    lam = os.path.join(EVAL, "lambada", "lambada_test.jsonl")
    texts = [json.loads(line)["text"] for line in open(lam)][:3] if os.path.isfile(lam) else \
        ["She opened the door and saw her brother", "He put the book back on the shelf"]
    texts.append("The word he could never spell was floccinaucinihilipilification")   # a many-token last word
    hs = os.path.join(EVAL, "hellaswag", "hellaswag_val.jsonl.xz")
    rows = [json.loads(line) for line in lzma.open(hs, "rt")][:5] if os.path.isfile(hs) else \
        [{"ctx": "A man is sitting on a roof. he", "endings": ["is eating.", "starts pulling up roofing.", "flies.", "sings."],
          "label": 1}] * 3
    for rel, content in (("wikitext-2-raw/wiki.test.raw", text), ("wikitext-2-raw/wiki.valid.raw", text[::-1]),
                         ("lambada/lambada_test.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in texts)),
                         ("hellaswag/hellaswag_val.jsonl", "".join(json.dumps(r) + "\n" for r in rows))):
        os.makedirs(os.path.dirname(root / rel), exist_ok=True)
        (root / rel).write_text(content, encoding="utf-8")
    return str(root)


def direct_logprob(model, ids, target_pos):
    """log p(ids[t] | ids[:t]) for each t in target_pos, one unbatched forward per call; and greedy hits."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0][0].double()
    logp = torch.log_softmax(logits, -1)
    return [logp[t - 1, ids[t]].item() for t in target_pos], [logits[t - 1].argmax().item() == ids[t] for t in target_pos]


def _request(*args):
    return types.SimpleNamespace(args=args)


def test_wikitext_protocol_matches_direct(eval_ckpt, eval_root):
    model, enc = evaluate.load_model(eval_ckpt["mhar"], "cpu")
    B, S = 16, 8
    text = evaluate.load_task("wikitext2", eval_root)
    toks = enc.encode_ordinary(text)
    n = len(toks)
    assert n > 3 * B and (n - B) % S, "the test text should end in a partial window"
    windows = evaluate.wikitext_windows(n, B)
    assert windows[0] == (0, B, 1) and windows[-1][1] == n and windows[-1][1] - windows[-1][0] < B
    res = evaluate.eval_wikitext2(evaluate.Scorer(model, B, 3, "cpu"), enc, text)
    # each token t >= 1 is predicted once: in window 0 if t < B, else in the window starting at (t // S - 1) * S
    nll = 0.0
    for t in range(1, n):
        s = 0 if t < B else (t // S - 1) * S
        nll -= direct_logprob(model, toks[s:t + 1], [t - s])[0][0]
    assert res["tokens"] == n - 1 and res["words"] == len(text.split())
    assert abs(math.log(res["token_ppl"]) * (n - 1) - nll) < 1e-4 * nll
    assert abs(math.log(res["word_ppl"]) * res["words"] - nll) < 1e-4 * nll
    limited = evaluate.eval_wikitext2(evaluate.Scorer(model, B, 3, "cpu"), enc, text, limit=2)
    assert limited["tokens"] == 2 * B - 1


def test_lambada_and_hellaswag_match_direct(eval_ckpt, eval_root):
    model, enc = evaluate.load_model(eval_ckpt["mhar"], "cpu")
    scorer = evaluate.Scorer(model, 32, 2, "cpu")
    texts = evaluate.load_task("lambada", eval_root)
    res = evaluate.eval_lambada(scorer, enc, texts)
    nlls, hits = [], []
    for text in texts:
        ctx, word = text.rsplit(" ", 1)
        c, w = enc.encode_ordinary(ctx), enc.encode_ordinary(" " + word)
        ids = (c + w)[-33:]                      # the context is cut from the left to the block
        lp, greedy = direct_logprob(model, ids, range(len(ids) - len(w), len(ids)))
        nlls.append(-sum(lp))
        hits.append(all(greedy))
    assert len(enc.encode_ordinary(" floccinaucinihilipilification")) > 3
    assert res["n"] == len(texts) and res["acc"] == sum(hits) / len(hits)
    assert abs(res["nll"] - sum(nlls) / len(nlls)) < 1e-4 * res["nll"]
    # the greedy test: a continuation that is the model's own greedy choice counts as correct, one token off does not
    ctx = enc.encode_ordinary("The history of the city")
    with torch.no_grad():
        nxt = model(torch.tensor([ctx]))[0][0, -1].argmax().item()
        nxt2 = model(torch.tensor([ctx + [nxt]]))[0][0, -1].argmax().item()
    (lp_ok, ok), (_, bad) = scorer.score([(ctx, [nxt, nxt2]), (ctx, [nxt, (nxt2 + 1) % 50257])])
    assert ok and not bad
    rows = evaluate.load_task("hellaswag", eval_root)
    res = evaluate.eval_hellaswag(scorer, enc, rows)
    acc = acc_norm = 0
    for ctx, endings, label in rows:
        c = enc.encode_ordinary(ctx)
        sums = []
        for e in endings:
            w = enc.encode_ordinary(" " + e)
            ids = (c + w)[-33:]
            sums.append(sum(direct_logprob(model, ids, range(len(ids) - len(w), len(ids)))[0]))
        acc += int(np.argmax(sums)) == label
        acc_norm += int(np.argmax([s / len(" " + e) for s, e in zip(sums, endings)])) == label
    assert res == {"acc": acc / len(rows), "acc_norm": acc_norm / len(rows), "n": len(rows)}


def test_eval_cli_json_and_errors(eval_ckpt, eval_root, tmp_path, capsys):
    out = str(tmp_path / "r.json")
    evaluate.main([f"--out_dir={eval_ckpt['mhar']}", f"--data_root={eval_root}", "--limit=2", f"--output={out}",
                   "--batch_size=4", "--block_size=16"])
    res = json.load(open(out))
    assert set(res) == {"wikitext2", "lambada", "hellaswag", "tokenizer"} and res["tokenizer"] == "gpt2"
    evaluate.main([f"--out_dir={eval_ckpt['mhar']}", f"--data_root={eval_root}", "--limit=1", "--tasks=lambada"])
    assert os.path.isfile(os.path.join(eval_ckpt["mhar"], "eval.limit1.json"))   # a --limit run: its own file
    assert set(res["wikitext2"]) == {"token_ppl", "word_ppl", "tokens", "words"} and res["wikitext2"]["tokens"] == 31
    assert set(res["lambada"]) == {"acc", "nll", "n"} and res["lambada"]["n"] == 2
    assert set(res["hellaswag"]) == {"acc", "acc_norm", "n"} and res["hellaswag"]["n"] == 2
    for bad, msg in ((["--tasks=wikitext2,mmlu"], "unknown task"), (["--block_size=64"], "exceeds the model's 32"),
                     (["--data_root=/nonexistent"], "not found")):
        with pytest.raises(SystemExit) as e:
            evaluate.main([f"--out_dir={eval_ckpt['mhar']}", f"--data_root={eval_root}", *bad])
        assert msg in str(e.value), (bad, e.value)


def test_sample_and_eval_refuse_bad_options_before_loading(tmp_path, eval_ckpt, monkeypatch):
    """sample.py's counts, top_k, temperature, device and prompt file, and eval.py's harness task names, are refused in
    one line before any model loads (the out_dir given has no checkpoint: a load would fail with another message); a
    harness task that needs the Hub while it cannot be reached gets the local-files hint."""
    nowhere = str(tmp_path / "no_run")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    for bad, msg in ((["--num_samples=0"], "--num_samples=0 must be >= 1"),
                     (["--max_new_tokens=0"], "--max_new_tokens=0 must be >= 1"),
                     (["--top_k=-5"], r"--top_k=-5 must be >= 0 \(0: sample among all tokens\)"),
                     (["--temperature=-1"], "--temperature=-1.0 must be a finite number >= 0"),
                     (["--temperature=nan"], "--temperature=nan must be a finite number >= 0"),
                     (["--device=gpu"], "--device='gpu' is not one of cpu, cuda, cuda:N"),
                     ([f"--start=FILE:{tmp_path / 'missing.txt'}"], "missing.txt: no such file"),
                     ([f"--start=FILE:{tmp_path}"], "is a folder, not a text file"),
                     ([f"--start=FILE:{tmp_path / 'latin1.txt'}"], r"latin1.txt is not UTF-8 text \(byte 3\)"),
                     (["--tokenizer=gpt3"], r"tokenizer='gpt3' is not one of")):
        with pytest.raises(SystemExit) as e:
            sample.main([f"--out_dir={nowhere}", "--device=cpu", *bad])
        assert str(e.value).startswith("sample.py: error: ") and re.search(msg, str(e.value)), (bad, e.value)
    for bad, msg in ((["--slices=0"], "--slices=0 must be >= 1"), (["--data_root=/nonexistent"], "--data_root=/nonexistent not found"),
                     (["--device=gpu"], "--device='gpu' is not one of cpu, cuda, cuda:N"),
                     ([f"--plot={tmp_path / 'no.jsonl'}"], "--plot: .*no.jsonl not found"),
                     ([f"--output={tmp_path / 'no_dir' / 'r.json'}"], "its folder does not exist"),
                     (["--probe", f"--data_dir={tmp_path}"], "holds no meta.json"),
                     (["--tokenizer=missing.json"], "tokenizer file missing.json not found")):
        with pytest.raises(SystemExit, match=msg):
            evaluate.main([f"--out_dir={nowhere}", *bad])
    lm_eval = pytest.importorskip("lm_eval", reason="pip install lm-eval (requirements.txt)")
    with pytest.raises(SystemExit) as e:
        evaluate.main([f"--out_dir={nowhere}", "--harness", "--tasks=lambada_openai,hellaswagg"])
    assert "unknown harness task(s) hellaswagg (hellaswagg: did you mean hellaswag" in str(e.value), e.value

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'allenai/ai2_arc' on the Hub (LocalEntryNotFoundError)")
    monkeypatch.setattr(lm_eval, "simple_evaluate", offline)
    with pytest.raises(SystemExit) as e:
        evaluate.main([f"--out_dir={eval_ckpt['mhar']}", "--harness", "--tasks=arc_easy", "--device=cpu"])
    assert "harness task 'arc_easy' needs the Hugging Face Hub" in str(e.value) and "--data_root=DIR" in str(e.value)


def test_harness_model_matches_direct_computation(eval_ckpt):
    """The lm-evaluation-harness model (eval.harness_lm): loglikelihood, rolling loglikelihood (disjoint windows of
    max_length predictions, the first after the end-of-text token) and greedy generate_until with a stop string
    equal direct computations with the model."""
    pytest.importorskip("lm_eval", reason="pip install lm-eval (requirements.txt)")
    model, enc = evaluate.load_model(eval_ckpt["mhar"], "cpu")
    L = 16
    lm = evaluate.harness_lm(model, enc, max_length=L, batch_size=3, device="cpu", max_gen_toks=12)
    pairs = [("The cat sat on the", " mat"), ("Once upon a time there was a", " princess who lived far away"),
             ("A", " b")]
    got = lm.loglikelihood([_request(c, x) for c, x in pairs], disable_tqdm=True)
    for (ctx, cont), (logp, greedy) in zip(pairs, got):
        c, x = enc.encode_ordinary(ctx), enc.encode_ordinary(cont)
        ids = (c + x)[-(L + 1):]
        lp, hits = direct_logprob(model, ids, range(len(ids) - len(x), len(ids)))
        assert abs(logp - sum(lp)) < 1e-4 and greedy == all(hits)
    text = "Senjo no Valkyria 3 : Unrecorded Chronicles is a tactical role playing video game developed by Sega " * 2
    toks = enc.encode_ordinary(text)
    assert len(toks) > 2 * L
    want, P = 0.0, [enc.eot_token] + toks   # block [a, b) of targets P[a+1 .. b]: the last L tokens before them as input
    for a in range(0, len(toks), L):         # (the first block: from the end-of-text token; the last: full context)
        b = min(a + L, len(toks))
        s0 = max(0, b - L)
        want += sum(direct_logprob(model, P[s0:b + 1], range(a + 1 - s0, b + 1 - s0))[0])
    (rolled,) = lm.loglikelihood_rolling([_request(text)], disable_tqdm=True)
    assert abs(rolled - want) < 1e-3
    prompts = ["The cat sat on the", "One two three four five"]
    outs = lm.generate_until([_request(p, {"until": ["\n\n"], "max_gen_toks": 6}) for p in prompts], disable_tqdm=True)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([enc.encode_ordinary(prompt)])
        ref = enc.decode(model.generate(ids, 6, temperature=0, use_cache=False)[0, ids.size(1):].tolist())
        assert out == ref.split("\n\n")[0]


def test_harness_offline_tasks_and_lambada_agree_with_ours(eval_ckpt, eval_root, tmp_path):
    """eval.py --harness with --data_root runs lm_eval.simple_evaluate on the three local task files (no Hub), and
    the harness' lambada_openai scores the examples as our built-in LAMBADA does (accuracy, perplexity = exp(nll))."""
    pytest.importorskip("lm_eval", reason="pip install lm-eval (requirements.txt)")
    out = str(tmp_path / "h.json")
    res = evaluate.main([f"--out_dir={eval_ckpt['mhar']}", f"--data_root={eval_root}", "--harness", "--limit=3",
                         f"--output={out}", "--batch_size=4", "--block_size=16"])
    assert json.load(open(out)) == res
    assert set(res) == {"wikitext_local", "lambada_openai_local", "hellaswag_local", "tokenizer"}
    assert {"word_perplexity", "byte_perplexity", "bits_per_byte"} <= set(res["wikitext_local"])
    assert {"acc", "acc_norm"} <= set(res["hellaswag_local"]) and res["hellaswag_local"]["n"] == 3
    ours = evaluate.main([f"--out_dir={eval_ckpt['mhar']}", f"--data_root={eval_root}", "--tasks=lambada", "--limit=3",
                          f"--output={tmp_path / 'o.json'}", "--batch_size=4", "--block_size=16"])["lambada"]
    theirs = res["lambada_openai_local"]
    assert theirs["n"] == ours["n"] == 3 and theirs["acc"] == ours["acc"]
    assert abs(math.log(theirs["perplexity"]) - ours["nll"]) < 1e-6 * max(1.0, ours["nll"])
    offline = load_module(os.path.join(evaluate.HARNESS_TASKS, "offline.py"))
    pages = offline.wikitext_pages(" = A = \n x \n = = B = = \n y \n = C = \n z \n")
    assert pages == [" = A = \n x \n = = B = = \n y \n", " = C = \n z \n"]


def test_probe_on_a_block_model(tmp_path):
    """eval.probe on a block-routed model: a map per site over its few sources (1 + completed and open blocks), and
    the plots name them."""
    torch.manual_seed(0)
    m = GPT(tiny_cfg(residual="mhar", route_heads=2, route_blocks=2))   # 4 sublayers, 2 a block
    res = evaluate.probe(m, torch.randint(0, 96, (2, 12)))
    assert [tuple(x.shape) for x in res["maps"]] == [(2, 1), (2, 2), (2, 2), (2, 3), (2, 3)]
    evaluate.plot_probe(res["maps"], str(tmp_path), "mhar", blocks=2)
    assert all(os.path.getsize(tmp_path / f) > 1000 for f in ("routing_maps.png", "head_deviation.png"))


def test_probe_kl_maps_and_plots(eval_ckpt, eval_root, tmp_path):
    gen = torch.Generator().manual_seed(0)
    sources = torch.randn(5, 2, 3, 32, generator=gen)
    g = torch.ones(32)
    assert evaluate.slice_kl(sources, torch.zeros(32), g, 4, 1e-6) == 0.0             # q = 0: every slice uniform
    assert evaluate.slice_kl(sources, torch.randn(32, generator=gen), g, 4, 1e-6) > 1e-3
    probe_dir = str(tmp_path / "probe")
    summary = evaluate.main(["--probe", f"--out_dir={eval_ckpt['attnres']}", f"--data_root={eval_root}",
                             f"--probe_dir={probe_dir}", "--batch_size=2", "--block_size=16"])
    t6 = summary["table6"]
    assert t6["kl_learned"] > 0 and t6["kl_null"] > 0 and abs(t6["excess"] - (t6["kl_learned"] - t6["kl_null"])) < 1e-12
    assert len(summary["maps"]) == 5 and all(abs(sum(row) - 1) < 1e-5 for m in summary["maps"] for row in m)
    for f in ("routing_maps.png", "head_deviation.png"):
        assert os.path.getsize(os.path.join(probe_dir, f)) > 1000
    assert json.load(open(os.path.join(probe_dir, "probe.json")))["table6"] == t6
    summary = evaluate.main(["--probe", f"--out_dir={eval_ckpt['mhar']}", f"--data_root={eval_root}",
                             f"--probe_dir={probe_dir}2", "--batch_size=2", "--block_size=16"])
    assert summary["table6"] is None and len(summary["maps"][0]) == 2   # H = 2: two rows per site
    log = tmp_path / "run" / "log.jsonl"
    log.parent.mkdir()
    log.write_text("".join(json.dumps({"step": s, "loss": 5 - s / 10}) + "\n" for s in range(1, 20))
                   + json.dumps({"step": 10, "val_loss": 4.2}) + "\n")
    evaluate.main(["--plot", str(log), f"--output={tmp_path / 'c.png'}"])
    assert os.path.getsize(tmp_path / "c.png") > 1000


# =====================================================================================================================
# bench.py
# =====================================================================================================================

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
    assert unknown.returncode != 0 and "bench.py: error: --scales=2b does not know 2b: give one or more of" in unknown.stderr
    for bad in (["--new=0"], ["--batch=1,x"], ["--prompt=-3"]):
        with pytest.raises(SystemExit, match="must be positive integers"):
            bench.generate_main(["--scale=tiny", "--device=cpu", *bad])
    for bad, said in ((["--ways=none,x"], "--ways=none,x does not know x"), (["--variants=,"], "--variants=, names nothing")):
        with pytest.raises(SystemExit, match=f"^bench.py ddp: error: {said}: give one or more of"):
            bench.ddp_main(["--device=cpu", *bad])


def test_bench_scales_are_the_configs_shapes():
    """Each bench.py scale is its config files' shape; 124m is config/repro_124m.py's d768 at the 100M microbatch."""
    for scale, spec in bench.SCALES.items():
        kw, micro = bench.scale_config(scale, 151936)
        assert kw["vocab_size"] == (1024 if scale == "tiny" else 151936) and micro > 0
        if isinstance(spec, tuple):
            cfg = train.parse_args([os.path.join(HERE, f) for f in spec])
            assert (kw["n_embd"], kw["n_layer"], kw["block_size"], micro) == (cfg.n_embd, cfg.n_layer, cfg.block_size,
                                                                               cfg.micro_batch)
    w, w_micro = bench.scale_config("124m", 50304)
    b, b_micro = bench.scale_config("100m", 50304)
    assert (w["n_embd"], w["n_kv_head"], w["n_layer"]) == (768, 4, 12)
    assert (w["block_size"], w_micro) == (b["block_size"], b_micro) == (2048, 8)


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


def test_bench_routing_blocks_option(monkeypatch):
    """bench.py routing --blocks=n: block routing's chain at every shape; n must divide every shape's sublayers and
    --tune-train takes the block chain's settings (by default all three), each a one-line error before anything runs. The pair
    count behind its GB/s is the block chain's own (routing_block.BlockChain.sources), and the tune times block chains
    without forcing a backward (the block chain has one)."""
    from routing_block import BlockChain
    for argv, msg in ((["--blocks=5"], r"--blocks=5 must divide every chain shape's sublayers \(2 x n_layer: 24, 48, "
                                       r"72\): give a divisor of 24"),
                      (["--blocks=0"], r"--blocks=0 must divide"),
                      (["--blocks=8", "--tune-train=fwd"], r"--tune-train=fwd: unknown setting fwd; choose from "
                                                           r"block_fwd, block_bwd, block_waves$"),
                      (["--tune-train=site"], r"--tune-train=site: unknown setting site; choose from fwd, fwd_lead, "
                                              r"fwd_lead_sites, gather, gather_lead, stored_logits$"),
                      (["--blocks=8", "--delta"], r"--blocks times this repo's block chain alone: drop --authors")):
        with pytest.raises(SystemExit, match=msg):
            bench_routing.main(argv)
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


def test_tune_candidates_cover_the_configs():
    """bench.py routing --tune-train can find every config shipped (else a retune silently drops a best)."""
    for name in rc.TUNABLE + rc.BLOCK_TUNABLE:
        used = {getattr(rc.DEFAULT, name)} | {w[name] for w in rc.TUNED_H200.values() if name in w}
        choices = rc.CHOICES.get(name, rc.CANDIDATES + ([None] if name.endswith("_lead") else []))
        assert used <= set(choices), (name, used - set(choices))


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


def test_every_script_refuses_bad_inputs_in_one_line(tmp_path, eval_ckpt, monkeypatch, capsys):
    """Inputs as a class, script by script: a number out of its range or not finite, a device that is not one, a path
    of the wrong kind (not a checkpoint, a safetensors file, a JSON that is no tokenizer, a Python file that does not
    load): each refused with one line naming the value, before anything is written. Options a mode does not read are
    said (eval.py). Ctrl-C: one line, exit 130 (run_script, every script's entry point)."""
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")   # a torch file, not this repository's checkpoint
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "vocab.json").write_text('{"hello": 1}')                # JSON, not a tokenizer
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "binary.py").write_bytes(b"\x00\x01\xff" * 10)
    (tmp_path / "notes.txt").write_text("mhar_triton\n")
    corpus_file = tmp_path / "docs.jsonl"
    corpus_file.write_text(json.dumps({"text": "a few words"}) + "\n")
    other, weights, vocab = tmp_path / "other.pt", tmp_path / "model.safetensors", tmp_path / "vocab.json"
    nowhere = str(tmp_path / "none")
    prep = lambda *a: prepare_data.main([f"--input={corpus_file}", f"--out_dir={tmp_path / 'prep'}", *a])  # noqa: E731
    table = [
        (lambda: sample.main([f"--out_dir={other}", "--device=cpu"]), r"other.pt is not a checkpoint of this repository"),
        (lambda: sample.main([f"--out_dir={weights}", "--device=cpu"]), r"model.safetensors is a safetensors file .* convert.py --hf_dir="),
        (lambda: sample.main([f"--out_dir={eval_ckpt['mhar']}", "--device=cpu", f"--tokenizer={vocab}"]),
         r"vocab.json is not a Hugging Face tokenizer.json"),
        (lambda: sample.main([f"--out_dir={nowhere}", "--temperature=inf"]), r"--temperature=inf must be a finite number >= 0"),
        (lambda: sample.main([f"--out_dir={nowhere}", "--device=cuda:99"]), r"--device=cuda:99 but (CUDA is not available|this machine has)"),
        (lambda: evaluate.main([f"--out_dir={other}", "--device=cpu"]), r"other.pt is not a checkpoint of this repository"),
        (lambda: evaluate.main([f"--out_dir={weights}", "--device=cpu"]), r"model.safetensors is a safetensors file .* convert.py --hf_dir="),
        (lambda: evaluate.main([f"--out_dir={nowhere}", "--limit=0"]), r"--limit=0 must be >= 1"),
        (lambda: export.main([f"--out_dir={other}", f"--hf_dir={tmp_path / 'hf'}"]), r"other.pt is not a checkpoint of this"),
        (lambda: prep(f"--tokenizer={vocab}"), r"vocab.json is not a Hugging Face tokenizer.json"),
        (lambda: prep("--max_val_tokens=0"), r"--max_val_tokens=0 must be a positive whole number"),
        (lambda: prep("--workers=-1"), r"--workers=-1 must be a positive whole number"),
        (lambda: prep("--val_fraction=nan"), r"val_fraction=nan must be in \(0, 1\)"),
        (lambda: prepare_data.main(["--verify", f"--out_dir={nowhere}"]), r"--verify needs --out_dir=<a folder prepare_data.py"),
        (lambda: bench.main(["--device=gpu"]), r"bench.py: error: --device='gpu' is not one of cpu, cuda, cuda:N"),
        (lambda: bench.main(["--device=cuda:99"]), r"bench.py: error: --device=cuda:99 but"),
        (lambda: bench.main(["--steps=0"]), r"bench.py: error: --steps=0 must be an integer >= 1"),
        (lambda: bench.main(["--vocab=1"]), r"--vocab=1 must be an integer >= 2"),
        (lambda: bench.generate_main(["--device=gpu"]), r"bench.py generate: error: --device='gpu' is not one of"),
        (lambda: bench.ddp_args(["--bucket_mb=inf"]), r"bench.py ddp: error: --bucket_mb=inf must be a finite number > 0"),
        (lambda: bench.ddp_args(["--accum=-1"]), r"bench.py ddp: error: --accum=-1 must be an integer >= 0"),
        (lambda: bench_routing.main(["--device=gpu"]), r"bench.py routing: error: --device='gpu' is not one of"),
        (lambda: bench_routing.main(["--tune-train=garbage"]), r"--tune-train=garbage: unknown setting garbage; choose from"),
        (lambda: bench_routing.load_authors(str(tmp_path / "broken.py")), r"broken.py, line 1 does not load \(SyntaxError"),
        (lambda: bench_routing.load_authors(str(tmp_path / "binary.py")), r"binary.py(, line \d+)? does not load"),
        (lambda: bench_routing.load_authors(str(tmp_path / "notes.txt")), r"notes.txt is not a Python file"),
        (lambda: convert.main([f"--hf_dir={tmp_path}", f"--out_dir={tmp_path / 'c'}", "--check_batches=-1"]),
         r"--check_batches=-1 must be >= 0"),
    ]
    for call, msg in table:
        with pytest.raises(SystemExit) as e:
            call()
        text = str(e.value.code)
        assert re.search(msg, text) and "\n" not in text, (msg, text)
    assert not (tmp_path / "prep").exists() and not (tmp_path / "hf").exists() and not (tmp_path / "c").exists()
    capsys.readouterr()
    evaluate.main(["--plot", os.path.join(HERE, "results", "repro_100m", "logs", "mhar_s0.log.jsonl"),
                   f"--output={tmp_path / 'c.png'}", "--slices=2", "--limit=3"])
    err = capsys.readouterr().err
    assert "eval.py: --limit=3 is unused with --plot; ignored" in err and "--slices=2 is unused with --plot" in err

    def interrupted():
        raise KeyboardInterrupt
    with pytest.raises(SystemExit) as e:
        prepare_data.run_script(interrupted, "eval.py", "; no results file was written")
    assert e.value.code == 130 and capsys.readouterr().err == "eval.py: stopped by Ctrl-C; no results file was written\n"


def test_ctrl_c_in_a_running_script_is_one_line(tmp_path, eval_ckpt):
    """Ctrl-C while sample.py generates (after it said which tokenizer) and while a script's imports load: exit
    130 with one line, or a quiet exit; never a traceback."""
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "sample.py"), f"--out_dir={eval_ckpt['mhar']}",
                          "--device=cpu", "--max_new_tokens=1000000", "--num_samples=4"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    while not p.stderr.readline().startswith("tokenizer: "):   # (a line about the routing may come first)
        assert p.poll() is None, "sample.py ended before generating"
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.splitlines()[-1] == "sample.py: stopped by Ctrl-C" and "Traceback" not in err, err
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "eval.py"), f"--out_dir={eval_ckpt['mhar']}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)   # torch still loading
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode in (130, -signal.SIGINT) and "Traceback" not in err, err


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
    with pytest.raises(SystemExit, match=r"--shapes=2B: unknown shape 2B; choose from 100M,350M,1B,100M-train,"):
        bench_routing.main(["--shapes=2B"])


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


# =====================================================================================================================
# results/: the study drivers and report scripts
# =====================================================================================================================

def write_eval_log(path, v):
    """A finished run's log.jsonl: evals every 100 steps to 2,000, falling to v (the tail-5 is v + 0.2)."""
    with open(path, "w") as f:
        for step in range(0, 2001, 100):
            f.write(json.dumps({"step": step, "val_loss": v + (2000 - step) / 1000}) + "\n")


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
            (tmp_path / f"350m_{name}.txt").write_text(f"run.sh: python train.py\ngit 0000000 | torch\nstopped\n"
                                                       f"run.sh: python train.py\ngit {tree} | torch\ndone\n")
    rs = study.runs(str(tmp_path))
    assert rs[("350m", "mhar", 3)]["tree"] == "abc1234" and rs[("350m", "attnres_x0.125", 3)]["tree"] == "def5678+dirty"
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
    fp, extended = study.simulate_extension(0.006, runs=20000)
    assert 0.04 < fp < 0.06 and extended < 0.1


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
    stopped run resumed from its checkpoint (nothing deleted unless FRESH=1)."""
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
    r = run_sh("100m:mhar:1", SAVE="True", FRESH="1")
    assert r.returncode == 0 and "100m_mhar_s1: FRESH=1, starting from scratch" in r.stdout, r.stdout
    assert (logs / "100m_mhar_s1.txt").read_text().count("config: ") == 1
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
