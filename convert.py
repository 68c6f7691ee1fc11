"""
Graft MHAR onto a pretrained Hugging Face Llama / Qwen3 checkpoint (the paper's mid-training setting,
section 3.3 and Appendix E): map its weights onto model.py, add the delta routing (every sublayer reads
x = P + alpha * route(null, embedding, block deltas), alpha = 0), check that the converted model is the
pretrained one bitwise, and write a checkpoint for train.py / sample.py / eval.py.

  python convert.py --hf_dir=path/to/Llama-3.1-8B --out_dir=out/llama8b_delta [--route_heads=8] [--num_blocks=8]
  python train.py config/midtrain_8b_delta.py --init_from=out/llama8b_delta --out_dir=out/llama8b_midtrain

Reads config.json and model.safetensors or a sharded model.safetensors.index.json, one tensor at a time (no
`transformers` needed): an 8B model converts in ~16 GB of RAM in bf16, ~32 GB during the fp32 identity check.
"""
import json
import os
import shlex
import shutil
import signal
import sys
import time

if __name__ == "__main__":   # Ctrl-C while torch loads: a quiet exit (nothing is written yet)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch

from checkpoint import read_checkpoint, verify_checkpoint
from model import GPT, GPTConfig
from common import LockHeld, keeps_signals, release_lock, run_script, take_lock
from options import Choice, Count, Device, Parser, Path
from tokenizer import Tokenizer, load_tokenizer, tokenizer_id

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
# Hugging Face tensor names -> model.py names ({i} = layer)
NAMES = {
    "model.embed_tokens.weight": "wte.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "model.layers.{i}.input_layernorm.weight": "blocks.{i}.attn.norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blocks.{i}.attn.q_proj.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blocks.{i}.attn.k_proj.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blocks.{i}.attn.v_proj.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blocks.{i}.attn.o_proj.weight",
    "model.layers.{i}.self_attn.q_norm.weight": "blocks.{i}.attn.q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blocks.{i}.attn.k_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blocks.{i}.mlp.norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blocks.{i}.mlp.gate_proj.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blocks.{i}.mlp.up_proj.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blocks.{i}.mlp.down_proj.weight",
}
IGNORED = ("rotary_emb.inv_freq",)   # buffers some exporters store; model.py recomputes them


def model_config(hf, route_heads=None, num_blocks=8, block_size=None):
    """GPTConfig of the delta model for a Hugging Face config.json dict. Raises ValueError on what it cannot map."""
    if not isinstance(hf, dict):
        raise ValueError(f"config.json holds a {type(hf).__name__}, not a Hugging Face config (a JSON object)")
    arch = architecture(hf)
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} (model_type {hf.get('model_type')!r}) is not supported: "
                         f"convert.py reads {', '.join(ARCHITECTURES)}")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"{key}=true is not supported (model.py has no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (SwiGLU with silu only)")
    # RoPE: classic keys (rope_theta, rope_scaling) or the rope_parameters dict of recent transformers
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = dict(rope) if rope else (dict(hf["rope_scaling"]) if hf.get("rope_scaling") else None)
    if scaling is not None:
        scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
        scaling.pop("rope_theta", None)
        if scaling["rope_type"] == "default":
            scaling = None
        elif scaling["rope_type"] != "llama3":
            raise ValueError(f"rope scaling {scaling['rope_type']!r} is not supported (llama3 or none)")
    missing = [k for k in ("vocab_size", "num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size")
               if not isinstance(hf.get(k), int)]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)} (or gives a non-integer): a truncated or edited "
                         "config? Download it again")
    n_head = hf["num_attention_heads"]
    return GPTConfig(
        vocab_size=hf["vocab_size"], block_size=block_size or hf.get("max_position_embeddings", 4096),
        n_layer=hf["num_hidden_layers"], n_head=n_head, n_kv_head=hf.get("num_key_value_heads", n_head),
        n_embd=hf["hidden_size"], ffn_hidden=hf["intermediate_size"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head, qk_norm=ARCHITECTURES[arch] == "qwen3",
        rope_theta=float(theta), rope_scaling=scaling, norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), residual="delta",
        route_heads=route_heads, num_blocks=num_blocks)


