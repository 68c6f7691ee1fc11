"""
Export a checkpoint to a Hugging Face folder that stock transformers, its generate() and lm-evaluation-harness load:
convert.py's mapping run the other way for the baseline, this repository's own model.py for every other mode.

  python export.py --out_dir=out/mhar_100m --hf_dir=hf/mhar_100m            # a train.py out_dir, or a ckpt.pt
  python export.py --out_dir=out/llama8b_delta --hf_dir=hf/llama8b_delta --dtype=bfloat16

- baseline (with qk-norm, as train.py's models are): a plain Qwen3 folder (Llama without qk-norm): config.json and the
  weights under transformers' own names. `AutoModelForCausalLM.from_pretrained(DIR)`, no remote code.
- attnres, mhar, hyper, block routing, delta: config.json's auto_map names modeling_mhar.py, written into the folder:
  a PreTrainedModel with GenerationMixin around model.py, which is copied beside it with the modules it imports (their
  imports of each other made package-relative, nothing else changed: one implementation). Load with
  `trust_remote_code=True`; generate() uses this repository's KV cache (greedy and sampling; beam search with
  use_cache=False). The model ignores attention_mask: batches padded on the left are read as their pad tokens.
Both: model.safetensors (sharded above 5 GB), generation_config.json, and the tokenizer (GPT-2's from tiktoken's cached
files, or the checkpoint's tokenizer.json). Written into a temporary folder, checked (the folder loaded with
transformers, where installed, against this repository's logits), then moved into place: a failure writes nothing.
"""
import argparse
import ast
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

if __name__ == "__main__":   # Ctrl-C while torch loads: a quiet exit (nothing is written yet)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch

from convert import NAMES
from checkpoint import load_model
from common import check_device, run_script

HERE = os.path.dirname(os.path.abspath(__file__))
SHARD_BYTES = 5 * 10**9
GPT2_FILES = ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
              "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe")


def load(path):
    """(model in fp32, its checkpoint dict) of a train.py out_dir or ckpt.pt; a ValueError in one line otherwise."""
    if os.path.isdir(path):
        path = os.path.join(path, "ckpt.pt")
    if not os.path.isfile(path):
        raise ValueError(f"--out_dir={path}: no checkpoint there (pass a train.py or convert.py out_dir, or a ckpt.pt)")
    from checkpoint import read_checkpoint
    ckpt = read_checkpoint(path)   # checked by content
    model = load_model(path, ckpt=ckpt)
    model.eval()
    return model, ckpt


def training_length(model, ckpt):
    """The sequence length the model was trained at (eval.py's default), or its RoPE length, at most 4096."""
    train = ckpt.get("train_config") or {}
    return min(train.get("block_size") or 4096, model.cfg.block_size)


# ---- the tokenizer ----------------------------------------------------------------------------------------------------

def tokenizer_files(ckpt, ckpt_dir, out, length):
    """tokenizer.json and tokenizer_config.json for the checkpoint's tokenizer; returns (eos id, eos text)."""
    name = ckpt.get("tokenizer") or "gpt2"
    if name.endswith(".json"):
        src = name if os.path.isabs(name) else os.path.join(ckpt_dir, name)
        if not os.path.isfile(src):
            raise ValueError(f"the checkpoint's tokenizer {src} is missing: put it back beside ckpt.pt")
        shutil.copyfile(src, os.path.join(out, "tokenizer.json"))
    elif name == "gpt2":
        gpt2_tokenizer().save(os.path.join(out, "tokenizer.json"))
    else:
        raise ValueError(f"tokenizer {name!r}: export writes GPT-2's or a tokenizer.json; a tiktoken {name} has no "
                         "Hugging Face file here")
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    from tokenizer import HFTokenizer
    eos = next((t for t in HFTokenizer.EOT_NAMES if tok.token_to_id(t) is not None), None)
    if eos is None:
        raise ValueError(f"the tokenizer has none of the end-of-text tokens {HFTokenizer.EOT_NAMES}")
    bos = eos if name == "gpt2" else None   # GPT-2 begins a text with <|endoftext|>, as the harness' prefix does
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": bos, "pad_token": eos,
              "clean_up_tokenization_spaces": False, "model_max_length": length}
    write_json(os.path.join(out, "tokenizer_config.json"), config)
    return tok.token_to_id(eos), bos and tok.token_to_id(bos)


