"""
Train a GPT with any residual mode (baseline | hyper | attnres | mhar | delta) on prepare_data.py token files.

  python train.py config/tiny.py --device=cpu                      # one process
  torchrun --standalone --nproc_per_node=8 train.py config/train_350m.py --residual=mhar
  python train.py -h                                               # every option with its default

Options: the model's (model.GPTConfig) and training's (TrainConfig below), then config files in order (plain Python
assignments), then --key=value. The global batch is given in tokens; gradient accumulation is derived, so 1 and N
processes run the same optimisation. Recipe (paper section 3.1, Appendix I): AdamW 0.9 / 0.95, weight decay 0.1 on
every parameter, clip 1.0, linear warmup then cosine to 0.1x, a fixed validation set, the tail-mean of the last 11 evals.

Stages, in the order main() runs them: parse_args -> setup_runtime (processes, device, precision) -> load_data (checked
against meta.json) -> resolve_start (the out_dir lock; scratch / resume / converted checkpoint) -> build_model, restore
-> the loop: run_microbatches (graphed or eager), optimizer_step (average, clip, AdamW), EMA, StepLog (metrics.py: the
lines, log.jsonl, val_bpb, routing statistics, the optional tracker); evaluate and save_checkpoint every eval_interval.
What a run keeps in out_dir (checkpoints, log, lock, stops) is checkpoint.py's; CUDA graphs and the gradient average
are graphs.py's.
"""
import ast
import difflib
import functools
import inspect
import json
import math
import os
import platform
import re
import signal
import sys
import time
import typing
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields, make_dataclass

if __name__ == "__main__":   # Ctrl-C while torch loads: a quiet exit (nothing is written yet)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch
import torch.distributed as dist

from checkpoint import (CheckpointWriteError, OutDirLocked, StopSignals, data_changes, data_identity, git_revision,
                        is_dtensor, keep_tokenizer, load_latest, lock_out_dir, previous_checkpoint, read_checkpoint,
                        restore, save_checkpoint)
