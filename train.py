"""
Train a GPT with any residual mode (baseline | hyper | attnres | mhar | delta) on prepare_data.py token files.

  python train.py config/tiny.py --device=cpu                      # one process
  torchrun --standalone --nproc_per_node=8 train.py config/train_350m.py --residual=mhar
  python train.py -h                                               # every option with its default

Options: the model's (model.GPTConfig) and training's (TrainConfig below), then config files in order (plain Python
assignments), then --key=value. The global batch is given in tokens; gradient accumulation is derived, so 1 and N
processes run the same optimisation. Recipe (paper section 3.1, Appendix I): AdamW 0.9 / 0.95, weight decay 0.1 on
every parameter, clip 1.0, linear warmup then cosine to 0.1x, a fixed validation set, the tail-mean of the last 11
evals.

Stages, in the order main() runs them: parse_args -> setup_runtime (processes, device, precision) -> load_data ->
resolve_start (scratch / resume / converted checkpoint) -> build_model, restore -> the loop (GraphedMicrostep or eager
microsteps, sync_grads, clip, AdamW, EMA, StepLog) with evaluate and save_checkpoint at every eval_interval.
"""
import ast
import atexit
import difflib
import errno
import functools
import inspect
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import typing
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields, make_dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from model import GPT, GPTConfig, previous_checkpoint, read_checkpoint, upgrade_state
from prepare_data import TokenData


@dataclass
class TrainConfig:
    # data and output
    data_dir: str = "data/fineweb_edu"  # prepare_data.py output: train.bin, val.bin, meta.json
    out_dir: str = "out"                # ckpt.pt (latest checkpoint) and log.jsonl
    init_from: str = "scratch"          # scratch | resume (continue out_dir/ckpt.pt) | the out_dir of convert.py
    # batch (the sequence length is the model's block_size)
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
    cuda_graph: bool = True             # replay microbatches as CUDA graphs where they apply (CUDA, no FSDP; else says why)
    grad_sync: str = "after"            # torchrun + CUDA graphs: after (one all-reduce after them) | overlap (under the backward)
    grad_bucket_mb: float = 25.0        # grad_sync=overlap: gradient bucket size in MB (DDP's default)
    seed: int = 42                      # fixes initialisation and data order


# The model's options are GPTConfig's fields (model.py: one default and one comment each) but vocab_size, which the
# data sets. Config holds both, flat, so that --n_layer=24 and cfg.n_layer work like any training option.
MODEL_KEYS = [f.name for f in fields(GPTConfig) if f.name != "vocab_size"]
Config = make_dataclass("Config", [(f.name, f.type, field(default=f.default)) for f in fields(GPTConfig)
                                   if f.name in MODEL_KEYS], bases=(TrainConfig,))
# keys that may differ when resuming (everything else must match the checkpoint; lr_decay_steps is compared after
# resolving -1 to max_steps: the schedule's horizon must match)
RESUMABLE = {"data_dir", "out_dir", "init_from", "max_steps", "eval_interval", "log_interval", "device",
             "dtype", "compile", "micro_batch", "activation_checkpointing", "routing_impl", "lr_decay_steps", "save",
             "cuda_graph", "grad_sync", "grad_bucket_mb"}


# ---- options ---------------------------------------------------------------------------------------------------------

def config_help():
    """Every option, one line each with its default and comment: GPTConfig's, then TrainConfig's."""
    def options(cls):
        body = inspect.getsource(cls).split("\n    def ")[0].splitlines()[2:]   # the field lines
        return ["  --" + ln.strip().replace(": ", " (", 1).replace(" = ", ") = ", 1) if not ln.strip().startswith("#")
                else ln for ln in body if not ln.strip().startswith("vocab_size")]
    return "\n".join(["options (python train.py [config.py ...] [--key=value ...]):", "  # model (model.GPTConfig)",
                      *options(GPTConfig), "  # training", *options(TrainConfig)])


def check_type(key, value):
    """Return value if it fits Config's annotation for key, else raise a ValueError that names both."""
    expected = typing.get_type_hints(Config)[key]
    allowed = typing.get_args(expected) or (expected,)
    ok = any((t is float and isinstance(value, (int, float)) and not isinstance(value, bool))
             or (t is int and isinstance(value, int) and not isinstance(value, bool))
             or (t is type(None) and value is None) or (t in (str, bool, dict) and type(value) is t)
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
    cfg.explicit = set()   # the keys a config file or the command line set (not a field: asdict leaves it out)
    for arg in argv:
        if not arg.startswith("--"):   # a config file: plain Python assignments
            if not os.path.isfile(arg):
                raise ValueError(f"config file {arg!r} not found")
            scope = {}
            try:
                exec(compile(open(arg).read(), arg, "exec"), {}, scope)
            except SyntaxError as e:
                raise ValueError(f"config file {arg}, line {e.lineno}: {e.msg}: {(e.text or '').strip()!r}") from None
            except Exception as e:
                raise ValueError(f"config file {arg}: {type(e).__name__}: {e}") from None
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
            cfg.explicit.add(key)
    for key, allowed in (("dtype", ("auto", "bfloat16", "float32")), ("lr_schedule", ("cosine", "linear", "1-sqrt")),
                         ("param_dtype", ("float32", "bfloat16")), ("grad_sync", ("after", "overlap"))):
        if getattr(cfg, key) not in allowed:
            raise ValueError(f"{key}={getattr(cfg, key)!r} is not one of {', '.join(allowed)}")
    for key in ("batch_tokens", "micro_batch", "max_steps", "eval_interval", "log_interval", "eval_tokens", "lr",
                "grad_bucket_mb"):
        if getattr(cfg, key) <= 0:
            raise ValueError(f"{key}={getattr(cfg, key)} must be positive")
    for key in ("weight_decay", "grad_clip", "warmup_steps", "z_loss", "adam_eps"):
        if getattr(cfg, key) < 0:
            raise ValueError(f"{key}={getattr(cfg, key)} must be >= 0")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio={cfg.min_lr_ratio} must be in [0, 1] (the decay ends at lr * min_lr_ratio)")
    for key in ("beta1", "beta2", "ema_decay"):
        if not 0 <= getattr(cfg, key) < 1:
            raise ValueError(f"{key}={getattr(cfg, key)} must be in [0, 1)")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device):
        raise ValueError(f"device={cfg.device!r} is not one of auto, cpu, cuda, cuda:N")
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


def fail(msg):
    sys.exit(f"train.py: error: {msg}")


# ---- runtime: processes, device, precision ---------------------------------------------------------------------------