def architecture(hf):
    """config.json's architecture: the first of its list (a bare string read as one name)."""
    archs = hf.get("architectures")
    return archs if isinstance(archs, str) else archs[0] if isinstance(archs, list) and archs else None


def read_json(path):
    """A JSON file, or an error naming it: missing, or not JSON."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: --hf_dir must hold a Hugging Face checkpoint")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON ({e}): truncated or corrupt? Download it again") from None


def shard_files(hf_dir):
    """(file -> tensor names) of the checkpoint's safetensors, every file checked to exist."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map (not a safetensors index)")
        files = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = {"model.safetensors": None}
    else:
        raise FileNotFoundError(f"{hf_dir} holds neither model.safetensors nor model.safetensors.index.json")
    missing = [f for f in files if not os.path.isfile(os.path.join(hf_dir, f))]
    if missing:
        raise FileNotFoundError(f"shard(s) listed in the index are missing from {hf_dir}: {', '.join(sorted(missing))}")
    return files


def load_weights(hf_dir, cfg, dtype):
    """model.py state dict (without routing parameters) from the safetensors shards, one tensor at a time."""
    from safetensors import SafetensorError, safe_open
    expected = _shapes(cfg)
    state = {}
    for fname in sorted(shard_files(hf_dir)):
        try:
            with safe_open(os.path.join(hf_dir, fname), framework="pt") as f:
                for name in f.keys():
                    ours = _our_name(name)
                    if ours is None:
                        if name.endswith(IGNORED) or (name == "lm_head.weight" and cfg.tie_embeddings):
                            continue
                        raise ValueError(f"{fname}: unexpected tensor {name!r} (not a Llama/Qwen3 weight this converter maps)")
                    if ours not in expected:
                        raise ValueError(f"{fname}: tensor {name!r} does not fit the config (no {ours} in the model; "
                                         "qk-norm weights in a Llama checkpoint, or a layer beyond num_hidden_layers?)")
                    t = f.get_tensor(name)
                    if tuple(t.shape) != expected[ours]:
                        raise ValueError(f"{fname}: {name} has shape {tuple(t.shape)}, the config implies {expected[ours]}")
                    state[ours] = t.to(dtype)
        except SafetensorError as e:   # a file cut short, corrupt or not safetensors at all: name it
            raise ValueError(f"{os.path.join(hf_dir, fname)} is not a readable safetensors file "
                             f"({str(e).splitlines()[0]}): truncated or corrupt? Download it again") from None
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{len(missing)} weight(s) not found in the checkpoint, e.g. {', '.join(missing[:4])}")
    return state


def _our_name(name):
    parts = name.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        pattern = ".".join(parts[:2] + ["{i}"] + parts[3:])
        return NAMES[pattern].format(i=parts[2]) if pattern in NAMES else None
    return NAMES.get(name)


def _shapes(cfg):
    """Shapes of every non-routing parameter of the model, computed without allocating it."""
    with torch.device("meta"):
        model = GPT(GPTConfig.from_dict({**cfg.__dict__, "residual": "baseline"}))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()
            if not (k == "lm_head.weight" and cfg.tie_embeddings)}   # tied: the embedding is the LM head


def build(cfg, weights):
    """The delta model around the given weights, routing parameters at their initial values."""
    dtype = next(iter(weights.values())).dtype
    routing = {f"routes.{k}.{p}": init(cfg.n_embd).to(dtype) for k in range(cfg.n_sites)
               for p, init in (("q", torch.zeros), ("g", torch.ones), ("null", torch.zeros),
                               ("alpha", lambda d: torch.zeros(1)))}
    return GPT.from_state(cfg, {**weights, **routing})


def identity_check(model, n_batches=3, seq_len=64, device="cpu", seed=0):
    """Largest |logit difference| between the delta model (alpha = 0) and the same weights as a plain
    pre-norm Transformer, on random token batches, in fp32. Converts the model to fp32 in place."""
    model.float().to(device)
    base = build_baseline(model)
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    with torch.no_grad():
        for _ in range(n_batches):
            idx = torch.randint(0, model.cfg.vocab_size, (2, min(seq_len, model.cfg.block_size)), generator=gen).to(device)
            a, b = model(idx)[0], base(idx)[0]
            if not torch.equal(a, b):
                worst = max(worst, (a - b).abs().max().item(), float("inf") if torch.isnan(a).any() else 0.0)
    return worst


