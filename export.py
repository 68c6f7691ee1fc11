"""
Export a checkpoint to a Hugging Face folder that stock transformers, its generate() and lm-evaluation-harness load:
convert.py's mapping run the other way for the baseline, this repository's own model.py for every other mode.

  python export.py --out_dir=out/mhar_100m --hf_dir=hf/mhar_100m            # a train.py out_dir, or a ckpt.pt
  python export.py --out_dir=out/llama8b_delta --hf_dir=hf/llama8b_delta --dtype=bfloat16

- baseline (with qk-norm, as train.py's models are): a plain Qwen3 folder (Llama without qk-norm): config.json and the
  weights under transformers' own names. `AutoModelForCausalLM.from_pretrained(DIR)`, no remote code.
- attnres, mhar, hyper, block routing, delta: config.json's auto_map names modeling_mhar.py, copied into the folder:
  a PreTrainedModel with GenerationMixin around model.py, which is copied beside it with the modules it imports (their
  imports of each other made package-relative, nothing else changed: one implementation). Load with
  `trust_remote_code=True` (the tokenizer, a stock one, with trust_remote_code=False); generate() uses this
  repository's KV cache (greedy, sampling, beam search; past the training length its RoPE tables grow, as a stock
  model's do); gradient_checkpointing_enable() recomputes the sublayers. attention_mask is honoured: a batch padded on
  either side gives each row's own text.
Both: model.safetensors (sharded above 5 GB), generation_config.json, and the tokenizer (GPT-2's from tiktoken's cached
files, or the checkpoint's tokenizer.json). Written into a temporary folder, checked (the folder loaded with
transformers, where installed, against this repository's logits), then moved into place: a failure writes nothing.
"""
import ast
import json
import os
import re
import shutil
import signal
import sys
import tempfile

if __name__ == "__main__":   # Ctrl-C while torch loads: a quiet exit (nothing is written yet)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch

from convert import NAMES
from checkpoint import load_model
from common import LockHeld, handle_signals, keeps_signals, pid_alive, release_lock, run_script, take_lock
from hub import check, write_card, write_weights
from options import Choice, Device, Flag, Parser, Path, Text

HERE = os.path.dirname(os.path.abspath(__file__))
GPT2_FILES = ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
              "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe")


def load(path, ema=False):
    """(model in fp32, its checkpoint dict) of a train.py out_dir or ckpt.pt; a ValueError in one line otherwise."""
    from checkpoint import checkpoint_path, read_checkpoint, read_sharded
    path = checkpoint_path(path)
    if not os.path.exists(path):
        raise ValueError(f"--out_dir={path}: no checkpoint there (pass a train.py or convert.py out_dir, or a ckpt.pt)")
    ckpt = read_sharded(path, whole=True) if path.rstrip("/").endswith(".dcp") else read_checkpoint(path)   # checked
    model = load_model(path, ckpt=ckpt, ema=ema, say=lambda line: print(f"export.py: {line}"))
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
        from tokenizer import HFTokenizer, tokenizer_id
        if str(ckpt.get("tokenizer_id", "")).startswith("sha1:") and tokenizer_id(src) != ckpt["tokenizer_id"]:
            raise ValueError(f"the checkpoint's tokenizer {src} is not the file it was trained with (its sha1 is not "
                             "the one the checkpoint records): damaged or replaced; put the original back")
        HFTokenizer(src)   # parsed before it is copied (a file cut short: one line naming it)
        shutil.copyfile(src, os.path.join(out, "tokenizer.json"))
    elif name == "gpt2":
        gpt2_tokenizer().save(os.path.join(out, "tokenizer.json"))
    else:
        raise ValueError(f"tokenizer {name!r}: export writes GPT-2's or a tokenizer.json; a tiktoken {name} has no "
                         "Hugging Face file here")
    from tokenizer import HFTokenizer
    tok = HFTokenizer(os.path.join(out, "tokenizer.json")).tok
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
    shutil.copyfile(os.path.join(HERE, "modeling_mhar.py"), os.path.join(out, "modeling_mhar.py"))
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


# ---- the command -----------------------------------------------------------------------------------------------------

def parser():
    """export.py's options, each with its kind and range (options.py)."""
    p = Parser(prog="export.py", description=__doc__)
    p.add_argument("--out_dir", type=Path("any", "a train.py / convert.py out_dir or a ckpt.pt"), required=True,
                   help="a train.py / convert.py out_dir, or a ckpt.pt")
    p.add_argument("--hf_dir", type=Path("out_dir", writes="export"), required=True,
                   help="the folder to write (refused if it exists, unless --force and export.py wrote it)")
    p.add_argument("--dtype", type=Choice("float32", "bfloat16"), default="float32", help="dtype of the written weights")
    p.add_argument("--ema", action="store_true", help="export the checkpoint's EMA weights (train.py --ema_decay)")
    p.add_argument("--check", type=Flag(), default=True, help="load the written folder with transformers in a fresh "
                   "process elsewhere and compare its logits with this repo's (fp32)")
    p.add_argument("--device", type=Device(), default="cpu", help="device of the check (cpu | cuda | cuda:N)")
    p.add_argument("--license", type=Text(), default="other", help="the model card's license (the Hub's identifiers, "
                   "e.g. apache-2.0; default other: yours to say)")
    p.add_argument("--force", action="store_true", help="replace an --hf_dir that export.py wrote (never another folder, "
                   "and never one that holds the checkpoint)")
    return p


