"""
Evaluate a checkpoint (paper Table 2), probe its routing (Table 6, Figure 4), plot training curves.

  python eval.py --harness --out_dir=out/mhar_100m                           # lm-evaluation-harness (the paper's)
  python eval.py --harness --out_dir=out/mhar_100m --data_root=../shared/data/eval   # its tasks over local files
  python eval.py --out_dir=out/mhar_100m                                     # our protocols, data from the Hub
  python eval.py --out_dir=out/mhar_100m --data_root=../shared/data/eval --limit=500   # -> out_dir/eval.limit500.json
  python eval.py --probe --out_dir=out/mhar_100m --data_dir=data/fineweb_edu # routing maps, Figure 4, Table 6
  python eval.py --plot out/baseline_100m/log.jsonl out/mhar_100m/log.jsonl --output=curves.png

--harness: the paper scored Table 2 zero-shot with lm-evaluation-harness; harness_lm wraps the checkpoint as its
model (registered "mhar") and run_harness calls lm_eval.simple_evaluate per task; with --data_root, wikitext,
lambada_openai and hellaswag are harness_tasks/'s local task files (the harness' prompts and metrics).
Our protocols, without --harness (the tokenizer is the checkpoint's; every score is a sum of log-probabilities of
given tokens):
  wikitext2  the raw test split as one string, encode_ordinary; windows of block_size tokens starting at
             multiples of block_size/2; the first window scores all its predictions, every later one only
             its last block_size/2 (each token is predicted once, with at least block_size/2 tokens of
             context after the first window); stop after the window that reaches the end. token_ppl =
             exp(NLL / scored tokens), word_ppl = exp(NLL / whitespace-separated words of the scored text).
             lm-evaluation-harness instead scores each of its documents (article) separately with rolling
             windows, so its perplexities differ.
  lambada    OpenAI's test set: each text split at its last space; the context is the text before it, the
             target the rest with its leading space; correct when the greedy prediction (teacher-forced)
             matches every target token; nll = mean over examples of the target tokens' summed NLL.
  hellaswag  validation: each ending scored by the summed log-probability of the tokens of " " + ending after
             the tokens of ctx (the `ctx` field as given); acc = argmax of the sums, acc_norm = argmax of the
             sums divided by len(" " + ending) in characters.
--limit=N keeps the first N*block_size tokens of WikiText-2 and the first N examples of the other two.
"""
import json
import lzma
import math
import os
import re
import signal
import sys
from contextlib import nullcontext

if __name__ == "__main__":   # Ctrl-C while torch loads: a quiet exit (nothing is written yet)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch
import torch.nn.functional as F

from checkpoint import load_model as checkpoint_model
from common import PLOT_MARK, keeps_signals, run_script, write_atomic
from metrics import read_log
from model import route_logit
from options import Count, Device, Parser, Path, Text
from prepare_data import TokenData, check_files
from tokenizer import Tokenizer, checkpoint_tokenizer, load_tokenizer

TASKS = ("wikitext2", "lambada", "hellaswag")
LOCAL = {"wikitext2": "wikitext-2-raw/wiki.test.raw", "lambada": "lambada/lambada_test.jsonl",
         "hellaswag": "hellaswag/hellaswag_val.jsonl"}


# -----------------------------------------------------------------------------
# data: the Hub (datasets, imported lazily) or local files laid out like ../shared/data/eval

def _read_jsonl(path):
    for p in (path, path + ".xz"):
        if os.path.isfile(p):
            with (lzma.open(p, "rt", encoding="utf-8") if p.endswith(".xz") else open(p, encoding="utf-8")) as f:
                return [json.loads(line) for line in f if line.strip()]
    raise FileNotFoundError(f"{path}[.xz] not found")


