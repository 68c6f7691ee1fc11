"""
Tokenize text into flat token files for train.py (TokenWriter), and read them back (TokenData).

Default: FineWeb-Edu sample-10BT streamed from the Hugging Face Hub (needs `datasets` and a network),
stopping after --max_tokens training tokens. Or local files: --input= a file, a glob or a directory of
.jsonl / .jsonl.gz / .jsonl.xz / .txt / .parquet (a `text` field per row; a .txt file is one document;
documents.py reads them), up to --max_tokens too (a line says when input is left unread).

Validation documents are held out by document: from --val_input when given, otherwise every k-th
document (k = 1 / --val_fraction, starting with the first), so train and val never share a document.
Every document is preceded by the end-of-text token. Output in --out_dir:
  train.bin, val.bin   raw token ids, uint16 (uint32 when the vocab does not fit)
  token_bytes.bin      the UTF-8 bytes each token id stands for (uint16; 0 for special tokens): train.py's val_bpb
  tokenizer.json       a Hugging Face tokenizer named by its Hub model (--tokenizer=Qwen/Qwen3-0.6B), fetched here
  meta.json            tokenizer, vocab size (and a Hub model's own), token/document counts, inputs
Examples:
  python prepare_data.py --max_tokens=100_000_000 --out_dir=data/fineweb_edu
  python prepare_data.py --input=../shared/data/text/books_wiki_en_train.jsonl.xz \
      --val_input=../shared/data/text/books_wiki_en_val.jsonl.xz --out_dir=data/books_wiki
  python prepare_data.py --tokenizer=Qwen/Qwen3-0.6B --out_dir=data/fineweb_qwen3    # the paper's tokenizer
"""
import hashlib
import json
import multiprocessing
import os
import re
import shlex
import shutil
import signal
import sys
import time
from collections import deque
from contextlib import contextmanager
from multiprocessing import Pool

import numpy as np

from common import LockHeld, handle_signals, keeps_signals, release_lock, take_lock, write_atomic
from documents import HUB_CONFIG, HUB_DATASET, Inputs, hub_documents, read_documents, resolve_inputs
from options import Count, Parser, Path, Real, Text
from tokenizer import (HFTokenizer, TOKENIZERS, Tokenizer, hub_tokenizer, is_hub_name, load_tokenizer, token_byte_table,
                       tokenizer_id)


def token_dtype(vocab_size):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


_enc = None


def _init_worker(name, eot=None, parent=None):
    global _enc
    if parent is not None:   # a pool worker: Ctrl-C and SIGTERM are the parent's to handle (_stop), and on Linux
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # the worker dies with it, however it ends (a replacement the
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # pool starts for a killed worker too)
        try:
            import ctypes
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        except (OSError, AttributeError):   # not Linux
            pass
        if os.getppid() != parent:   # the parent ended before that took hold
            os._exit(0)
    _enc = load_tokenizer(name, eot=eot)


def _encode(texts):
    eot = _enc.eot_token
    return [np.array([eot] + _enc.encode_ordinary(t), dtype=np.uint32) for t in texts]


def batched(iterable, n):
    batch = []
    for x in iterable:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def encode_stream(docs, tokenizer, workers, batch_docs=64, eot=None):
    """Yield token arrays (one per document, end-of-text first) in document order. Parallel over
    `workers` processes with a bounded look-ahead, so a streamed source is read only as far as used."""
    if workers <= 1:
        _init_worker(tokenizer, eot)
        for batch in batched(docs, batch_docs):
            yield from _encode(batch)
        return
    pool, pending = Pool(workers, initializer=_init_worker, initargs=(tokenizer, eot, os.getpid())), deque()
    try:
        for batch in batched(docs, batch_docs):
            pending.append(pool.apply_async(_encode, (batch,)))
            if len(pending) >= 4 * workers:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()
    finally:   # (a caller that stops early, at --max_tokens): the batches sent are finished before the pool closes.
        # Pool.terminate() with tasks still in its pipe can hang: its task thread, blocked writing to the full pipe of
        # workers being killed, holds the lock terminate() needs. A worker that died (the OOM killer) still gets it.
        finished = all(result.wait(60) or result.ready() for result in pending)
        if finished:
            pool.close()
            pool.join()
        else:
            pool.terminate()


