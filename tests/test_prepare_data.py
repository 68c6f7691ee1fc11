"""
prepare_data.py and tokenizer.py: token files, their checks, refusals and stops; tokenizers.
"""

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import common
import eval as evaluate
import prepare_data
import tokenizer
from support import HERE, read_docs


def test_prepare_data_counts_and_round_trip(data_dir, corpus):
    meta = json.load(open(os.path.join(data_dir, "meta.json")))
    docs = read_docs(corpus)
    enc = tokenizer.load_tokenizer("gpt2")
    train_tok = np.fromfile(os.path.join(data_dir, "train.bin"), dtype=np.uint16)
    val_tok = np.fromfile(os.path.join(data_dir, "val.bin"), dtype=np.uint16)
    assert meta["train_tokens"] == len(train_tok) and meta["val_tokens"] == len(val_tok)
    assert meta["train_docs"] + meta["val_docs"] == len(docs) and meta["vocab_size"] == 50257
    val_docs, train_docs = docs[::20], [d for i, d in enumerate(docs) if i % 20]   # val_fraction 0.05
    eot = "<|endoftext|>"
    assert enc.decode(val_tok.tolist()) == "".join(eot + d for d in val_docs)
    assert enc.decode(train_tok.tolist()) == "".join(eot + d for d in train_docs)
    assert (train_tok == enc.eot_token).sum() == len(train_docs)


def test_prepare_data_limits_and_refusals(tmp_path, corpus, data_dir, capsys):
    out = str(tmp_path / "d")
    meta = prepare_data.prepare(input=corpus, val_input=corpus, out_dir=out, max_tokens=5000, max_val_tokens=3000, workers=1)
    assert meta["train_tokens"] == 5000 and meta["val_tokens"] == 3000
    said = "prepare_data.py: stopped at --max_tokens=5,000 before the end of"   # local input cut at the cap: said
    assert said in capsys.readouterr().out
    assert os.path.getsize(os.path.join(out, "train.bin")) == 10000
    with pytest.raises(FileExistsError, match="--force"):
        prepare_data.prepare(input=corpus, out_dir=out, workers=1)
    meta = prepare_data.prepare(input=corpus, out_dir=out, tokenizer="cl100k_base", max_tokens=2000, workers=1, force=True)
    assert meta["dtype"] == "uint32" and meta["train_tokens"] == 2000
    assert "stopped at --max_tokens=2,000" in capsys.readouterr().out
    txt = tmp_path / "texts"
    txt.mkdir()
    (txt / "a.txt").write_text("Hello world. " * 50)
    (txt / "b.txt").write_text("Another document. " * 50)
    meta = prepare_data.prepare(input=str(txt), out_dir=str(tmp_path / "t"), val_fraction=0.5, workers=1)
    assert meta["train_docs"] == 1 and meta["val_docs"] == 1 and "stopped at" not in capsys.readouterr().out
    exact = meta["train_tokens"]   # a cap the input fills exactly leaves nothing unread: nothing to say
    meta = prepare_data.prepare(input=str(txt), out_dir=str(tmp_path / "t"), val_fraction=0.5, workers=1,
                                max_tokens=exact, force=True)
    assert meta["train_tokens"] == exact and "stopped at" not in capsys.readouterr().out
    prepare_data.prepare(input=str(txt), out_dir=str(tmp_path / "t"), val_fraction=0.5, workers=1,
                         max_tokens=exact - 1, force=True)
    assert "stopped at --max_tokens=" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError):
        prepare_data.prepare(input=str(tmp_path / "missing*.jsonl"), out_dir=str(tmp_path / "x"))