def load_task(task, data_root=None, wikitext_split="test"):
    """wikitext2: the raw text of a split (str); lambada: [text]; hellaswag: [(ctx, [4 endings], label)]."""
    if data_root is not None:
        path = os.path.join(data_root, LOCAL[task])
        if task == "wikitext2":
            path = path.replace("wiki.test.raw", "wiki.valid.raw" if wikitext_split == "validation" else "wiki.test.raw")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} not found (--data_root must hold {os.path.relpath(path, data_root)})")
            return open(path, encoding="utf-8").read()
        rows = _read_jsonl(path)
    else:
        try:
            import datasets
        except ImportError as e:
            raise RuntimeError("reading the evaluation sets from the Hub needs `pip install datasets`; "
                               "or pass --data_root=DIR with local copies (e.g. ../shared/data/eval)") from e
        try:
            if task == "wikitext2":   # rows are the file's lines, newlines kept: joined they are the raw file
                return "".join(datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=wikitext_split)["text"])
            name, split = {"lambada": ("EleutherAI/lambada_openai", "test"), "hellaswag": ("Rowan/hellaswag", "validation")}[task]
            rows = list(datasets.load_dataset(name, split=split))
        except (OSError, ConnectionError, TimeoutError) as e:   # offline: the Hub client's errors derive from these
            raise RuntimeError(f"could not load {task} from the Hugging Face Hub ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}); without a network, pass --data_root=DIR "
                               "with local copies (laid out like ../shared/data/eval)") from None
    if task == "lambada":
        return [r["text"] for r in rows]
    return [(r["ctx"], list(r["endings"]), int(r["label"])) for r in rows]   # the Hub's labels are strings


# -----------------------------------------------------------------------------
# scoring: requests (context tokens, continuation tokens) -> summed log-probability and greedy match

class Scorer:
    def __init__(self, model, block_size, batch_size, device):
        self.model, self.block_size, self.batch_size, self.device = model, block_size, batch_size, device
        device_type = "cuda" if str(device).startswith("cuda") else "cpu"
        self.autocast = torch.autocast(device_type, dtype=torch.bfloat16) if device_type == "cuda" else nullcontext()
        with torch.no_grad(), self.autocast:   # one token first: the first forward's notes (which routing runs) come
            model(torch.zeros(1, 1, dtype=torch.long, device=device))   # before a progress bar, not inside its line

    @torch.no_grad()
    def score(self, requests, desc=None):
        """[(ctx_ids, cont_ids)] -> [(sum of log p(cont | ctx), every cont token the argmax)]. The context is cut
        from the left to fit block_size; requests are batched longest first, padded on the right (causal: the
        padding never reaches a scored position)."""
        from tqdm import tqdm
        out = [None] * len(requests)
        seqs = []
        for i, (ctx, cont) in enumerate(requests):
            if not cont:
                raise ValueError(f"request {i} has an empty continuation")
            full = (list(ctx) + list(cont))[-(self.block_size + 1):]
            n_cont = min(len(cont), len(full) - 1)
            seqs.append((i, full, n_cont))
        seqs.sort(key=lambda s: -len(s[1]))
        batches = [seqs[k:k + self.batch_size] for k in range(0, len(seqs), self.batch_size)]
        for batch in tqdm(batches, desc=desc, disable=desc is None, leave=False):
            T = max(len(f) for _, f, _ in batch) - 1
            x = torch.zeros(len(batch), T, dtype=torch.long)
            for b, (_, full, _) in enumerate(batch):
                x[b, :len(full) - 1] = torch.tensor(full[:-1])
            with self.autocast:
                logits, _ = self.model(x.to(self.device))
            # every scored position of the batch at once: (row of the batch, position, target) flattened
            req, pos, tgt = [], [], []
            for b, (_, full, n_cont) in enumerate(batch):
                req += [b] * n_cont
                pos += range(len(full) - 1 - n_cont, len(full) - 1)
                tgt += full[-n_cont:]
            dev = logits.device
            req, pos, tgt = (torch.tensor(v, device=dev) for v in (req, pos, tgt))
            rows = logits[req, pos].float()
            logp = F.log_softmax(rows, dim=-1).gather(1, tgt[:, None]).squeeze(1).double()
            sums = torch.zeros(len(batch), dtype=torch.float64, device=dev).index_add_(0, req, logp)
            misses = torch.zeros(len(batch), dtype=torch.long, device=dev).index_add_(0, req, (rows.argmax(-1) != tgt).long())
            for (i, _, _), s, m in zip(batch, sums.tolist(), misses.tolist()):   # one host sync per batch
                out[i] = (s, m == 0)
        return out


def wikitext_windows(n_tokens, block_size):
    """(start, end, first scored) of each window: tokens[start:end] in the model, targets [first, end) scored."""
    stride, start, scored_to, windows = block_size // 2, 0, 1, []
    while True:
        end = min(start + block_size, n_tokens)
        windows.append((start, end, max(scored_to, start + 1)))
        scored_to = end
        if end >= n_tokens:
            return windows
        start += stride


