"""
What a run reports (train.py's StepLog): one line per logged step and per eval on stdout, their records in
out_dir/log.jsonl, the checks that stop a run on a non-finite state; validation bits per byte (val_bpb), which
compares across tokenizers; routing statistics at each eval, the method's own signal; model FLOPs utilisation (mfu);
and an optional tracker (Weights & Biases, --wandb_log). log.jsonl stays the record; the tracker gets the same numbers.

Records in log.jsonl: {"step", "loss", "lr", "grad_norm", "dt_ms", "tok_per_s"} per logged step; {"step",
"val_loss", "val_bpb", "routing"} per eval, routing (attnres, mhar, delta) = per site, from the eval's first
microbatch: "entropy" (of the token-averaged routing weights, per head, in [0, ln N] for N sources), "kl" (their KL
divergence from the uniform mix, ln N - entropy: how far routing has left its zero-query start), "logit_sd" (the
standard deviation over the N sources of the token-averaged logit: how far apart the router scores its sources, in
logit units, route_scale included), "w_first" (the weight on the first source: the embedding; in delta mode the null
source comes before it, so the embedding is source 1 there) and "w_newest" (on the newest source), each a list of
sites of lists of heads. kl and logit_sd are the router's speed as the run measures it: two routers compared at one
step have moved as far as these say, whatever their learning rates or scales were meant to match.
"""
import json
import math
import os
import sys
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

from common import is_dtensor, write_atomic


# ---- log.jsonl: read back (a resume trims it to its checkpoint) --------------------------------------------------------------------------------------------------------

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


# ---- routing statistics -----------------------------------------------------------------------------------------------

# The statistics come from the reference routing, which records the weights: fp32, every site re-stacking its sources,
# so its largest transient is ~18 bytes per source element against the fused chain's 2 (bf16), which a training step
# holds once. An eighth of a microbatch at a time keeps the statistics' forward near that (a 350M eval of the whole
# microbatch at once asked for more than an 80 GB card had left beside the step's CUDA graphs).
STATS_PIECES = 8