from graphs import GraphCaptureError, GraphedMicrostep, OverlappedGradSync, sync_grads
from metrics import StepLog, Tracker, routing_statistics, val_bytes_per_token
from model import GPT, GPTConfig
from prepare_data import TokenData, check_files, lock_holder, run_script


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
    routing_lr_scale: float = 1.0       # LR multiplier of the routing queries (delta: every routing parameter, no decay)
    z_loss: float = 0.0                 # logit z-loss coefficient (the paper's 8B mid-training: 1e-4)
    ema_decay: float = 0.0              # weight EMA, evaluated and saved beside the weights (0 = off; 8B recipe: 0.999)
    # evaluation and logging
    eval_interval: int = 500            # evaluate and checkpoint every this many steps (and at the end)
    eval_tokens: int = 1048576          # fixed validation set: the first this-many tokens of val.bin
    log_interval: int = 1               # print/log every this many steps (each print syncs the GPU)
    keep_every: int = 0                 # also keep out_dir/ckpt-stepN.pt every this many steps, never rotated (0: off)
    wandb_log: bool = False             # also log to Weights & Biases (pip install wandb; WANDB_MODE=offline works)
    wandb_project: str = "mhar"         # its project
    wandb_run_name: str = ""            # its run name ("": wandb's own)
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
             "cuda_graph", "grad_sync", "grad_bucket_mb", "keep_every", "wandb_log", "wandb_project", "wandb_run_name"}


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
            except (ValueError, SyntaxError):   # a bare word is a string (nan and inf: numbers, refused as such)
                val = float(raw) if raw.lower().lstrip("+-") in ("nan", "inf", "infinity") else raw
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
    positive = ("batch_tokens", "micro_batch", "max_steps", "eval_interval", "log_interval", "eval_tokens", "lr",
                "grad_bucket_mb", "routing_lr_scale")
    for rng, ok, keys in (("> 0", lambda v: v > 0, positive),
                          (">= 0", lambda v: v >= 0, ("weight_decay", "grad_clip", "warmup_steps", "z_loss", "adam_eps",
                                                      "keep_every")),
                          ("in [0, 1] (the decay ends at lr * min_lr_ratio)", lambda v: 0 <= v <= 1, ("min_lr_ratio",)),
                          ("in [0, 1)", lambda v: 0 <= v < 1, ("beta1", "beta2", "ema_decay")),
                          ("> 0, or -1 (= max_steps)", lambda v: v > 0 or v == -1, ("lr_decay_steps",))):
        for key in keys:
            if not (math.isfinite(getattr(cfg, key)) and ok(getattr(cfg, key))):
                raise ValueError(f"{key}={getattr(cfg, key)} must be a finite number {rng}")
    if cfg.keep_every % cfg.eval_interval:
        raise ValueError(f"keep_every={cfg.keep_every} must be a multiple of eval_interval={cfg.eval_interval} (checkpoints "
                         f"are written at evals), e.g. --keep_every={max(1, round(cfg.keep_every / cfg.eval_interval)) * cfg.eval_interval}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device):
        raise ValueError(f"device={cfg.device!r} is not one of auto, cpu, cuda, cuda:N")
    GPTConfig(vocab_size=128, **{k: getattr(cfg, k) for k in MODEL_KEYS})   # model errors now, not after data
    return cfg


# the options only some residual modes read (route_init_std and route_blocks: GPTConfig refuses them elsewhere)
MODE_OPTIONS = {"route_heads": ("mhar", "delta"), "route_scale": ("attnres", "mhar", "delta"),
                "routing_impl": ("attnres", "mhar", "delta"), "routing_lr_scale": ("attnres", "mhar", "delta"),
                "num_blocks": ("delta",), "hc_streams": ("hyper",), "hc_dynamic": ("hyper",)}


def unused_options(cfg):
    """One line per option set to other than its default (in a config file or on the command line) that cfg.residual
    does not read."""
    default = Config()
    return [f"train.py: {key}={getattr(cfg, key)!r} is unused by residual={cfg.residual} (it is for "
            f"{' / '.join(MODE_OPTIONS[key])}); ignored" for key in sorted(cfg.explicit & MODE_OPTIONS.keys())
            if cfg.residual not in MODE_OPTIONS[key] and getattr(cfg, key) != getattr(default, key)]


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
    identity: dict             # what a resume checks the data against (checkpoint.data_identity)
    bytes_per_token: float     # UTF-8 bytes per evaluated validation target token (val_bpb); None: unknown


def load_data(cfg, world, rank=0):
    meta_path = os.path.join(cfg.data_dir, "meta.json")
    if not os.path.isfile(meta_path):
        fail(f"{meta_path} not found; run prepare_data.py --out_dir={cfg.data_dir} first")
    try:
        meta = json.load(open(meta_path))
        missing = [k for k in ("tokenizer", "tokenizer_id", "vocab_size", "dtype", "train_tokens", "val_tokens")
                   if k not in meta]
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
        fail(f"{meta_path} is not prepare_data.py's JSON ({e}); prepare the data again (prepare_data.py --force)")
    if missing:
        fail(f"{meta_path} lacks {', '.join(missing)}: not written by prepare_data.py; prepare the data again")
    holder = lock_holder(cfg.data_dir)
    if holder is not None:
        fail(f"{cfg.data_dir} is being written by prepare_data.py (pid {holder}): start once it has finished")
    try:   # sizes and sampled blocks against meta.json, on every start: a few MB read whatever the files' size
        files = check_files(cfg.data_dir, meta)
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
    quiet = print if rank == 0 else (lambda line: None)
    return Data(meta, train_data, val_data, seqs_per_step, seqs_per_step // per_micro, n_eval,
                data_identity(meta, files), val_bytes_per_token(cfg.data_dir, meta, n_eval * cfg.block_size, quiet))


# ---- what the run starts from ----------------------------------------------------------------------------------------

def horizon(cfg):
    """The step at which the LR schedule's decay ends."""
    return cfg.lr_decay_steps if cfg.lr_decay_steps > 0 else cfg.max_steps


def resolve_start(cfg, data, master):
    """(ckpt, init, mcfg, model_source): out_dir taken for this run (one run per out_dir), then start_point's choice
    and the model's GPTConfig."""
    if master:
        try:
            lock_out_dir(cfg.out_dir)   # before anything in out_dir is read or moved
        except OutDirLocked as e:
            fail(e)
    ckpt, init, model_cfg, model_source = start_point(cfg, data, master)
    try:
        return ckpt, init, GPTConfig.from_dict({**model_cfg, "routing_impl": cfg.routing_impl}), model_source
    except ValueError as e:
        fail(e)


def start_point(cfg, data, master):
    """(ckpt, init, model_cfg, model_source): the checkpoint to resume, or a convert.py checkpoint to start from, and
    the model's config; refuses anything that would overwrite a checkpoint or resume a different run (or data)."""
    ckpt_path, meta = os.path.join(cfg.out_dir, "ckpt.pt"), data.meta
    if cfg.init_from == "resume":
        try:
            ckpt = load_latest(ckpt_path, master)
        except ValueError as e:
            fail(e)
        if ckpt.get("train_config") is None:   # convert.py's: weights and architecture, no training state
            fail(f"{ckpt_path} is a converted model (convert.py), not a run to continue: train from it with "
                 f"--init_from={cfg.out_dir} --out_dir=<a new folder>")
        old = {**asdict(Config()), **ckpt["train_config"]}   # an option newer than the checkpoint had its default
        skip = RESUMABLE | (set(MODEL_KEYS) if ckpt.get("model_source", "config") != "config" else set())
        diff = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in asdict(cfg).items() if k not in skip and old.get(k) != v]
        old_horizon = old["lr_decay_steps"] if old["lr_decay_steps"] > 0 else old["max_steps"]
        if old_horizon != horizon(cfg):
            diff.append(f"decay horizon (lr_decay_steps, -1 = max_steps): {old_horizon} -> {horizon(cfg)}; "
                        f"pass --lr_decay_steps={old_horizon} to keep the old schedule")
        identity = ckpt.get("data", {}).get("identity")
        for name, old_v, new_v in (() if identity else (   # a checkpoint without an identity: tokenizer and count only
                ("tokenizer", ckpt["meta"].get("tokenizer_id"), meta["tokenizer_id"]),
                ("train_tokens", ckpt["meta"]["train_tokens"], meta["train_tokens"]))):
            if old_v != new_v:
                diff.append(f"data {name}: {old_v!r} -> {new_v!r}")
        quiet = print if master else (lambda line: None)
        diff += [f"data {c}" for c in data_changes(identity, data.identity, cfg.data_dir, quiet)]
        if diff:
            fail("cannot resume, the config differs from the checkpoint's:\n  " + "\n  ".join(diff)
                 + "\nuse the checkpoint's values, or a new out_dir with --init_from=scratch")
        refuse_ignored_architecture(cfg, ckpt["model_config"], ckpt_path)
        return ckpt, None, ckpt["model_config"], ckpt.get("model_source", "config")
    for path in (ckpt_path, previous_checkpoint(ckpt_path)):
        if os.path.exists(path):
            fail(f"{path} already exists; " + (
                f"it is a converted model: train from it with --init_from={cfg.out_dir} --out_dir=<a new folder>"
                if converted(path) else "continue it with --init_from=resume or choose another --out_dir")
                + " (nothing is overwritten)")
    if master and os.path.exists(os.path.join(cfg.out_dir, "log.jsonl")):   # a run that died before its first checkpoint
        kept = os.path.join(cfg.out_dir, f"log.{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
        os.replace(os.path.join(cfg.out_dir, "log.jsonl"), kept)
        print(f"moved the log of an earlier run without a checkpoint to {kept}")
    if cfg.init_from == "scratch":
        vocab = meta.get("model_vocab_size") or math.ceil(meta["vocab_size"] / 128) * 128   # (a Hub model's own size)
        return None, None, {**{k: getattr(cfg, k) for k in MODEL_KEYS}, "vocab_size": vocab}, "config"
    path = os.path.join(cfg.init_from, "ckpt.pt") if os.path.isdir(cfg.init_from) else cfg.init_from
    if not os.path.isfile(path):   # a convert.py checkpoint: its architecture, its weights
        fail(f"init_from={cfg.init_from!r} is not scratch, resume, or the out_dir of convert.py")
    try:
        init = read_checkpoint(path)
    except ValueError as e:
        fail(e)
    refuse_ignored_architecture(cfg, init["model_config"], path)
    if init.get("tokenizer_id") is not None and meta["tokenizer_id"] != init["tokenizer_id"]:
        fail(f"{cfg.data_dir} was tokenized with {meta['tokenizer']!r} but the model in {path} uses "
             f"{init['tokenizer']!r}: prepare the data with --tokenizer set to the model's tokenizer (its tokenizer.json)")
    if meta["vocab_size"] > init["model_config"]["vocab_size"]:
        fail(f"the data's vocabulary ({meta['vocab_size']}) exceeds the model's ({init['model_config']['vocab_size']})")
    return None, init, init["model_config"], os.path.abspath(path)


def converted(path):
    """Is the checkpoint at path convert.py's (no training state)? A look at its keys, not a check of its content."""
    try:
        return read_checkpoint(path, verify=False).get("train_config") is None
    except ValueError:
        return False


def refuse_ignored_architecture(cfg, model_config, path):
    """A checkpoint's architecture is the model's: explicit options that differ from it would be ignored, so refuse
    (block_size, the training sequence length, and routing_impl apply)."""
    model_config = {**{f.name: f.default for f in fields(GPTConfig)}, **model_config}   # a field newer than the file
    keys = sorted(k for k in getattr(cfg, "explicit", ()) if k in MODEL_KEYS and k not in ("routing_impl", "block_size")
                  and model_config[k] != getattr(cfg, k))
    if keys:
        fail(f"the architecture comes from {path}; these options differ from it and would be ignored: "
             + ", ".join(f"--{k}={getattr(cfg, k)!r} (checkpoint: {model_config[k]!r})" for k in keys)
             + ". Drop them (--block_size and --routing_impl may differ)")


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
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict   # FSDP's imports:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard   # ~0.7 s that only FSDP runs pay
    if state is None and master:   # scratch: rank 0 initialises, everyone receives the same weights
        state = GPT(mcfg).state_dict()
    with torch.device("meta"):
        model = GPT(mcfg)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # the mesh on the run's device type: FSDP2's default mesh takes CUDA whenever the machine has it, CPU runs too
    mesh = dist.device_mesh.init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
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


def prepare_for_training(model, params, cfg, rt):
    """The model the loop runs: sublayers compiled (--compile), wrapped in DDP for eager steps under torchrun; graphed
    steps are not wrapped (DDP's hooks are not captured): every process starts from rank 0's weights, as under DDP,
    and the gradients are averaged after each step's graphs (optimizer_step) or under their backward (overlap)."""
    model.checkpoint_sublayers, model.z_loss = cfg.activation_checkpointing, cfg.z_loss
    if cfg.compile:
        model.compile_sublayers()
    if rt.ddp and not cfg.fsdp and not rt.graphs:
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[rt.local_rank] if rt.device_type == "cuda" else None)
    if rt.ddp and not cfg.fsdp:
        for t in [*params, *model.buffers()]:
            dist.broadcast(t.detach(), 0)
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
            if is_dtensor(p):
                full = sys.modules["torch.distributed.tensor"].distribute_tensor(full, p.device_mesh, p.placements)
            e.copy_(full)

    def state_dict(self, master):
        """{name: full fp32 tensor on CPU} on rank 0 (every rank takes part in gathering sharded tensors)."""
        out = {}
        for (name, _), e in zip(self.named, self.shadow):
            full = e.full_tensor() if is_dtensor(e) else e
            if master:
                out[name] = full.cpu()
        return out


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
    rows = (rows.pin_memory() if rt.device_type == "cuda" else rows).to(rt.device, non_blocking=True)
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def evaluate(model, data, cfg, rt, stats=False):
    """Mean validation loss over the fixed validation set (the first n_eval sequences of val.bin); with stats, also the
    routing statistics of its first microbatch (metrics.routing_statistics: the reference routing, which records the
    weights, in pieces of the microbatch), else None."""
    total, routing = torch.zeros(2, device=rt.device, dtype=torch.float64), None
    record = stats and cfg.residual in ("attnres", "mhar", "delta")
    for first in range(rt.rank * cfg.micro_batch, data.n_eval, cfg.micro_batch * rt.world):
        x, y = to_device(data.val.rows([i * cfg.block_size for i in range(first, first + cfg.micro_batch)]), rt)
        if record and routing is None:
            routing, loss_sum = routing_statistics(model, x, y, rt.autocast, delta=cfg.residual == "delta")
        else:
            with rt.autocast:
                loss_sum = model(x, y)[1].double() * y.numel()
        total += torch.stack([loss_sum, torch.tensor(y.numel(), device=rt.device, dtype=torch.float64)])
    if rt.ddp:
        dist.all_reduce(total)
    return (total[0] / total[1]).item(), routing


