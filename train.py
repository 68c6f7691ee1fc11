"""
Train a GPT with any residual mode (baseline | hyper | attnres | mhar | delta) on prepare_data.py token files.

  python train.py config/tiny.py --device=cpu                      # one process
  torchrun --standalone --nproc_per_node=8 train.py config/train_350m.py --residual=mhar
  python train.py -h                                               # every option with its default
  python train.py --list[=out]                                     # the runs in a folder: step, loss, mode, state

Options (configurator.py): the model's (model.GPTConfig) and training's (TrainConfig), then config files in order (plain
Python assignments), then --key=value. The global batch is given in tokens; gradient accumulation is derived, so 1 and N
processes run the same optimisation. Recipe (paper section 3.1, Appendix I): AdamW 0.9 / 0.95, weight decay 0.1 on
every parameter, clip 1.0, linear warmup then cosine to 0.1x, a fixed validation set, the tail-mean of the last 11 evals.

Stages, in the order main() runs them: parse_args -> setup_runtime (processes, device, precision) -> load_data (checked
against meta.json) -> resolve_start (the out_dir lock; scratch / resume / converted checkpoint) -> build_model, restore
-> the loop: run_microbatches (graphed or eager), optimizer_step (average, clip, AdamW), EMA, StepLog (metrics.py: the
lines, log.jsonl, val_bpb, routing statistics, the optional tracker); evaluate every eval_interval and save_checkpoint
at evals (every save_every steps where given).
Its checkpoints are checkpoint.py's; what a run folder holds besides (the lock, stops, --list) and what a run starts
from (the resume policy) runs.py's; CUDA graphs and the gradient average graphs.py's.
"""
import functools
import json
import math
import os
import platform
import shlex
import signal
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass

if __name__ == "__main__":   # Ctrl-C while torch loads: a quiet exit (nothing is written yet)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch
import torch.distributed as dist

from checkpoint import CheckpointWriteError, data_identity, git_revision, keep_tokenizer, restore, save_checkpoint
from common import is_dtensor, keeps_signals, lock_holder, run_script
from configurator import MODEL_KEYS, horizon, parse_args, unused_options
from graphs import GraphCaptureError, GraphedMicrostep, OverlappedGradSync, sync_grads
from metrics import StepLog, Tracker, routing_statistics, val_bytes_per_token
from model import GPT, GPTConfig
from prepare_data import TokenData, check_files
from runs import OutDirLocked, StopSignals, lock_out_dir, print_runs, start_point


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
    holder = lock_holder(os.path.join(cfg.data_dir, "prepare.lock"))
    if holder is not None:
        fail(f"{cfg.data_dir} is being written by prepare_data.py (pid {holder['pid']}): start once it has finished")
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
    if n_eval * cfg.block_size < cfg.eval_tokens and "eval_tokens" in getattr(cfg, "explicit", ()):
        quiet(f"train.py: eval_tokens={cfg.eval_tokens:,}: the fixed validation set is {n_eval} sequences of "
              f"{cfg.block_size} ({n_eval * cfg.block_size:,} tokens), all that val.bin holds in whole eval batches")
    return Data(meta, train_data, val_data, seqs_per_step, seqs_per_step // per_micro, n_eval,
                data_identity(meta, files), val_bytes_per_token(cfg.data_dir, meta, n_eval * cfg.block_size, quiet))


# ---- what the run starts from ----------------------------------------------------------------------------------------

def resolve_start(cfg, data, master):
    """(ckpt, init, mcfg, model_source): out_dir taken for this run (one run per out_dir), then start_point's choice
    and the model's GPTConfig."""
    if master:
        try:
            lock_out_dir(cfg.out_dir)   # before anything in out_dir is read or moved
        except OutDirLocked as e:
            fail(e)
        except OSError as e:   # a read-only or full disk, another user's folder: nothing was left there
            fail(f"cannot write --out_dir={cfg.out_dir} ({e.strerror or e}): pick a folder this user can write")
    try:
        ckpt, init, model_cfg, model_source = start_point(cfg, data.meta, data.identity, master)
        return ckpt, init, GPTConfig.from_dict({**model_cfg, "routing_impl": cfg.routing_impl}), model_source
    except ValueError as e:
        fail(e)


# ---- model, optimizer and their state --------------------------------------------------------------------------------

def build_model(mcfg, cfg, device, param_dtype, state, master):
    """The model on `device`, weights from `state` (a full state dict) or a fresh seeded init. With FSDP
    it is built on the meta device and sharded sublayer by sublayer; only rank 0 reads `state`, which is broadcast;
    "shards": a sharded checkpoint's, which restore loads in place (no init, nothing broadcast)."""
    torch.manual_seed(cfg.seed)
    if not cfg.fsdp:
        model = GPT(mcfg) if state is None or isinstance(state, str) else GPT.from_state(mcfg, state)   # (no copy)
        for p in model.parameters():   # parameters only: the RoPE tables stay fp32 with bf16 weights
            p.data = p.data.to(device, param_dtype, copy=True)   # a copy: never train in a mmap of the checkpoint
        return model.to(device)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict   # FSDP's imports:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard   # ~0.7 s that only FSDP runs pay
    if state is None and master:   # scratch: rank 0 initialises, everyone receives the same weights
        state = GPT(mcfg).state_dict()
    shards = isinstance(state, str)
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
    if not shards:
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
        shards = os.path.join(cfg.out_dir, "ckpt.dcp")
        say(f"resumed from {shards if cfg.fsdp and os.path.exists(shards) else os.path.join(cfg.out_dir, 'ckpt.pt')} "
            f"at step {step}")


# ---- main ------------------------------------------------------------------------------------------------------------

@keeps_signals
def main(argv):
    if argv[:1] and argv[0].split("=")[0] == "--list":
        return print_runs(argv[0].split("=", 1)[1] if "=" in argv[0] else "out")
    try:
        cfg = parse_args(argv, __doc__)
        Tracker.check(cfg)
    except (ValueError, RuntimeError) as e:
        fail(e)
    rt = setup_runtime(cfg)
    for line in unused_options(cfg):
        rt.say(line)
    data = load_data(cfg, rt.world, rt.rank)
    ckpt, init, mcfg, model_source = resolve_start(cfg, data, rt.master)
    state = "shards" if ckpt is not None and ckpt.get("sharded") else ckpt["model"] if ckpt is not None else \
        init["model"] if init is not None else None   # ("shards": restore fills them in place)
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
            due = last or stopping or not cfg.save_every or step % cfg.save_every == 0
            if step > log.start_step and cfg.save and due:   # before the eval: an eval crash finds it written
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
            if rt.master and cfg.save:
                out = shlex.quote(cfg.out_dir)
                rt.say(f"next: python sample.py --out_dir={out}  |  python eval.py --out_dir={out}  |  "
                       f"python export.py --out_dir={out} --hf_dir=<a new folder>")
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