@torch.no_grad()
def routing_statistics(model, x, y, autocast, delta=False):
    """Routing statistics of one microbatch (x, y: (B, T)) and its loss summed over its targets (a float64 tensor): the
    model runs with return_routing=True on STATS_PIECES pieces of the batch, eagerly (the pieces' shape would
    otherwise recompile the sublayers), and each piece's weights are reduced to per-site sums as they come, so one
    piece's are held at a time. The statistics equal those of the whole batch in one forward."""
    sums, loss_sum, rows = None, torch.zeros((), dtype=torch.float64, device=y.device), -(-len(x) // STATS_PIECES)
    for i in range(0, len(x), rows):
        with autocast, torch.compiler.set_stance("force_eager"):
            _, loss, routing = model(x[i:i + rows], y[i:i + rows], return_routing=True)
        part = token_sums(routing)
        sums = part if sums is None else [(a + pa, b + pb) for (a, b), (pa, pb) in zip(sums, part)]
        loss_sum += loss.double() * y[i:i + rows].numel()
    return routing_stats([(a / y.numel(), b / y.numel()) for a, b in sums], delta), loss_sum


def token_sums(routing):
    """Per site, the routing weights alpha (N_j, B, T, H) summed over the tokens, and their logs summed likewise:
    [(sum of alpha, sum of log alpha)], each (N_j, H) in float64. log alpha[n] is the logit of source n less the
    token's log-sum-exp, which is the same for every source, so the log's token mean differs from the logit's token mean
    by one constant per head: its spread over the sources is the logits'. A weight that underflowed float32 (a logit
    ~87 below the token's largest) counts as float32's smallest normal number."""
    tiny = torch.finfo(torch.float32).tiny
    return [(alpha.double().sum((1, 2)), alpha.double().clamp_min(tiny).log().sum((1, 2))) for alpha in routing]


def routing_stats(means, delta=False):
    """Per site: the entropy of the token-averaged routing weights and its KL divergence from uniform, the spread of
    the token-averaged logits over the sources, and the weight on the first history source (the embedding) and on the
    newest, per head. means: per site, (the routing weights alpha averaged over the tokens, the same of log alpha),
    (N_j, H) each: token_sums over the token count."""
    stats = {"entropy": [], "kl": [], "logit_sd": [], "w_first": [], "w_newest": []}
    for mean, log_mean in means:
        mean, log_mean = mean.double(), log_mean.double()
        entropy = 0.0 - (mean * mean.clamp_min(1e-30).log()).sum(0)   # (0.0 - : no -0.0)
        stats["entropy"].append(entropy.tolist())
        stats["kl"].append((math.log(len(mean)) - entropy).clamp_min(0.0).tolist())   # rounding keeps it >= 0
        stats["logit_sd"].append(log_mean.std(0, correction=0).tolist())
        stats["w_first"].append(mean[min(int(delta), len(mean) - 1)].tolist())
        stats["w_newest"].append(mean[-1].tolist())
    return stats


def routing_summary(stats):
    """Scalars of routing_stats for the eval line and the tracker: the mean over sites and heads of each statistic."""
    return {k: float(np.mean([x for site in v for x in site])) for k, v in stats.items()}


# ---- bits per byte ----------------------------------------------------------------------------------------------------

def val_bytes_per_token(data_dir, meta, n_targets, log=print):
    """Bytes per target token of the fixed validation set (the tokens at positions 1 .. n_targets of val.bin, what
    the evals predict), from the data folder's token_bytes.bin (tokenizer.token_byte_table: a token's UTF-8 bytes,
    0 for special tokens such as the end-of-text separator); a folder prepared without it gets one, measured from its
    tokenizer now. None, said in one line, where the tokenizer cannot be loaded."""
    import tokenizer
    path = os.path.join(data_dir, "token_bytes.bin")
    if os.path.isfile(path):
        table = np.fromfile(path, dtype=np.uint16)
    else:
        try:
            table = tokenizer.token_byte_table(tokenizer.load_tokenizer(meta["tokenizer"]))
        except Exception as e:
            log(f"val_bpb: n/a ({data_dir} has no token_bytes.bin and its tokenizer {meta['tokenizer']!r} cannot be "
                f"loaded: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); prepare the data again to get it")
            return None
        try:   # measured once: later runs read it
            write_atomic(path, table.tobytes())
        except OSError:
            pass
    tokens = np.memmap(os.path.join(data_dir, "val.bin"), dtype=meta["dtype"], mode="r")[1:n_targets + 1]
    if len(tokens) and int(tokens.max()) >= len(table):
        log(f"val_bpb: n/a (val.bin holds token {int(tokens.max())}, beyond its tokenizer's {len(table)} tokens)")
        return None
    n_bytes = int(table[tokens].sum(dtype=np.int64))
    return n_bytes / len(tokens) if n_bytes else None


def bits_per_byte(val_loss, bytes_per_token):
    """Nats per token -> bits per byte: val_loss / ln 2 / (bytes per token). Every target's nats count, the end-of-text
    separators' too, over the text's bytes (a separator has none); nanochat's evaluate_bpb leaves 0-byte targets out
    of the nats. The two differ by the separators' share of the loss: on the books+Wikipedia validation text (0.097%
    of its targets are separators) a 200-step config/tiny.py model reads 0.2% higher here (2.7430 against 2.7375)."""
    return None if bytes_per_token is None else val_loss / math.log(2) / bytes_per_token


# ---- the tracker ------------------------------------------------------------------------------------------------------

class Tracker:
    """Weights & Biases on rank 0 (nanoGPT's --wandb_log, --wandb_project, --wandb_run_name); offline with
    WANDB_MODE=offline. Without --wandb_log nothing is imported."""

    def __init__(self, cfg, master, config):
        self.run = None
        if not (cfg.wandb_log and master):
            return
        import wandb   # train.py checked that it imports before any training
        # the run's id, kept in out_dir: a resumed run continues its own W&B run (a fresh one starts a new run)
        id_file = os.path.join(cfg.out_dir, "wandb_run_id")
        run_id = open(id_file).read().strip() if cfg.init_from == "resume" and os.path.isfile(id_file) else None
        run_id = run_id or uuid.uuid4().hex[:8]
        write_atomic(id_file, run_id)
        self.run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name or None, config=config,
                              dir=cfg.out_dir, id=run_id, resume="allow")

    @staticmethod
    def check(cfg):
        """Raise a RuntimeError naming the fix where --wandb_log cannot run (wandb is not a requirement)."""
        if cfg.wandb_log:
            try:
                import wandb  # noqa: F401
            except ImportError:
                raise RuntimeError("--wandb_log=True needs Weights & Biases: pip install wandb (or drop the flag; "
                                   "log.jsonl records everything)") from None

    def log(self, record):
        if self.run is not None:   # its scalars (the routing record's lists are logged as their summary)
            self.run.log({k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))},
                         step=record["step"])

    def finish(self):
        if self.run is not None:
            self.run.finish()


