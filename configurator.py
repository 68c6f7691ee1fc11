"""
train.py's options: every training option with its default and one comment (TrainConfig), the model's (model.GPTConfig,
but the vocabulary, which the data sets), and how a run's options are read: defaults, then config files in order (plain
Python assignments), then --key=value, each value checked against its field's type and range; which options each
residual mode reads. nanoGPT's configurator.py, beside a train.py that is the loop. Raises ValueError, never exits.
"""
import ast
import difflib
import inspect
import math
import os
import re
import typing
from dataclasses import dataclass, field, fields, make_dataclass

from model import GPTConfig


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


# ---- reading them ------------------------------------------------------------------------------------------------------

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


def parse_args(argv, usage=""):
    """Defaults <- config files <- --key=value overrides, with clear errors for unknown keys and bad types. -h / --help:
    `usage` (the calling script's), then every option, and exit."""
    if any(a in ("-h", "--help") for a in argv):
        print(usage + "\n" + config_help())
        raise SystemExit(0)
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


def horizon(cfg):
    """The step at which the LR schedule's decay ends."""
    return cfg.lr_decay_steps if cfg.lr_decay_steps > 0 else cfg.max_steps