class TokenWriter:
    """Append token arrays to `path`, hashing them as they go (SHA-256 of the file's bytes: meta.json's)."""

    def __init__(self, path, dtype):
        self.path, self.dtype, self.tokens, self.docs = path, dtype, 0, 0
        self.f, self.sha = open(path, "wb"), hashlib.sha256()

    def write(self, toks, limit=None):
        if limit is not None:
            toks = toks[: max(limit - self.tokens, 0)]
        raw = toks.astype(self.dtype).tobytes()
        self.f.write(raw)
        self.sha.update(raw)
        self.tokens += len(toks)
        self.docs += 1
        return len(toks)

    def close(self):
        self.f.close()
        return {"bytes": os.path.getsize(self.path), "sha256": self.sha.hexdigest(),
                "sampled_sha256": sampled_sha256(self.path)}


def sampled_sha256(path, block=1 << 16, samples=64):
    """SHA-256 of a file's both ends and `samples` evenly spaced blocks: ~4 MB read whatever its size (a few
    milliseconds), what train.py checks at every start; a changed size or a changed sampled block shows."""
    size, digest = os.path.getsize(path), hashlib.sha256()
    last = max(0, size - block)
    with open(path, "rb") as f:
        for offset in sorted({0, last, *(i * last // samples for i in range(samples))}):
            f.seek(offset)
            digest.update(f.read(block))
    return digest.hexdigest()


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_files(data_dir, meta, full=False):
    """Every file a run reads from data_dir against meta.json, a ValueError naming the first that differs: the token
    files' sizes (the token counts meta.json gives), their sampled blocks (when meta.json has them) and with full=True
    the SHA-256 of every byte (prepare_data.py --verify); token_bytes.bin and a kept tokenizer.json by their SHA-256
    always (small); a tokenizer.json the folder names elsewhere (a converted model's) by the identity meta.json records
    (its sha1). Returns each token file's size and sampled SHA-256 (what a checkpoint records of its data)."""
    for name, want in meta.get("files", {}).items():
        path = os.path.join(data_dir, name)
        if name not in ("train.bin", "val.bin") and (not os.path.isfile(path) or sha256_file(path) != want["sha256"]):
            raise ValueError(f"{path} is {'missing' if not os.path.isfile(path) else 'not the file meta.json records'} "
                             f"(its SHA-256): damaged or replaced after prepare_data.py wrote it; prepare the folder "
                             f"again: {remake_command(data_dir, meta)}")
    tok = meta.get("tokenizer", "")
    if tok.endswith(".json") and "tokenizer.json" not in meta.get("files", {}):   # (a kept one is checked above)
        if not os.path.isfile(tok) or tokenizer_id(tok) != meta.get("tokenizer_id"):
            raise ValueError(f"{tok}, the tokenizer {data_dir} was prepared with, is "
                             f"{'gone' if not os.path.isfile(tok) else 'not that file any more (its sha1 differs)'}: "
                             "a run would keep a tokenizer its tokens do not match; restore it, or prepare the data again "
                             "with the tokenizer at hand")
    width, found = np.dtype(meta["dtype"]).itemsize, {}
    for name, count in (("train.bin", meta["train_tokens"]), ("val.bin", meta["val_tokens"])):
        path, want = os.path.join(data_dir, name), meta.get("files", {}).get(name, {})
        if not os.path.isfile(path):
            raise ValueError(f"{path} not found: prepare the folder again: {remake_command(data_dir, meta)}")
        size = os.path.getsize(path)
        if size != count * width:
            raise ValueError(f"{path} holds {size // width:,} tokens ({size:,} bytes) but meta.json says {count:,}: the "
                             "folder changed after prepare_data.py wrote it (cut short, or another prepare into it); "
                             f"prepare it again: {remake_command(data_dir, meta)}")
        found[name] = {"bytes": size, "sampled_sha256": sampled_sha256(path)}
        if full and want.get("sha256"):
            if sha256_file(path) != want["sha256"]:
                raise ValueError(f"{path}: its SHA-256 is not meta.json's: damaged; prepare it again: "
                                 f"{remake_command(data_dir, meta)}")
        elif want.get("sampled_sha256") and found[name]["sampled_sha256"] != want["sampled_sha256"]:
            raise ValueError(f"{path} has meta.json's size but other bytes (its sampled blocks differ): changed or "
                             f"damaged after it was written; prepare it again: {remake_command(data_dir, meta)}")
    table = meta.get("files", {}).get("token_bytes.bin", {}).get("bytes")   # 2 bytes a token of the tokenizer
    top = int(np.memmap(os.path.join(data_dir, "val.bin"), dtype=meta["dtype"], mode="r").max())
    if (table is not None and table != 2 * meta["vocab_size"]) or top >= meta["vocab_size"]:
        raise ValueError(f"{data_dir}/meta.json's vocab_size ({meta['vocab_size']:,}) is not its tokenizer's ("
                         + (f"token_bytes.bin covers {table // 2:,} tokens" if table is not None else
                            f"val.bin holds token id {top:,}") + "): meta.json was edited; prepare the folder again: "
                         + remake_command(data_dir, meta))
    return found


def remake_command(data_dir, meta):
    """The prepare_data.py command that makes data_dir again from what its meta.json records."""
    inputs, val = meta.get("inputs") or [], meta.get("val_inputs") or []
    local = inputs and not inputs[0].startswith("hf://")
    q = shlex.quote   # (a path with a space is one argument)
    args = ([f"--input={q(inputs[0] if len(inputs) == 1 else os.path.commonpath(inputs))}"] if local else []) + \
        ([f"--val_input={q(val[0] if len(val) == 1 else os.path.commonpath(val))}"] if val else []) + \
        ([f"--tokenizer={meta.get('tokenizer_source') or meta['tokenizer']}"] if meta.get("tokenizer", "gpt2") != "gpt2"
         else []) + ([f"--tokenizer_revision={meta['tokenizer_revision']}"] if meta.get("tokenizer_revision") else []) + \
        [f"--{k}={meta[k]:g}" for k in ("max_tokens", "max_val_tokens") if meta.get(k) is not None]
    every = re.fullmatch(r"every (\d+)th document", meta.get("val_split", ""))
    args += ([f"--val_fraction={1 / int(every.group(1)):g}"] if every and every.group(1) != "100" else []) + \
        ([f"--text_field={meta['text_field']}"] if meta.get("text_field", "text") != "text" else [])
    return " ".join(["python prepare_data.py", *args, f"--out_dir={q(data_dir)}", "--force"])


class TokenData:
    """The reader of a TokenWriter file: the tokens cut into non-overlapping sequences of block_size (+1 for the
    targets). Training order: a fresh permutation of all sequences every epoch, seeded by (seed, epoch); the k-th
    sequence of a run is a pure function of k, so a resumed run and any number of processes see the same data."""

    def __init__(self, path, dtype, block_size, seed):
        if not os.path.isfile(path):
            raise ValueError(f"{path} not found: prepare the data folder with prepare_data.py --out_dir="
                             f"{os.path.dirname(path) or '.'}")
        size, width = os.path.getsize(path), np.dtype(dtype).itemsize
        if size == 0 or size % width:
            raise ValueError(f"{path} is {'empty' if size == 0 else f'{size} bytes, not a whole number of {dtype} tokens'}:"
                             " a damaged or unfinished file; prepare the data again (prepare_data.py --force)")
        self.data = np.memmap(path, dtype=dtype, mode="r")
        self.T, self.seed = block_size, seed
        self.n_seq = (len(self.data) - 1) // block_size
        if self.n_seq < 1:
            raise ValueError(f"{path} holds {len(self.data)} tokens, fewer than block_size + 1 = {block_size + 1}")
        self._perm_epoch, self._perm = None, None

    def rows(self, starts):
        """The sequences starting at these token offsets, as a (len(starts), T+1) int64 array."""
        return np.stack([self.data[s: s + self.T + 1] for s in starts]).astype(np.int64)

    def train_batch(self, first, count):
        """Sequences first .. first+count-1 of the training order, as a (count, T+1) int64 array."""
        starts = []
        for k in range(first, first + count):
            epoch, pos = divmod(k, self.n_seq)
            if epoch != self._perm_epoch:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_seq)
                self._perm_epoch = epoch
            starts.append(int(self._perm[pos]) * self.T)
        return self.rows(starts)


def prepare(input=None, val_input=None, out_dir=None, tokenizer="gpt2", max_tokens=100_000_000,
            max_val_tokens=None, val_fraction=0.01, text_field="text", workers=None, force=False, eot_token=None,
            tokenizer_revision=None):
    hub, model_vocab = (tokenizer, None) if is_hub_name(tokenizer) else (None, None)
    if tokenizer_revision and not hub:
        raise ValueError(f"--tokenizer_revision={tokenizer_revision} is for a Hugging Face model's name (--tokenizer="
                         "owner/model)")
    if hub:   # a Hub model's tokenizer.json, fetched (or found in the Hub's cache) now; copied into out_dir at the end
        tokenizer, model_vocab = hub_tokenizer(hub, tokenizer_revision)
    if eot_token and not tokenizer.endswith(".json"):
        raise ValueError(f"--eot_token={eot_token!r} is for a tokenizer.json; tiktoken's {tokenizer} has its own")
    enc = load_tokenizer(tokenizer, eot=eot_token)   # fail early, before reading any data
    if not val_input and not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1) when no --val_input is given")
    for name, value in (("max_tokens", max_tokens), ("max_val_tokens", max_val_tokens), ("workers", workers)):
        if value is not None and value <= 0:
            raise ValueError(f"--{name}={value} must be a positive whole number")
    if out_dir is None:
        name = "fineweb_edu" if input is None else os.path.basename(input.rstrip("/*")).split(".")[0] or "local"
        out_dir = os.path.join("data", name)
    cores = os.cpu_count() or 1
    if workers and workers > cores:
        print(f"prepare_data.py: --workers={workers} on {cores} cores: the workers take turns on them")
    workers = workers or min(cores, 16)
    dtype = token_dtype(enc.n_vocab)
    inputs = resolve_inputs(input) if input else None
    val_inputs = resolve_inputs(val_input) if val_input else None
    from tqdm import tqdm
    every = None if val_inputs else max(1, round(1 / val_fraction))
    t0 = time.time()
    with staging(out_dir, force) as stage:   # (the folder is held before what it holds is looked at)
        train, val = (TokenWriter(os.path.join(stage, name), dtype) for name in ("train.bin", "val.bin"))
        # progress: the Hub stream toward --max_tokens; local files by their bytes read (the tokens they hold unknown)
        bar = tqdm(total=sum(map(os.path.getsize, inputs)) if inputs else max_tokens, unit="B" if inputs else "tok",
                   unit_scale=True, desc=f"tokenizing ({workers} workers)")
        docs = read_documents(inputs, text_field, bar.update) if inputs else hub_documents(text_field)
        stream, capped = encode_stream(docs, tokenizer, workers, eot=eot_token), False
        with bar:
            for i, toks in enumerate(stream):
                if every is not None and i % every == 0:
                    if max_val_tokens is None or val.tokens < max_val_tokens:
                        val.write(toks, max_val_tokens)
                    continue
                written = train.write(toks, max_tokens)
                if inputs:
                    bar.set_postfix_str(f"{train.tokens:,} tokens", refresh=False)
                else:
                    bar.update(written)
                if max_tokens is not None and train.tokens >= max_tokens:   # local input left unread: said below
                    capped = bool(inputs) and (written < len(toks) or next(stream, None) is not None)
                    break
        stream.close()   # (its pool, before the validation documents start one of their own)
        if val_inputs:
            for toks in encode_stream(read_documents(val_inputs, text_field), tokenizer, workers, eot=eot_token):
                val.write(toks, max_val_tokens)
                if max_val_tokens is not None and val.tokens >= max_val_tokens:
                    break
        if train.tokens == 0 or val.tokens == 0:
            raise RuntimeError(f"got {train.tokens} train and {val.tokens} val tokens: need some of each "
                               "(more input documents, or a larger --val_fraction)")
        files = {"train.bin": train.close(), "val.bin": val.close()}
        identity = tokenizer_id(tokenizer)   # what it is, for checks against a model
        if hub:   # the data folder keeps the Hub model's tokenizer: the runs it feeds read it from there
            shutil.copyfile(tokenizer, os.path.join(stage, "tokenizer.json"))
            tokenizer = os.path.join(out_dir, "tokenizer.json")
        if tokenizer.endswith(".json"):   # and where it came from
            tokenizer = os.path.abspath(tokenizer)
        write_atomic(os.path.join(stage, "token_bytes.bin"), token_byte_table(enc).tobytes())
        for name in ("token_bytes.bin", "tokenizer.json"):   # the small files a run reads: hashed whole, checked whole
            if os.path.isfile(os.path.join(stage, name)):
                files[name] = {"bytes": os.path.getsize(os.path.join(stage, name)),
                               "sha256": sha256_file(os.path.join(stage, name))}
        meta = {"tokenizer": tokenizer, "tokenizer_id": identity, "vocab_size": enc.n_vocab,
                **({"tokenizer_source": hub, "tokenizer_revision": tokenizer_revision, "model_vocab_size": model_vocab}
                   if hub else {}),
                "eot_token": enc.eot_token, "dtype": np.dtype(dtype).name, "train_tokens": train.tokens,
                "val_tokens": val.tokens, "train_docs": train.docs, "val_docs": val.docs,
                "inputs": inputs or [f"hf://{HUB_DATASET}/{HUB_CONFIG}"], "val_inputs": val_inputs,
                "val_split": "val_input" if val_inputs else f"every {every}th document",
                "max_tokens": max_tokens, "max_val_tokens": max_val_tokens, "text_field": text_field, "files": files}
        write_atomic(os.path.join(stage, "meta.json"), json.dumps(meta, indent=2))
    print(f"wrote {out_dir}: {train.tokens:,} train tokens ({train.docs:,} docs), "
          f"{val.tokens:,} val tokens ({val.docs:,} docs), {np.dtype(dtype).name}, {time.time() - t0:.1f}s")
    if capped:
        print(f"prepare_data.py: stopped at --max_tokens={max_tokens:,} before the end of {input}: the rest was not "
              f"read; give a larger --max_tokens (e.g. --max_tokens=1e{len(str(max_tokens))}) to take all of it")
    print(f"next: python train.py config/tiny.py --data_dir={shlex.quote(out_dir)}   (config/*.py: the paper's scales)")
    return meta


# the prepare in progress, for the stop handler: its staging folder, lock, and whether it made out_dir
_ACTIVE = {}


@contextmanager
def staging(out_dir, force=False):
    """A folder (out_dir/.incomplete) that one prepare writes every file into, under out_dir/prepare.lock (a second
    prepare into out_dir is refused, naming the first; train.py refuses the folder while it is held). When the body
    succeeds its files replace out_dir's, meta.json last (Ctrl-C and SIGTERM held off meanwhile); when it fails the
    staging folder is removed, and out_dir too when this call made it and nothing else is in it (_stop does the same
    for a signal)."""
    created = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    lock = os.path.join(out_dir, "prepare.lock")
    try:
        if take_lock(lock, "prepare_data.py") is not None:
            print(f"prepare_data.py: took over {lock}: the prepare that held it is gone")
    except LockHeld as e:
        raise FileExistsError(f"{out_dir} is being prepared by another prepare_data.py (pid {e.holder['pid']}): wait "
                              "for it to finish, or pick another --out_dir") from None
    stage = os.path.join(out_dir, ".incomplete")
    _ACTIVE.clear()
    _ACTIVE.update(stage=stage, lock=lock, out_dir=out_dir, created=created)
    try:
        existing = [n for n in ("train.bin", "val.bin", "meta.json") if os.path.exists(os.path.join(out_dir, n))]
        if existing and not force:
            raise FileExistsError(f"{out_dir} already holds {', '.join(existing)}: choose another --out_dir or pass "
                                  "--force to replace them")
        if existing and not written_here(out_dir):
            raise FileExistsError(f"{out_dir} holds {', '.join(existing)} that prepare_data.py did not write (no "
                                  "meta.json of its own): --force replaces only its own folders; choose another --out_dir")
        shutil.rmtree(stage, ignore_errors=True)   # (left by a prepare that was killed: its lock was stale)
        os.makedirs(stage)
        yield stage
        names = sorted(os.listdir(stage), key=lambda n: n == "meta.json")   # meta.json last: it vouches for the rest
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            for name in names:
                os.replace(os.path.join(stage, name), os.path.join(out_dir, name))
            os.rmdir(stage)
            release_lock(lock)
            _ACTIVE.clear()
            _ACTIVE["done"] = out_dir
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
    except BaseException:
        _discard()
        raise


def written_here(out_dir):
    """Did prepare_data.py write out_dir? Its meta.json (the tokenizer and counts it records) is the mark."""
    try:
        with open(os.path.join(out_dir, "meta.json")) as f:
            meta = json.load(f)
        return isinstance(meta, dict) and {"tokenizer_id", "train_tokens"} <= meta.keys()
    except (OSError, ValueError):
        return False


def _discard():
    """Remove the prepare in progress: its staging folder, its lock, out_dir if it made it and it is empty."""
    if "stage" in _ACTIVE:
        shutil.rmtree(_ACTIVE["stage"], ignore_errors=True)
        release_lock(_ACTIVE["lock"])
        if _ACTIVE["created"] and not os.listdir(_ACTIVE["out_dir"]):
            os.rmdir(_ACTIVE["out_dir"])
        _ACTIVE.clear()


def _stop(signum, frame):
    """Ctrl-C or SIGTERM: kill the pool's workers, remove the partial files, one line, exit 130 / 143. Done here and
    at once (os._exit): an exception raised wherever the main thread is could land inside the pool's own machinery,
    whose shutdown can then wait forever on a lock a killed worker held."""
    for worker in multiprocessing.active_children():
        worker.kill()
        worker.join(1)
    partial, done = "stage" in _ACTIVE, _ACTIVE.get("done")
    _discard()
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    print(("\n" if partial else "") + f"prepare_data.py: stopped by {name}; " + (
        "the partial files were removed and the folder holds what it held before" if partial else
        f"{done} was complete before it" if done else "nothing was written"), file=sys.stderr, flush=True)
    os._exit(130 if signum == signal.SIGINT else 143)


def parser(verify=False):
    """prepare_data.py's options, each with its kind and range (options.py); with --verify, --out_dir is read, not
    written (a folder that exists, not the write guard's)."""
    p = Parser(prog="prepare_data.py", description=__doc__)
    p.add_argument("--input", type=Inputs(), help="file, glob or directory of .jsonl[.gz|.xz]/.txt/.parquet; default: "
                   "FineWeb-Edu from the Hub")
    p.add_argument("--val_input", type=Inputs(), help="validation documents (same formats); default: every k-th input "
                   "document")
    p.add_argument("--out_dir", type=Path("dir", "a folder prepare_data.py wrote (its meta.json)", absolute=False)
                   if verify else Path("out_dir", absolute=False, writes="data"),
                   help="output folder (default data/<input name> or data/fineweb_edu)")
    p.add_argument("--tokenizer", type=Tokenizer(hub=True), default="gpt2", help=f"tiktoken encoding "
                   f"({', '.join(TOKENIZERS)}; default gpt2), the path of a Hugging Face tokenizer.json (e.g. of a model "
                   "converted with convert.py), or a Hub model's name (Qwen/Qwen3-0.6B: the paper's; its tokenizer.json is "
                   "fetched and kept in --out_dir)")
    p.add_argument("--tokenizer_revision", type=Text(), default=None, help="with a Hub model's --tokenizer: the "
                   "branch, tag or commit to fetch it at (default: main; a commit pins it)")
    p.add_argument("--eot_token", type=Text(), default=None, help="a tokenizer.json's end-of-text token, written before "
                   "every document (default: the first it has of " + ", ".join(HFTokenizer.EOT_NAMES) + ")")
    p.add_argument("--max_tokens", type=Count(1, 10**13), default=100_000_000,
                   help="stop after this many training tokens (default 100M; 1e9 style accepted); local input past it is left "
                   "unread (a line says so)")
    p.add_argument("--max_val_tokens", type=Count(1, 10**13), default=None, help="cap on validation tokens (default: "
                   "none)")
    p.add_argument("--val_fraction", type=Real(0, 1, lo_open=True, hi_open=True), default=0.01,
                   help="held-out fraction of documents (default 0.01)")
    p.add_argument("--text_field", type=Text(), default="text", help="field/column holding the text (default text)")
    p.add_argument("--workers", type=Count(1, 1024), default=None, help="encoding processes (default: CPU count, at "
                   "most 16)")
    p.add_argument("--force", action="store_true", help="replace the token files of a folder prepare_data.py wrote "
                   "(never another folder's files)")
    p.add_argument("--verify", action="store_true", help="check --out_dir's token files against its meta.json, every "
                   "byte (SHA-256), and exit; train.py checks their sizes and sampled blocks at every start")
    return p


@keeps_signals
def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = parser(verify="--verify" in argv)
    args = p.parse_args(argv)
    handle_signals(_stop, signal.SIGINT, signal.SIGTERM)
    try:
        if args.verify:
            verify(args.out_dir)
        else:
            prepare(**{k: v for k, v in vars(args).items() if k != "verify"})
    except (ValueError, FileNotFoundError, FileExistsError, KeyError, RuntimeError) as e:
        sys.exit(f"prepare_data.py: error: {e}")
    except OSError as e:   # a full disk, a read-only folder: what was staged is gone (staging)
        sys.exit(f"prepare_data.py: error: could not write {args.out_dir or 'the output folder'} ({e.strerror or e}); the "
                 "partial files were removed and the folder holds what it held before")


def verify(out_dir):
    if not out_dir or not os.path.isfile(os.path.join(out_dir, "meta.json")):
        raise FileNotFoundError(f"--verify needs --out_dir=<a folder prepare_data.py wrote>; {out_dir} has no meta.json")
    with open(os.path.join(out_dir, "meta.json")) as f:
        meta = json.load(f)
    if "files" not in meta:
        raise ValueError(f"{out_dir}/meta.json has no checksums (an older prepare): prepare it again to have them")
    t0 = time.time()
    check_files(out_dir, meta, full=True)
    unchecked = [n for n in ("token_bytes.bin",) if n not in meta["files"] and os.path.isfile(os.path.join(out_dir, n))]
    print(f"{out_dir}: {', '.join(meta['files'])} match meta.json ({sum(f['bytes'] for f in meta['files'].values()):,} "
          f"bytes, SHA-256, {time.time() - t0:.1f}s)" + (f"; {', '.join(unchecked)} unchecked (an older prepare "
                                                         "recorded no hash of it)" if unchecked else ""))


if __name__ == "__main__":
    main()   # (Ctrl-C and SIGTERM: _stop)