def microbatch(data, cfg, rt, step, micro):
    """(inputs, targets) of microbatch `micro` of step `step` on this process, on the device."""
    first = step * data.seqs_per_step + (rt.rank * data.accum + micro) * cfg.micro_batch
    return to_device(data.train.train_batch(first, cfg.micro_batch), rt)


def run_microbatches(batch, accum, model, graphed, rt, fsdp=False):
    """A step's forward and backward over its accum microbatches (batch(micro) -> inputs, targets), into the
    gradients: replayed as CUDA graphs (graphed, a GraphedMicrostep), else eager (DDP's all-reduce, or FSDP's
    reduce-scatter, on the last one only). Returns (the summed loss, on the device; graphed, or None once its capture
    has failed and the run went eager). train.py's loop and bench.py's step both run it."""
    loss_sum = torch.zeros((), device=rt.device)
    wrapped = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    for micro in range(accum):
        x, y = batch(micro)
        if graphed is not None:
            try:
                loss_sum += graphed(x, y, first=micro == 0, last=micro == accum - 1).float()
                continue
            except GraphCaptureError as e:   # this microbatch and the rest of the run go eager
                rt.say(f"*** CUDA graphs off: {e}. The run continues with eager steps (--cuda_graph=False "
                       "skips the attempt) ***")
                graphed = None
        sync = not rt.ddp or micro == accum - 1   # DDP all-reduces gradients on the last micro-step only
        if fsdp:
            model.set_requires_gradient_sync(sync)
        with (model.no_sync() if wrapped and not sync else nullcontext()), rt.autocast:
            _, loss = model(x, y)
            (loss / accum).backward()
        loss_sum += loss.detach().float()
    return loss_sum, graphed