def gpt2_tokenizer():
    """GPT-2's byte-level BPE as a `tokenizers` Tokenizer, from tiktoken's cached encoder.json and vocab.bpe (the
    files its gpt2 encoding reads: the same merges, so the same tokens)."""
    from tiktoken.load import read_file_cached
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    try:
        vocab, bpe = (read_file_cached(url) for url in GPT2_FILES)
    except Exception as e:
        raise ValueError(f"GPT-2's BPE files are not in tiktoken's cache and cannot be fetched ({type(e).__name__}): "
                         "set TIKTOKEN_CACHE_DIR to a folder holding them, or connect once") from None
    merges = [tuple(line.split(" ")) for line in bpe.decode().split("\n")[1:] if line]
    tok = Tokenizer(models.BPE(json.loads(vocab), merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(["<|endoftext|>"])
    return tok


# ---- the weights and configs ------------------------------------------------------------------------------------------

def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_weights(state, out):
    """model.safetensors, or shards of at most SHARD_BYTES with model.safetensors.index.json (transformers' layout)."""
    from safetensors.torch import save_file
    shards, size = [{}], 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in state.values())
    write_json(os.path.join(out, "model.safetensors.index.json"), {"metadata": {"total_size": total},
                                                                   "weight_map": weight_map})


def baseline_export(model, length, dtype):
    """(config.json dict, state dict under transformers' names): Qwen3 with qk-norm, Llama without."""
    cfg = model.cfg
    qwen = cfg.qk_norm
    ours_to_hf = {}
    for hf_name, ours in NAMES.items():
        if not qwen and ("q_norm" in ours or "k_norm" in ours):   # Llama has no qk-norm
            continue
        for i in range(cfg.n_layer) if "{i}" in ours else [None]:
            ours_to_hf[ours.format(i=i)] = hf_name.format(i=i)
    state = {ours_to_hf[k]: v.to(dtype) for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and cfg.tie_embeddings)}
    config = {"architectures": ["Qwen3ForCausalLM" if qwen else "LlamaForCausalLM"],
              "model_type": "qwen3" if qwen else "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd,
              "intermediate_size": cfg.ffn_hidden, "num_hidden_layers": cfg.n_layer,
              "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.hd,
              "hidden_act": "silu", "max_position_embeddings": length, "rms_norm_eps": cfg.norm_eps,
              "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
              "mlp_bias": False, "attention_dropout": 0.0, "use_cache": True}
    if cfg.rope_scaling:
        config["rope_scaling"] = dict(cfg.rope_scaling)
    return config, state


