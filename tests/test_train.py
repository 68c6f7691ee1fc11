"""
train.py and configurator.py: options, runs as users run them (resume, DDP, FSDP2), non-finite states.
"""

import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

import checkpoint
import configurator
import eval as evaluate
import export
import prepare_data
import runs
import sample
import train
from model import GPTConfig
from support import HERE, kill_when_logged, launch_env, read_docs, read_log, run_train, strict_log, together


@pytest.mark.parametrize("argv,msg", [   # each option's rule (configurator.py's fields), then the rules between options
    (["--n_layers=3"], r"unknown option 'n_layers'.*did you mean n_layer"),
    (["--max_steps=ten"], r"max_steps='ten' must be a whole number in \[1, 1,000,000,000\]"),
    (["--compile=1"], r"compile=1 must be True or False"),
    (["--lr"], r"write options as --key=value"),
    (["--lr_schedule=cos"], r"lr_schedule='cos' must be one of cosine, linear, 1-sqrt"),
    (["--n_embd=512", "--route_heads=3"], r"n_embd=512 must be divisible by route_heads=3"),
    (["no_such_config.py"], r"config file 'no_such_config.py' not found"),
    (["--lr=-1"], r"lr=-1 must be a finite number in \(0, 1e\+06\]"),
    (["--min_lr_ratio=2"], r"min_lr_ratio=2 must be a finite number in \[0, 1\]"),
    (["--weight_decay=-0.1"], r"weight_decay=-0.1 must be a finite number in \[0, 10\]"),
    (["--grad_clip=-1"], r"grad_clip=-1 must be a finite number in \[0, 1e\+06\]"),
    (["--warmup_steps=-5"], r"warmup_steps=-5 must be a whole number in \[0, 1,000,000,000\]"),
    (["--beta2=1"], r"beta2=1 must be a finite number in \[0, 1\)"),
    (["--device=gpu"], r"device='gpu' must be auto, cpu, cuda or cuda:N"),
    (["--grad_sync=ddp"], r"grad_sync='ddp' must be one of after, overlap"),
    (["--grad_bucket_mb=0"], r"grad_bucket_mb=0 must be a finite number in \(0, 1e\+06\]"),
    (["--routing_lr_scale=0"], r"routing_lr_scale=0 must be a finite number in \(0"),
    (["--route_init_std=0.02", "--residual=hyper"], r"route_init_std=0.02 is for attnres and mhar, not residual='hyper'"),
    (["--route_blocks=5"], r"route_blocks=5 must be a positive divisor of the 24 sublayers \(2 x n_layer=12\)"),
    (["--route_blocks=0"], r"route_blocks=0 must be a whole number in \[1, 2,048\]"),
    (["--route_blocks=2", "--residual=baseline"], r"route_blocks=2 is for attnres and mhar .*not residual='baseline'"),
    (["--route_blocks=2", "--residual=hyper"], r"route_blocks=2 is for attnres and mhar .*not residual='hyper'"),
    (["--route_blocks=2", "--residual=delta", "--num_blocks=4"], r"not residual='delta': drop it \(delta mode's blocks: num_blocks\)"),
    (["--keep_every=250"], r"keep_every=250 must be a multiple of eval_interval=500 .*e.g. --keep_every=500"),
    (["--keep_every=-500"], r"keep_every=-500 must be a whole number in \[0, 1,000,000,000\]"),
    (["--save_every=750"], r"save_every=750 must be a multiple of eval_interval=500 .*e.g. --save_every=1000"),
    (["--save_every=1000", "--keep_every=500"], r"keep_every=500 must be a multiple of save_every=1000 .*--keep_every=1000"),
    (["--route_scale=1e999"], r"route_scale=inf must be a finite number in \(0"),       # inf is positive: finite is the rule
    (["--routing_lr_scale=1e999"], r"routing_lr_scale=inf must be a finite number"),
    (["--lr=nan"], r"lr=nan must be a finite number"),
    (["--ema_decay=1e999"], r"ema_decay=inf must be a finite number in \[0, 1\)"),
    (["--lr_decay_steps=0"], r"lr_decay_steps=0 must be one of -1 or a whole number in \[1, 1,000,000,000\]"),
    (["--rope_theta=-1"], r"rope_theta=-1 must be a finite number in \(0, 1e\+12\]"),
])
def test_bad_train_options(argv, msg):
    with pytest.raises(ValueError, match=msg):
        configurator.parse_args(argv, paths=False)


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
    lines = configurator.unused_options(configurator.parse_args(argv))
    assert len(lines) == len(said) and all(s in line and line.endswith("; ignored") for s, line in zip(said, lines)), lines