def eval_wikitext2(scorer, enc, text, limit=None):
    tokens = enc.encode_ordinary(text)
    if limit:
        tokens = tokens[:limit * scorer.block_size]
        text = enc.decode(tokens)
    if len(tokens) < 2:
        raise ValueError("wikitext2: fewer than 2 tokens to score")
    windows = wikitext_windows(len(tokens), scorer.block_size)
    res = scorer.score([(tokens[s:first], tokens[first:e]) for s, e, first in windows], desc="wikitext2")
    nll, n = -sum(r[0] for r in res), len(tokens) - 1
    words = len(text.split())
    return {"token_ppl": math.exp(nll / n), "word_ppl": math.exp(nll / words), "tokens": n, "words": words}


def lambada_request(enc, text):
    ctx, word = text.rsplit(" ", 1)
    return enc.encode_ordinary(ctx), enc.encode_ordinary(" " + word)


def eval_lambada(scorer, enc, texts, limit=None):
    texts = texts[:limit] if limit else texts
    res = scorer.score([lambada_request(enc, t) for t in texts], desc="lambada")
    return {"acc": sum(r[1] for r in res) / len(res), "nll": -sum(r[0] for r in res) / len(res), "n": len(res)}


def eval_hellaswag(scorer, enc, rows, limit=None):
    rows = rows[:limit] if limit else rows
    requests = [(enc.encode_ordinary(ctx), enc.encode_ordinary(" " + e)) for ctx, endings, _ in rows for e in endings]
    res = scorer.score(requests, desc="hellaswag")
    acc = acc_norm = 0
    k = 0
    for ctx, endings, label in rows:
        sums = [res[k + i][0] for i in range(len(endings))]
        norm = [s / len(" " + e) for s, e in zip(sums, endings)]
        acc += max(range(len(sums)), key=sums.__getitem__) == label
        acc_norm += max(range(len(norm)), key=norm.__getitem__) == label
        k += len(endings)
    return {"acc": acc / len(rows), "acc_norm": acc_norm / len(rows), "n": len(rows)}


EVALS = {"wikitext2": eval_wikitext2, "lambada": eval_lambada, "hellaswag": eval_hellaswag}


def load_model(out_dir, device, tokenizer=None, ema=False):
    """The checkpoint's model (eval mode; ema: its EMA weights) and tokenizer (`tokenizer` overrides the one it
    records); the tokenizer's name is model.checkpoint_info["tokenizer_used"]."""
    model = checkpoint_model(out_dir, device=device, ema=ema, say=lambda line: print(f"eval.py: {line}", file=sys.stderr))
    model.eval()
    enc, model.checkpoint_info["tokenizer_used"] = checkpoint_tokenizer(model.checkpoint_info, model.cfg.vocab_size,
                                                                        tokenizer)
    return model, enc


def default_block_size(model):
    """The training sequence length; a convert.py checkpoint (never trained here): its RoPE length, at most 4096."""
    train = model.checkpoint_info.get("train_config") or {}
    return min(train.get("block_size") or 4096, model.cfg.block_size)


# -----------------------------------------------------------------------------
# lm-evaluation-harness (the paper's Table 2 protocol): the model "mhar" around a checkpoint, and local task files

HARNESS_TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness_tasks")
LOCAL_HARNESS = {"wikitext": "wikitext_local", "lambada_openai": "lambada_openai_local", "hellaswag": "hellaswag_local"}