def remote_export(model, length, dtype, out):
    """(config.json dict, state dict): modeling_mhar.py's model, with model.py and its modules copied into out."""
    cfg, modules = model.cfg, model_modules()
    for name in modules:   # each module of this repo imported as a sibling in the package transformers makes
        with open(os.path.join(HERE, name + ".py")) as f:
            text = f.read()
        with open(os.path.join(out, name + ".py"), "w") as f:
            f.write(package_relative(text, modules))
    with open(os.path.join(out, "modeling_mhar.py"), "w") as f:
        f.write(MODELING)
    state = {"model." + k: v.to(dtype) for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and cfg.tie_embeddings)}
    gpt = {**cfg.__dict__, "routing_impl": "auto"}
    config = {"architectures": ["MHARForCausalLM"], "model_type": "mhar",
              "auto_map": {"AutoConfig": "modeling_mhar.MHARConfig", "AutoModelForCausalLM": "modeling_mhar.MHARForCausalLM"},
              "gpt_config": gpt, "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd,
              "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
              "max_position_embeddings": length, "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True}
    return config, state


def model_modules():
    """model.py and every module of this repository it imports, directly or through another, at the top or inside a
    function: what an exported folder must hold, read from the import statements themselves (a list kept by hand goes
    stale the day a module gains an import)."""
    own = {f[:-3] for f in os.listdir(HERE) if f.endswith(".py")}
    found, todo = set(), ["model"]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        with open(os.path.join(HERE, name + ".py")) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                todo += [a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in own]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level and node.module.split(".")[0] in own:
                todo.append(node.module.split(".")[0])
    return sorted(found)


def package_relative(text, modules):
    """A module's imports of the given modules of this repository as package-relative ones ("from checkpoint import
    x" -> "from .checkpoint import x", "import routing_kernel as rk" -> "from . import routing_kernel as rk"): the
    modules live in one package in transformers' cache, whose name the code cannot know."""
    names = "|".join(modules)
    text = re.sub(rf"^(\s*)from ({names}) import ", r"\1from .\2 import ", text, flags=re.M)
    return re.sub(rf"^(\s*)import ({names})( as \w+)?(\s*(#.*)?)$", r"\1from . import \2\3\4", text, flags=re.M)


# ---- the check and the command ----------------------------------------------------------------------------------------

# loads an exported folder as whoever downloads it does: transformers alone, no repository on the path
LOAD_ELSEWHERE = """
import sys, torch
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
                            str(int(remote))], cwd=work, capture_output=True, text=True)
        if r.returncode:
            last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ValueError(f"the exported folder does not load in a process outside this repository ({last}); "
                             "nothing written")
        theirs = torch.load(os.path.join(work, "logits.pt"))
    with torch.no_grad():
        ours = model.to(device)(idx.to(device))[0]
    return (ours.float().cpu() - theirs).abs().max().item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", required=True, help="a train.py / convert.py out_dir, or a ckpt.pt")
    p.add_argument("--hf_dir", required=True, help="the folder to write (refused if it exists, unless --force)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="dtype of the written weights")
    p.add_argument("--check", default="True", choices=("True", "False"),
                   help="load the written folder with transformers and compare its logits with this repo's (fp32)")
    p.add_argument("--device", default="cpu", help="device of the check (cpu | cuda)")
    p.add_argument("--force", action="store_true", help="replace an existing --hf_dir")
    args = p.parse_args(argv)
    try:
        check_device(args.device)
        if os.path.exists(args.hf_dir) and not args.force:
            raise ValueError(f"--hf_dir={args.hf_dir} exists: pick another folder or pass --force to replace it")
        if os.path.abspath(args.hf_dir) == os.path.abspath(args.out_dir if os.path.isdir(args.out_dir)
                                                           else os.path.dirname(args.out_dir)):
            raise ValueError("--hf_dir must not be the checkpoint's own folder")
        model, ckpt = load(args.out_dir)
        written = export(model, ckpt, args)
    except (ValueError, OSError) as e:
        sys.exit(f"export.py: error: {e}")
    return written


def export(model, ckpt, args):
    """The folder written into a temporary sibling of --hf_dir, checked, then moved into place."""
    mode, dtype = model.cfg.residual, getattr(torch, args.dtype)
    if mode not in ("baseline", "hyper", "attnres", "mhar", "delta"):
        raise ValueError(f"residual={mode!r}: export knows baseline, hyper, attnres, mhar and delta")
    ckpt_dir = model.checkpoint_info["dir"]
    parent = os.path.dirname(os.path.abspath(args.hf_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        length = training_length(model, ckpt)
        eos, bos = tokenizer_files(ckpt, ckpt_dir, tmp, length)
        remote = mode != "baseline"
        config, state = remote_export(model, length, dtype, tmp) if remote else baseline_export(model, length, dtype)
        config.update({"eos_token_id": eos, "bos_token_id": bos, "pad_token_id": eos, "dtype": args.dtype,
                       "exported_from": {"checkpoint": ckpt_dir, "step": ckpt.get("step"), "git": ckpt.get("git")}})
        write_json(os.path.join(tmp, "config.json"), config)
        write_json(os.path.join(tmp, "generation_config.json"),
                   {"eos_token_id": eos, "bos_token_id": bos, "pad_token_id": eos, "do_sample": False, "use_cache": True})
        write_weights(state, tmp)
        worst = check(tmp, model, remote, args.device) if args.check == "True" else None
        if worst is not None and not worst <= (1e-4 if args.dtype == "float32" else float("inf")):   # (NaN fails)
            raise ValueError(f"the exported model's logits differ from the checkpoint's by {worst:.3g}; nothing written")
        if os.path.exists(args.hf_dir):
            shutil.rmtree(args.hf_dir)
        os.replace(tmp, args.hf_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    kind = "Qwen3" if config["model_type"] == "qwen3" else "Llama" if config["model_type"] == "llama" else \
        f"{mode} through modeling_mhar.py (trust_remote_code=True)"
    print(f"wrote {args.hf_dir}: {kind}, {args.dtype}, {len(state)} tensors" + (
        f"; its logits match the checkpoint's to {worst:.1e} (fp32, transformers)" if worst is not None else
        "; not checked (transformers is not installed)"))
    return args.hf_dir


# The modeling file written into every non-baseline export: transformers' wrapper of this folder's model.py.
MODELING = '''"""
A Multi-Head Attention Residuals model (arXiv 2607.27230) exported by the mhar repository's export.py: model.py and
the modules beside this file are that repository's, copied with their imports made package-relative. This file only
wraps model.GPT for transformers: config, weights, loss and logits, and generate() through model.py's KV cache.
"""
import inspect

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .generation import KVCache
from .model import GPT, GPTConfig

# the name under which generate() hands a model its cache: "cache" in recent transformers, "past_key_values" before
CACHE = "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters else \
    "past_key_values"


class MHARConfig(PretrainedConfig):
    model_type = "mhar"

    def __init__(self, gpt_config=None, **kwargs):
        self.gpt_config = dict(gpt_config or {})   # model.GPTConfig's fields
        super().__init__(**kwargs)


class MHARForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MHARConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"model.lm_head.weight": "model.wte.weight"}   # tied where config.tie_word_embeddings says

    def __init__(self, config):
        super().__init__(config)
        self.model = GPT(GPTConfig.from_dict(config.gpt_config))
        self.rope_ready = False   # RoPE tables: not in the weights, so made on the first forward where the model is
        self.post_init()

    def _init_weights(self, module):   # the weights come from the checkpoint; model.py initialised the rest
        pass

    def get_input_embeddings(self):
        return self.model.wte

    def get_output_embeddings(self):
        return self.model.lm_head

    @classmethod
    def _supports_default_dynamic_cache(cls):   # generation keeps model.py's own KV cache
        return False

    def forward(self, input_ids=None, attention_mask=None, labels=None, use_cache=None, cache=None,
                past_key_values=None, **kwargs):
        """Logits (B, T, vocab) of input_ids; with labels (input_ids' shape, -100 ignored) the next-token loss; with
        use_cache the KV cache (model.py's KVCache) to pass back for the next tokens. attention_mask is not read:
        every position attends to the positions before it."""
        if not self.rope_ready:   # (transformers builds the model on the meta device: its buffers hold no values)
            self.model.reset_buffers(self.model.wte.weight.device)
            self.rope_ready = True
        cache = cache if isinstance(cache, KVCache) else past_key_values if isinstance(past_key_values, KVCache) else None
        if cache is None and use_cache and not self.training:
            cache = KVCache(self.model, input_ids.size(0), dtype=self.model.wte.weight.dtype)
        if cache is not None and cache.pos + input_ids.size(1) > cache.max_len:
            raise ValueError(f"{cache.pos + input_ids.size(1)} tokens exceed max_position_embeddings "
                             f"{cache.max_len}; generate fewer tokens")
        logits, _ = self.model(input_ids, cache=cache)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        out = CausalLMOutputWithPast(loss=loss, logits=logits)
        if cache is not None:   # handed back to the next step by generate()
            out[CACHE] = cache
        return out

    def prepare_inputs_for_generation(self, input_ids, cache=None, past_key_values=None, attention_mask=None,
                                      use_cache=True, **kwargs):
        cache = cache if isinstance(cache, KVCache) else past_key_values if isinstance(past_key_values, KVCache) else None
        if cache is not None:
            input_ids = input_ids[:, cache.pos:]   # only the tokens the cache has not seen
        return {"input_ids": input_ids, CACHE: cache, "use_cache": use_cache}
'''


if __name__ == "__main__":
    run_script(main, "export.py", "; --hf_dir is as it was (the folder is written beside it, then moved)")