def test_resume_refuses_another_route_blocks():
    """A checkpoint's model_config records route_blocks (train.py saves asdict of it); resuming with another value is
    refused, also against a checkpoint from before the field (its routing: full, None); the same value passes."""
    saved = vars(GPTConfig(route_blocks=2))
    older = {k: v for k, v in vars(GPTConfig()).items() if k != "route_blocks"}
    assert saved["route_blocks"] == 2 and GPTConfig.from_dict(older).route_blocks is None
    for model_config, was in ((saved, 2), (older, None)):
        with pytest.raises(ValueError, match=rf"would be ignored: --route_blocks=4 \(checkpoint: {was}\)"):
            runs.refuse_ignored_architecture(configurator.parse_args(["--route_blocks=4"]), model_config, "ckpt.pt")
    runs.refuse_ignored_architecture(configurator.parse_args(["--route_blocks=2"]), saved, "ckpt.pt")


def test_config_file_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("n_layer = 4\nlr = (1e-3\n")
    with pytest.raises(ValueError, match=rf"config file {re.escape(str(bad))}, line 2: "):
        configurator.parse_args([str(bad)])
    bad.write_text("n_layer = undefined_name\n")
    with pytest.raises(ValueError, match=r"NameError: name 'undefined_name' is not defined"):
        configurator.parse_args([str(bad)])


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
        (d / "prepare.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
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


def test_keep_every_keeps_checkpoints_through_a_resume(tmp_path, data_dir):
    """--keep_every=10: the step-10, 20 and 30 checkpoints stay beside ckpt.pt / ckpt.prev.pt (copies of those saves,
    files of their own: bytes damaged in ckpt.pt in place leave the kept copy whole), a resume neither rotates nor
    replaces them, and each loads in sample.py, eval.py --probe and export.py."""
    out = tmp_path / "k"
    first = run_train(str(out), data_dir, "--max_steps=20", "--eval_interval=10", "--keep_every=10")
    assert first.returncode == 0 and "kept as" in first.stdout, first.stderr
    inode = os.stat(out / "ckpt-step10.pt").st_ino
    assert inode != os.stat(out / "ckpt.prev.pt").st_ino and os.stat(out / "ckpt-step20.pt").st_ino != \
        os.stat(out / "ckpt.pt").st_ino
    with open(out / "ckpt.pt", "r+b") as f:   # damage in place (a disk, a stray write): the kept step-20 copy is whole
        f.seek(os.path.getsize(out / "ckpt.pt") // 2)
        f.write(b"\xff" * 64)
    checkpoint.verify_checkpoint(str(out / "ckpt-step20.pt"))
    shutil.copyfile(out / "ckpt-step20.pt", out / "ckpt.pt")   # (the resume below starts from whole bytes)
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


def test_save_every_writes_the_checkpoint_less_often_than_the_evals(tmp_path, data_dir):
    """--save_every=10 with --eval_interval=5: every eval runs, ckpt.pt is written at steps 10 and 20 and at the end
    (25), and the kept copies ride on those saves."""
    out = tmp_path / "s"
    run = run_train(str(out), data_dir, "--max_steps=25", "--eval_interval=5", "--save_every=10", "--keep_every=20")
    assert run.returncode == 0, run.stderr
    assert re.findall(r"^saved \S+ \(step (\d+),", run.stdout, re.M) == ["10", "20", "25"], run.stdout
    evals = [r["step"] for r in map(json.loads, open(out / "log.jsonl")) if "val_loss" in r]
    assert evals == [0, 5, 10, 15, 20, 25]
    assert sorted(p for p in os.listdir(out) if p.startswith("ckpt")) == ["ckpt-step20.pt", "ckpt.prev.pt", "ckpt.pt"]


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
    asked = []
    monkeypatch.setattr(prepare_data, "hub_tokenizer", lambda name, revision: asked.append(revision) or (
        str(tmp_path / "tokenizer.json"), 640))
    data = str(tmp_path / "qwenish")
    meta = prepare_data.prepare(input=corpus, out_dir=data, tokenizer="Owner/Model-0.6B", max_tokens=20000, workers=1,
                                tokenizer_revision="abc123")   # a pinned revision: fetched at it, recorded
    assert asked == ["abc123"] and meta["tokenizer_revision"] == "abc123"
    assert "--tokenizer=Owner/Model-0.6B --tokenizer_revision=abc123" in prepare_data.remake_command(data, meta)
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
    cfg = configurator.parse_args([os.path.join(HERE, "config", "tiny.py"), "--lr=1e-3", "--route_heads=2",
                                   "--residual=baseline"], paths=False)   # (its data_dir need not exist here)
    assert cfg.lr == 1e-3 and cfg.route_heads == 2 and cfg.residual == "baseline" and cfg.n_layer == 4
    assert isinstance(configurator.parse_args(["--lr=1"]).lr, float)
    for path in glob.glob(os.path.join(HERE, "config", "*.py")):
        configurator.parse_args([path], paths=False)   # every shipped config is valid


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
    model = checkpoint.load_model(out)
    assert model.cfg.residual == "mhar" and model.checkpoint_info["tokenizer"] == "gpt2"
    s, r = together(   # sample.py reads the checkpoint; starting over in the same out_dir would overwrite it: refused
        lambda: subprocess.run([sys.executable, os.path.join(HERE, "sample.py"), f"--out_dir={out}", "--device=cpu",
                                "--max_new_tokens=8", "--start=The"], capture_output=True, text=True),
        lambda: run_train(out, data_dir, "--max_steps=2"), cores_each=1)
    assert s.returncode == 0 and s.stdout.startswith("The"), s.stderr
    assert r.returncode != 0 and "--init_from=resume" in r.stderr
    assert typo.returncode != 0
    assert "init_from='resumee' must be one of scratch, resume or an existing file or folder" in typo.stderr
    # activation checkpointing recomputes sublayers: the same losses
    assert ac.returncode == 0, ac.stderr
    assert all(abs(read_log(ckpt_out)[0][s]["loss"] - steps[s]["loss"]) < 1e-5 for s in range(1, 6))


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


def test_fsdp_checkpoints_are_shards_that_reshard(tmp_path, data_dir):
    """An FSDP run saves each rank's shards at once (torch.distributed.checkpoint) into out_dir/ckpt.dcp, checked by
    content (crc.json, written last), rotated to ckpt.prev.dcp: saved at step 4 by 2 processes (gloo), it resumes at 2
    processes to the unbroken run's losses bitwise, and at 1 (resharded on load) within the cross-world tolerance of
    bf16 FSDP; sample.py, eval.py and export.py read the folder whole without a process group; a changed byte in one
    rank's shard is found, and the resume falls back to the checkpoint before it."""
    a, b, c = (str(tmp_path / n) for n in ("a", "b", "c"))
    fsdp = ["--eval_interval=2", "--fsdp=True"]
    first, unbroken = together(lambda: run_train(a, data_dir, "--max_steps=4", "--keep_every=2", *fsdp, nproc=2),
                               lambda: run_train(c, data_dir, "--max_steps=8", *fsdp, nproc=2))
    assert first.returncode == 0 and unbroken.returncode == 0, first.stderr[-2000:] + unbroken.stderr[-2000:]
    shards = sorted(os.listdir(os.path.join(a, "ckpt.dcp")))
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "crc.json", "meta.pt"], shards
    assert not os.path.exists(os.path.join(a, "ckpt.pt")) and os.path.isdir(os.path.join(a, "ckpt.prev.dcp"))
    assert checkpoint.load_model(os.path.join(a, "ckpt-step2.dcp")).checkpoint_info["step"] == 2   # --keep_every
    shutil.copytree(a, b)
    two, one = together(lambda: run_train(a, data_dir, "--max_steps=8", *fsdp, "--init_from=resume", nproc=2),
                        lambda: run_train(b, data_dir, "--max_steps=8", *fsdp, "--init_from=resume", nproc=1))
    assert two.returncode == 0 and one.returncode == 0, two.stderr[-2000:] + one.stderr[-2000:]
    assert "resumed from" in two.stdout and "ckpt.dcp at step 4" in two.stdout
    steps = range(5, 9)
    ref, at2, at1 = (read_log(d)[0] for d in (c, a, b))
    assert [at2[s]["loss"] for s in steps] == [ref[s]["loss"] for s in steps]   # bitwise: the same world size
    assert max(abs(at1[s]["loss"] - ref[s]["loss"]) for s in steps) < 2e-2     # resharded to one process
    model = checkpoint.load_model(a)   # whole, in this process (no process group)
    assert model.checkpoint_info["step"] == 8 and model.checkpoint_info["file"] == "ckpt.dcp"
    s = subprocess.run([sys.executable, os.path.join(HERE, "sample.py"), f"--out_dir={a}", "--device=cpu",
                        "--max_new_tokens=3"], capture_output=True, text=True, env=launch_env(), timeout=300)
    assert s.returncode == 0, s.stderr
    export.main([f"--out_dir={a}", f"--hf_dir={tmp_path / 'hf'}", "--check=False"])
    assert json.load(open(tmp_path / "hf" / "config.json"))["exported_from"]["step"] == 8
    shard = os.path.join(a, "ckpt.dcp", "__1_0.distcp")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 1
    open(shard, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"ckpt.dcp is damaged: 1 of its 4 files fail their CRC check"):
        checkpoint.read_sharded(os.path.join(a, "ckpt.dcp"))
    r = run_train(a, data_dir, "--max_steps=10", *fsdp, "--init_from=resume", nproc=2)
    assert r.returncode == 0 and "resuming from the checkpoint before it" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


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
