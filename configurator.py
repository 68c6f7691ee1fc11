"""
train.py's options: every training option with its kind and range, default and one comment (TrainConfig), the model's
(model.GPTConfig's fields but the vocabulary, which the data sets; their kinds in MODEL_RULES), and how a run's options
are read: defaults, then config files in order (plain Python assignments), then --key=value, each value checked by its
rule (options.py) and refused in one line naming the option, the value and the rule; which options each residual mode
reads. nanoGPT's configurator.py, beside a train.py that is the loop. Raises ValueError, never exits.
"""
import ast
import difflib
import inspect
import os
import re
from dataclasses import dataclass, field, fields, make_dataclass

from model import RESIDUAL_MODES, ROUTING_IMPLS, GPTConfig
from options import Choice, Count, Device, Either, Flag, Mapping, Maybe, Path, Real, Seed, Text

# kinds several options share; each field below names its kind and range (options.py), then its default and comment
STEPS, TOKENS = Count(1, 10**9), Count(1, 2**40)   # a billion steps, a trillion tokens: past any run
UNIT, UNIT_OPEN = Real(0, 1), Real(0, 1, hi_open=True)
DATA = Path("dir", "prepare_data.py's --out_dir (python prepare_data.py --out_dir=... makes one)", absolute=False)
START = Either(Choice("scratch", "resume"), Path("any", "convert.py's out_dir or its ckpt.pt", absolute=False))


def option(default, kind):
    """A field of TrainConfig: its default and its kind and range (options.py), which check_option and -h read."""
    return field(default=default, metadata={"kind": kind})


@dataclass
class TrainConfig:
    # data and output
    data_dir: str = option("data/fineweb_edu", DATA)         # prepare_data.py's train.bin, val.bin, meta.json
    out_dir: str = option("out", Path("out_dir", absolute=False, writes=("run", "converted")))   # ckpt.pt, log.jsonl
    init_from: str = option("scratch", START)                # scratch | resume (out_dir/ckpt.pt) | convert.py's out_dir
    # batch (the sequence length is the model's block_size)
    batch_tokens: int = option(131072, TOKENS)               # global batch per optimizer step, in tokens (64 x 2048)
    micro_batch: int = option(8, Count(1, 2**16))            # sequences per forward/backward per process
    # optimizer and schedule
    lr: float = option(1e-3, Real(0, 1e6, lo_open=True))     # peak learning rate
    min_lr_ratio: float = option(0.1, UNIT)                  # the decay ends at lr * min_lr_ratio
    warmup_steps: int = option(1000, Count(0, 10**9))        # linear warmup
    lr_schedule: str = option("cosine", Choice("cosine", "linear", "1-sqrt"))   # the decay after warmup
    lr_decay_steps: int = option(-1, Either(Choice(-1), STEPS))   # decay horizon; -1: max_steps (fix it to extend)
    max_steps: int = option(20000, STEPS)                    # optimizer steps (a resumed run continues up to here)
    weight_decay: float = option(0.1, Real(0, 10))           # AdamW weight decay
    decay_all: bool = option(True, Flag())                   # decay every parameter (the paper); False: not norms...
    beta1: float = option(0.9, UNIT_OPEN)                    # AdamW beta1
    beta2: float = option(0.95, UNIT_OPEN)                   # AdamW beta2
    adam_eps: float = option(1e-8, Real(0, 1, lo_open=True))   # AdamW eps (0 divides by a zero second moment)
    grad_clip: float = option(1.0, Real(0, 1e6))             # global gradient-norm clip (0 = off)
    # LR multiplier of the routing queries (delta: of every routing parameter)
    routing_lr_scale: float = option(1.0, Real(0, 1e6, lo_open=True))
    z_loss: float = option(0.0, UNIT)                        # logit z-loss coefficient (the paper's 8B: 1e-4)
    ema_decay: float = option(0.0, UNIT_OPEN)                # weight EMA, evaluated and saved beside (0: off)
    # evaluation and logging
    eval_interval: int = option(500, STEPS)                  # evaluate and checkpoint every this many steps, and last
    eval_tokens: int = option(1048576, TOKENS)               # fixed validation set: the first this-many of val.bin
    log_interval: int = option(1, STEPS)                     # print/log every this many steps (each print syncs)
    save_every: int = option(0, Count(0, 10**9))             # write out_dir/ckpt.pt this often (0: at every eval)
    keep_every: int = option(0, Count(0, 10**9))             # also keep out_dir/ckpt-stepN.pt this often (0: off)
    wandb_log: bool = option(False, Flag())                  # also log to Weights & Biases (pip install wandb)
    wandb_project: str = option("mhar", Text())              # its project
    wandb_run_name: str = option("", Text(empty=True))       # its run name ("": wandb's own)
    # system
    device: str = option("auto", Device(auto=True))          # auto | cpu | cuda | cuda:N (torchrun: a GPU a process)
    # compute: auto (bf16 autocast on CUDA, fp32 on CPU) | bfloat16 | float32
    dtype: str = option("auto", Choice("auto", "bfloat16", "float32"))
    # float32 master weights | bfloat16 (a pure-bf16 model, as the paper's: less memory)
    param_dtype: str = option("float32", Choice("float32", "bfloat16"))
    compile: bool = option(True, Flag())                     # torch.compile each sublayer (and the reference routing)
    activation_checkpointing: bool = option(False, Flag())   # recompute each sublayer in backward: less memory
    fsdp: bool = option(False, Flag())                       # FSDP2: shard each sublayer over the processes
    save: bool = option(True, Flag())                        # out_dir/ckpt.pt at evals (save_every) and at the end
    cuda_graph: bool = option(True, Flag())                  # replay microbatches as CUDA graphs where they apply
    # torchrun + CUDA graphs: after (one all-reduce after them) | overlap (under the backward)
    grad_sync: str = option("after", Choice("after", "overlap"))
    grad_bucket_mb: float = option(25.0, Real(0, 1e6, lo_open=True))   # grad_sync=overlap: bucket size in MB
    seed: int = option(42, Seed())                           # fixes initialisation and data order


