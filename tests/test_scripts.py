"""
Every script as a user runs it: bad input ends in one line, Ctrl-C in one line.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import bench
import bench_routing
import common
import convert
import eval as evaluate
import export
import prepare_data
import sample
from support import HERE, refusal, write_tiny_tokenizer


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
        (lambda: sample.main([f"--out_dir={eval_ckpt['mhar']}", "--temperature=inf"]), r"--temperature=inf must be a finite number"),
        (lambda: sample.main([f"--out_dir={eval_ckpt['mhar']}", "--device=cuda:99"]), r"--device=cuda:99 but (CUDA is not available|this machine has)"),
        (lambda: sample.main([f"--out_dir={nowhere}"]), r"--out_dir=.*none does not exist"),
        (lambda: evaluate.main([f"--out_dir={other}", "--device=cpu"]), r"other.pt is not a checkpoint of this repository"),
        (lambda: evaluate.main([f"--out_dir={weights}", "--device=cpu"]), r"model.safetensors is a safetensors file .* convert.py --hf_dir="),
        (lambda: evaluate.main([f"--out_dir={eval_ckpt['mhar']}", "--limit=0"]), r"--limit=0 must be a whole number in \[1,"),
        (lambda: export.main([f"--out_dir={other}", f"--hf_dir={tmp_path / 'hf'}"]), r"other.pt is not a checkpoint of this"),
        (lambda: prep(f"--tokenizer={vocab}"), r"vocab.json is not a Hugging Face tokenizer.json"),
        (lambda: prep("--max_val_tokens=0"), r"--max_val_tokens=0 must be a whole number in \[1,"),
        (lambda: prep("--workers=-1"), r"--workers=-1 must be a whole number in \[1, 1,024\]"),
        (lambda: prep("--val_fraction=nan"), r"--val_fraction=nan must be a finite number in \(0, 1\)"),
        (lambda: prepare_data.main(["--verify", f"--out_dir={nowhere}"]), r"does not exist: it must be an existing folder: a folder prepare_data.py wrote"),
        (lambda: bench.main(["--device=gpu"]), r"bench.py: error: --device=gpu must be cpu, cuda or cuda:N"),
        (lambda: bench.main(["--device=cuda:99"]), r"bench.py: error: --device=cuda:99 but"),
        (lambda: bench.main(["--steps=0"]), r"bench.py: error: --steps=0 must be a whole number in \[1,"),
        (lambda: bench.main(["--vocab=1"]), r"--vocab=1 must be a whole number in \[2,"),
        (lambda: bench.generate_main(["--device=gpu"]), r"bench.py generate: error: --device=gpu must be"),
        (lambda: bench.ddp_args(["--bucket_mb=inf"]), r"bench.py ddp: error: --bucket_mb=inf must be a finite number"),
        (lambda: bench.ddp_args(["--accum=-1"]), r"bench.py ddp: error: --accum=-1 must be a whole number in \[0,"),
        (lambda: bench_routing.main(["--device=gpu"]), r"bench.py routing: error: --device=gpu must be"),
        (lambda: bench_routing.main(["--tune-train=garbage"]), r"--tune-train=garbage must be one or more of"),
        (lambda: bench_routing.load_authors(str(tmp_path / "broken.py")), r"broken.py, line 1 does not load \(SyntaxError"),
        (lambda: bench_routing.load_authors(str(tmp_path / "binary.py")), r"binary.py(, line \d+)? does not load"),
        (lambda: bench_routing.load_authors(str(tmp_path / "notes.txt")), r"notes.txt is not a Python file"),
        (lambda: convert.main([f"--hf_dir={tmp_path}", f"--out_dir={tmp_path / 'c'}", "--check_batches=-1"]),
         r"--check_batches=-1 must be a whole number in \[0, 1,000\]"),
    ]
    for call, msg in table:
        said = refusal(call)
        assert re.search(msg, said), (msg, said)
    assert not (tmp_path / "prep").exists() and not (tmp_path / "hf").exists() and not (tmp_path / "c").exists()
    capsys.readouterr()
    evaluate.main(["--plot", os.path.join(HERE, "results", "repro_100m", "logs", "mhar_s0.log.jsonl"),
                   f"--output={tmp_path / 'c.png'}", "--slices=2", "--limit=3"])
    err = capsys.readouterr().err
    assert "eval.py: --limit=3 is unused with --plot; ignored" in err and "--slices=2 is unused with --plot" in err

    def interrupted():
        raise KeyboardInterrupt
    with pytest.raises(SystemExit) as e:
        common.run_script(interrupted, "eval.py", "; no results file was written")
    assert e.value.code == 130 and capsys.readouterr().err == "eval.py: stopped by Ctrl-C; no results file was written\n"


def test_a_relative_tokenizer_path_is_read_from_the_working_directory(tmp_path, eval_ckpt):
    """sample.py --tokenizer=sub/tokenizer.json run from a folder holding it reads that file, not one under the
    checkpoint's folder (where there is none)."""
    (tmp_path / "sub").mkdir()
    write_tiny_tokenizer(str(tmp_path / "sub" / "tokenizer.json"))
    r = subprocess.run([sys.executable, os.path.join(HERE, "sample.py"), f"--out_dir={eval_ckpt['mhar']}", "--device=cpu",
                        "--tokenizer=sub/tokenizer.json", "--max_new_tokens=2", "--num_samples=1"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and f"tokenizer: {tmp_path / 'sub' / 'tokenizer.json'}" in r.stderr, r.stderr


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