def harness_lm(model, enc, max_length, batch_size, device, max_gen_toks=256):
    """An lm_eval TemplateLM over a GPT (registered as "mhar" in this process; the lm_eval command finds no model
    outside its package: export.py's folder and `lm_eval --model hf ... trust_remote_code=True` run it there).
    loglikelihood: Scorer's batches (longest first, contexts cut from the left to max_length); rolling loglikelihood:
    the harness' disjoint windows of max_length tokens; generate_until: KV-cached greedy (or sampled) generation,
    batched over requests of one context length, cut at the first stop string."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import MODEL_REGISTRY, register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class MHARLM(TemplateLM):
        def __init__(self, pretrained=None, model=None, enc=None, max_length=None, batch_size=16, device="cpu",
                     max_gen_toks=256, tokenizer=None):
            super().__init__()
            if model is None:   # from the harness' command line: --model_args pretrained=OUT_DIR[,tokenizer=...]
                model, enc = load_model(pretrained, device, tokenizer)
            self.model, self.enc, self.device_ = model, enc, device
            self.max_length = int(max_length or default_block_size(model))
            self.batch_size, self.max_gen_toks = int(batch_size), int(max_gen_toks)
            self.scorer = Scorer(model, self.max_length, self.batch_size, device)

        @property
        def eot_token_id(self):
            return self.enc.eot_token

        def tok_encode(self, string, add_special_tokens=None, **kwargs):
            return self.enc.encode_ordinary(string)

        def tok_decode(self, tokens, **kwargs):
            return self.enc.decode(list(tokens))

        def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
            return self.scorer.score([(ctx, cont) for _, ctx, cont in requests],
                                     desc=None if disable_tqdm else "loglikelihood")

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            windows, owner = [], []
            for i, (text,) in enumerate(req.args for req in requests):
                for w in get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                   max_seq_len=self.max_length, context_len=1):
                    windows.append(make_disjoint_window(w))
                    owner.append(i)
            scores = self.scorer.score(windows, desc=None if disable_tqdm else "loglikelihood_rolling")
            totals = [0.0] * len(requests)
            for i, (logp, _) in zip(owner, scores):
                totals[i] += logp
            return totals

        def generate_until(self, requests, disable_tqdm=False):
            out = [None] * len(requests)
            groups = {}   # (context length, generation settings) -> request indices: one batch shape each
            for i, req in enumerate(requests):
                context, kw = req.args
                kw = dict(kw or {})
                until = kw.pop("until", None) or [self.tok_decode([self.eot_token_id])]
                until = [until] if isinstance(until, str) else list(until)
                n_new = int(kw.pop("max_gen_toks", self.max_gen_toks))
                sample, temperature = kw.pop("do_sample", False), float(kw.pop("temperature", 0.0) or 0.0)
                temp = temperature if sample and temperature > 0 else 0.0   # the harness' default: greedy
                ids = self.tok_encode(context)[-max(1, self.max_length - n_new):]
                groups.setdefault((len(ids), n_new, temp, tuple(until)), []).append((i, ids))
            for (_, n_new, temp, until), members in groups.items():
                for k in range(0, len(members), self.batch_size):
                    chunk = members[k:k + self.batch_size]
                    idx = torch.tensor([ids for _, ids in chunk], device=self.device_)
                    n0 = idx.size(1)

                    def done(seq):   # every row has a stop string (or the end-of-text token) in its new text
                        return all(any(u in self.tok_decode(row[n0:].tolist()) for u in until) for row in seq)
                    with self.scorer.autocast:
                        seq = self.model.generate(idx, n_new, temperature=temp, stop=done)
                    for (i, _), row in zip(chunk, seq.tolist()):
                        text = self.tok_decode(row[n0:])
                        for u in until:
                            text = text.split(u)[0]
                        out[i] = text
            return out

    if "mhar" not in MODEL_REGISTRY:
        register_model("mhar")(MHARLM)
    return MHARLM(model=model, enc=enc, max_length=max_length, batch_size=batch_size, device=device,
                  max_gen_toks=max_gen_toks)


def harness_tasks(tasks, data_root):
    """(lm_eval's TaskManager, the task names to run): every name checked against the harness' registry (and this
    repo's local task files) before any model loads; with data_root, the three Table 2 tasks become their local
    versions."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise RuntimeError("--harness needs lm-evaluation-harness: pip install lm-eval (requirements.txt)") from e
    metadata = None
    if data_root:   # the local task files (they never ask the Hub; other tasks still may)
        metadata = {"data_root": os.path.abspath(data_root)}
        tasks = [LOCAL_HARNESS.get(t, t) for t in tasks]
    manager = TaskManager(include_path=HARNESS_TASKS, metadata=metadata)
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        import difflib
        close = {t: difflib.get_close_matches(t, known, n=3) for t in unknown}
        raise ValueError(f"--tasks: unknown harness task(s) {', '.join(unknown)}"
                         + "".join(f" ({t}: did you mean {' or '.join(c)}?)" for t, c in close.items() if c)
                         + f"; the harness knows {len(known):,} (`lm_eval ls tasks` lists them)")
    return manager, tasks


def _offline(error):
    """Did this error come from an unreachable Hugging Face Hub (its chain searched)?"""
    while error is not None:
        text = f"{type(error).__name__}: {error}"
        if any(s in text for s in ("ConnectionError", "LocalEntryNotFound", "OfflineModeIsEnabled", "Couldn't reach",
                                   "couldn't connect", "Max retries exceeded", "Name or service not known")):
            return True
        error = error.__cause__ or error.__context__
    return False


def run_harness(args, model, enc, manager, tasks):
    """lm_eval.simple_evaluate of each task, zero-shot (the paper's Table 2 setting): {task: metrics, seconds}."""
    import time
    import lm_eval
    lm = harness_lm(model, enc, args.block_size or default_block_size(model), args.batch_size, args.device)
    results = {}
    for task in tasks:
        t0 = time.time()
        try:
            res = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, num_fewshot=0, limit=args.limit,
                                          log_samples=False, bootstrap_iters=0)
        except Exception as e:
            if not _offline(e):
                raise
            raise RuntimeError(f"harness task {task!r} needs the Hugging Face Hub, which cannot be reached "
                               f"({type(e).__name__}); connect, or pass --data_root=DIR with local copies laid out like "
                               "../shared/data/eval (wikitext, lambada_openai and hellaswag then run from them)") from e
        metrics = {k.split(",")[0]: v for k, v in res["results"][task].items()
                   if "," in k and not k.split(",")[0].endswith("_stderr") and isinstance(v, (int, float))}
        results[task] = {**metrics, "seconds": round(time.time() - t0, 1), "n": res["n-samples"][task]["effective"]}
        print(f"{task} (harness): " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in results[task].items()), flush=True)
    return results