def build_baseline(model):
    """The same weights (shared, not copied) as a residual='baseline' model."""
    cfg = GPTConfig.from_dict({**model.cfg.__dict__, "residual": "baseline"})
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("routes.")}
    return GPT.from_state(cfg, state, device=next(model.parameters()).device)


def parser():
    """convert.py's options, each with its kind and range (options.py)."""
    p = Parser(prog="convert.py", description=__doc__)
    p.add_argument("--hf_dir", type=Path("dir", "a Hugging Face checkpoint: config.json and safetensors"), required=True,
                   help="folder with config.json and the safetensors weights")
    p.add_argument("--out_dir", type=Path("out_dir", writes="converted"), required=True,
                   help="where ckpt.pt (and tokenizer.json) are written")
    p.add_argument("--route_heads", type=Count(1, 65536), default=None, help="routing heads H (default 8)")
    p.add_argument("--num_blocks", type=Count(1, 1024), default=8, help="blocks of layers whose deltas are sources "
                   "(default 8)")
    p.add_argument("--tokenizer", type=Tokenizer(), default=None, help="tiktoken encoding name or a tokenizer.json path "
                   "(default: the checkpoint's tokenizer.json)")
    p.add_argument("--dtype", type=Choice("bfloat16", "float32"), default="bfloat16", help="dtype of the written weights")
    p.add_argument("--block_size", type=Count(2, 2**20), default=None, help="longest sequence (default "
                   "max_position_embeddings)")
    p.add_argument("--check_batches", type=Count(0, 1000), default=3, help="random batches of the identity check (0 = "
                   "skip)")
    p.add_argument("--device", type=Device(), default="cpu", help="device of the identity check (cpu | cuda | cuda:N)")
    p.add_argument("--force", action="store_true", help="replace a converted checkpoint in --out_dir (never a trained "
                   "one)")
    return p


def converted_here(path):
    """Is the checkpoint at path convert.py's (no training state)? A look at its keys; an unreadable file is not."""
    try:
        return read_checkpoint(path, verify=False).get("train_config", 0) is None
    except ValueError:
        return False


@keeps_signals
def main(argv=None):
    args = parser().parse_args(argv)   # every option by its rule, before anything loads
    t0 = time.time()
    parent, name = os.path.split(os.path.abspath(args.out_dir))
    lock = os.path.join(parent, f".{name}.convert.lock")   # one convert.py into a folder at a time
    try:
        os.makedirs(parent, exist_ok=True)
        take_lock(lock, "convert.py")
    except LockHeld as e:
        sys.exit(f"convert.py: error: --out_dir={args.out_dir} is being written by another convert.py (pid "
                 f"{e.holder['pid']}, since {e.holder.get('since', '?')}): wait for it, or pick another folder")
    try:
        convert(args, t0)
    finally:
        release_lock(lock)