@dataclass
class Runtime:
    """Processes, device and precision of a run, decided once and printed with the reason."""
    ddp: bool                  # launched by torchrun (RANK, WORLD_SIZE set)
    rank: int
    local_rank: int
    world: int
    device: str                # cpu | cuda:N
    device_type: str           # cpu | cuda
    compute: str               # compute dtype
    why: str                   # why that compute dtype
    param_dtype: torch.dtype   # the weights' dtype
    autocast: object           # context manager of every forward
    graphs: bool               # microbatches replayed as CUDA graphs (GraphedMicrostep)
    graphs_why: str            # why graphs are on or off

    @property
    def master(self):
        return self.rank == 0

    def say(self, *args, **kwargs):   # print on rank 0 only
        if self.master:
            print(*args, **kwargs)


def graph_plan(cuda_graph, device, fsdp):
    """(replay microbatches as CUDA graphs?, why): where they apply (CUDA, no FSDP) unless --cuda_graph=False."""
    if not cuda_graph:
        return False, "--cuda_graph=False: every kernel launched from Python"
    if not device.startswith("cuda"):
        return False, f"they need CUDA, the device is {device}"
    if fsdp:
        return False, "FSDP's gradient hooks are not captured: eager steps"
    return True, "each microbatch's forward and backward replayed; --cuda_graph=False launches kernels from Python"


def grad_sync_plan(cfg, rt):
    """(overlap the gradient average in the graphs?, how the processes average their gradients: a log line)."""
    if rt.world == 1 and not cfg.fsdp:
        return False, "one process, nothing to average" + (" (--grad_sync=overlap unused)" if cfg.grad_sync == "overlap" else "")
    if cfg.fsdp:
        return False, "FSDP2 reduce-scatters them per sublayer during the backward"
    if not rt.graphs:
        return False, "DDP's bucketed all-reduce during the backward" + (
            " (--grad_sync=overlap is for graphed steps; DDP overlaps already)" if cfg.grad_sync == "overlap" else "")
    if cfg.grad_sync == "overlap":
        return True, f"bucketed all-reduces ({cfg.grad_bucket_mb:g} MB) in the last microbatch's graph, under its backward"
    return False, "one all-reduce after the step's graphs (--grad_sync=overlap starts it under the backward)"


def setup_runtime(cfg):
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
            fail(f"device={cfg.device!r} but CUDA is not available; use --device=cpu")
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    graphs, graphs_why = graph_plan(cfg.cuda_graph, device, cfg.fsdp)
    if ddp:
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    elif cfg.fsdp:   # FSDP2 in one process (e.g. one GPU): a process group of one
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
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
    if param_dtype != torch.float32 and not cfg.fsdp:
        compute, why = cfg.param_dtype, "the weights' dtype: no autocast, AdamW states in it too"
    return Runtime(ddp, rank, local_rank, world, device, device_type, compute, why, param_dtype, autocast, graphs,
                   graphs_why)


# ---- data ------------------------------------------------------------------------------------------------------------

@dataclass
class Data:
    meta: dict                 # prepare_data.py's meta.json
    train: TokenData
    val: TokenData
    seqs_per_step: int         # sequences per optimizer step (all processes)
    accum: int                 # micro-steps per step and process
    n_eval: int                # validation sequences (the same every eval)