# The model's options: GPTConfig's fields (model.py: one default and one comment each) but vocab_size, which the data
# sets, with the kinds train.py reads them as (what they mean together, GPTConfig's own checks say). Config holds both,
# flat, so that --n_layer=24 and cfg.n_layer work like any training option.
MODEL_RULES = dict(
    block_size=Count(1, 2**20), n_layer=Count(1, 1024), n_head=Count(1, 1024), n_kv_head=Count(1, 1024),
    n_embd=Count(1, 65536), ffn_hidden=Count(1, 2**20), head_dim=Maybe(Count(2, 4096)), qk_norm=Flag(),
    rope_theta=Real(0, 1e12, lo_open=True), rope_scaling=Maybe(Mapping()), norm_eps=Real(0, 1, lo_open=True),
    tie_embeddings=Flag(), residual=Choice(*RESIDUAL_MODES), route_heads=Maybe(Count(1, 65536)),
    route_scale=Real(0, 1e6, lo_open=True), route_init_std=Real(0, 10), route_blocks=Maybe(Count(1, 2048)),
    num_blocks=Count(1, 1024), hc_streams=Count(1, 64), hc_dynamic=Flag(), routing_impl=Choice(*ROUTING_IMPLS))
MODEL_KEYS = [f.name for f in fields(GPTConfig) if f.name != "vocab_size"]
Config = make_dataclass("Config", [(f.name, f.type, option(f.default, MODEL_RULES[f.name])) for f in fields(GPTConfig)
                                   if f.name in MODEL_KEYS], bases=(TrainConfig,))
RULES = {f.name: f.metadata.get("kind") for f in fields(Config)}   # every option's kind (a test checks each has one)
# keys that may differ when resuming (everything else must match the checkpoint; lr_decay_steps is compared after
# resolving -1 to max_steps: the schedule's horizon must match)
RESUMABLE = {"data_dir", "out_dir", "init_from", "max_steps", "eval_interval", "log_interval", "device",
             "dtype", "compile", "micro_batch", "activation_checkpointing", "routing_impl", "lr_decay_steps", "save",
             "cuda_graph", "grad_sync", "grad_bucket_mb", "save_every", "keep_every", "wandb_log", "wandb_project",
             "wandb_run_name"}