def test_prepare_data_one_run_per_folder_and_checksums(tmp_path, corpus):
    """prepare_data.py holds out_dir/prepare.lock while it writes: a second prepare into the folder is refused naming the
    first (a lock whose process is gone is taken over); meta.json records each file's SHA-256, which --verify checks
    byte by byte."""
    out = tmp_path / "d"
    out.mkdir()
    lock = str(out / "prepare.lock")
    common.take_lock(lock, "prepare_data.py")   # this process is the first prepare
    r = subprocess.run([sys.executable, os.path.join(HERE, "prepare_data.py"), f"--input={corpus}", f"--out_dir={out}",
                        "--max_tokens=2000", "--workers=1"], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{out} is being prepared by another prepare_data.py (pid {os.getpid()})" in r.stderr.strip().splitlines()[-1]
    with pytest.raises(common.LockHeld, match="held by prepare_data.py"):
        common.take_lock(lock, "prepare_data.py")
    with open(lock, "w") as f:
        json.dump({"pid": 99999999, "host": socket.gethostname()}, f)   # its process is gone
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
        tokenizer.load_tokenizer("o200k_base")


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


def test_prepare_takes_its_lock_before_it_looks(tmp_path, corpus, monkeypatch):
    """Two prepares into one new folder, the second started while the first runs, the first finishing between the
    second's start and its lock (here: the first runs whole inside the second's call for the lock). The second finds
    the folder full once it holds it, and is refused without --force; the first's files stand. (It used to look before
    taking the lock, and replaced them.)"""
    out = tmp_path / "d"
    real = prepare_data.take_lock

    def first_finishes_first(path, by):
        monkeypatch.setattr(prepare_data, "take_lock", real)
        prepare_data.prepare(input=corpus, out_dir=str(out), max_tokens=3000, workers=1)
        return real(path, by)
    monkeypatch.setattr(prepare_data, "take_lock", first_finishes_first)
    with pytest.raises(FileExistsError, match="already holds train.bin, val.bin, meta.json"):
        prepare_data.prepare(input=corpus, out_dir=str(out), max_tokens=2000, workers=1)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train_tokens"] == 3000 and prepare_data.check_files(str(out), meta, full=True)
    assert sorted(os.listdir(out)) == ["meta.json", "token_bytes.bin", "train.bin", "val.bin"]


def test_every_file_a_run_reads_is_checked_by_content(tmp_path, corpus):
    """meta.json hashes token_bytes.bin (val_bpb divides by it) beside the token files: one changed byte is refused by
    --verify and by the check every train.py and eval.py start makes; an edited vocab_size is refused (token_bytes.bin
    covers the tokenizer's); a tokenizer.json the folder was prepared with, changed or cut short afterwards, is refused
    before a run could keep it."""
    from support import write_tiny_tokenizer
    out = tmp_path / "d"
    meta = prepare_data.prepare(input=corpus, out_dir=str(out), max_tokens=2000, workers=1)
    assert meta["files"]["token_bytes.bin"] == {"bytes": 2 * meta["vocab_size"],
                                                "sha256": hashlib.sha256((out / "token_bytes.bin").read_bytes()).hexdigest()}
    prepare_data.check_files(str(out), meta)
    table = (out / "token_bytes.bin").read_bytes()
    (out / "token_bytes.bin").write_bytes(table[:100] + bytes([table[100] ^ 1]) + table[101:])
    for check in (lambda: prepare_data.main(["--verify", f"--out_dir={out}"]),
                  lambda: prepare_data.check_files(str(out), meta)):
        with pytest.raises((SystemExit, ValueError), match="token_bytes.bin is not the file meta.json records"):
            check()
    (out / "token_bytes.bin").write_bytes(table)
    with pytest.raises(ValueError, match=r"vocab_size \(1,000\) is not its tokenizer's"):
        prepare_data.check_files(str(out), {**meta, "vocab_size": 1000})
    tok = write_tiny_tokenizer(str(tmp_path / "tokenizer.json"))
    meta = prepare_data.prepare(input=corpus, out_dir=str(tmp_path / "t"), max_tokens=2000, workers=1, tokenizer=tok)
    prepare_data.check_files(str(tmp_path / "t"), meta)
    text = open(tok).read()
    open(tok, "w").write(text[:len(text) // 2])   # cut short after the data were prepared
    with pytest.raises(ValueError, match="the tokenizer .* was prepared with, is not that file any more"):
        prepare_data.check_files(str(tmp_path / "t"), meta)
