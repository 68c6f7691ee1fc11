"""
An export's Hugging Face side (export.py writes the rest): the weights as huggingface_hub shards them, the model card
through its ModelCardData (the Hub's metadata, and eval results only of exactly the weights exported), and the check
that the finished folder loads with transformers alone, in a process where none of this repository can be imported.
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

SHARD_BYTES = 5 * 10**9


def write_weights(state, out):
    """model.safetensors, or shards of at most SHARD_BYTES with model.safetensors.index.json: huggingface_hub's
    save_torch_state_dict, the writer transformers' save_pretrained uses (its layout and index, not one of our own)."""
    from huggingface_hub import save_torch_state_dict
    save_torch_state_dict(state, out, max_shard_size=SHARD_BYTES, metadata={"format": "pt"})


# loads an exported folder as whoever downloads it does: transformers alone, no repository on the path
LOAD_ELSEWHERE = """
import os, signal, sys
try:   # Linux: this process ends when export.py does, however it ends (a SIGKILL too), not left running
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[5]):   # export.py ended before that took hold
    sys.exit(1)
import torch
from transformers import AutoModelForCausalLM
folder, work, device, remote = sys.argv[1:5]
hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=remote == "1", dtype=torch.float32)
with torch.no_grad():
    torch.save(hf.to(device).eval()(torch.load(work + "/idx.pt").to(device)).logits.float().cpu(), work + "/logits.pt")
"""