# ---- reading them ----------------------------------------------------------------------------------------------------

def config_help():
    """Every option, one line each: its rule, default and comment, the model's (GPTConfig) first, then TrainConfig's."""
    def comments(cls):   # each field's comment: on its line (and the deeper-indented comment lines under it), or
        notes, above, last = {}, None, None   # the comment line right above it
        for line in inspect.getsource(cls).splitlines():
            field_ = re.match(r"^    (\w+): .*?=.*?(?:#\s*(.*))?$", line)
            if last and line.startswith(" " * 8) and line.strip().startswith("#"):   # its comment, continued
                notes[last] += " " + line.strip()[1:].strip()
                continue
            last = None
            if field_ and (field_.group(2) or above):
                notes[field_.group(1)] = field_.group(2) or above
                last = field_.group(1) if field_.group(2) else None
            above = line.strip()[1:].strip() if line.strip().startswith("#") else None
        return notes
    lines = ["options (python train.py [config.py ...] [--key=value ...]):"]
    for title, cls, keys in (("the model (model.GPTConfig)", GPTConfig, MODEL_KEYS),
                             ("training", TrainConfig, [f.name for f in fields(TrainConfig)])):
        notes = comments(cls)
        lines.append(f"  # {title}")
        lines += [f"  --{k}={getattr(Config, k)!r}  {RULES[k].describe()}" + (f"  # {notes[k]}" if k in notes else "")
                  for k in keys]
    return "\n".join(lines)


def is_path(kind):
    """Does this option name a path (its existence is checked, so a caller without the files may skip it)?"""
    return isinstance(kind, Path) or any(isinstance(r, Path) for r in getattr(kind, "rules", ()))


def check_option(key, value, raw=None):
    """value as option `key` takes it (its rule: options.py), else a ValueError naming both and the rule. raw: the
    command line's text, taken as such where the value read from it does not fit (--wandb_run_name=2024 is text).
    Paths are checked and kept as given (train.py resolves them against its working directory as it uses them)."""
    for v in (value,) if raw is None or raw == value else (value, raw):
        try:
            return RULES[key].check(v)
        except ValueError as e:
            error = e
    raise ValueError(f"{key}={value!r} {error}") from None


def parse_args(argv, usage="", paths=True):
    """Defaults <- config files <- --key=value overrides; each option's final value checked by its rule (a config
    file's path that the command line replaces is never looked at). paths=False: the path options go unchecked (for
    a caller that reads a config's shapes only). -h / --help: `usage` (the calling script's), every option, exit."""
    if any(a in ("-h", "--help") for a in argv):
        print(usage + "\n" + config_help())
        raise SystemExit(0)
    cfg, known, given = Config(), {f.name for f in fields(Config)}, {}
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
            items, source = [(key, val, raw)], "on the command line"
        for key, val, *raw in items:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=3)
                hint = f" (did you mean {' or '.join(close)}?)" if close else ""
                raise ValueError(f"unknown option {key!r} {source}{hint}; python train.py -h lists every option")
            given[key] = (val, *raw)
            cfg.explicit.add(key)
    for key, (val, *raw) in given.items():
        setattr(cfg, key, check_option(key, val, *raw) if paths or not is_path(RULES[key]) else val)
    # checkpoints are written at evals, kept copies at checkpoints: each interval a multiple of the one it rides on
    for key, base in (("save_every", "eval_interval"),
                      ("keep_every", "save_every" if cfg.save_every else "eval_interval")):
        every, unit = getattr(cfg, key), getattr(cfg, base)
        if every % unit:
            raise ValueError(f"{key}={every} must be a multiple of {base}={unit} (it takes effect at those steps), "
                             f"e.g. --{key}={max(1, round(every / unit)) * unit}")
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