def exported_here(folder):
    """Did export.py write this folder? Its config.json names the checkpoint it came from (exported_from)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return "exported_from" in json.load(f)
    except (OSError, ValueError, TypeError):
        return False


def others(hf_dir, files):
    """The files of an earlier export at hf_dir that export.py did not write (its config.json's manifest; an export
    from before manifests: those the new one writes), relative paths; a ValueError where the new export writes a file
    of one of those names (the user's file would be lost)."""
    try:
        with open(os.path.join(hf_dir, "config.json")) as f:
            ours = set(json.load(f)["exported_from"].get("files") or files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        ours = set(files)
    found = sorted(os.path.relpath(os.path.join(d, f), hf_dir) for d, _, fs in os.walk(hf_dir) for f in fs)
    foreign = [rel for rel in found if rel not in ours]
    clash = [rel for rel in foreign if rel in files]
    if clash:
        raise ValueError(f"--hf_dir={hf_dir} holds {', '.join(clash)}, which export.py did not write there and the new "
                         "export writes: move it away first; nothing was written")
    return foreign


def check_target(hf_dir, ckpt_path, force):
    """--hf_dir may be written: new, or (--force) a folder export.py wrote that holds no checkpoint; a ValueError else."""
    ckpt_dir = os.path.dirname(ckpt_path)
    if os.path.commonpath([hf_dir, ckpt_dir]) == hf_dir:
        raise ValueError(f"--hf_dir={hf_dir} holds the checkpoint ({ckpt_path}): write the export to a folder of its own")
    if os.path.exists(hf_dir):
        if not force:
            raise ValueError(f"--hf_dir={hf_dir} exists: pick another folder, or pass --force to replace an export")
        if not exported_here(hf_dir):
            raise ValueError(f"--hf_dir={hf_dir} exists and export.py did not write it (no config.json naming its "
                             "checkpoint): --force replaces only exports; pick another folder")
        if any(f.endswith(".pt") for _, _, files in os.walk(hf_dir) for f in files):
            raise ValueError(f"--hf_dir={hf_dir} holds .pt files (checkpoints?): --force does not replace it")


class Stopped(Exception):
    """SIGTERM during an export: the temporary folder is removed on the way out."""


@keeps_signals
def main(argv=None):
    args = parser().parse_args(argv)   # every option by its rule, before anything loads
    def stop(signum, frame):
        raise Stopped
    handle_signals(stop, signal.SIGTERM)
    parent, name = os.path.split(os.path.abspath(args.hf_dir))
    lock = os.path.join(parent, f".{name}.export.lock")   # one export into a folder at a time
    try:
        from checkpoint import checkpoint_path
        path = checkpoint_path(args.out_dir)
        os.makedirs(parent, exist_ok=True)
        take_lock(lock, "export.py")
        check_target(args.hf_dir, os.path.abspath(path), args.force)
        model, ckpt = load(args.out_dir, args.ema)
        written = export(model, ckpt, args)
    except LockHeld as e:
        sys.exit(f"export.py: error: --hf_dir={args.hf_dir} is being written by another export.py (pid "
                 f"{e.holder['pid']}, since {e.holder.get('since', '?')}): wait for it, or pick another folder")
    except (ValueError, OSError) as e:
        sys.exit(f"export.py: error: {e}")
    except Stopped:
        print(f"export.py: stopped by SIGTERM; nothing was written ({args.hf_dir} is as it was)", file=sys.stderr)
        sys.exit(143)
    finally:
        release_lock(lock)
    return written


def export(model, ckpt, args):
    """The folder written into a temporary sibling of --hf_dir, checked, then moved into place (a replaced export is
    removed only once the new one is in place)."""
    mode, dtype = model.cfg.residual, getattr(torch, args.dtype)
    if mode not in ("baseline", "hyper", "attnres", "mhar", "delta"):
        raise ValueError(f"residual={mode!r}: export knows baseline, hyper, attnres, mhar and delta")
    ckpt_dir = model.checkpoint_info["dir"]
    parent = os.path.dirname(os.path.abspath(args.hf_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    need = sum(p.numel() for p in model.parameters()) * dtype.itemsize + 2**26   # the weights, and room for the rest
    free = shutil.disk_usage(parent).free
    if free < need:
        raise ValueError(f"{parent} has {free / 1e9:.2f} GB free; the export needs ~{need / 1e9:.2f} GB (its weights and "
                         f"{2**26 / 1e9:.2f} GB for the rest): free some space or pick another --hf_dir")
    for stale in os.listdir(parent):   # the temporary folders of exports that were killed (their pid is gone)
        pid = re.fullmatch(r"\.export-(\d+)-\w+", stale)
        if pid and not pid_alive(int(pid[1])) and os.path.isdir(os.path.join(parent, stale)):
            shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
            print(f"export.py: removed {os.path.join(parent, stale)}, left by an export that was killed")
    tmp = tempfile.mkdtemp(prefix=f".export-{os.getpid()}-", dir=parent)
    old, foreign = None, []
    try:
        length = training_length(model, ckpt)
        eos, bos = tokenizer_files(ckpt, ckpt_dir, tmp, length)
        remote = mode != "baseline"
        config, state = remote_export(model, length, dtype, tmp) if remote else baseline_export(model, length, dtype)
        config.update({"eos_token_id": eos, "bos_token_id": bos, "pad_token_id": eos, "dtype": args.dtype,
                       "exported_from": {"checkpoint": os.path.basename(ckpt_dir), "step": ckpt.get("step"),
                                         "git": ckpt.get("git"), "weights": model.checkpoint_info["weights"]}})
        write_json(os.path.join(tmp, "config.json"), config)
        write_json(os.path.join(tmp, "generation_config.json"),
                   {"eos_token_id": eos, "bos_token_id": bos, "pad_token_id": eos, "do_sample": False, "use_cache": True})
        print(f"export.py: writing {len(state)} tensors ({need / 1e9:.2f} GB, {args.dtype})", flush=True)
        write_weights(state, tmp)
        write_card(tmp, model, ckpt, config, args)
        shutil.copyfile(os.path.join(HERE, "LICENSE"), os.path.join(tmp, "LICENSE"))   # the repository's (its code)
        config["exported_from"]["files"] = sorted({"config.json"} | {os.path.relpath(os.path.join(d, f), tmp)
                                                                    for d, _, fs in os.walk(tmp) for f in fs})
        write_json(os.path.join(tmp, "config.json"), config)   # the manifest: what --force may replace, later
        if args.check:
            print("export.py: checking the folder in a fresh python -I elsewhere (transformers alone)", flush=True)
        worst = check(tmp, model, remote, args.device) if args.check else None
        if worst is not None and not worst <= (1e-4 if args.dtype == "float32" else float("inf")):   # (NaN fails)
            raise ValueError(f"the exported model's logits differ from the checkpoint's by {worst:.3g}; nothing written")
        os.chmod(tmp, 0o755)   # (mkdtemp makes it 0700: a folder to share reads as save_pretrained's do)
        foreign = others(args.hf_dir, config["exported_from"]["files"]) if os.path.exists(args.hf_dir) else []
        if os.path.exists(args.hf_dir):   # an earlier export (check_target): set aside until the new one is in place
            old = tempfile.mkdtemp(prefix=f".replaced-{os.getpid()}-", dir=parent)
            os.replace(args.hf_dir, os.path.join(old, "export"))
        os.replace(tmp, args.hf_dir)
        for rel in foreign:   # files export.py did not write there stay, in the new export
            os.makedirs(os.path.dirname(os.path.join(args.hf_dir, rel)), exist_ok=True)
            os.replace(os.path.join(old, "export", rel), os.path.join(args.hf_dir, rel))
        if foreign:
            print(f"export.py: kept {', '.join(foreign)} in {args.hf_dir} (not written by export.py)")
        foreign = []
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not os.path.exists(args.hf_dir):
            os.replace(os.path.join(old, "export"), args.hf_dir)
        raise
    finally:
        if old is not None and not foreign:   # (a failure while moving them leaves the old export where it is)
            shutil.rmtree(old, ignore_errors=True)
    kind = "Qwen3" if config["model_type"] == "qwen3" else "Llama" if config["model_type"] == "llama" else \
        f"{mode} through modeling_mhar.py (trust_remote_code=True)"
    print(f"wrote {args.hf_dir}: {kind}, {args.dtype}, {model.checkpoint_info['weights']} weights, {len(state)} tensors" +
          (f"; its logits match the checkpoint's to {worst:.1e} (fp32, transformers)" if worst is not None else
           "; not checked (transformers is not installed)" if args.check else "; not checked (--check=False)"))
    trust = ", trust_remote_code=True" if remote else ""
    print(f"next: AutoModelForCausalLM.from_pretrained({args.hf_dir!r}{trust}) and AutoTokenizer.from_pretrained(the "
          f"same{', trust_remote_code=False' if remote else ''}); its README.md is the model card")
    return args.hf_dir




if __name__ == "__main__":
    run_script(main, "export.py", "; --hf_dir is as it was (the folder is written beside it, then moved)")
