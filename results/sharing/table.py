# Every mode's export, in fp32 and bf16, used the way someone who downloads it would use it, on the CPU: a tiny model of
# each mode trained 400 steps of 1,024 tokens (the routing live), export.py at each dtype, then, in a `python -I` process in another
# folder (nothing of this repository importable), transformers loads the folder at its dtype and gives
#   logits   the largest |difference| from this repository's model at that dtype, on one random batch;
#   greedy   whether generate()'s 12 greedy tokens, with the KV cache and without, are GPT.generate's at that dtype;
#   padded   whether a left-padded batch of three prompts continues each row as that prompt alone;
#   lm_eval  the README's `lm_eval --model hf ... trust_remote_code=True` line on the local task files (LAMBADA
#            accuracy and perplexity, WikiText bits per byte), beside eval.py --harness on the checkpoint (fp32).
#   python results/sharing/table.py WORK_DIR [--text=FILE] [--eval=DIR] [--limit=N]
# (defaults: ../shared/data's validation text and eval sets; TIKTOKEN_CACHE_DIR set where OpenAI is unreachable)
import glob
import json
import os
import subprocess
import sys

import torch

HERE = os.getcwd()
sys.path.insert(0, HERE)
import checkpoint  # noqa: E402

work = os.path.abspath(sys.argv[1])
opts = dict(a[2:].split("=", 1) for a in sys.argv[2:] if a.startswith("--"))
text = os.path.abspath(opts.get("text", "../shared/data/text/books_wiki_en_val.jsonl.xz"))
eval_root = os.path.abspath(opts.get("eval", "../shared/data/eval"))
limit = int(opts.get("limit", 20))
MODES = {"baseline": ["--residual=baseline"], "hyper": ["--residual=hyper"], "attnres": ["--residual=attnres"],
         "mhar": ["--residual=mhar"], "mhar_blocks2": ["--residual=mhar", "--route_blocks=2"]}
TRAIN = ["--n_layer=2", "--n_head=2", "--n_kv_head=2", "--n_embd=64", "--ffn_hidden=128", "--block_size=64",
         "--batch_tokens=1024", "--micro_batch=8", "--lr=3e-3", "--warmup_steps=20", "--max_steps=400",
         "--lr_decay_steps=400", "--eval_interval=400", "--eval_tokens=4096", "--device=cpu", "--compile=False"]
OFFLINE = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
LOAD = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, dtype, remote = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3] == "1"
hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=remote, dtype=dtype).eval()
tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=remote)
prompt = torch.tensor([tok("The castle stood on a hill above the").input_ids])
with torch.no_grad():
    logits = hf(torch.load("idx.pt")).logits.float()
greedy = dict(max_new_tokens=12, do_sample=False)
cached, uncached = hf.generate(prompt, **greedy), hf.generate(prompt, **greedy, use_cache=False)
texts, new = ["The castle stood", "A", "Rain fell on the old stone bridge while"], dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
tok.padding_side = "left"
batch = hf.generate(**tok(texts, return_tensors="pt", padding=True), **new)[:, -8:]
alone = torch.stack([hf.generate(**tok([t], return_tensors="pt"), **new)[0, -8:] for t in texts])
torch.save(dict(type=type(hf).__name__, logits=logits, prompt=prompt, cached=cached, uncached=uncached,
                padded=torch.equal(batch, alone)), "out.pt")
"""


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return r


data = os.path.join(work, "data")
if not os.path.isdir(data):
    run([sys.executable, "prepare_data.py", f"--input={text}", f"--out_dir={data}", "--val_fraction=0.05"])
lines = [f"{'mode':<13} {'dtype':<9} {'loads as':<17} {'logits max |diff|':>17} {'greedy':>7} {'padded':>7}   "
         "lm_eval: LAMBADA acc / ppl, WikiText bpb (eval.py: the same)"]
for mode, args in MODES.items():
    ckpt_dir = os.path.join(work, mode)
    if not os.path.isfile(os.path.join(ckpt_dir, "ckpt.pt")):
        run([sys.executable, "train.py", f"--data_dir={data}", f"--out_dir={ckpt_dir}", *TRAIN, *args])
    run([sys.executable, "eval.py", f"--out_dir={ckpt_dir}", "--harness", f"--data_root={eval_root}",
         "--tasks=lambada_openai,wikitext", f"--limit={limit}", "--batch_size=4"])
    ours = json.load(open(os.path.join(ckpt_dir, f"eval_harness.limit{limit}.json")))
    for dtype in ("float32", "bfloat16"):
        hf_dir = os.path.join(work, f"hf_{mode}_{dtype}")
        if not os.path.isdir(hf_dir):
            run([sys.executable, "export.py", f"--out_dir={ckpt_dir}", f"--hf_dir={hf_dir}", f"--dtype={dtype}"])
        elsewhere = os.path.join(work, f"elsewhere_{mode}_{dtype}")
        os.makedirs(elsewhere, exist_ok=True)
        model = checkpoint.load_model(ckpt_dir).eval().to(getattr(torch, dtype))
        idx = torch.randint(0, 50257, (2, 48), generator=torch.Generator().manual_seed(1))
        torch.save(idx, os.path.join(elsewhere, "idx.pt"))
        run([sys.executable, "-I", "-c", LOAD, hf_dir, dtype, str(int(mode != "baseline"))], cwd=elsewhere,
            env=OFFLINE)
        got = torch.load(os.path.join(elsewhere, "out.pt"))
        with torch.no_grad():
            diff = (model(idx)[0].float() - got["logits"]).abs().max().item()
            want = model.generate(got["prompt"], 12, temperature=0)
        greedy = torch.equal(got["cached"], want) and torch.equal(got["uncached"], want)
        out = os.path.join(elsewhere, "lm_eval")
        run([os.path.join(os.path.dirname(sys.executable), "lm_eval"), "--model", "hf", "--model_args",
             f"pretrained={hf_dir},trust_remote_code=True,dtype={dtype}", "--tasks", "lambada_openai_local,wikitext_local",
             "--include_path", os.path.join(HERE, "harness_tasks"), "--metadata", json.dumps({"data_root": eval_root}),
             "--limit", str(limit), "--device", "cpu", "--batch_size", "4", "--output_path", out], cwd=elsewhere,
            env=OFFLINE)
        theirs = json.load(open(glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True)[0]))["results"]
        lam, wiki = theirs["lambada_openai_local"], theirs["wikitext_local"]
        o_lam, o_wiki = ours["lambada_openai_local"], ours["wikitext_local"]
        lines.append(f"{mode:<13} {dtype:<9} {got['type']:<17} {diff:>17.2e} {str(greedy):>7} {str(got['padded']):>7}   "
                     f"{lam['acc,none']:.3f} / {lam['perplexity,none']:.2f}, {wiki['bits_per_byte,none']:.4f} "
                     f"({o_lam['acc']:.3f} / {o_lam['perplexity']:.2f}, {o_wiki['bits_per_byte']:.4f})")
        print(lines[-1], flush=True)
print("\n".join(["", f"{torch.__version__=}, lm_eval --limit {limit}"] + lines))