def convert(args, t0):
    """The conversion main runs under its lock: checks, the model, the identity check, the checkpoint written."""
    try:
        if os.path.isdir(args.out_dir) and os.path.samefile(args.hf_dir, args.out_dir):
            raise ValueError(f"--out_dir={args.out_dir} is --hf_dir: write the converted model to a folder of its own")
        out = os.path.join(args.out_dir, "ckpt.pt")
        if os.path.exists(out) and not args.force:
            raise FileExistsError(f"{out} exists: choose another --out_dir or pass --force")
        if os.path.exists(out) and not converted_here(out):
            raise FileExistsError(f"{out} is a train.py checkpoint, not a converted one: --force replaces only "
                                  "convert.py's; choose another --out_dir")
        hf = read_json(os.path.join(args.hf_dir, "config.json"))
        cfg = model_config(hf, args.route_heads, args.num_blocks, args.block_size)
        tok_src = args.tokenizer or os.path.join(args.hf_dir, "tokenizer.json")
        if tok_src.endswith(".json") and not os.path.isfile(tok_src):
            if args.tokenizer:
                raise FileNotFoundError(f"--tokenizer={tok_src}: no such file")
            tok_src = None
        if tok_src is not None:
            load_tokenizer(tok_src)   # fail before the long part
        need = sum(os.path.getsize(os.path.join(args.hf_dir, f)) for f in os.listdir(args.hf_dir)
                   if f.endswith(".safetensors")) * (1 if args.dtype == "bfloat16" else 2)
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(out))
                                 if os.path.isdir(os.path.dirname(os.path.abspath(out))) else ".").free
        if free < need:   # (the weights at --dtype, at most twice the safetensors' bytes)
            raise ValueError(f"{args.out_dir}'s disk has {free / 1e9:.2f} GB free; the checkpoint needs ~{need / 1e9:.2f} "
                             "GB: free some space or pick another --out_dir")
        print(f"convert.py: reading {args.hf_dir}'s weights", flush=True)
        weights = load_weights(args.hf_dir, cfg, getattr(torch, args.dtype))
        model = build(cfg, weights)
        del weights
        n = sum(p.numel() for p in model.parameters())
        print(f"{ARCHITECTURES[architecture(hf)]}: {cfg.n_layer} layers, d {cfg.n_embd}, {cfg.n_head}/{cfg.n_kv_head} "
              f"heads of {cfg.hd}, vocab {cfg.vocab_size}, {n:,} parameters; delta routing: {cfg.n_sites} sites, "
              f"H {cfg.heads}, {cfg.num_blocks} blocks of {cfg.n_layer // cfg.num_blocks} layers")
        if args.check_batches:
            worst = identity_check(model, args.check_batches, device=args.device)
            if worst != 0.0:
                raise RuntimeError(f"identity check failed: alpha = 0 changed the logits by up to {worst:.3g}; nothing written")
            print(f"identity check: {args.check_batches} random batches of 2 x {min(64, cfg.block_size)} tokens, fp32 logits "
                  "with alpha = 0 equal the pretrained model's bitwise")
        model.to("cpu", getattr(torch, args.dtype))
    except (ValueError, FileNotFoundError, FileExistsError, KeyError, RuntimeError) as e:
        sys.exit(f"convert.py: error: {e}")
    os.makedirs(args.out_dir, exist_ok=True)
    tokenizer = None
    if tok_src is not None and tok_src.endswith(".json"):
        shutil.copyfile(tok_src, os.path.join(args.out_dir, "tokenizer.json"))
        tokenizer = "tokenizer.json"   # relative to the checkpoint's folder
    elif tok_src is not None:
        tokenizer = tok_src
    else:
        print("warning: no tokenizer found or given; sample.py and eval.py will need one (--tokenizer)")
    ckpt = {"model": model.state_dict(), "model_config": cfg.__dict__, "step": 0, "tokenizer": tokenizer,
            "tokenizer_id": tokenizer_id(os.path.join(args.out_dir, tokenizer)) if tokenizer and tokenizer.endswith(".json")
            else tokenizer, "converted_from": {"hf_dir": os.path.abspath(args.hf_dir), "config": hf},
            "train_config": None, "optimizer": None}
    print(f"convert.py: writing {out}", flush=True)
    try:
        torch.save(ckpt, out + ".tmp")
        verify_checkpoint(out + ".tmp")   # read back by content before it lands
        os.replace(out + ".tmp", out)
    except (OSError, RuntimeError, ValueError) as e:   # a full disk: torch.save's own error, not a traceback
        sys.exit(f"convert.py: error: could not write {out} ({e}); nothing was written")
    finally:
        if os.path.exists(out + ".tmp"):
            os.remove(out + ".tmp")
    print(f"wrote {out} ({args.dtype}) in {time.time() - t0:.0f}s")
    print(f"next: python train.py --init_from={shlex.quote(args.out_dir)} --out_dir=<a new folder> ...  (or sample.py / "
          f"eval.py --out_dir={shlex.quote(args.out_dir)})")


if __name__ == "__main__":
    run_script(main, "convert.py", "; no checkpoint was written (one already in --out_dir is as it was)")
