"""
The suite's setup and its shared fixtures. The README's command runs it: python -m pytest -q -rs -n auto
--maxprocesses=16 --dist worksteal tests (pytest-xdist, one worker per core; plain `python -m pytest tests` runs the
same tests one by one). One file per file under test; support.py holds what several use. Uses ../shared/data (offline
text, eval sets, tiktoken's cache) when it is there; otherwise a small corpus built from Python's own documentation,
and tiktoken's normal download.
"""
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # the repository's modules, imported by name as its scripts import one another

# PyTorch's CPU allocator on transparent huge pages: the suite's small CPU trainings allocate a (tokens x 50,304)
# logit tensor at every micro-step, and on 4 KB pages the kernel faults and zeroes it page by page (a tiny run's step
# 1.7x faster with it on 2 cores). Set before torch is imported; train.py and the other launches inherit it.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():   # kernels run on the CPU through Triton's interpreter (set before importing it)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# each pytest-xdist worker keeps to its share of the cores
torch.set_num_threads(min(torch.get_num_threads(), max(1, (os.cpu_count() or 1)
                                                         // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))
# The routing tests put tanh between sites and compare two paths at 1e-5 (fp32). PyTorch's CPU tanh (seen with 2.13
# on 2 cores) now and then returns its first result in a process 5e-5 off: that first call is made here, not in a test
torch.tanh(torch.zeros(64))
# The suite's subprocesses (train.py, torchrun, sample.py, ...) import torch afresh. Where Python cannot keep bytecode
# beside torch's sources (a read-only install, or PYTHONDONTWRITEBYTECODE), each launch compiles its ~1,800 modules
# again (5 s of every launch on a GPU host); a bytecode cache of the suite's own compiles them once.
_PYCACHE = os.path.join(os.path.dirname(torch.__file__), "__pycache__")
if sys.dont_write_bytecode or not os.access(_PYCACHE if os.path.isdir(_PYCACHE) else os.path.dirname(_PYCACHE), os.W_OK):
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ.setdefault("PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), "mhar-tests-pycache"))
_SHARED = os.path.join(ROOT, "..", "shared", "data")   # offline text, eval sets, tiktoken's cache (support.SHARED)
if "TIKTOKEN_CACHE_DIR" not in os.environ and os.path.isdir(os.path.join(_SHARED, "tiktoken_cache")):
    os.environ["TIKTOKEN_CACHE_DIR"] = os.path.realpath(os.path.join(_SHARED, "tiktoken_cache"))

import json  # noqa: E402
import lzma  # noqa: E402
import pydoc  # noqa: E402

import pytest  # noqa: E402

import prepare_data  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from support import EVAL, SHARED  # noqa: E402


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
