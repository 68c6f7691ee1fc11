"""
Train a GPT with any residual mode (baseline | hyper | attnres | mhar) on prepare_data.py token files.

  python train.py config/tiny.py --device=cpu                      # one process
  torchrun --standalone --nproc_per_node=8 train.py config/train_350m.py --residual=mhar
  python train.py -h                                               # every option with its default

Config: the defaults below, then config files in order (plain Python assignments), then --key=value.
The global batch is given in tokens; gradient accumulation is derived, so 1 and N processes run the
same optimisation. Recipe: ../shared/SPEC.md section 3 (AdamW 0.9/0.95, wd 0.1 on every parameter,
clip 1.0, linear warmup then cosine to 0.1x, fixed validation set, tail-mean of the last 11 evals).
"""
import ast
import difflib
import inspect
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
import typing
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from model import GPT, GPTConfig, upgrade_state


@dataclass
class Config:
    # data and output
    data_dir: str = "data/fineweb_edu"  # prepare_data.py output: train.bin, val.bin, meta.json
    out_dir: str = "out"                # ckpt.pt (latest checkpoint) and log.jsonl
    init_from: str = "scratch"          # scratch | resume (continue out_dir/ckpt.pt) | the out_dir of convert.py
    # model (paper Table 1, 100M shape)
    residual: str = "mhar"              # baseline | hyper | attnres | mhar
    route_heads: int | None = None      # MHAR heads; None = n_kv_head
    routing_impl: str = "reference"     # reference (plain PyTorch) | fused (Triton kernel)
    hc_streams: int = 4                 # hyper-connections: streams
    hc_dynamic: bool = True             # hyper-connections: dynamic (True) or static
    n_layer: int = 12                   # blocks (2 sublayers each)
    n_head: int = 8                     # query heads
    n_kv_head: int = 4                  # key/value heads
    n_embd: int = 512                   # width d
    ffn_hidden: int = 1536              # SwiGLU hidden width
    block_size: int = 2048              # sequence length in tokens
    rope_theta: float = 1e4             # RoPE base
    norm_eps: float = 1e-6              # RMSNorm eps
    # batch
    batch_tokens: int = 131072          # global batch per optimizer step, in tokens (64 x 2048)
    micro_batch: int = 8                # sequences per forward/backward per process
    # optimizer and schedule
    lr: float = 1e-3                    # peak learning rate
    min_lr_ratio: float = 0.1           # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 1000            # linear warmup
    lr_schedule: str = "cosine"         # decay after warmup, to lr * min_lr_ratio: cosine | linear | 1-sqrt
    lr_decay_steps: int = -1            # decay horizon; -1 = max_steps (fix it to extend a run later)
    max_steps: int = 20000              # optimizer steps to train (a resumed run continues up to here)
    weight_decay: float = 0.1           # AdamW weight decay
    decay_all: bool = True              # the paper decays every parameter; False: no decay on norms/embeddings/routing
    beta1: float = 0.9                  # AdamW beta1
    beta2: float = 0.95                 # AdamW beta2
    adam_eps: float = 1e-8              # AdamW eps
    grad_clip: float = 1.0              # global gradient-norm clip (0 = off)
    routing_lr_scale: float = 1.0       # delta mode: LR multiplier of the new routing parameters (own group, no decay)
    z_loss: float = 0.0                 # logit z-loss coefficient (the paper's 8B mid-training: 1e-4)
    chunked_ce: int = 0                 # training loss over this many tokens at a time: no (tokens, vocab) logits (0 = off)
    ema_decay: float = 0.0              # weight EMA, evaluated and saved beside the weights (0 = off; 8B recipe: 0.999)
    # evaluation and logging
    eval_interval: int = 500            # evaluate and checkpoint every this many steps (and at the end)
    eval_tokens: int = 1048576          # fixed validation set: the first this-many tokens of val.bin
    log_interval: int = 1               # print/log every this many steps (each print syncs the GPU)
    # system
    device: str = "auto"                # auto | cpu | cuda | cuda:N (torchrun: one GPU per process)
    dtype: str = "auto"                 # compute dtype: auto (bf16 autocast on CUDA, fp32 on CPU) | bfloat16 | float32
    param_dtype: str = "float32"        # float32 master weights | bfloat16 (pure-bf16 model like the paper; less memory)
    compile: bool = True                # torch.compile each sublayer (and the reference routing)
    activation_checkpointing: bool = False  # recompute each sublayer in backward: less memory, ~1/3 more compute
    fsdp: bool = False                  # FSDP2: shard each sublayer over the processes, bf16 compute, fp32 master weights
    save: bool = True                   # write out_dir/ckpt.pt at every eval and at the end (False: speed runs, only the log)
    cuda_graph: bool = False            # replay each microbatch's forward+backward as one CUDA graph (CUDA, no FSDP)
    seed: int = 42                      # fixes initialisation and data order