def optimizer_step(optimizer, params, grad_clip, world=None, zero_grad=None):
    """The end of every step, after its microbatches (train.py's loop and bench.py's step): average the gradients
    over `world` processes in one all-reduce (sync_grads; None: nothing to average, or the backward did it), clip their
    global norm to grad_clip (0: no clip; the norm is returned either way, a full tensor under FSDP), AdamW, then
    zero_grad() where given (eager steps: graphed steps overwrite their fixed .grad tensors)."""
    if world is not None:
        sync_grads(params, world)
    if grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if is_dtensor(grad_norm):   # FSDP: the norm over every shard
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    if zero_grad is not None:
        zero_grad()
    return grad_norm


def log_header(cfg, rt, model, mcfg, data, model_source, step, device_name):
    n_params = model.num_params()
    n_extra = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("routes.", "hyper.")))
    import routing_kernel   # its triton: None where Triton is not installed
    triton_version = routing_kernel.triton.__version__ if routing_kernel.triton is not None else "not installed"
    say, meta = rt.say, data.meta
    say(f"git {git_revision()} | python {platform.python_version()} | torch {torch.__version__} | triton {triton_version}"
        f" | cuda {torch.version.cuda} | {rt.world} x {device_name}")
    say(f"precision: compute {rt.compute} ({rt.why}), weights {cfg.param_dtype}")
    say(f"CUDA graphs: {'on' if rt.graphs else 'off'} ({rt.graphs_why})")
    say(f"gradients: {grad_sync_plan(cfg, rt)[1]}")
    routed = mcfg.residual in ("attnres", "mhar", "delta")
    path = model.routing_path(rt.device, getattr(torch, rt.compute) if mcfg.residual != "delta" else torch.float32)
    blocks = f" over {mcfg.route_blocks} blocks" if mcfg.route_blocks else ""
    say(f"model: residual={mcfg.residual} (" + (f"routing heads {mcfg.heads}{blocks}, {path} routing, routing_impl={mcfg.routing_impl}"
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
        Tracker.check(cfg)
    except (ValueError, RuntimeError) as e:
        fail(e)
    rt = setup_runtime(cfg)
    for line in unused_options(cfg):
        rt.say(line)
    data = load_data(cfg, rt.world, rt.rank)
    ckpt, init, mcfg, model_source = resolve_start(cfg, data, rt.master)
    state = ckpt["model"] if ckpt is not None else init["model"] if init is not None else None
    raw_model = build_model(mcfg, cfg, rt.device, rt.param_dtype, state, rt.master)   # checkpoints save it: clean names
    params = [p for p in raw_model.parameters() if p.requires_grad]
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.lr, (cfg.beta1, cfg.beta2), cfg.adam_eps,
                                               cfg.decay_all, fused=rt.device_type == "cuda" and not cfg.fsdp,
                                               routing_lr_scale=cfg.routing_lr_scale)
    named = [(n, p) for n, p in raw_model.named_parameters() if p.requires_grad]
    ema = EMA(named, cfg.ema_decay) if cfg.ema_decay > 0 else None
    try:
        step = restore(ckpt, raw_model, optimizer, ema, cfg, rt) if ckpt is not None else 0
    except ValueError as e:
        fail(e)
    saved_step = step if ckpt is not None else None
    del ckpt, init, state
    model = prepare_for_training(raw_model, params, cfg, rt)
    device_name = torch.cuda.get_device_name(rt.device) if rt.device_type == "cuda" else platform.processor() or "cpu"
    log_header(cfg, rt, raw_model, mcfg, data, model_source, step, device_name)
    extra = {"model_config": asdict(mcfg), "model_source": model_source, "train_config": asdict(cfg), "meta": data.meta,
             "tokenizer": keep_tokenizer(cfg.out_dir, data.meta["tokenizer"], rt.master),
             "tokenizer_id": data.meta["tokenizer_id"], "git": git_revision()}
    try:   # (a resume reads the log: a damaged line mid-file is named)
        log = StepLog(cfg, rt, raw_model, device_name if rt.device_type == "cuda" else None, step, saved_step,
                      Tracker(cfg, rt.master, extra["train_config"]), data.bytes_per_token)
    except ValueError as e:
        fail(e)
    grad_sync = OverlappedGradSync(params, cfg.grad_bucket_mb) if grad_sync_plan(cfg, rt)[0] else None
    graphed = GraphedMicrostep(model, rt.autocast, loss_scale=1 / data.accum, grad_sync=grad_sync) if rt.graphs else None
    wrapped = isinstance(model, torch.nn.parallel.DistributedDataParallel)
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
                extra["data"] = {"seqs_consumed": step * data.seqs_per_step, "seed": cfg.seed, "identity": data.identity}
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
            val, routing = evaluate(raw_model, data, cfg, rt, stats=True)
            val_ema = None
            if ema is not None:   # the EMA weights, swapped in for an eval of their own
                with ema.swapped_in():
                    val_ema = evaluate(raw_model, data, cfg, rt)[0]
            log.eval(step, val, val_ema, routing)
            log.flush()   # a new timing window after the eval
        if last:
            log.done(step)
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step) * group.get("lr_scale", 1.0)
        loss_sum, graphed = run_microbatches(functools.partial(microbatch, data, cfg, rt, step), data.accum, model,
                                             graphed, rt, cfg.fsdp)
        if rt.ddp:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)   # the logged loss is the global-batch mean
        averaged = wrapped or cfg.fsdp or (graphed is not None and graphed.grad_sync is not None)
        grad_norm = optimizer_step(optimizer, params, cfg.grad_clip, world=rt.world if rt.ddp and not averaged else None,
                                   zero_grad=None if graphed is not None else lambda: optimizer.zero_grad(set_to_none=True))
        if ema is not None:
            ema.update()
        step += 1
        log.step(step, loss_sum / data.accum, grad_norm, lr_at(cfg, step - 1))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    run_script(lambda: main(sys.argv[1:]), "train.py")
