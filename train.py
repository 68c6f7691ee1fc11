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
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields, make_dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from model import GPT, GPTConfig, upgrade_state
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
             "cuda_graph"}


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
    meta = json.load(open(meta_path))
    train_data = TokenData(os.path.join(cfg.data_dir, "train.bin"), meta["dtype"], cfg.block_size, cfg.seed)
    val_data = TokenData(os.path.join(cfg.data_dir, "val.bin"), meta["dtype"], cfg.block_size, cfg.seed)
    seqs_per_step, per_micro = cfg.batch_tokens // cfg.block_size, cfg.micro_batch * world
    if cfg.batch_tokens % (cfg.block_size * per_micro):
        fail(f"batch_tokens={cfg.batch_tokens} must be a multiple of block_size * micro_batch * processes = "
             f"{cfg.block_size} * {cfg.micro_batch} * {world} = {cfg.block_size * per_micro}; e.g. --batch_tokens="
             f"{max(1, round(cfg.batch_tokens / (cfg.block_size * per_micro))) * cfg.block_size * per_micro}")
    n_eval = min(val_data.n_seq, cfg.eval_tokens // cfg.block_size) // per_micro * per_micro
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
        if not os.path.isfile(ckpt_path):
            fail(f"--init_from=resume but {ckpt_path} does not exist")
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False, mmap=True)
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
        return ckpt, None, ckpt["model_config"], ckpt.get("model_source", "config")
    if os.path.exists(ckpt_path):
        fail(f"{ckpt_path} already exists; continue it with --init_from=resume or choose another --out_dir "
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
    init = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    init["model"] = upgrade_state(init["model"])
    if init.get("tokenizer_id") is not None and tok_id(meta) != init["tokenizer_id"]:
        fail(f"{cfg.data_dir} was tokenized with {meta['tokenizer']!r} but the model in {path} uses "
             f"{init['tokenizer']!r}: prepare the data with --tokenizer set to the model's tokenizer (its tokenizer.json)")
    if meta["vocab_size"] > init["model_config"]["vocab_size"]:
        fail(f"the data's vocabulary ({meta['vocab_size']}) exceeds the model's ({init['model_config']['vocab_size']})")
    return None, init, init["model_config"], os.path.abspath(path)


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


def save_checkpoint(path, model, optimizer, ema, step, extra, cfg, rt):
    """Weights, optimizer, EMA, step, every rank's RNG states and `extra` (configs, data position) to `path`, through
    a temp file and a rename: a crash mid-save leaves the previous checkpoint. Every rank takes part (FSDP gathers)."""
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
        torch.save({"model": model_state, "optimizer": optim_state, "ema": ema_state, "step": step, "rng": rngs, **extra},
                   path + ".tmp")
        os.replace(path + ".tmp", path)
        rt.say(f"saved {path} (step {step}, {os.path.getsize(path) / 1e9:.2f} GB) in {time.time() - t0:.1f} s")


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
        try:
            with torch.cuda.graph(graph, pool=pool):
                self.losses[first] = self._forward_backward()
        except Exception as e:   # e.g. an op that syncs with the host: undo this microbatch, say what failed
            for p, g in zip(self.params, saved or [None] * len(self.params)):
                p.grad = g
            self.graphs.clear()
            self.losses.clear()
            raise GraphCaptureError(f"capturing the graph of the {'first microbatch' if first else 'later microbatches'} failed "
                                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
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


class StepLog:
    """Step lines on stdout and records in out_dir/log.jsonl (rank 0). Step losses stay on the device until a flush,
    which checks them for non-finite values (stopping the run before anything is saved) and then times the window:
    after the losses reach the host, so that it holds the GPU's work (a CUDA-graph step is queued far faster than it
    runs)."""

    def __init__(self, cfg, rt, model, device_name, step):
        self.cfg, self.rt, self.model, self.device_name = cfg, rt, model, device_name
        self.path = os.path.join(cfg.out_dir, "log.jsonl")
        self.start_step, self.pending, self.speeds = step, [], []   # pending: (step, loss tensor)
        self.t0, self.n_window = time.time(), 0
        self.evals = {}   # step -> val loss, with those already in the log of a resumed run (the last record counts)
        if cfg.init_from == "resume" and os.path.isfile(self.path):
            for line in open(self.path):
                rec = json.loads(line)
                if "val_loss" in rec and rec["step"] <= step:
                    self.evals[rec["step"]] = rec["val_loss"]

    def write(self, record):
        if self.rt.master:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def mfu(self, tok_s):
        return self.model.estimate_mfu(tok_s / self.rt.world, self.device_name, self.cfg.block_size)

    def step(self, step, loss):
        self.pending.append((step, loss))
        self.n_window += 1
        if step % self.cfg.log_interval == 0 or step == self.cfg.max_steps:
            self.flush()

    def flush(self):
        """Log the pending steps, and start a new timing window."""
        if self.pending:
            losses = torch.stack([l for _, l in self.pending]).tolist()
            dt = (time.time() - self.t0) / self.n_window
            for (s, _), loss in zip(self.pending, losses):
                if not math.isfinite(loss):
                    self.rt.say(f"train.py: non-finite loss {loss} at step {s}; stopping before any save. The last "
                                f"checkpoint ({os.path.join(self.cfg.out_dir, 'ckpt.pt')}) is intact. Try a lower --lr, "
                                "a longer --warmup_steps, or --dtype=float32.")
                    if self.rt.ddp:
                        dist.destroy_process_group()
                    sys.exit(2)
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
    log = StepLog(cfg, rt, raw_model, device_name if rt.device_type == "cuda" else None, step)
    graphed = GraphedMicrostep(model, rt.autocast, loss_scale=1 / data.accum) if rt.graphs else None
    wrapped = isinstance(model, torch.nn.parallel.DistributedDataParallel)

    while True:
        last = step >= cfg.max_steps
        if (step % cfg.eval_interval == 0 or last) and step not in log.evals:
            log.flush()
            if step > log.start_step and cfg.save:   # before the eval: an eval crash loses nothing
                extra["data"] = {"seqs_consumed": step * data.seqs_per_step, "seed": cfg.seed}
                save_checkpoint(os.path.join(cfg.out_dir, "ckpt.pt"), raw_model, optimizer, ema, step, extra, cfg, rt)
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
                    loss_sum += graphed(x, y, first=micro == 0).float()
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
        if rt.ddp and not (wrapped or cfg.fsdp):   # graphed steps: no DDP wrapper, the gradients averaged here
            sync_grads(params, rt.world)
        if rt.ddp:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)   # the logged loss is the global-batch mean
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        if graphed is None:   # the graphs' first microbatch overwrites their fixed .grad tensors instead
            optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update()
        step += 1
        log.step(step, loss_sum / data.accum)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