# keys that may differ when resuming (everything else must match the checkpoint)
RESUMABLE = {"data_dir", "out_dir", "init_from", "max_steps", "eval_interval", "log_interval", "device",
             "dtype", "compile", "micro_batch", "activation_checkpointing", "routing_impl",
             "lr_decay_steps", "save", "chunked_ce", "cuda_graph"}   # compared after resolving -1 to max_steps: the schedule's horizon must match
MODEL_KEYS = {f.name for f in fields(GPTConfig)} & {f.name for f in fields(Config)}   # the rest: GPTConfig defaults


def config_help():
    """The Config block above, one option per line with its default and comment."""
    lines = inspect.getsource(Config).splitlines()[2:]
    return "options (python train.py [config.py ...] [--key=value ...]):\n" + "\n".join(
        "  --" + ln.strip().replace(": ", " (", 1).replace(" = ", ") = ", 1) if not ln.strip().startswith("#") else ln
        for ln in lines)


def check_type(key, value):
    """Return value if it fits Config's annotation for key, else raise a ValueError that names both."""
    expected = typing.get_type_hints(Config)[key]
    allowed = typing.get_args(expected) or (expected,)
    ok = any((t is float and isinstance(value, (int, float)) and not isinstance(value, bool))
             or (t is int and isinstance(value, int) and not isinstance(value, bool))
             or (t is type(None) and value is None) or (t in (str, bool) and type(value) is t)
             for t in allowed)
    if not ok:
        names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
        raise ValueError(f"{key}={value!r} has type {type(value).__name__}, expected {names}")
    return float(value) if allowed[0] is float else value


def parse_args(argv):
    """Defaults <- config files <- --key=value overrides, with clear errors for unknown keys and bad types."""
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__ + "\n" + config_help())
        sys.exit(0)
    cfg, known = Config(), {f.name for f in fields(Config)}
    for arg in argv:
        if not arg.startswith("--"):   # a config file: plain Python assignments
            if not os.path.isfile(arg):
                raise ValueError(f"config file {arg!r} not found")
            scope = {}
            exec(open(arg).read(), {}, scope)
            items = [(k, v) for k, v in scope.items() if not k.startswith("_") and not inspect.ismodule(v)]
            source = f"in {arg}"
        else:
            if "=" not in arg:
                raise ValueError(f"{arg!r}: write options as --key=value")
            key, raw = arg[2:].split("=", 1)
            try:
                val = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                val = raw              # a bare word is a string
            items, source = [(key, val)], "on the command line"
        for key, val in items:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=3)
                raise ValueError(f"unknown option {key!r} {source}" + (f" (did you mean {' or '.join(close)}?)" if close else "")
                                 + "; python train.py -h lists every option")
            setattr(cfg, key, check_type(key, val))
    for key, allowed in (("dtype", ("auto", "bfloat16", "float32")), ("lr_schedule", ("cosine", "linear", "1-sqrt")),
                         ("param_dtype", ("float32", "bfloat16"))):
        if getattr(cfg, key) not in allowed:
            raise ValueError(f"{key}={getattr(cfg, key)!r} is not one of {', '.join(allowed)}")
    for key in ("batch_tokens", "micro_batch", "max_steps", "eval_interval", "log_interval", "eval_tokens"):
        if getattr(cfg, key) <= 0:
            raise ValueError(f"{key}={getattr(cfg, key)} must be positive")
    GPTConfig(vocab_size=128, **{k: getattr(cfg, k) for k in MODEL_KEYS})   # model errors now, not after data
    return cfg


