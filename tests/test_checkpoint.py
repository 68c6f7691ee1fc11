"""
checkpoint.py: what a run keeps in out_dir (checkpoints, log, lock) and its stops.
"""

import errno
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import checkpoint
import configurator
import eval as evaluate
import export
import metrics
import prepare_data
import runs
import train
from model import GPT
from support import HERE, kill_when_logged, read_log, run_train, strict_log, tiny_cfg, together


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
        metrics.read_log(log)
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
    assert r.returncode == 0 and f"taking over {lock} from a file that is not a lock" in r.stdout, r.stdout + r.stderr


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
        checkpoint.load_model(out)
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
        checkpoint.load_model(noisy)
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
    cfg = configurator.parse_args(["--device=cpu"])
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


class Payload:
    """What a stranger's checkpoint could hold: unpickled, it calls open(path, "w"), creating the file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_checkpoint_never_runs_code(tmp_path, data_dir):
    """A ckpt.pt whose pickle would create a file (its CRCs valid: torch writes them for any object), opened by every
    script that reads checkpoints: sample.py, eval.py, export.py, train.py's resume and --init_from, --list. Each refuses
    it in one line naming what it would have run, and the file is never created. A checkpoint this repository writes
    loads with torch.load(weights_only=True) as it is (its numpy RNG state is plain data)."""
    from dataclasses import asdict
    model = GPT(tiny_cfg(vocab_size=50304))
    run, marker = tmp_path / "run", tmp_path / "created-by-the-pickle"
    run.mkdir()
    torch.save({"model": model.state_dict(), "model_config": asdict(model.cfg), "step": 4, "tokenizer": "gpt2",
                "train_config": {"max_steps": 8}, "optimizer": None, "payload": Payload(str(marker))}, run / "ckpt.pt")
    checkpoint.verify_checkpoint(str(run / "ckpt.pt"))   # the CRC check passes: it cannot tell
    py = [sys.executable]
    launches = {"sample.py": py + [os.path.join(HERE, "sample.py"), f"--out_dir={run}", "--max_new_tokens=2",
                                   "--device=cpu"],
                "eval.py": py + [os.path.join(HERE, "eval.py"), f"--out_dir={run}", "--device=cpu", "--limit=1",
                                 "--tasks=wikitext2", f"--data_root={tmp_path}"],
                "export.py": py + [os.path.join(HERE, "export.py"), f"--out_dir={run}", f"--hf_dir={tmp_path / 'hf'}"],
                "resume": None, "init_from": None, "--list": None}
    results = together(*[lambda c=c: subprocess.run(c, capture_output=True, text=True, timeout=300, cwd=tmp_path)
                         for c in launches.values() if c],
                       lambda: run_train(str(run), data_dir, "--init_from=resume", "--max_steps=8"),
                       lambda: run_train(str(tmp_path / "new"), data_dir, f"--init_from={run}", "--max_steps=8"),
                       lambda: subprocess.run([sys.executable, os.path.join(HERE, "train.py"), f"--list={tmp_path}"],
                                              capture_output=True, text=True, timeout=300), cores_each=1)
    opener = f"{open.__module__}.{open.__name__}"   # as pickle names it: io.open to Python 3.11, _io.open from 3.12
    for name, r in zip(launches, results):
        out = (r.stdout + r.stderr).strip()
        assert not marker.exists() and "Traceback" not in out, (name, out)
        if name == "--list":
            assert r.returncode == 0 and "refused: its checkpoint asks to run code when loaded" in out, out
        else:
            assert r.returncode != 0 and f"asks to run {opener} when loaded" in out.splitlines()[-1], (name, out)
    ours = tmp_path / "ours"
    r = run_train(str(ours), data_dir, "--max_steps=2", "--eval_interval=2")
    assert r.returncode == 0, r.stderr
    assert torch.load(ours / "ckpt.pt", weights_only=True)["rng"][0]["numpy"]["name"] == "MT19937"


def test_list_runs_names_what_it_cannot_read_and_copies(tmp_path):
    """train.py --list over a folder: a run whose log.jsonl has a damaged line mid-file is listed, its row naming the
    line (the other runs list too, no traceback); a checkpoint copied into another folder is marked with the folder it
    was written in; a finished run is finished."""
    def run(name, home, log):
        (tmp_path / name).mkdir()
        torch.save({"model": {}, "model_config": {"residual": "mhar"}, "step": 8,
                    "train_config": {"max_steps": 8, "out_dir": home}}, tmp_path / name / "ckpt.pt")
        (tmp_path / name / "log.jsonl").write_text(log)
    good = '{"step": 8, "loss": 3.5}\n{"step": 8, "val_loss": 3.6}\n'
    run("a", "out/a", '{"step": 1, "loss": 9.0}\nnot json\n' + good)
    run("b", "out/b", good)
    run("copy", "out/b", good)
    rows = {name: state for name, _, _, _, _, state in runs.list_runs(str(tmp_path))}
    assert rows == {"a": "finished; log.jsonl damaged at line 2", "b": "finished",
                    "copy": "finished; its checkpoint was written in out/b (copied or renamed here)"}, rows
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), f"--list={tmp_path}"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "3 run(s)" in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr
