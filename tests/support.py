"""
What several test files use (their fixtures are conftest.py's): the repository's root, the device the tests run on, small
model configs, train.py launched as users launch it, tiny Hugging Face checkpoints written here.
"""
import importlib.util
import json
import lzma
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import convert
from model import GPT, GPTConfig

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository's root
SHARED = os.path.join(HERE, "..", "shared", "data")                    # offline text, eval sets, tiktoken's cache
EVAL = os.path.join(SHARED, "eval")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the cores this process may keep busy: the machine's, shared among pytest-xdist's workers under pytest -n
CORES = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
MODES = ("baseline", "hyper", "attnres", "mhar")


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


def read_docs(path):
    with lzma.open(path, "rt") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def kill_when_logged(proc, log, step, sig):
    """Send sig to a run once its log.jsonl holds a whole record at step or later; its output."""
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(log) and any(json.loads(l).get("step", 0) >= step for l in open(log) if l.endswith("\n")):
            proc.send_signal(sig)
            break
        time.sleep(0.02)
    return proc.communicate()[0]


def strict_log(out_dir):
    """Every line of log.jsonl as strict JSON (a bare NaN or Infinity is an error)."""
    def refuse(name):
        raise ValueError(f"{name} in log.jsonl")
    return [json.loads(line, parse_constant=refuse) for line in open(os.path.join(out_dir, "log.jsonl"))]


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


EVAL = os.path.join(SHARED, "eval")


def refusal(call):
    """The one line a script ends with when it refuses its input (call: its main, in this process): sys.exit's
    message, or what its parser (options.Parser) printed before exit status 2. Fails if the call was not refused."""
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            call()
        except SystemExit as e:
            code = e.code
        else:
            raise AssertionError("not refused")
    said = err.getvalue().strip() if code == 2 else str(code)
    assert code and "\n" not in said and "Traceback" not in said, said
    return said