def git_revision():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class TokenData:
    """Contiguous token file cut into non-overlapping sequences of block_size (+1 for the targets).
    Training order: a fresh permutation of all sequences every epoch, seeded by (seed, epoch); the k-th
    sequence of the run is a pure function of k, so resume and any number of processes see the same data."""

    def __init__(self, path, dtype, block_size, seed):
        self.data = np.memmap(path, dtype=dtype, mode="r")
        self.T, self.seed = block_size, seed
        self.n_seq = (len(self.data) - 1) // block_size
        if self.n_seq < 1:
            raise ValueError(f"{path} holds {len(self.data)} tokens, fewer than block_size + 1 = {block_size + 1}")
        self._perm_epoch, self._perm = None, None

    def rows(self, starts):
        return torch.from_numpy(np.stack([self.data[s: s + self.T + 1] for s in starts]).astype(np.int64))

    def train_batch(self, first, count):
        """Sequences first .. first+count-1 of the training order, as (count, T+1) int64."""
        starts = []
        for k in range(first, first + count):
            epoch, pos = divmod(k, self.n_seq)
            if epoch != self._perm_epoch:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_seq)
                self._perm_epoch = epoch
            starts.append(int(self._perm[pos]) * self.T)
        return self.rows(starts)


class GraphedMicrostep:
    """One microbatch's forward and backward captured as CUDA graphs and replayed: the host launches one graph
    instead of hundreds of kernels (compiled sublayers, ~3 Triton launches per routing site), so small
    microbatches stop being bound by Python and launch overhead. Two graphs share one memory pool: the first
    microbatch of a step writes the gradients (captured with every .grad unset, so backward stores into them as
    eager autograd does after zero_grad(set_to_none=True)); later microbatches add into them. The graphs fix the
    batch shape, their input buffers and the .grad tensors: never set .grad to None afterwards (no zero_grad
    needed, the first microbatch overwrites). The model is not wrapped in DDP or FSDP (their gradient hooks are
    not captured here): under torchrun, train.py averages the gradients after the graphs (sync_grads). The model
    must run without host syncs (every mode does).

        micro = GraphedMicrostep(model, autocast, loss_scale=1 / accum)
        loss = micro(x, y, first=k == 0)   # first call of each kind warms up and captures; returns the loss
    """

    def __init__(self, model, autocast, loss_scale=1.0, warmup=3):
        self.model, self.autocast, self.loss_scale, self.warmup = model, autocast, loss_scale, warmup
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.graphs, self.losses = {}, {}   # first: bool -> CUDAGraph, its loss output
        self.x = self.y = None

    def _forward_backward(self):
        with self.autocast:
            _, loss = self.model(self.x, self.y)
        (loss * self.loss_scale).backward()
        return loss.detach()

    def _capture(self, first):
        if not first and True not in self.graphs:
            raise RuntimeError("GraphedMicrostep: the first microbatch of a step (first=True) must come first")
        saved = None if first else [p.grad.clone() for p in self.params]   # this step's gradients so far
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # compile, autotune and allocate outside the graph
            for _ in range(self.warmup):
                self._forward_backward()
        torch.cuda.current_stream().wait_stream(side)
        if first:
            for p in self.params:   # unset: the captured backward allocates .grad in the graph's pool and writes it
                p.grad = None
        graph = torch.cuda.CUDAGraph()
        pool = self.graphs[True].pool() if not first else None
        with torch.cuda.graph(graph, pool=pool):
            self.losses[first] = self._forward_backward()
        if saved is not None:
            with torch.no_grad():   # the warm-up added extra gradients: restore this step's
                torch._foreach_copy_([p.grad for p in self.params], saved)
        self.graphs[first] = graph

    def __call__(self, x, y, first=True):
        if self.x is None:
            self.x, self.y = x.clone(), y.clone()   # the graphs' input buffers
        else:
            self.x.copy_(x, non_blocking=True)
            self.y.copy_(y, non_blocking=True)
        if first not in self.graphs:
            self._capture(first)
        self.graphs[first].replay()
        return self.losses[first]