# -----------------------------------------------------------------------------
# routing probes (paper Figure 4's per-head deviations, Table 6's width-disagreement probe)

@torch.no_grad()
def probe(model, idx, slices=4, seed=0):
    """Routing statistics of one batch idx (B, T): per-site token-averaged alpha per head, and for H = 1 the
    width-disagreement probe (paper Table 6): q split into `slices` channel slices, each slice's softmax over
    its partial logits against the shared alpha, KL(slice || shared) averaged over slices, tokens and sites,
    with a matched-norm random query as the null. Also the mean pairwise cosine of the sources at the last
    site (source collinearity)."""
    if model.cfg.residual not in ("attnres", "mhar", "delta"):
        raise ValueError(f"the routing probe needs a routed model; this one is residual={model.cfg.residual!r}")
    gen = torch.Generator().manual_seed(seed)
    kl = {"learned": [], "null": []}
    last = {}

    def observe(site, stacked):   # sees every site's stacked sources (N, B, T, d)
        if site.heads == 1:
            for name, q in (("learned", site.q.float()), ("null", _matched_random(site.q.float(), gen))):
                kl[name].append(slice_kl(stacked, q, site.gain(), slices, site.eps))
        last["sources"] = stacked

    model.routing_observer = observe
    try:
        _, _, routing = model(idx, return_routing=True)
    finally:
        model.routing_observer = None
    maps = [a.float().mean(dim=(1, 2)).T.cpu() for a in routing]   # site j: (H, N_j) token-averaged alpha
    s = last["sources"].float().flatten(1, 2)                        # (N, B*T, d)
    s = F.normalize(s, dim=-1)
    cos = torch.einsum("ntd,mtd->nm", s, s) / s.size(1)
    n = cos.size(0)
    result = {"maps": maps, "collinearity": ((cos.sum() - cos.diagonal().sum()) / max(1, n * (n - 1))).item()}
    if kl["learned"]:
        learned, null = sum(kl["learned"]) / len(kl["learned"]), sum(kl["null"]) / len(kl["null"])
        result["table6"] = {"slices": slices, "kl_learned": learned, "kl_null": null, "excess": learned - null}
    return result


def _matched_random(q, gen):
    r = torch.randn(q.shape, generator=gen).to(q.device)
    return r * (q.norm() / r.norm().clamp_min(1e-30))


