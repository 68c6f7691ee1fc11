"""
convert.py and delta mode: tiny checkpoints in Hugging Face layout, written here.
"""

import filecmp
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import checkpoint
import convert
import eval as evaluate
import prepare_data
from support import (HERE, HF_CONFIGS, launch_env, read_log, refusal, rel_err, together, write_hf_checkpoint,
                     write_tiny_tokenizer)


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
    model = checkpoint.load_model(out)
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
    model = checkpoint.load_model(out)
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
    said = refusal(lambda: convert.main([f"--hf_dir={hf_dir}", f"--out_dir={hf_dir}/", "--num_blocks=2"]))
    assert re.search(r"--out_dir=\S+ is a folder of other things .*: it must be new, an empty folder or a convert.py "
                     r"folder", said), said   # (the pretrained model's folder: the write guard refuses it)
    import common
    lock = os.path.join(os.path.dirname(hf_dir), ".busy.convert.lock")   # another convert.py writing that folder
    common.take_lock(lock, "convert.py")
    try:
        said = refusal(lambda: convert.main([f"--hf_dir={hf_dir}", f"--out_dir={os.path.dirname(hf_dir)}/busy"]))
    finally:
        common.release_lock(lock)
    assert f"is being written by another convert.py (pid {os.getpid()}" in said, said
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
    cases.append((str(tmp_path / "nothing_here"), r"--hf_dir=.*nothing_here does not exist"))
    (tmp_path / "a_file").write_text("not a folder")   # an --out_dir that is a file: refused before any conversion
    cases.append((hf_dir, r"--out_dir=.*a_file is a file: it must be a folder to write", str(tmp_path / "a_file")))
    for d, match, *out in cases:
        out = out[0] if out else os.path.join(d, "out")
        said = refusal(lambda: convert.main([f"--hf_dir={d}", f"--out_dir={out}", "--num_blocks=2"]))
        assert re.search(match, said), (match, said)
        assert not os.path.exists(out) or os.path.isfile(out)
    said = refusal(lambda: convert.main([f"--hf_dir={hf_dir}", f"--out_dir={tmp_path / 'o'}", "--num_blocks=0"]))
    assert "--num_blocks=0 must be a whole number in [1, 1,024]" in said
    if not torch.cuda.is_available():
        said = refusal(lambda: convert.main([f"--hf_dir={hf_dir}", f"--out_dir={tmp_path / 'o'}", "--num_blocks=2",
                                             "--device=cuda"]))
        assert "--device=cuda but CUDA is not available; use --device=cpu" in said


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

    longer = [{"--block_size=64": "--block_size=512", "--batch_tokens=512": "--batch_tokens=2048"}.get(a, a) for a in args]

    def run(*argv):
        return subprocess.run(list(argv), capture_output=True, text=True, env=launch_env())
    r, bf16, gpt2, arch, long = together(   # the runs from the converted model, side by side
        lambda: run(*cmd, "--max_steps=4", "--eval_interval=2"),
        # the single-GPU 8B setting of BENCHMARKS.md: bf16 weights and AdamW states, no checkpoint written
        lambda: run(*cmd[:3], f"--out_dir={out}_bf16", f"--init_from={conv}", *args, "--max_steps=2",
                    "--param_dtype=bfloat16", "--ema_decay=0", "--save=False"),
        # a gpt2-tokenized data folder is refused
        lambda: run(sys.executable, os.path.join(HERE, "train.py"), f"--data_dir={gpt2_data}", f"--out_dir={out}2",
                    f"--init_from={conv}", *args, "--max_steps=1"),
        # architecture options a converted model would ignore are refused (here when starting; below when resuming)
        lambda: run(*cmd[:3], f"--out_dir={out}_arch", f"--init_from={conv}", *args, "--max_steps=8", "--n_layer=5"),
        # sequences longer than the model's positions (max_position_embeddings 256) are refused before any step
        lambda: run(*cmd[:3], f"--out_dir={out}_long", f"--init_from={conv}", *longer, "--max_steps=1"))
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
    assert long.returncode == 1 and "Traceback" not in long.stderr, long.stderr
    assert "--block_size=512 exceeds the block_size of the model in" in long.stderr and "(256)" in long.stderr
    # resume continues it
    r = run(*cmd[:4], "--init_from=resume", *args, "--max_steps=6", "--eval_interval=2")
    assert r.returncode == 0, r.stdout + r.stderr
    resumed = run(*cmd[:3], f"--out_dir={out}", "--init_from=resume", *args, "--max_steps=8", "--n_layer=5")
    for r in (arch, resumed):
        assert r.returncode != 0 and "would be ignored: --n_layer=5 (checkpoint: 4)" in r.stderr, r.stderr
    # the training length is the run's own, a converted model's architecture or not: a change is refused
    shorter = [a.replace("--block_size=64", "--block_size=32") for a in args]
    r = run(*cmd[:3], f"--out_dir={out}", "--init_from=resume", *shorter, "--max_steps=8")
    assert r.returncode == 1 and "block_size: 64 -> 32" in r.stderr, r.stderr
    # the run keeps its tokenizer.json: the converted model's folder moved away, sample.py still reads it
    assert ckpt["tokenizer"] == "tokenizer.json" and filecmp.cmp(tok, os.path.join(out, "tokenizer.json"), shallow=False)
    os.rename(hf_dir, hf_dir + "_moved")
    s = run(sys.executable, os.path.join(HERE, "sample.py"), f"--out_dir={out}", "--device=cpu", "--max_new_tokens=3")
    assert s.returncode == 0 and "tokenizer: tokenizer.json" in s.stderr, s.stderr
    os.rename(hf_dir + "_moved", hf_dir)   # (the data's tokenizer.json is checked before anything: back in place)
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
    ckpt = checkpoint.read_sharded(os.path.join(out, "ckpt.dcp"), whole=True)   # each rank's shards, read whole
    assert ckpt["model"]["routes.0.alpha"].shape == (1,) and ckpt["step"] == 3 and not os.path.exists(f"{out}/ckpt.pt")
    r = subprocess.run(dist + args + ["--init_from=resume", "--max_steps=4"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stdout and sorted(read_log(out)[0]) == [1, 2, 3, 4]
    model = checkpoint.load_model(out)   # the FSDP run's checkpoint, resumed in one process
    assert model.routes[0].alpha.shape == (1,)
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *args, "--init_from=resume", "--max_steps=5"],
                       capture_output=True, text=True, env=launch_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(read_log(out)[0]) == [1, 2, 3, 4, 5]