def build_model(mcfg, cfg, device, param_dtype, state, master):
    """The model on `device`, weights from `state` (a full state dict) or a fresh seeded init. With FSDP
    it is built on the meta device and sharded sublayer by sublayer; only rank 0 reads `state`, which is broadcast."""
    torch.manual_seed(cfg.seed)
    if not cfg.fsdp:
        model = GPT(mcfg) if state is None else GPT.from_state(mcfg, state)   # from_state: no init, no fp32 copy
        for p in model.parameters():   # parameters only: the RoPE tables stay fp32 with bf16 weights
            p.data = p.data.to(device, param_dtype, copy=True)   # a copy: never train in a mmap of the checkpoint
        return model.to(device)
    if state is None and master:   # scratch: rank 0 initialises, everyone receives the same weights
        state = GPT(mcfg).state_dict()
    with torch.device("meta"):
        model = GPT(mcfg)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for sub in model.sublayers():   # the unit of sharding is what forward calls: each attention and MLP
        fully_shard(sub, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.to_empty(device=device)
    # bf16 RoPE tables: FSDP2 casts each sublayer's inputs to bf16 in forward, but (torch 2.11, compiled sublayers)
    # not when activation checkpointing recomputes it, which then fails on the fp32 tables' changed dtype
    model.reset_buffers(device, torch.bfloat16)
    set_model_state_dict(model, state if master else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def main(argv):
    try:
        cfg = parse_args(argv)
    except ValueError as e:
        sys.exit(f"train.py: error: {e}")

    # ---- processes, device, precision: decided once, printed with the reason
    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank, local_rank, world = (int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["WORLD_SIZE"])) if ddp else (0, 0, 1)
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = f"cuda:{local_rank}"
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    if device_type == "cuda":
        if not torch.cuda.is_available():
            sys.exit(f"train.py: error: device={cfg.device!r} but CUDA is not available; use --device=cpu")
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if cfg.cuda_graph and (device_type != "cuda" or cfg.fsdp):
        sys.exit(f"train.py: error: --cuda_graph=True needs CUDA and no FSDP (device {device}, fsdp={cfg.fsdp}); "
                 "drop --cuda_graph for this run")
    if ddp:
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    elif cfg.fsdp:   # FSDP2 in one process (e.g. one GPU): a process group of one
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
    master = rank == 0
    say = print if master else (lambda *a, **k: None)

    if cfg.dtype == "auto":
        compute = "bfloat16" if device_type == "cuda" else "float32"
        why = "bf16 autocast on CUDA" if device_type == "cuda" else "fp32 on CPU"
    else:
        compute, why = cfg.dtype, "requested"
    param_dtype = getattr(torch, cfg.param_dtype)
    if cfg.fsdp:
        compute, why = "bfloat16", "FSDP2 mixed precision: bf16 parameters in compute, fp32 gradient reduction"
    autocast = (torch.autocast(device_type, dtype=getattr(torch, compute))
                if compute != "float32" and param_dtype == torch.float32 and not cfg.fsdp else nullcontext())

    # ---- data
    meta_path = os.path.join(cfg.data_dir, "meta.json")
    if not os.path.isfile(meta_path):
        sys.exit(f"train.py: error: {meta_path} not found; run prepare_data.py --out_dir={cfg.data_dir} first")
    meta = json.load(open(meta_path))
    train_data = TokenData(os.path.join(cfg.data_dir, "train.bin"), meta["dtype"], cfg.block_size, cfg.seed)
    val_data = TokenData(os.path.join(cfg.data_dir, "val.bin"), meta["dtype"], cfg.block_size, cfg.seed)
    seqs_per_step, per_micro = cfg.batch_tokens // cfg.block_size, cfg.micro_batch * world
    if cfg.batch_tokens % (cfg.block_size * per_micro):
        sys.exit(f"train.py: error: batch_tokens={cfg.batch_tokens} must be a multiple of block_size * micro_batch * "
                 f"processes = {cfg.block_size} * {cfg.micro_batch} * {world} = {cfg.block_size * per_micro}; "
                 f"e.g. --batch_tokens={max(1, round(cfg.batch_tokens / (cfg.block_size * per_micro))) * cfg.block_size * per_micro}")
    accum = seqs_per_step // per_micro
    n_eval = min(val_data.n_seq, cfg.eval_tokens // cfg.block_size) // per_micro * per_micro
    if n_eval == 0:
        sys.exit(f"train.py: error: val.bin has {val_data.n_seq} sequences of {cfg.block_size} tokens, fewer than one "
                 f"eval batch ({per_micro}); lower micro_batch or block_size, or prepare more validation data")

    # ---- model, optimizer, resume
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    ckpt = init = None
    if cfg.init_from == "resume":
        if not os.path.isfile(ckpt_path):
            sys.exit(f"train.py: error: --init_from=resume but {ckpt_path} does not exist")
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False, mmap=True)
        ckpt.update({k: upgrade_state(ckpt[k]) for k in ("model", "optimizer", "ema") if ckpt.get(k) is not None})
        old = ckpt["train_config"]
        skip = RESUMABLE | (MODEL_KEYS if ckpt.get("model_source", "config") != "config" else set())
        diff = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in asdict(cfg).items() if k not in skip and old.get(k) != v]
        old_horizon = old["lr_decay_steps"] if old["lr_decay_steps"] > 0 else old["max_steps"]
        if old_horizon != (cfg.lr_decay_steps if cfg.lr_decay_steps > 0 else cfg.max_steps):
            diff.append(f"decay horizon (lr_decay_steps, -1 = max_steps): {old_horizon} -> "
                        f"{cfg.lr_decay_steps if cfg.lr_decay_steps > 0 else cfg.max_steps}; "
                        f"pass --lr_decay_steps={old_horizon} to keep the old schedule")
        tok_id = lambda m: m.get("tokenizer_id", m["tokenizer"])   # older meta.json files have no tokenizer_id
        for name, old_v, new_v in (("tokenizer", tok_id(ckpt["meta"]), tok_id(meta)),
                                   ("train_tokens", ckpt["meta"]["train_tokens"], meta["train_tokens"])):
            if old_v != new_v:
                diff.append(f"data {name}: {old_v!r} -> {new_v!r}")
        if diff:
            sys.exit("train.py: error: cannot resume, the config differs from the checkpoint's:\n  " + "\n  ".join(diff)
                     + "\nuse the checkpoint's values, or a new out_dir with --init_from=scratch")
        model_cfg, model_source = ckpt["model_config"], ckpt.get("model_source", "config")
    else:
        if os.path.exists(ckpt_path):
            sys.exit(f"train.py: error: {ckpt_path} already exists; continue it with --init_from=resume "
                     "or choose another --out_dir (nothing is overwritten)")
        if master and os.path.exists(os.path.join(cfg.out_dir, "log.jsonl")):   # a run that died before its first checkpoint
            kept = os.path.join(cfg.out_dir, f"log.{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
            os.replace(os.path.join(cfg.out_dir, "log.jsonl"), kept)
            print(f"moved the log of an earlier run without a checkpoint to {kept}")
        model_cfg = {k: getattr(cfg, k) for k in MODEL_KEYS}
        model_cfg["vocab_size"] = math.ceil(meta["vocab_size"] / 128) * 128
        model_source = "config"
        if cfg.init_from != "scratch":   # a convert.py checkpoint: its architecture, its weights
            path = os.path.join(cfg.init_from, "ckpt.pt") if os.path.isdir(cfg.init_from) else cfg.init_from
            if not os.path.isfile(path):
                sys.exit(f"train.py: error: init_from={cfg.init_from!r} is not scratch, resume, or the out_dir of convert.py")
            init = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
            init["model"] = upgrade_state(init["model"])
            model_cfg, model_source = init["model_config"], os.path.abspath(path)
            data_tok, model_tok = meta.get("tokenizer_id", meta["tokenizer"]), init.get("tokenizer_id")
            if model_tok is not None and data_tok != model_tok:
                sys.exit(f"train.py: error: {cfg.data_dir} was tokenized with {meta['tokenizer']!r} but the model in "
                         f"{path} uses {init['tokenizer']!r}: prepare the data with --tokenizer set to the model's "
                         "tokenizer (its tokenizer.json)")
            if meta["vocab_size"] > model_cfg["vocab_size"]:
                sys.exit(f"train.py: error: the data's vocabulary ({meta['vocab_size']}) exceeds the model's "
                         f"({model_cfg['vocab_size']})")
    try:
        mcfg = GPTConfig.from_dict({**model_cfg, "routing_impl": cfg.routing_impl})
    except ValueError as e:
        sys.exit(f"train.py: error: {e}")
    vocab = mcfg.vocab_size
    state = ckpt["model"] if ckpt is not None else init["model"] if init is not None else None
    model = build_model(mcfg, cfg, device, param_dtype, state, master)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.lr, (cfg.beta1, cfg.beta2), cfg.adam_eps, cfg.decay_all,
                                           fused=device_type == "cuda" and not cfg.fsdp,
                                           routing_group=mcfg.residual == "delta", routing_lr_scale=cfg.routing_lr_scale)
    ema = [p.detach().clone().float() for p in params] if cfg.ema_decay > 0 else None
    step = 0
    if ckpt is not None:
        if cfg.fsdp:
            set_optimizer_state_dict(model, optimizer, ckpt["optimizer"] if master else {},
                                     options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        else:
            optimizer.load_state_dict(ckpt["optimizer"])
        if ema is not None:
            if ckpt.get("ema") is None:
                sys.exit("train.py: error: --ema_decay is set but the checkpoint has no EMA weights")
            for e, (name, p) in zip(ema, model.named_parameters()):
                full = ckpt["ema"][name].to(device)
                e.copy_(distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full)
        step = ckpt["step"]
        rng = ckpt["rng"][rank] if rank < len(ckpt["rng"]) else ckpt["rng"][0]
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        if device_type == "cuda" and rng.get("cuda") is not None:
            torch.cuda.set_rng_state(rng["cuda"])
    del ckpt, init, state
    raw_model = model
    model.checkpoint_sublayers = cfg.activation_checkpointing
    model.z_loss = cfg.z_loss
    model.chunked_ce = cfg.chunked_ce
    if cfg.compile:
        model.compile_sublayers()
    if ddp and not cfg.fsdp and not cfg.cuda_graph:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if device_type == "cuda" else None)
    elif ddp and not cfg.fsdp:   # CUDA graphs: no DDP wrapper (its backward hooks are not captured); as DDP does,
        for t in [*params, *raw_model.buffers()]:   # start every process from rank 0's weights, and average the
            dist.broadcast(t.detach(), 0)          # gradients after each step's graphs (sync_grads below)

    # ---- log header
    device_name = torch.cuda.get_device_name(device) if device_type == "cuda" else platform.processor() or "cpu"
    n_params = raw_model.num_params()
    n_extra = sum(p.numel() for n, p in raw_model.named_parameters() if n.startswith(("routes.", "hyper.")))
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    say(f"git {git_revision()} | python {platform.python_version()} | torch {torch.__version__} | triton {triton_version}"
        f" | cuda {torch.version.cuda} | {world} x {device_name}")
    if param_dtype != torch.float32 and not cfg.fsdp:
        compute, why = cfg.param_dtype, "the weights' dtype: no autocast, AdamW states in it too"
    say(f"precision: compute {compute} ({why}), weights {cfg.param_dtype}")
    if device_type == "cuda" and not (cfg.fsdp or cfg.cuda_graph):
        say("tip: --cuda_graph=True replays each microbatch as a CUDA graph (no per-kernel launch overhead: 2-3x "
            "faster at the 1B shape on one GPU, BENCHMARKS.md)")
    say(f"model: residual={mcfg.residual} (routing heads {mcfg.heads if mcfg.residual in ('attnres', 'mhar', 'delta') else '-'}, "
        f"{mcfg.routing_impl}) | {n_params:,} parameters ({n_params - raw_model.wte.weight.numel():,} non-embedding, "
        f"{n_extra:,} residual-mechanism) | vocab {vocab} ({meta['tokenizer']})")
    say(f"batch: {cfg.batch_tokens:,} tokens = {world} processes x {accum} micro-steps x {cfg.micro_batch} x {cfg.block_size} | "
        f"data {meta['train_tokens']:,} train tokens (1 epoch = {train_data.n_seq // seqs_per_step} steps), "
        f"val {n_eval} x {cfg.block_size} tokens fixed")
    horizon = cfg.lr_decay_steps if cfg.lr_decay_steps > 0 else cfg.max_steps
    say(f"schedule: lr {cfg.lr:g}, warmup {cfg.warmup_steps}, {cfg.lr_schedule} to {cfg.min_lr_ratio:g}x at step {horizon}; "
        f"training steps {step} -> {cfg.max_steps}" + (f"; z-loss {cfg.z_loss:g}" if cfg.z_loss else "")
        + (f"; EMA {cfg.ema_decay:g}" if cfg.ema_decay else "") + (f"; from {model_source}" if model_source != "config" else ""))
    if model_source == "config":
        say("config: " + json.dumps(asdict(cfg)))
    else:   # the architecture is the checkpoint's: its options here would be ignored, so they are not shown
        say("config: " + json.dumps({k: v for k, v in asdict(cfg).items() if k not in MODEL_KEYS - {"routing_impl"}}))
        say("architecture (from the checkpoint): " + json.dumps(asdict(mcfg)))
    if cfg.init_from == "resume":
        say(f"resumed from {ckpt_path} at step {step}")
    if master:
        os.makedirs(cfg.out_dir, exist_ok=True)
    log_path = os.path.join(cfg.out_dir, "log.jsonl")

    def log(record):
        if master:
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def lr_at(s):
        if s < cfg.warmup_steps:
            return cfg.lr * (s + 1) / cfg.warmup_steps
        p = min(1.0, (s - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps))
        decay = {"cosine": 0.5 * (1 + math.cos(math.pi * p)), "linear": 1 - p, "1-sqrt": 1 - math.sqrt(p)}[cfg.lr_schedule]
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay)

    def to_device(rows):
        rows = rows.pin_memory() if device_type == "cuda" else rows
        rows = rows.to(device, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]

    @torch.no_grad()
    def evaluate():
        total = torch.zeros(2, device=device, dtype=torch.float64)
        for first in range(rank * cfg.micro_batch, n_eval, per_micro):
            x, y = to_device(val_data.rows([i * cfg.block_size for i in range(first, first + cfg.micro_batch)]))
            with autocast:
                _, loss = raw_model(x, y)
            total += torch.stack([loss.double() * y.numel(), torch.tensor(y.numel(), device=device, dtype=torch.float64)])
        if ddp:
            dist.all_reduce(total)
        return (total[0] / total[1]).item()

    def save_checkpoint():
        t0 = time.time()
        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
               "cuda": torch.cuda.get_rng_state(device) if device_type == "cuda" else None}
        rngs = [None] * world
        if ddp:
            dist.all_gather_object(rngs, rng)
        else:
            rngs = [rng]
        if cfg.fsdp:   # gather full tensors on rank 0 (every rank takes part)
            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_state, optim_state = get_model_state_dict(raw_model, options=opts), get_optimizer_state_dict(raw_model, optimizer, options=opts)
        else:
            model_state, optim_state = raw_model.state_dict(), optimizer.state_dict()
        ema_state = None if ema is None else {}
        for (name, _), e in zip(raw_model.named_parameters(), ema or []):
            full = e.full_tensor() if isinstance(e, DTensor) else e   # every rank takes part; rank 0 keeps a copy
            if master:
                ema_state[name] = full.cpu()
        if master:
            state = {"model": model_state, "optimizer": optim_state, "ema": ema_state, "step": step,
                     "model_config": asdict(mcfg), "model_source": model_source, "train_config": asdict(cfg),
                     "rng": rngs, "meta": meta, "tokenizer": meta["tokenizer"],
                     "tokenizer_id": meta.get("tokenizer_id", meta["tokenizer"]),
                     "data": {"seqs_consumed": step * seqs_per_step, "seed": cfg.seed}, "git": git_revision()}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)   # atomic: a crash mid-save leaves the old checkpoint
            say(f"saved {ckpt_path} (step {step}, {os.path.getsize(ckpt_path) / 1e9:.2f} GB) in {time.time() - t0:.1f} s")

    # evals already in the log (a resumed run appends to it; the last record of a step counts)
    evals = {}
    if cfg.init_from == "resume" and os.path.isfile(log_path):
        for line in open(log_path):
            rec = json.loads(line)
            if "val_loss" in rec and rec["step"] <= step:
                evals[rec["step"]] = rec["val_loss"]

    pending = []  # (step, loss tensor) not yet synced to the host: checked for NaN/inf before any save

    def flush(t_start, n_window):
        """Log the pending steps; the window since t_start is timed after the losses reach the host, so that it
        holds the GPU's work (a CUDA-graph step is queued far faster than it runs)."""
        nonlocal pending
        if not pending:
            return
        losses = torch.stack([l for _, l in pending]).tolist()
        t_window = time.time() - t_start
        for (s, _), loss in zip(pending, losses):
            if not math.isfinite(loss):
                say(f"train.py: non-finite loss {loss} at step {s}; stopping before any save. The last checkpoint "
                    f"({ckpt_path}) is intact. Try a lower --lr, a longer --warmup_steps, or --dtype=float32.")
                if ddp:
                    dist.destroy_process_group()
                sys.exit(2)
        s, loss = pending[-1][0], losses[-1]
        dt = t_window / n_window
        tok_s = cfg.batch_tokens / dt
        if s > start_step + n_window:   # the first window holds compilation and warm-up
            speeds.append(tok_s)
        mfu = raw_model.estimate_mfu(tok_s / world, device_name if device_type == "cuda" else None, cfg.block_size)
        eta = (cfg.max_steps - s) * dt
        say(f"step {s}/{cfg.max_steps} | loss {loss:.4f} | lr {lr_at(s - 1):.2e} | {dt * 1000:.0f} ms | "
            f"{tok_s:,.0f} tok/s | mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | "
            f"eta {int(eta // 3600)}h{int(eta % 3600 // 60):02d}m{int(eta % 60):02d}s")
        log({"step": s, "loss": loss, "lr": lr_at(s - 1), "dt_ms": dt * 1000, "tok_per_s": tok_s})
        pending = []

    def peak_mem():
        return f" | peak mem {torch.cuda.max_memory_allocated(device) / 1e9:.1f} GB" if device_type == "cuda" else ""

    def sync_grads():
        """Average the gradients over the processes in one all-reduce (DDP without its hooks: graphed steps)."""
        grads = [p.grad for p in params]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat.div_(world)
        torch._foreach_copy_(grads, torch._utils._unflatten_dense_tensors(flat, grads))

    # ---- the loop
    graphed = GraphedMicrostep(model, autocast, loss_scale=1 / accum) if cfg.cuda_graph else None
    start_step = step
    speeds = []
    t0, n_window = time.time(), 0
    while True:
        last = step >= cfg.max_steps
        if (step % cfg.eval_interval == 0 or last) and step not in evals:
            flush(t0, max(n_window, 1))
            if step > start_step and cfg.save:
                save_checkpoint()                      # before the eval: an eval crash loses nothing
            val = evaluate()
            evals[step] = val
            tail = [evals[k] for k in sorted(evals)][-11:]
            record = {"step": step, "val_loss": val}
            if ema is not None:   # the EMA weights, swapped in for the eval
                with torch.no_grad():
                    backup = [p.detach().clone() for p in params]
                    for p, e in zip(params, ema):   # one copy_ per tensor: DTensors (FSDP2) have no _foreach_copy_
                        p.copy_(e)
                    record["val_loss_ema"] = evaluate()
                    for p, b in zip(params, backup):
                        p.copy_(b)
                    del backup
            say(f"eval step {step} | val_loss {val:.4f} | tail-mean({len(tail)}) {sum(tail) / len(tail):.4f}"
                + (f" | ema {record['val_loss_ema']:.4f}" if ema is not None else "") + peak_mem())
            log(record)
            t0, n_window = time.time(), 0
        if last:
            if speeds:
                tok_s = float(np.median(speeds))
                mfu = raw_model.estimate_mfu(tok_s / world, device_name if device_type == "cuda" else None, cfg.block_size)
                say(f"done: step {step} | median {tok_s:,.0f} tok/s after warm-up | mfu "
                    f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'}{peak_mem()} | last val_loss {evals[max(evals)]:.4f}")
            break
        lr = lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        loss_sum = torch.zeros((), device=device)
        for micro in range(accum):
            first = step * seqs_per_step + (rank * accum + micro) * cfg.micro_batch
            x, y = to_device(train_data.train_batch(first, cfg.micro_batch))
            if graphed is not None:
                loss_sum += graphed(x, y, first=micro == 0).float()
                continue
            sync = not ddp or micro == accum - 1           # DDP all-reduces gradients on the last micro-step only
            if cfg.fsdp:
                model.set_requires_gradient_sync(sync)
            with (nullcontext() if sync or cfg.fsdp else model.no_sync()), autocast:
                _, loss = model(x, y)
                (loss / accum).backward()
            loss_sum += loss.detach().float()
        if graphed is not None and ddp:
            sync_grads()
        if ddp:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)   # the logged loss is the global-batch mean
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        if graphed is None:   # the graphs' first microbatch overwrites their fixed .grad tensors instead
            optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            with torch.no_grad():
                for e, p in zip(ema, params):
                    e.lerp_(p.detach().float(), 1 - cfg.ema_decay)
        step += 1
        n_window += 1
        pending.append((step, loss_sum / accum))
        if step % cfg.log_interval == 0 or step == cfg.max_steps:
            flush(t0, n_window)
            t0, n_window = time.time(), 0
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