def check(folder, model, remote, device, n_tokens=32):
    """Largest |logit difference| between the exported folder, loaded by transformers in a fresh `python -I` process
    in another working directory (where none of this repository can be imported), and this repo's model, fp32, on one
    random batch; None when transformers is not installed. A folder that does not load there raises ValueError."""
    if importlib.util.find_spec("transformers") is None:
        return None
    idx = torch.randint(0, model.cfg.vocab_size, (2, min(n_tokens, model.cfg.block_size)),
                        generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as work:
        torch.save(idx, os.path.join(work, "idx.pt"))
        r = subprocess.run([sys.executable, "-I", "-c", LOAD_ELSEWHERE, os.path.abspath(folder), work, device,
                            str(int(remote)), str(os.getpid())], cwd=work, capture_output=True, text=True)
        if r.returncode:
            last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ValueError(f"the exported folder does not load in a process outside this repository ({last}); "
                             "nothing written")
        theirs = torch.load(os.path.join(work, "logits.pt"))
    with torch.no_grad():
        ours = model.to(device)(idx.to(device))[0]
    return (ours.float().cpu() - theirs).abs().max().item()


def card_results(ckpt_dir, info, ckpt):
    """The scores a card may quote: those of exactly the weights exported, as (line for the card, huggingface_hub
    EvalResults for its model-index). The run's eval at the checkpoint's own step (its EMA loss for EMA weights), and
    every eval.py results file beside the checkpoint whose recorded checkpoint fingerprint and weights (raw or EMA) are
    these; each file left out is named with what it scored instead."""
    from huggingface_hub import EvalResult
    from metrics import read_log
    found, step, ema = [], ckpt.get("step"), info["weights"] == "ema"
    result = lambda dataset, metric, value: EvalResult(  # noqa: E731
        task_type="text-generation", dataset_type=dataset, dataset_name=dataset, metric_type=metric, metric_value=value)
    try:
        at = [r for r in read_log(os.path.join(ckpt_dir, "log.jsonl")) if r.get("step") == step and "val_loss" in r]
    except (OSError, ValueError):
        at = []
    loss = at[-1].get("val_loss_ema" if ema else "val_loss") if at else None
    if loss is not None:
        bpb = at[-1].get("val_bpb") if not ema else None
        found.append((f"validation loss (its run's held-out split): {loss:.4f} at step {step}"
                      + (f", {bpb:.4f} bits per byte" if bpb else ""),
                      [result("held-out split of its training text", "loss", round(loss, 4))]))
    for name in sorted(f for f in os.listdir(ckpt_dir) if re.fullmatch(r"eval(_harness)?(-step\d+)?(\.limit\d+)?\.json", f)):
        try:
            with open(os.path.join(ckpt_dir, name)) as f:
                results = json.load(f)
            scored = results.get("checkpoint") or {}
        except (OSError, ValueError, AttributeError):
            continue
        if scored.get("fingerprint") != info["fingerprint"] or results.get("weights") != info["weights"]:
            print(f"export.py: the model card leaves out {name}: it scored " + (
                f"{scored.get('file')} at step {scored.get('step')} ({results.get('weights')} weights)" if scored else
                "weights it does not record") + f", not these ({info['file']} at step {step}, {info['weights']})")
            continue
        tasks = {task: {k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                 for task, r in results.items() if isinstance(r, dict) and task != "checkpoint"}
        found.append((f"eval.py ({name}): " + "; ".join(f"{t}: " + ", ".join(f"{k} {v:.4g}" for k, v in m.items())
                                                        for t, m in tasks.items()),
                      [result(t, k, v) for t, m in tasks.items() for k, v in m.items()]))
    return found


def card_license(text):
    """(license, license_name) for the card's metadata: a Hub identifier as it is (mit, apache-2.0, other); any other
    text is license "other" with that text as license_name, made a Hub name (lowercase, hyphens)."""
    if re.fullmatch(r"[a-z0-9][a-z0-9.-]*", text):
        return text, None
    return "other", re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "custom"


def write_card(out, model, ckpt, config, args):
    """README.md through huggingface_hub's ModelCardData (the Hub's metadata: quoting, license, model-index eval
    results tied to these weights): what the model is, how it was trained and scored, how to load it."""
    from huggingface_hub import ModelCard, ModelCardData
    cfg, info, train = model.cfg, model.checkpoint_info, ckpt.get("train_config") or {}
    remote, ckpt_dir, title = cfg.residual != "baseline", info["dir"], os.path.basename(os.path.abspath(args.hf_dir))
    source = (ckpt.get("converted_from") or {}).get("config", {}).get("_name_or_path", "")
    data = [i[len("hf://"):].rsplit("/", 1)[0] for i in (ckpt.get("meta") or {}).get("inputs") or [] if i.startswith("hf://")]
    evals = card_results(ckpt_dir, info, ckpt)
    license_, license_name = card_license(args.license)
    meta = ModelCardData(
        library_name="transformers", license=license_, license_name=license_name, pipeline_tag="text-generation",
        tags=list(dict.fromkeys(["mhar", "attention-residuals", cfg.residual] + (["custom_code"] if remote else []))),
        base_model=source if re.fullmatch(r"[\w.-]+/[\w.-]+", source or "") else None,
        datasets=sorted(set(data)) or None, model_name=title,
        eval_results=[r for _, rs in evals for r in rs] or None)
    loads = "trust_remote_code=True" if remote else ""
    inputs = ", ".join(i[len("hf://"):] if i.startswith("hf://") else os.path.basename(i)   # (no local paths)
                       for i in (ckpt.get("meta") or {}).get("inputs") or [])[:300] or "?"
    body = [f"# {title}", "",
            f"A {model.num_params() / 1e6:.0f}M-parameter Qwen3-style decoder with residual mode `{cfg.residual}`"
            + (f" (routing heads {cfg.heads}" + (f", over {cfg.route_blocks} blocks" if cfg.route_blocks else "") + ")"
               if cfg.residual in ("attnres", "mhar", "delta") else "")
            + ": Multi-Head Attention Residuals (arXiv 2607.27230) and the residual schemes it is compared with, as "
            "the mhar repository trains them. "
            + ("Every sublayer reads a learned softmax mix of all earlier sublayer outputs; the modeling code is the "
               "repository's own model.py, copied into this folder (trust_remote_code=True) under the MIT licence in "
               "LICENSE." if remote else "The baseline (an additive residual stream): a stock Qwen3 folder, no remote "
               "code."), "",
            f"- licence of the weights: {args.license}; LICENSE: the mhar repository's (MIT), for its code",
            f"- shape: {cfg.n_layer} layers, width {cfg.n_embd}, {cfg.n_head} heads ({cfg.n_kv_head} key/value), "
            f"vocabulary {cfg.vocab_size}, trained at {train.get('block_size') or config.get('max_position_embeddings')} "
            "tokens",
            f"- weights: {info['weights']} ({'the EMA of training' if info['weights'] == 'ema' else 'as trained'}), "
            f"{args.dtype}, step {ckpt.get('step')}, the repository's tree {ckpt.get('git') or 'unknown'}",
            *([f"- training: {train.get('max_steps')} steps of {train.get('batch_tokens'):,} tokens, peak LR "
               f"{train.get('lr')}, seed {train.get('seed')}, data: {inputs}"]
              if train.get("batch_tokens") else ["- converted from a pretrained model (convert.py): delta routing at "
                                                 "alpha = 0 computes the pretrained model's logits"]),
            *[f"- {line}" for line, _ in evals], "",
            "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f"model = AutoModelForCausalLM.from_pretrained(PATH{', ' + loads if loads else ''})",
            f"tokenizer = AutoTokenizer.from_pretrained(PATH{', trust_remote_code=False' if remote else ''})"
            + ("   # a stock tokenizer: no code of this folder runs" if remote else ""),
            "```",
            "Batches may be padded on either side: the attention mask is honoured." if remote else ""]
    ModelCard(f"---\n{meta.to_yaml()}\n---\n\n" + "\n".join(body).rstrip() + "\n").save(os.path.join(out, "README.md"))