# ---- the step log -----------------------------------------------------------------------------------------------------

class StepLog:
    """Step lines on stdout and records in out_dir/log.jsonl (rank 0), and the tracker's. Step losses and gradient norms
    stay on the device until a flush, which checks them for non-finite values (stopping the run before anything is
    saved) and then times the window: after the losses reach the host, so that it holds the GPU's work (a CUDA-graph
    step is queued far faster than it runs). It also knows the last checkpoint, for messages that say which one is
    intact."""

    def __init__(self, cfg, rt, model, device_name, step, saved_step, tracker=None, bytes_per_token=None):
        self.cfg, self.rt, self.model, self.device_name = cfg, rt, model, device_name
        self.tracker, self.bytes_per_token = tracker, bytes_per_token
        self.path = os.path.join(cfg.out_dir, "log.jsonl")
        self.start_step, self.pending, self.speeds = step, [], []   # pending: (step, loss, gradient norm, lr)
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
        flags = torch.stack([(p.to_local() if is_dtensor(p) else p).isfinite().all() for _, p in named_params])
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
            if self.tracker is not None:
                self.tracker.log(record)

    def mfu(self, tok_s):
        return mfu(self.model, tok_s / self.rt.world, self.device_name, self.cfg.block_size)

    def step(self, step, loss, grad_norm, lr):
        self.pending.append((step, loss, grad_norm, lr))
        self.n_window += 1
        if step % self.cfg.log_interval == 0 or step == self.cfg.max_steps:
            self.flush()

    def flush(self):
        """Log the pending steps, and start a new timing window."""
        if self.pending:
            values = torch.stack([torch.stack([l.float(), g.float()]) for _, l, g, _ in self.pending]).tolist()
            dt = (time.time() - self.t0) / self.n_window
            for (s, _, _, _), (loss, norm) in zip(self.pending, values):
                if not math.isfinite(loss):
                    self.stop(f"non-finite loss {loss} at step {s}")
                if not math.isfinite(norm):
                    self.stop(f"non-finite gradient norm {norm} at step {s} (its update made the weights non-finite)")
            (s, _, _, lr), (loss, norm), tok_s = self.pending[-1], values[-1], self.cfg.batch_tokens / dt
            if s > self.start_step + self.n_window:   # the first window holds compilation and warm-up
                self.speeds.append(tok_s)
            mfu, eta = self.mfu(tok_s), (self.cfg.max_steps - s) * dt
            self.rt.say(f"step {s}/{self.cfg.max_steps} | loss {loss:.4f} | lr {lr:.2e} | grad {norm:.3f} | "
                        f"{dt * 1000:.0f} ms | {tok_s:,.0f} tok/s | mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | "
                        f"eta {int(eta // 3600)}h{int(eta % 3600 // 60):02d}m{int(eta % 60):02d}s")
            self.write({"step": s, "loss": loss, "lr": lr, "grad_norm": norm, "dt_ms": dt * 1000, "tok_per_s": tok_s})
            self.pending = []
        self.t0, self.n_window = time.time(), 0

    def peak_mem(self):
        return f" | peak mem {torch.cuda.max_memory_allocated(self.rt.device) / 1e9:.1f} GB" if self.rt.device_type == "cuda" else ""

    def eval(self, step, val, val_ema=None, routing=None):
        for name, v in (("validation loss", val), ("EMA validation loss", val_ema)):
            if v is not None and not math.isfinite(v):
                self.stop(f"non-finite {name} {v} at step {step} with finite weights",
                          "An overflow in the eval's compute dtype? Try --dtype=float32, or a lower --lr")
        self.evals[step] = val
        tail = [self.evals[k] for k in sorted(self.evals)][-11:]   # the paper's metric: the tail-mean of 11 evals
        bpb = bits_per_byte(val, self.bytes_per_token)
        summary = routing_summary(routing) if routing else None
        self.rt.say(f"eval step {step} | val_loss {val:.4f} | val_bpb " + ("n/a" if bpb is None else f"{bpb:.4f}")
                    + f" | tail-mean({len(tail)}) {sum(tail) / len(tail):.4f}"
                    + (f" | ema {val_ema:.4f}" if val_ema is not None else "")
                    + (f" | routing entropy {summary['entropy']:.3f}, kl {summary['kl']:.4f}, embedding "
                       f"{summary['w_first']:.3f}, newest {summary['w_newest']:.3f}" if summary else "") + self.peak_mem())
        self.write({"step": step, "val_loss": val, "val_bpb": bpb, **({} if val_ema is None else {"val_loss_ema": val_ema}),
                    **({"routing": routing} if routing else {})})
        if summary and self.tracker is not None and self.rt.master:   # the routing record's numbers, per site and head
            self.tracker.log({"step": step, **{f"routing/{k}": v for k, v in summary.items()},
                              **{f"routing/entropy_site{j + 1}": float(np.mean(h)) for j, h in enumerate(routing["entropy"])},
                              **{f"routing_heads/{stat}/site{j + 1}/head{h}": float(x) for stat, sites in routing.items()
                                 for j, heads in enumerate(sites) for h, x in enumerate(heads)}})

    def done(self, step):
        if self.tracker is not None:
            self.tracker.finish()
        if self.speeds:
            tok_s = float(np.median(self.speeds))
            mfu = self.mfu(tok_s)
            self.rt.say(f"done: step {step} | median {tok_s:,.0f} tok/s after warm-up | mfu "
                        f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'}{self.peak_mem()} | last val_loss "
                        f"{self.evals[max(self.evals)]:.4f}")


# ---- model FLOPs utilisation --------------------------------------------------------------------------------------------

PEAK_FLOPS = {  # dense bf16 tensor-core peaks (datasheets), matched as substrings of the device name
    "H200": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "GH200": 989e12,
    "B200": 2250e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "RTX 4090": 165e12,
}


def peak_flops(device_name):
    """Peak bf16 FLOP/s of a device by name; None for a device not in the table (never a guess)."""
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):   # longest match first: "H100 PCIe" before "H100"
        if key in (device_name or ""):
            return PEAK_FLOPS[key]
    return None


def mfu(model, tokens_per_s, device_name, seq_len=None):
    """Model FLOPs utilisation in [0, 1] (GPT.flops_per_token against the device's peak), or None when the device's
    peak is unknown."""
    peak = peak_flops(device_name)
    return None if peak is None else model.flops_per_token(seq_len) * tokens_per_s / peak