def load_data(cfg, world):
    meta_path = os.path.join(cfg.data_dir, "meta.json")
    if not os.path.isfile(meta_path):
        fail(f"{meta_path} not found; run prepare_data.py --out_dir={cfg.data_dir} first")
    try:
        meta = json.load(open(meta_path))
        missing = [k for k in ("tokenizer", "vocab_size", "dtype", "train_tokens") if k not in meta]
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
        fail(f"{meta_path} is not prepare_data.py's JSON ({e}); prepare the data again (prepare_data.py --force)")
    if missing:
        fail(f"{meta_path} lacks {', '.join(missing)}: not written by prepare_data.py; prepare the data again")
    try:
        train_data = TokenData(os.path.join(cfg.data_dir, "train.bin"), meta["dtype"], cfg.block_size, cfg.seed)
        val_data = TokenData(os.path.join(cfg.data_dir, "val.bin"), meta["dtype"], cfg.block_size, cfg.seed)
    except (ValueError, TypeError) as e:
        fail(e)
    seqs_per_step, per_micro = cfg.batch_tokens // cfg.block_size, cfg.micro_batch * world
    if cfg.batch_tokens % (cfg.block_size * per_micro):
        fail(f"batch_tokens={cfg.batch_tokens} must be a multiple of block_size * micro_batch * processes = "
             f"{cfg.block_size} * {cfg.micro_batch} * {world} = {cfg.block_size * per_micro}; e.g. --batch_tokens="
             f"{max(1, round(cfg.batch_tokens / (cfg.block_size * per_micro))) * cfg.block_size * per_micro}")
    n_eval = min(val_data.n_seq, cfg.eval_tokens // cfg.block_size) // per_micro * per_micro
    if n_eval == 0 and cfg.eval_tokens < cfg.block_size * per_micro:
        fail(f"eval_tokens={cfg.eval_tokens} is less than one eval batch of micro_batch * processes * block_size = "
             f"{per_micro} * {cfg.block_size} = {per_micro * cfg.block_size} tokens; raise --eval_tokens")
    if n_eval == 0:
        fail(f"val.bin has {val_data.n_seq} sequences of {cfg.block_size} tokens, fewer than one eval batch "
             f"({per_micro}); lower micro_batch or block_size, or prepare more validation data")
    return Data(meta, train_data, val_data, seqs_per_step, seqs_per_step // per_micro, n_eval)


# ---- what the run starts from ----------------------------------------------------------------------------------------

def horizon(cfg):
    """The step at which the LR schedule's decay ends."""
    return cfg.lr_decay_steps if cfg.lr_decay_steps > 0 else cfg.max_steps


def resolve_start(cfg, meta, master):
    """(ckpt, init, model_cfg, model_source): the checkpoint to resume, or a convert.py checkpoint to start from, and
    the model's config; refuses anything that would overwrite a checkpoint or resume a different run."""
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    tok_id = lambda m: m.get("tokenizer_id", m["tokenizer"])   # older meta.json files have no tokenizer_id
    if cfg.init_from == "resume":
        ckpt = load_latest(ckpt_path, master)
        ckpt.update({k: upgrade_state(ckpt[k]) for k in ("model", "optimizer", "ema") if ckpt.get(k) is not None})
        old = {**ckpt["model_config"], **ckpt["train_config"]}   # older checkpoints name fewer model keys in the latter
        skip = RESUMABLE | (set(MODEL_KEYS) if ckpt.get("model_source", "config") != "config" else set())
        diff = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in asdict(cfg).items() if k not in skip and old.get(k) != v]
        old_horizon = old["lr_decay_steps"] if old["lr_decay_steps"] > 0 else old["max_steps"]
        if old_horizon != horizon(cfg):
            diff.append(f"decay horizon (lr_decay_steps, -1 = max_steps): {old_horizon} -> {horizon(cfg)}; "
                        f"pass --lr_decay_steps={old_horizon} to keep the old schedule")
        for name, old_v, new_v in (("tokenizer", tok_id(ckpt["meta"]), tok_id(meta)),
                                   ("train_tokens", ckpt["meta"]["train_tokens"], meta["train_tokens"])):
            if old_v != new_v:
                diff.append(f"data {name}: {old_v!r} -> {new_v!r}")
        if diff:
            fail("cannot resume, the config differs from the checkpoint's:\n  " + "\n  ".join(diff)
                 + "\nuse the checkpoint's values, or a new out_dir with --init_from=scratch")
        refuse_ignored_architecture(cfg, ckpt["model_config"], ckpt_path)
        return ckpt, None, ckpt["model_config"], ckpt.get("model_source", "config")
    for path in (ckpt_path, previous_checkpoint(ckpt_path)):
        if os.path.exists(path):
            fail(f"{path} already exists; continue it with --init_from=resume or choose another --out_dir "
                 "(nothing is overwritten)")
    if master and os.path.exists(os.path.join(cfg.out_dir, "log.jsonl")):   # a run that died before its first checkpoint
        kept = os.path.join(cfg.out_dir, f"log.{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
        os.replace(os.path.join(cfg.out_dir, "log.jsonl"), kept)
        print(f"moved the log of an earlier run without a checkpoint to {kept}")
    if cfg.init_from == "scratch":
        return None, None, {**{k: getattr(cfg, k) for k in MODEL_KEYS},
                            "vocab_size": math.ceil(meta["vocab_size"] / 128) * 128}, "config"
    path = os.path.join(cfg.init_from, "ckpt.pt") if os.path.isdir(cfg.init_from) else cfg.init_from
    if not os.path.isfile(path):   # a convert.py checkpoint: its architecture, its weights
        fail(f"init_from={cfg.init_from!r} is not scratch, resume, or the out_dir of convert.py")
    try:
        init = read_checkpoint(path)
    except ValueError as e:
        fail(e)
    refuse_ignored_architecture(cfg, init["model_config"], path)
    init["model"] = upgrade_state(init["model"])
    if init.get("tokenizer_id") is not None and tok_id(meta) != init["tokenizer_id"]:
        fail(f"{cfg.data_dir} was tokenized with {meta['tokenizer']!r} but the model in {path} uses "
             f"{init['tokenizer']!r}: prepare the data with --tokenizer set to the model's tokenizer (its tokenizer.json)")
    if meta["vocab_size"] > init["model_config"]["vocab_size"]:
        fail(f"the data's vocabulary ({meta['vocab_size']}) exceeds the model's ({init['model_config']['vocab_size']})")
    return None, init, init["model_config"], os.path.abspath(path)


def refuse_ignored_architecture(cfg, model_config, path):
    """A checkpoint's architecture is the model's: explicit options that differ from it would be ignored, so refuse
    (block_size, the training sequence length, and routing_impl apply)."""
    keys = sorted(k for k in getattr(cfg, "explicit", ()) if k in MODEL_KEYS and k not in ("routing_impl", "block_size")
                  and k in model_config and model_config[k] != getattr(cfg, k))
    if keys:
        fail(f"the architecture comes from {path}; these options differ from it and would be ignored: "
             + ", ".join(f"--{k}={getattr(cfg, k)!r} (checkpoint: {model_config[k]!r})" for k in keys)
             + ". Drop them (--block_size and --routing_impl may differ)")


def load_latest(ckpt_path, master):
    """The checkpoint to resume: ckpt_path, or, when it is missing or unreadable, the one before it (one line says
    so; the unreadable file is moved aside, never deleted). Fails naming both files when neither can be read."""
    prev, errors = previous_checkpoint(ckpt_path), []
    for path in (ckpt_path, prev):
        if not os.path.isfile(path):
            errors.append(f"{path} does not exist")
            continue
        try:
            ckpt = read_checkpoint(path)
        except ValueError as e:
            errors.append(str(e).split(";")[0])
            continue
        if path == prev and master:
            aside = None
            if os.path.isfile(ckpt_path):
                aside = f"{ckpt_path}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}"
                os.replace(ckpt_path, aside)
            print(f"train.py: {errors[0]}; resuming from the checkpoint before it, {prev} (step {ckpt['step']})"
                  + (f"; the unreadable file is now {aside}" if aside else ""))
        return ckpt
    fail("--init_from=resume but no checkpoint can be read: " + "; ".join(errors)
         + ". Start again with --init_from=scratch in a new --out_dir")


# ---- model, optimizer and their state --------------------------------------------------------------------------------

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
    # the mesh on the run's device type: FSDP2's default mesh takes CUDA whenever the machine has it, CPU runs too
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    for sub in model.sublayers():   # the unit of sharding is what forward calls: each attention and MLP
        fully_shard(sub, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=device)
    # bf16 RoPE tables: FSDP2 casts each sublayer's inputs to bf16 in forward, but (torch 2.11, compiled sublayers)
    # not when activation checkpointing recomputes it, which then fails on the fp32 tables' changed dtype
    model.reset_buffers(device, torch.bfloat16)
    set_model_state_dict(model, state if master else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


class EMA:
    """An fp32 exponential moving average of the trainable weights (the paper's 8B mid-training: 0.999, Appendix I),
    evaluated and saved beside them."""

    def __init__(self, named_params, decay):
        self.named, self.decay = named_params, decay
        self.shadow = [p.detach().clone().float() for _, p in named_params]

    @torch.no_grad()
    def update(self):
        for e, (_, p) in zip(self.shadow, self.named):
            e.lerp_(p.detach().float(), 1 - self.decay)

    @contextmanager
    def swapped_in(self):
        """The EMA weights in place of the model's (for an eval), restored after."""
        with torch.no_grad():
            backup = [p.detach().clone() for _, p in self.named]
            for (_, p), e in zip(self.named, self.shadow):   # one copy_ per tensor: DTensors have no _foreach_copy_
                p.copy_(e)
        try:
            yield
        finally:
            with torch.no_grad():
                for (_, p), b in zip(self.named, backup):
                    p.copy_(b)

    def load(self, state, device):
        for e, (name, p) in zip(self.shadow, self.named):
            full = state[name].to(device)
            e.copy_(distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full)

    def state_dict(self, master):
        """{name: full fp32 tensor on CPU} on rank 0 (every rank takes part in gathering sharded tensors)."""
        out = {}
        for (name, _), e in zip(self.named, self.shadow):
            full = e.full_tensor() if isinstance(e, DTensor) else e
            if master:
                out[name] = full.cpu()
        return out


def restore(ckpt, model, optimizer, ema, cfg, rt):
    """Optimizer, EMA and RNG states of a resumed checkpoint (the weights are loaded by build_model); its step."""
    if cfg.fsdp:
        set_optimizer_state_dict(model, optimizer, ckpt["optimizer"] if rt.master else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    else:
        optimizer.load_state_dict(ckpt["optimizer"])
    if ema is not None:
        if ckpt.get("ema") is None:
            fail("--ema_decay is set but the checkpoint has no EMA weights")
        ema.load(ckpt["ema"], rt.device)
    rng = ckpt["rng"][rt.rank] if rt.rank < len(ckpt["rng"]) else ckpt["rng"][0]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if rt.device_type == "cuda" and rng.get("cuda") is not None:
        torch.cuda.set_rng_state(rng["cuda"])
    return ckpt["step"]


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (its partial file is removed; the previous checkpoints are untouched)."""


def save_checkpoint(path, model, optimizer, ema, step, extra, cfg, rt):
    """Weights, optimizer, EMA, step, every rank's RNG states and `extra` (configs, data position) to `path`. Written
    to a temp file, flushed to disk and read back (memory-mapped: the archive's index and records, not every byte)
    before the rotation: the checkpoint it replaces becomes ckpt.prev.pt, so a crash at any point leaves one whole
    checkpoint. Every rank takes part (FSDP gathers); a failed write raises CheckpointWriteError."""
    t0 = time.time()
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
           "cuda": torch.cuda.get_rng_state(rt.device) if rt.device_type == "cuda" else None}
    rngs = [None] * rt.world
    if rt.ddp:
        dist.all_gather_object(rngs, rng)
    else:
        rngs = [rng]
    if cfg.fsdp:   # gather full tensors on rank 0 (every rank takes part)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optim_state = get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optimizer, options=opts)
    else:
        model_state, optim_state = model.state_dict(), optimizer.state_dict()
    ema_state = None if ema is None else ema.state_dict(rt.master)
    if rt.master:
        tmp = path + ".tmp"
        try:
            torch.save({"model": model_state, "optimizer": optim_state, "ema": ema_state, "step": step, "rng": rngs,
                        **extra}, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            read_checkpoint(tmp)
        except Exception as e:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise CheckpointWriteError(write_failure(path, tmp, step, e)) from e
        if os.path.exists(path):
            os.replace(path, previous_checkpoint(path))
        os.replace(tmp, path)
        rt.say(f"saved {path} (step {step}, {os.path.getsize(path) / 1e9:.2f} GB) in {time.time() - t0:.1f} s")


def write_failure(path, tmp, step, error):
    """The one line for a checkpoint that could not be written: disk full or not, and which checkpoints are intact."""
    folder = os.path.dirname(os.path.abspath(path))
    free = shutil.disk_usage(folder).free
    full = (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left" in str(error) \
        or "unexpected pos" in str(error) or free < 2**20
    why = (f"no space left on the device of {folder} ({free / 1e9:.2f} GB free)" if full
           else f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
    kept = []
    for p in (path, previous_checkpoint(path)):
        try:
            kept.append(f"{p} (step {read_checkpoint(p)['step']})")
        except (ValueError, FileNotFoundError):   # absent, or itself unreadable: not intact
            pass
    return (f"saving the step-{step} checkpoint failed: {why}, writing {tmp}; the partial file is removed. "
            + (f"Intact: {', '.join(kept)}. " if kept else "No earlier checkpoint exists. ")
            + ("Free some space, then continue with --init_from=resume" if full else "Fix the cause, then continue "
               "with --init_from=resume"))


# ---- log.jsonl, the out_dir lock, stop signals ------------------------------------------------------------------------

def read_log(path, repair=False, say=print):
    """The records of a log.jsonl. A last line cut short (a crash or a full disk mid-write) is left out, and with
    repair also cut from the file (one line says so); any other line that is not JSON is an error naming the line."""
    with open(path, "rb") as f:
        data = f.read()
    lines, records = data.split(b"\n"), []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except (ValueError, UnicodeDecodeError) as e:
            if i < len(lines) - 1:   # a complete line (a newline follows) that is not JSON: not ours to guess
                raise ValueError(f"{path}, line {i + 1}: not JSON ({e}); fix or remove that line") from None
            if repair:
                with open(path, "r+b") as f:
                    f.truncate(len(data) - len(line))
                say(f"{path}: removed a partial last line ({len(line)} bytes, written when the run stopped)")
            return records
    if repair and lines[-1].strip():   # a whole last record without its newline: the next one gets its own line
        with open(path, "ab") as f:
            f.write(b"\n")
    return records


def trim_log(path, step, say):
    """Resuming at `step`: log.jsonl keeps the records up to it; those of later steps (the stopped run went past its
    last checkpoint, and the resumed run writes them again) move to a side file, named in one line."""
    records = read_log(path, repair=True, say=say)
    later = [r for r in records if r.get("step", 0) > step]
    if later:
        side = f"{os.path.splitext(path)[0]}.after-step{step}.{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
        with open(side, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in later)
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records if r.get("step", 0) <= step)
        os.replace(path + ".tmp", path)
        say(f"{path}: {len(later)} records after step {step} (the stopped run's, redone now) moved to {side}")


def lock_out_dir(out_dir):
    """One run per out_dir: out_dir/train.lock names this process (pid, host) until it exits. A lock whose process is
    gone (same host) is taken over with one line; a live one, or one from another host, is refused. A run that
    ends having written nothing leaves no empty out_dir behind."""
    created = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    path, me = os.path.join(out_dir, "train.lock"), {"pid": os.getpid(), "host": socket.gethostname(),
                                                      "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                other = json.load(open(path))
                pid, host, since = int(other["pid"]), other["host"], other.get("since", "?")
            except (OSError, ValueError, KeyError, TypeError):
                other = None   # unreadable: a lock being written this instant, or a broken one
            if other is None:
                time.sleep(0.2)
                if os.path.exists(path) and time.time() - os.path.getmtime(path) > 5:
                    os.remove(path)
                continue
            if host != me["host"]:
                fail(f"{out_dir} is locked by a run on host {host} (pid {pid}, since {since}). If that run has ended, "
                     f"delete {path}; else choose another --out_dir")
            if pid_alive(pid):
                fail(f"{out_dir} is in use by a running train.py (pid {pid}, since {since}); wait for it, stop it, "
                     "or choose another --out_dir")
            print(f"train.py: taking over {path} from pid {pid} (since {since}), which is no longer running")
            os.remove(path)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        atexit.register(unlock_out_dir, path, me["pid"], created)
        return path
    fail(f"could not take {path}; delete it if no run uses {out_dir}")


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's live process
        return True
    return True


def unlock_out_dir(path, pid, created):
    try:
        if json.load(open(path))["pid"] == pid:
            os.remove(path)
        if created and not os.listdir(os.path.dirname(path)):
            os.rmdir(os.path.dirname(path))
    except (OSError, ValueError, KeyError):
        pass


class StopSignals:
    """SIGTERM (a cluster's preemption) or SIGINT (Ctrl-C) asks the loop to stop after the current step: it saves a
    checkpoint and exits 143 / 130. A second signal exits at once. Under torchrun the processes agree on the step at
    log-interval steps (an all-reduce of the request, where the log syncs anyway)."""

    def __init__(self):
        self.signum = None
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if self.signum is not None:
            sys.exit(128 + signum)
        self.signum = signum
        print(f"train.py: {signal.Signals(signum).name}: stopping after this step with a checkpoint (send it again to "
              "stop at once)", file=sys.stderr, flush=True)

    def requested(self, step, cfg, rt):
        if not rt.ddp:
            return self.signum is not None
        if step % cfg.log_interval:
            return False
        flag = torch.tensor(self.signum or 0, device=rt.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.signum = self.signum or int(flag.item()) or None
        return self.signum is not None


# ---- the step's pieces -----------------------------------------------------------------------------------------------

def lr_at(cfg, s):
    """Linear warmup to cfg.lr, then the decay to lr * min_lr_ratio at the horizon."""
    if s < cfg.warmup_steps:
        return cfg.lr * (s + 1) / cfg.warmup_steps
    p = min(1.0, (s - cfg.warmup_steps) / max(1, horizon(cfg) - cfg.warmup_steps))
    decay = {"cosine": 0.5 * (1 + math.cos(math.pi * p)), "linear": 1 - p, "1-sqrt": 1 - math.sqrt(p)}[cfg.lr_schedule]
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay)


def to_device(rows, rt):
    """(inputs, targets) on the device from (B, T+1) token rows."""
    rows = torch.from_numpy(rows)
    rows = rows.pin_memory() if rt.device_type == "cuda" else rows
    rows = rows.to(rt.device, non_blocking=True)
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def evaluate(model, data, cfg, rt):
    """Mean validation loss over the fixed validation set (the first n_eval sequences of val.bin)."""
    total = torch.zeros(2, device=rt.device, dtype=torch.float64)
    for first in range(rt.rank * cfg.micro_batch, data.n_eval, cfg.micro_batch * rt.world):
        x, y = to_device(data.val.rows([i * cfg.block_size for i in range(first, first + cfg.micro_batch)]), rt)
        with rt.autocast:
            _, loss = model(x, y)
        total += torch.stack([loss.double() * y.numel(), torch.tensor(y.numel(), device=rt.device, dtype=torch.float64)])
    if rt.ddp:
        dist.all_reduce(total)
    return (total[0] / total[1]).item()


def sync_grads(params, world):
    """Average the gradients over the processes in one all-reduce (DDP without its hooks: graphed steps)."""
    grads = [p.grad for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat.div_(world)
    torch._foreach_copy_(grads, torch._utils._unflatten_dense_tensors(flat, grads))


class OverlappedGradSync:
    """The gradient average of graphed steps, started during the backward instead of after it: DDP's bucketed
    reducer in a form a CUDA graph can capture. Every .grad is a view into one flat buffer, laid out in the order the
    backward finishes the gradients and cut into buckets of ~bucket_mb; a hook on each parameter launches its bucket's
    all-reduce (async, on the process group's stream) once the bucket's last gradient is written, so the transfer runs
    under the rest of the backward. Buckets launch in index order on every process, as collectives must; finish()
    joins them. Inside a captured microbatch the hooks run once, at capture, and each replay repeats their all-reduces.

        sync = OverlappedGradSync(params)
        sync.zero_grad(); sync.begin(last=True); loss.backward(); sync.finish()   # .grad: the mean over processes

    The first backward only records the order (rank 0's is used everywhere), then builds the buffer and, on a last
    microbatch, averages it in one all-reduce. A parameter that got no gradient stays out (its .grad stays None)."""

    def __init__(self, params, bucket_mb=25.0):
        self.params, self.bucket_bytes = list(params), bucket_mb * 2**20
        self.flat = None     # the gradients, one buffer; None until the first backward has shown their order
        self.buckets = []    # (start, end, number of parameters) in flat, in launch order
        self.bucket_of = {}  # parameter index -> its bucket
        self.order, self.armed, self.works = [], False, []
        self.hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._ready, i))
                      for i, p in enumerate(self.params)]

    def zero_grad(self):
        """Zero the buffer (the gradients stay its views); before it exists, unset every .grad."""
        if self.flat is not None:
            self.flat.zero_()
        else:
            for p in self.params:
                p.grad = None

    def begin(self, last):
        """Before a backward: on the step's last microbatch, average the gradients during it; else only accumulate."""
        self.armed, self.next, self.works = last, 0, []
        self.left = [n for _, _, n in self.buckets]   # gradients each bucket still waits for

    def _ready(self, i, p):   # p.grad is final for this backward
        if self.flat is None:
            if i not in self.bucket_of:   # the first backward: record the order
                self.bucket_of[i] = None
                self.order.append(i)
            return
        b = self.bucket_of.get(i)
        if self.armed and b is not None:
            self.left[b] -= 1
            while self.next < len(self.buckets) and self.left[self.next] == 0:
                self._launch()

    def _launch(self):
        start, end, _ = self.buckets[self.next]
        self.works.append(dist.all_reduce(self.flat[start:end], op=dist.ReduceOp.AVG, async_op=True))
        self.next += 1

    def finish(self):
        """After the backward: on the last microbatch, wait for every bucket's all-reduce (launching any left)."""
        if self.flat is None:
            self._build()
            if self.armed:
                dist.all_reduce(self.flat, op=dist.ReduceOp.AVG)
        elif self.armed:
            while self.next < len(self.buckets):
                self._launch()
            for work in self.works:
                work.wait()
        self.armed, self.works = False, []

    def _build(self):
        """The buffer from the recorded order (rank 0's), each gradient moved into its view."""
        shared = [self.order]
        dist.broadcast_object_list(shared, src=0)   # one layout on every process: the collectives must match
        order = shared[0]
        dtypes = sorted({str(self.params[i].dtype) for i in order})
        if len(dtypes) != 1:
            raise ValueError(f"grad_sync=overlap needs one gradient dtype, the parameters have {dtypes}: "
                             "use --grad_sync=after")
        first = self.params[order[0]]
        self.flat = torch.zeros(sum(self.params[i].numel() for i in order), dtype=first.dtype, device=first.device)
        self.bucket_of, start, end, count = {}, 0, 0, 0
        for i in order:
            p = self.params[i]
            if count and (end - start + p.numel()) * p.element_size() > self.bucket_bytes:
                self.buckets.append((start, end, count))
                start, count = end, 0
            view = self.flat[end:end + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            self.bucket_of[i] = len(self.buckets)
            end, count = end + p.numel(), count + 1
        self.buckets.append((start, end, count))

    def close(self):
        """Remove the hooks: the gradients are averaged some other way from now on."""
        for hook in self.hooks:
            hook.remove()
        self.armed, self.works = False, []


class GraphCaptureError(RuntimeError):
    """A microbatch's forward and backward could not be captured as a CUDA graph (gradients left as before it)."""


class GraphedMicrostep:
    """One microbatch's forward and backward captured as CUDA graphs and replayed: the host launches one graph
    instead of hundreds of kernels (compiled sublayers, ~3 Triton launches per routing site), so small
    microbatches stop being bound by Python and launch overhead. Two graphs share one memory pool: the first
    microbatch of a step writes the gradients (captured with every .grad unset, so backward stores into them as
    eager autograd does after zero_grad(set_to_none=True)); later microbatches add into them. The graphs fix the
    batch shape, their input buffers and the .grad tensors: never set .grad to None afterwards (no zero_grad
    needed, the first microbatch overwrites). The model is not wrapped in DDP or FSDP (their gradient hooks are
    not captured here): under torchrun, train.py averages the gradients after the graphs (sync_grads), or, given
    grad_sync (an OverlappedGradSync), a third graph for the step's last microbatch holds the average, started
    under its backward: then the .grad tensors are views into grad_sync's buffer, which the first microbatch's graph
    zeroes. The model must run without host syncs (every mode does).

        micro = GraphedMicrostep(model, autocast, loss_scale=1 / accum)
        loss = micro(x, y, first=k == 0, last=k == accum - 1)   # each kind's first call warms up and captures
    """

    def __init__(self, model, autocast, loss_scale=1.0, warmup=3, grad_sync=None):
        self.model, self.autocast, self.loss_scale, self.warmup = model, autocast, loss_scale, warmup
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grad_sync = grad_sync
        self.graphs, self.losses = {}, {}   # (first, last) -> CUDAGraph, its loss output (last: with grad_sync only)
        self.x = self.y = None

    def _forward_backward(self, first, last):
        if self.grad_sync is not None:
            if first:
                self.grad_sync.zero_grad()
            self.grad_sync.begin(last)
        with self.autocast:
            _, loss = self.model(self.x, self.y)
        (loss * self.loss_scale).backward()
        if self.grad_sync is not None:
            self.grad_sync.finish()
        return loss.detach()

    def _capture(self, kind):
        first, last = kind
        if not first and not any(f for f, _ in self.graphs):
            raise RuntimeError("GraphedMicrostep: the first microbatch of a step (first=True) must come first")
        saved = None if first else [p.grad.clone() for p in self.params]   # this step's gradients so far
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # compile, autotune and allocate outside the graph
            for _ in range(self.warmup):
                self._forward_backward(first, last)
        torch.cuda.current_stream().wait_stream(side)
        if first and self.grad_sync is None:
            for p in self.params:   # unset: the captured backward allocates .grad in the graph's pool and writes it
                p.grad = None
        graph = torch.cuda.CUDAGraph()
        pool = next(iter(self.graphs.values())).pool() if self.graphs else None
        try:
            with torch.cuda.graph(graph, pool=pool):
                self.losses[kind] = self._forward_backward(first, last)
        except Exception as e:   # e.g. an op that syncs with the host: undo this microbatch, say what failed
            for p, g in zip(self.params, saved or [None] * len(self.params)):
                p.grad = g
            if self.grad_sync is not None:   # the eager steps that follow average after the backward (sync_grads)
                self.grad_sync.close()
            self.graphs.clear()
            self.losses.clear()
            raise GraphCaptureError(f"capturing the graph of the {'first microbatch' if first else 'later microbatches'} failed "
                                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
        if saved is not None:
            with torch.no_grad():   # the warm-up added extra gradients: restore this step's
                torch._foreach_copy_([p.grad for p in self.params], saved)
        self.graphs[kind] = graph

    def __call__(self, x, y, first=True, last=True):
        if self.x is None:
            self.x, self.y = x.clone(), y.clone()   # the graphs' input buffers
        else:
            self.x.copy_(x, non_blocking=True)
            self.y.copy_(y, non_blocking=True)
        kind = (first, last and self.grad_sync is not None)   # without grad_sync the last microbatch is like the others
        if kind not in self.graphs:
            self._capture(kind)
        self.graphs[kind].replay()
        return self.losses[kind]


class StepLog:
    """Step lines on stdout and records in out_dir/log.jsonl (rank 0). Step losses and gradient norms stay on the
    device until a flush, which checks them for non-finite values (stopping the run before anything is saved) and
    then times the window: after the losses reach the host, so that it holds the GPU's work (a CUDA-graph step is
    queued far faster than it runs). It also knows the last checkpoint, for messages that say which one is intact."""

    def __init__(self, cfg, rt, model, device_name, step, saved_step):
        self.cfg, self.rt, self.model, self.device_name = cfg, rt, model, device_name
        self.path = os.path.join(cfg.out_dir, "log.jsonl")
        self.start_step, self.pending, self.speeds = step, [], []   # pending: (step, loss, gradient norm) tensors
        self.saved_step = saved_step   # the step of out_dir/ckpt.pt (None: this run has none)
        self.t0, self.n_window = time.time(), 0
        self.evals = {}   # step -> val loss, with those already in the log of a resumed run
        if cfg.init_from == "resume" and os.path.isfile(self.path):
            if rt.master:
                trim_log(self.path, step, rt.say)
            for rec in read_log(self.path):
                if "val_loss" in rec and rec["step"] <= step:
                    self.evals[rec["step"]] = rec["val_loss"]

    def stop(self, problem, advice="Try a lower --lr, a longer --warmup_steps, or --dtype=float32."):
        """A non-finite state: say so, saying which checkpoint is intact, and exit 2 (nothing is saved)."""
        ckpt = os.path.join(self.cfg.out_dir, "ckpt.pt")
        kept = (f"The last checkpoint, {ckpt} (step {self.saved_step}), is intact" if self.saved_step is not None
                else "This run has saved no checkpoint")
        self.rt.say(f"train.py: {problem}; stopping before any further save. {kept}. {advice}", flush=True)
        if self.rt.ddp:
            dist.destroy_process_group()
        sys.exit(2)

    def check_weights(self, step, named_params):
        """Before a save: every parameter finite (one host sync), or stop."""
        flags = torch.stack([(p.to_local() if isinstance(p, DTensor) else p).isfinite().all() for _, p in named_params])
        if self.rt.ddp:   # FSDP shards: every rank's verdict
            flags = flags.to(torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        bad = [n for (n, _), ok in zip(named_params, flags.tolist()) if not ok]
        if bad:
            self.stop(f"non-finite weights after step {step} ({len(bad)} of {len(named_params)} tensors, e.g. {bad[0]}; "
                      "the losses so far were finite, the last update was not)")

    def write(self, record):
        if self.rt.master:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def mfu(self, tok_s):
        return self.model.estimate_mfu(tok_s / self.rt.world, self.device_name, self.cfg.block_size)

    def step(self, step, loss, grad_norm):
        self.pending.append((step, loss, grad_norm))
        self.n_window += 1
        if step % self.cfg.log_interval == 0 or step == self.cfg.max_steps:
            self.flush()

    def flush(self):
        """Log the pending steps, and start a new timing window."""
        if self.pending:
            values = torch.stack([torch.stack([l.float(), g.float()]) for _, l, g in self.pending]).tolist()
            losses = [v[0] for v in values]
            dt = (time.time() - self.t0) / self.n_window
            for (s, _, _), (loss, norm) in zip(self.pending, values):
                if not math.isfinite(loss):
                    self.stop(f"non-finite loss {loss} at step {s}")
                if not math.isfinite(norm):
                    self.stop(f"non-finite gradient norm {norm} at step {s} (its update made the weights non-finite)")
            s, loss, tok_s = self.pending[-1][0], losses[-1], self.cfg.batch_tokens / dt
            if s > self.start_step + self.n_window:   # the first window holds compilation and warm-up
                self.speeds.append(tok_s)
            mfu, eta = self.mfu(tok_s), (self.cfg.max_steps - s) * dt
            self.rt.say(f"step {s}/{self.cfg.max_steps} | loss {loss:.4f} | lr {lr_at(self.cfg, s - 1):.2e} | "
                        f"{dt * 1000:.0f} ms | {tok_s:,.0f} tok/s | mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | "
                        f"eta {int(eta // 3600)}h{int(eta % 3600 // 60):02d}m{int(eta % 60):02d}s")
            self.write({"step": s, "loss": loss, "lr": lr_at(self.cfg, s - 1), "dt_ms": dt * 1000, "tok_per_s": tok_s})
            self.pending = []
        self.t0, self.n_window = time.time(), 0

    def peak_mem(self):
        return f" | peak mem {torch.cuda.max_memory_allocated(self.rt.device) / 1e9:.1f} GB" if self.rt.device_type == "cuda" else ""

    def eval(self, step, val, val_ema=None):
        for name, v in (("validation loss", val), ("EMA validation loss", val_ema)):
            if v is not None and not math.isfinite(v):
                self.stop(f"non-finite {name} {v} at step {step} with finite weights",
                          "An overflow in the eval's compute dtype? Try --dtype=float32, or a lower --lr")
        self.evals[step] = val
        tail = [self.evals[k] for k in sorted(self.evals)][-11:]   # the paper's metric: the tail-mean of 11 evals
        self.rt.say(f"eval step {step} | val_loss {val:.4f} | tail-mean({len(tail)}) {sum(tail) / len(tail):.4f}"
                    + (f" | ema {val_ema:.4f}" if val_ema is not None else "") + self.peak_mem())
        self.write({"step": step, "val_loss": val, **({} if val_ema is None else {"val_loss_ema": val_ema})})

    def done(self, step):
        if self.speeds:
            tok_s = float(np.median(self.speeds))
            mfu = self.mfu(tok_s)
            self.rt.say(f"done: step {step} | median {tok_s:,.0f} tok/s after warm-up | mfu "
                        f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'}{self.peak_mem()} | last val_loss "
                        f"{self.evals[max(self.evals)]:.4f}")


def log_header(cfg, rt, model, mcfg, data, model_source, step, device_name):
    n_params = model.num_params()
    n_extra = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("routes.", "hyper.")))
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    say, meta = rt.say, data.meta
    say(f"git {git_revision()} | python {platform.python_version()} | torch {torch.__version__} | triton {triton_version}"
        f" | cuda {torch.version.cuda} | {rt.world} x {device_name}")
    say(f"precision: compute {rt.compute} ({rt.why}), weights {cfg.param_dtype}")
    say(f"CUDA graphs: {'on' if rt.graphs else 'off'} ({rt.graphs_why})")
    say(f"gradients: {grad_sync_plan(cfg, rt)[1]}")
    routed = mcfg.residual in ("attnres", "mhar", "delta")
    path = model.routing_path(rt.device, getattr(torch, rt.compute) if mcfg.residual != "delta" else torch.float32)
    say(f"model: residual={mcfg.residual} (" + (f"routing heads {mcfg.heads}, {path} routing, routing_impl={mcfg.routing_impl}"
        if routed else "no routing") + f") | {n_params:,} parameters ({n_params - model.wte.weight.numel():,} non-embedding, "
        f"{n_extra:,} residual-mechanism) | vocab {mcfg.vocab_size} ({meta['tokenizer']})")
    say(f"batch: {cfg.batch_tokens:,} tokens = {rt.world} processes x {data.accum} micro-steps x {cfg.micro_batch} x "
        f"{cfg.block_size} | data {meta['train_tokens']:,} train tokens (1 epoch = {data.train.n_seq // data.seqs_per_step} "
        f"steps), val {data.n_eval} x {cfg.block_size} tokens fixed")
    say(f"schedule: lr {cfg.lr:g}, warmup {cfg.warmup_steps}, {cfg.lr_schedule} to {cfg.min_lr_ratio:g}x at step "
        f"{horizon(cfg)}; training steps {step} -> {cfg.max_steps}" + (f"; z-loss {cfg.z_loss:g}" if cfg.z_loss else "")
        + (f"; EMA {cfg.ema_decay:g}" if cfg.ema_decay else "") + (f"; from {model_source}" if model_source != "config" else ""))
    if model_source == "config":
        say("config: " + json.dumps(asdict(cfg)))
    else:   # the architecture is the checkpoint's: its options here would be ignored, so they are not shown
        say("config: " + json.dumps({k: v for k, v in asdict(cfg).items() if k not in set(MODEL_KEYS) - {"routing_impl"}}))
        say("architecture (from the checkpoint): " + json.dumps(asdict(mcfg)))
    if cfg.init_from == "resume":
        say(f"resumed from {os.path.join(cfg.out_dir, 'ckpt.pt')} at step {step}")


# ---- main ------------------------------------------------------------------------------------------------------------

def main(argv):
    try:
        cfg = parse_args(argv)
    except ValueError as e:
        fail(e)
    rt = setup_runtime(cfg)
    data = load_data(cfg, rt.world)
    if rt.master:
        lock_out_dir(cfg.out_dir)   # before anything in out_dir is read or moved
    ckpt, init, model_cfg, model_source = resolve_start(cfg, data.meta, rt.master)
    try:
        mcfg = GPTConfig.from_dict({**model_cfg, "routing_impl": cfg.routing_impl})
    except ValueError as e:
        fail(e)
    state = ckpt["model"] if ckpt is not None else init["model"] if init is not None else None
    model = build_model(mcfg, cfg, rt.device, rt.param_dtype, state, rt.master)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.lr, (cfg.beta1, cfg.beta2), cfg.adam_eps, cfg.decay_all,
                                           fused=rt.device_type == "cuda" and not cfg.fsdp,
                                           routing_group=mcfg.residual == "delta", routing_lr_scale=cfg.routing_lr_scale)
    ema = EMA([(n, p) for n, p in model.named_parameters() if p.requires_grad], cfg.ema_decay) if cfg.ema_decay > 0 else None
    step = restore(ckpt, model, optimizer, ema, cfg, rt) if ckpt is not None else 0
    saved_step = step if ckpt is not None else None
    del ckpt, init, state
    raw_model = model   # unwrapped and uncompiled in place: checkpoints have clean parameter names
    model.checkpoint_sublayers, model.z_loss = cfg.activation_checkpointing, cfg.z_loss
    if cfg.compile:
        model.compile_sublayers()
    if rt.ddp and not cfg.fsdp and not rt.graphs:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rt.local_rank] if rt.device_type == "cuda" else None)
    elif rt.ddp and not cfg.fsdp:   # CUDA graphs: no DDP wrapper (its backward hooks are not captured); as DDP does,
        for t in [*params, *raw_model.buffers()]:   # start every process from rank 0's weights, and average the
            dist.broadcast(t.detach(), 0)          # gradients after each step's graphs (sync_grads)
    device_name = torch.cuda.get_device_name(rt.device) if rt.device_type == "cuda" else platform.processor() or "cpu"
    log_header(cfg, rt, raw_model, mcfg, data, model_source, step, device_name)
    if rt.master:
        os.makedirs(cfg.out_dir, exist_ok=True)
    extra = {"model_config": asdict(mcfg), "model_source": model_source, "train_config": asdict(cfg), "meta": data.meta,
             "tokenizer": data.meta["tokenizer"], "tokenizer_id": data.meta.get("tokenizer_id", data.meta["tokenizer"]),
             "git": git_revision()}
    log = StepLog(cfg, rt, raw_model, device_name if rt.device_type == "cuda" else None, step, saved_step)
    overlap = grad_sync_plan(cfg, rt)[0]
    grad_sync = OverlappedGradSync(params, cfg.grad_bucket_mb) if overlap else None
    graphed = GraphedMicrostep(model, rt.autocast, loss_scale=1 / data.accum, grad_sync=grad_sync) if rt.graphs else None
    wrapped = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    named = [(n, p) for n, p in raw_model.named_parameters() if p.requires_grad]
    stop = StopSignals()
    if step >= cfg.max_steps and step in log.evals:   # a finished run resumed: say so rather than exit silently
        rt.say(f"train.py: the checkpoint in {cfg.out_dir} is at step {step}, max_steps={cfg.max_steps}: nothing to "
               f"train. Pass a larger --max_steps to continue (with --lr_decay_steps={horizon(cfg)} to keep the schedule)")
        if dist.is_initialized():
            dist.destroy_process_group()
        return

    while True:
        last = step >= cfg.max_steps
        stopping = not last and stop.requested(step, cfg, rt)
        if ((step % cfg.eval_interval == 0 or last) and step not in log.evals) or stopping:
            log.flush()   # checks the pending losses and gradient norms
            if step > log.start_step and cfg.save:   # before the eval: an eval crash loses nothing
                log.check_weights(step, named)
                extra["data"] = {"seqs_consumed": step * data.seqs_per_step, "seed": cfg.seed}
                try:
                    save_checkpoint(os.path.join(cfg.out_dir, "ckpt.pt"), raw_model, optimizer, ema, step, extra, cfg, rt)
                except CheckpointWriteError as e:
                    fail(e)
                log.saved_step = step
            if stopping:
                rt.say(f"train.py: stopped by {signal.Signals(stop.signum).name} at step {step}; " + (
                    f"continue with --init_from=resume (checkpoint at step {log.saved_step})" if log.saved_step is not None
                    else "no checkpoint" + (" (--save=False)" if not cfg.save else "")), flush=True)
                if rt.ddp:
                    dist.destroy_process_group()
                sys.exit(128 + stop.signum)
            val = evaluate(raw_model, data, cfg, rt)
            val_ema = None
            if ema is not None:   # the EMA weights, swapped in for an eval of their own
                with ema.swapped_in():
                    val_ema = evaluate(raw_model, data, cfg, rt)
            log.eval(step, val, val_ema)
            log.flush()   # a new timing window after the eval
        if last:
            log.done(step)
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step) * group.get("lr_scale", 1.0)
        loss_sum = torch.zeros((), device=rt.device)
        for micro in range(data.accum):
            first = step * data.seqs_per_step + (rt.rank * data.accum + micro) * cfg.micro_batch
            x, y = to_device(data.train.train_batch(first, cfg.micro_batch), rt)
            if graphed is not None:
                try:
                    loss_sum += graphed(x, y, first=micro == 0, last=micro == data.accum - 1).float()
                    continue
                except GraphCaptureError as e:   # this microbatch and the rest of the run go eager
                    rt.say(f"*** CUDA graphs off: {e}. The run continues with eager steps (--cuda_graph=False "
                           "skips the attempt) ***")
                    graphed = None
            sync = not rt.ddp or micro == data.accum - 1   # DDP all-reduces gradients on the last micro-step only
            if cfg.fsdp:
                model.set_requires_gradient_sync(sync)
            with (model.no_sync() if wrapped and not sync else nullcontext()), rt.autocast:
                _, loss = model(x, y)
                (loss / data.accum).backward()
            loss_sum += loss.detach().float()
        if rt.ddp and not (wrapped or cfg.fsdp or (graphed is not None and graphed.grad_sync is not None)):
            sync_grads(params, rt.world)   # graphed steps (no DDP wrapper) average here, unless their graphs did
        if rt.ddp:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)   # the logged loss is the global-batch mean
        if cfg.grad_clip > 0:   # the norm is kept either way: StepLog stops the run on a non-finite one
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if isinstance(grad_norm, DTensor):   # FSDP: the norm over every shard
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        if graphed is None:   # the graphs' first microbatch overwrites their fixed .grad tensors instead
            optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update()
        step += 1
        log.step(step, loss_sum / data.accum, grad_norm)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