def slice_kl(sources, q, g, slices, eps):
    """Mean over slices and tokens of KL(softmax of a slice's partial logits || softmax of the full logits),
    for a one-head site. Both go through model.route_logit, a slice's with its own part of <q g, s>: with the paper's
    logit the full logit is the sum of the slice logits (route_reference's math); a changed route_logit reaches the
    probe too."""
    N, B, T, d = sources.shape
    if d % slices:
        raise ValueError(f"width {d} does not split into {slices} slices")
    s = sources.float()
    r = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)            # (N, B, T, 1)
    dot = (s * (q.float() * g.float())).view(N, B, T, slices, d // slices).sum(-1)   # (N, B, T, S) parts of <q g, s>
    n = torch.arange(N, device=s.device).view(N, 1, 1, 1)
    shared = F.log_softmax(route_logit(r, dot.sum(-1, keepdim=True), n, N), dim=0)   # (N, B, T, 1)
    own = F.log_softmax(route_logit(r, dot, n, N), dim=0)                            # (N, B, T, S)
    return (own.exp() * (own - shared)).sum(0).mean().item()


def routing_matrix(maps):
    """(H, sites, max sources) with NaN where a site has fewer sources."""
    H, width = maps[0].size(0), max(m.size(1) for m in maps)
    out = torch.full((H, len(maps), width), float("nan"))
    for j, m in enumerate(maps):
        out[:, j, :m.size(1)] = m
    return out


def _pyplot():
    """matplotlib's pyplot on the file-only backend (no display needed), imported when a plot is made."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_maps(mat, path, title, xlabel="source"):
    plt = _pyplot()
    from matplotlib.colors import PowerNorm
    H = mat.size(0)
    cols = min(H, 4)
    rows = math.ceil(H / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.0 * cols + 1.0, 3.0 * rows + 0.4), squeeze=False, layout="constrained")
    diverging = title.startswith("deviation")
    vmax = float(torch.nan_to_num(mat.abs(), nan=0.0).max()) or 1.0
    for h in range(rows * cols):
        ax = axes[h // cols][h % cols]
        if h >= H:
            ax.axis("off")
            continue
        # weights: a square-root colour scale, or the first sites' weights near 1 leave the deep sites' ~0.05 dark
        scale = dict(vmin=-vmax, vmax=vmax) if diverging else dict(norm=PowerNorm(0.5, vmin=0, vmax=vmax))
        im = ax.imshow(mat[h].numpy(), aspect="auto", interpolation="nearest",
                       cmap="RdBu_r" if diverging else "viridis", **scale)
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("site")
    fig.colorbar(im, ax=axes, shrink=0.8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_probe(maps, probe_dir, residual, blocks=None):
    """routing_maps.png and head_deviation.png (Figure 4) from per-site maps (H, sources), e.g. probe.json's "maps";
    blocks: a block-routed model's route_blocks (its sources are the embedding, then block sums)."""
    mat = routing_matrix([torch.as_tensor(m) for m in maps])
    what, xlabel = (f", {blocks} blocks", "source (0: embedding, then blocks)") if blocks else ("", "source")
    plot_maps(mat, os.path.join(probe_dir, "routing_maps.png"),
              f"token-averaged routing weights ({residual}{what}, H={mat.size(0)})", xlabel)
    first = mat[:, :10]
    dev = first - torch.nanmean(first, dim=0, keepdim=True)
    plot_maps(dev, os.path.join(probe_dir, "head_deviation.png"), "deviation of each head from the head mean, sites 1-10",
              xlabel)


def run_probe(args, model, enc):
    T = args.block_size or default_block_size(model)
    if args.data_dir:
        meta = json.load(open(os.path.join(args.data_dir, "meta.json")))
        check_files(args.data_dir, meta)   # sizes and sampled blocks against meta.json
        data = TokenData(os.path.join(args.data_dir, "val.bin"), meta["dtype"], T, 0)
        n = min(args.batch_size, data.n_seq)
        if n == 0:
            raise ValueError(f"{args.data_dir}/val.bin holds fewer than {T + 1} tokens")
        idx = torch.from_numpy(data.rows([i * T for i in range(n)])[:, :-1])
    else:   # the start of WikiText-2's validation split stands in for validation text
        text = load_task("wikitext2", args.data_root, wikitext_split="validation")
        toks = enc.encode_ordinary(text)[:args.batch_size * T]
        idx = torch.tensor(toks[:len(toks) // T * T]).view(-1, T)
    res = probe(model, idx.to(args.device), slices=args.slices)
    os.makedirs(args.probe_dir, exist_ok=True)
    plot_probe(res["maps"], args.probe_dir, model.cfg.residual, model.cfg.route_blocks)
    summary = {"written_by": "eval.py --probe", "tokens": idx.numel(), "collinearity": res["collinearity"],
               "table6": res.get("table6"), "maps": [m.tolist() for m in res["maps"]]}
    with open(os.path.join(args.probe_dir, "probe.json"), "w") as f:
        json.dump(summary, f)
    print(f"probe over {idx.numel():,} tokens -> {args.probe_dir}/routing_maps.png, head_deviation.png, probe.json")
    print(f"source collinearity (mean pairwise cosine, last site): {res['collinearity']:.4f}")
    if res.get("table6"):
        t = res["table6"]
        print(f"Table 6 ({t['slices']} slices): KL learned {t['kl_learned']:.4f} | matched-norm random query "
              f"{t['kl_null']:.4f} | excess {t['excess']:.4f}")
    else:
        print(f"Table 6 probe: for single-head (H = 1) checkpoints only; this one has H = {model.cfg.heads}")
    return summary


# -----------------------------------------------------------------------------
# training curves

def plot_logs(paths, output, smooth=0.9):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for path in paths:
        recs = read_log(path)   # a partial last line (a run that stopped mid-write) is left out
        train = {r["step"]: r["loss"] for r in recs if "loss" in r}   # the last record of a step counts (resumes)
        val = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
        if not train and not val:
            raise ValueError(f"{path} holds no train or val records")
        name = os.path.basename(path)   # out_dir/log.jsonl -> the out_dir's name; else the file's
        label = os.path.basename(os.path.dirname(os.path.abspath(path))) if name == "log.jsonl" else name.split(".")[0]
        steps, ema, smoothed = sorted(train), None, []
        for k, s in enumerate(steps):   # EMA with a per-step decay, whatever the logging interval
            a = smooth ** (s - steps[k - 1]) if k else 0.0
            ema = train[s] if ema is None else a * ema + (1 - a) * train[s]
            smoothed.append(ema)
        line, = ax.plot(steps, smoothed, lw=1.2, label=f"{label} train (EMA {smooth}/step)")
        ax.plot(sorted(val), [val[s] for s in sorted(val)], "o", ms=3.5, color=line.get_color(), label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=120, metadata={"Software": PLOT_MARK})   # what the write guard knows it by
    plt.close(fig)
    print(f"wrote {output}")


# -----------------------------------------------------------------------------

CHECKPOINT = Path("any", "a train.py / convert.py out_dir or a ckpt.pt")


def parser():
    """eval.py's options, each with its kind and range (options.py)."""
    p = Parser(prog="eval.py", description=__doc__)
    p.add_argument("--out_dir", type=CHECKPOINT, default=None, help="train.py / convert.py out_dir (or a ckpt.pt path; "
                   "default out)")
    p.add_argument("--tasks", type=Text(), default=None, help=f"comma-separated subset of {','.join(TASKS)} (default: "
                   "all); with --harness any harness task (default: wikitext,lambada_openai,hellaswag, local with "
                   "--data_root)")
    p.add_argument("--harness", action="store_true", help="score with lm-evaluation-harness (the paper's protocol); "
                   "results in out_dir/eval_harness.json")
    p.add_argument("--limit", type=Count(1, 10**9), default=None,
                   help="first N examples (WikiText-2: first N*block_size tokens)")
    p.add_argument("--block_size", type=Count(2, 2**20), default=None,
                   help="longest scored sequence (default: the training length)")
    p.add_argument("--data_root", type=Path("dir", "laid out like ../shared/data/eval"), default=None,
                   help="local copies laid out like ../shared/data/eval (default: the Hub)")
    p.add_argument("--output", type=Path("out_file", writes=("eval results", "plot")), default=None,
                   help="results JSON (default: out_dir/eval.json); with --plot: the PNG")
    p.add_argument("--device", type=Device(), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu | cuda | cuda:N")
    p.add_argument("--batch_size", type=Count(1, 65536), default=16, help="sequences per forward")
    p.add_argument("--tokenizer", type=Tokenizer(), default=None, help="tiktoken name or tokenizer.json (default: the "
                   "checkpoint's; recorded in the results JSON)")
    p.add_argument("--ema", action="store_true", help="score the checkpoint's EMA weights (train.py --ema_decay); "
                   "the results JSON says which")
    p.add_argument("--probe", action="store_true", help="routing maps, Figure 4 and Table 6 instead of the tasks")
    p.add_argument("--data_dir", type=Path("dir", "a prepare_data.py folder"), default=None,
                   help="--probe: prepare_data.py folder whose val.bin is probed (default: WikiText-2 validation text)")
    p.add_argument("--probe_dir", type=Path("out_dir", writes="probe"), default=None,
                   help="--probe: where the PNGs and probe.json go (default out_dir/probe)")
    p.add_argument("--slices", type=Count(1, 4096), default=4, help="--probe: query slices of the Table 6 probe")
    p.add_argument("--plot", nargs="+", type=Path("file", "a train.py log.jsonl"), metavar="LOG", default=None,
                   help="plot these log.jsonl files and exit")
    return p


@keeps_signals
def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    for name in ignored_options(args, p):
        print(f"eval.py: --{name}={getattr(args, name)} is unused " + ("with --plot" if args.plot else "with --probe" if
              args.probe else "without --probe") + "; ignored", file=sys.stderr)
    try:
        if args.plot:
            output = Path("out_file", writes="plot").check(args.output or "curves.png")   # (not eval results)
            plot_logs(args.plot, output)
            return None
        if args.out_dir is None:   # (the default, read only where a checkpoint is: not with --plot)
            try:
                args.out_dir = CHECKPOINT.check("out")
            except ValueError as e:
                raise ValueError(f"--out_dir=out {e}") from None
        default = ",".join(LOCAL_HARNESS if args.harness else TASKS)
        tasks = [t.strip() for t in (args.tasks or default).split(",") if t.strip()]
        unknown = [t for t in tasks if t not in TASKS and not args.harness]
        if unknown or not tasks:
            raise ValueError(f"--tasks={args.tasks!r}: unknown task(s) {unknown}; choose from {','.join(TASKS)}")
        if args.tokenizer:   # (the checkpoint's own is checked against its vocabulary once it loads)
            load_tokenizer(args.tokenizer)
        if args.probe and args.data_dir and not os.path.isfile(os.path.join(args.data_dir, "meta.json")):
            raise FileNotFoundError(f"--data_dir={args.data_dir} holds no meta.json: a prepare_data.py folder, whose "
                                    "val.bin the probe reads")
        if args.harness and not args.probe:   # the task names, before the model loads
            manager, tasks = harness_tasks(tasks, args.data_root)
        model, enc = load_model(args.out_dir, args.device, args.tokenizer, args.ema)
        if args.block_size and args.block_size > model.cfg.block_size:
            raise ValueError(f"--block_size={args.block_size} exceeds the model's {model.cfg.block_size}")
        base = model.checkpoint_info["dir"]
        kept = re.fullmatch(r"ckpt-step(\d+)\.pt", os.path.basename(args.out_dir))   # a --keep_every checkpoint:
        tag = f"-step{kept.group(1)}" if kept else ""                                 # its results beside the latest's
        if args.probe:
            args.probe_dir = Path("out_dir", writes="probe").check(args.probe_dir or os.path.join(base, "probe" + tag))
            return run_probe(args, model, enc)
        name = "eval_harness" if args.harness else "eval"
        output = args.output or os.path.join(base, f"{name}{tag}" + (f".limit{args.limit}" if args.limit else "") + ".json")
        try:   # where the results go, checked before the tasks run
            Path("out_file", writes="eval results").check(output)
        except ValueError as e:
            raise ValueError(f"the results file {output} {e}: pass --output=") from None
        if args.harness:
            results = run_harness(args, model, enc, manager, tasks)
            tasks = []
        else:
            scorer = Scorer(model, args.block_size or default_block_size(model), args.batch_size, args.device)
            results = {}
        for task in tasks:
            results[task] = EVALS[task](scorer, enc, load_task(task, args.data_root), args.limit)
            print(f"{task}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in results[task].items()),
                  flush=True)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        sys.exit(f"eval.py: error: {e}")
    info = model.checkpoint_info   # what was scored: the exact weights (export.py's card quotes only results of its own)
    results.update(written_by="eval.py", tokenizer=info["tokenizer_used"], weights=info["weights"],
                   checkpoint={"file": info["file"], "step": info["step"], "fingerprint": info["fingerprint"]})
    earlier = scored(output)
    if earlier:
        print(f"eval.py: replacing {output} (its results: {earlier})")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    write_atomic(output, json.dumps(results, indent=1))
    print(f"wrote {output}")
    return results


def scored(path):
    """What an earlier results file at path holds, in a phrase (its tasks and the weights they scored); "" where none."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return ""
    tasks = [k for k, v in old.items() if isinstance(v, dict) and k != "checkpoint"] if isinstance(old, dict) else []
    ckpt = old.get("checkpoint") or {} if isinstance(old, dict) else {}
    return f"{', '.join(tasks) or 'no tasks'}" + (f" of {ckpt.get('file')} at step {ckpt.get('step')}, "
                                                  f"{old.get('weights')} weights" if ckpt else "")


def ignored_options(args, parser):
    """The options given other than their defaults that the chosen mode (--plot, --probe, the tasks) does not read."""
    used = ({"plot", "output"} if args.plot else
            {"out_dir", "block_size", "data_root", "output", "device", "batch_size", "tokenizer", "probe", "data_dir",
             "probe_dir", "slices", "ema"} if args.probe else
            {"out_dir", "tasks", "harness", "limit", "block_size", "data_root", "output", "device", "batch_size",
             "tokenizer", "probe", "ema"})
    return [k for k, v in vars(args).items() if k not in used and v != parser.get_default(k)]


if __name__ == "__main__":
    run_script(main, "eval.py", "; no results file was written")
