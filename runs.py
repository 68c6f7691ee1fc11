"""
What a train.py run folder holds besides its checkpoints, and who holds it: where a run starts from (start_point: scratch,
its own checkpoint to resume, or a converted model; train.py's resume policy), the runs in a folder (list_runs;
print_runs is train.py --list), one run per folder (lock_out_dir: train.lock), and its stops (StopSignals: SIGTERM,
SIGINT become a stop with a checkpoint). The checkpoints are checkpoint.py's, the log metrics.py's.
"""
import atexit
import math
import os
import pickle
import signal
import socket
import sys
import time
from dataclasses import asdict, fields

import torch
import torch.distributed as dist

from checkpoint import SHARDED, load_latest, load_plain, previous_checkpoint, read_checkpoint
from common import LockHeld, handle_signals, lock_holder, release_lock, take_lock
from configurator import MODEL_KEYS, RESUMABLE, Config, horizon
from metrics import read_log
from model import GPTConfig


class OutDirLocked(RuntimeError):
    """Another run holds the out_dir (or its lock could not be taken)."""


# ---- what a run starts from: scratch, a checkpoint to resume, or a converted model (train.py's resume policy) ----------

def start_point(cfg, meta, identity, master):
    """(ckpt, init, model_cfg, model_source) of a train.py run with options cfg on data of this meta.json and identity
    (data_identity): the checkpoint to resume, or a convert.py checkpoint to start from, and the model's config. A
    ValueError refuses anything that would overwrite a checkpoint or resume a different run (or data)."""
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    sharded = os.path.join(cfg.out_dir, SHARDED)
    if (cfg.fsdp or not os.path.exists(ckpt_path)) and (os.path.exists(sharded) or os.path.exists(
            previous_checkpoint(sharded)) or (cfg.fsdp and not os.path.exists(ckpt_path))):
        ckpt_path = sharded   # an FSDP run's shards (resharded to this run; a full ckpt.pt of an earlier tree resumes too)
    if cfg.init_from == "resume":
        ckpt = load_latest(ckpt_path, master)
        if ckpt.get("train_config") is None:   # convert.py's: weights and architecture, no training state
            raise ValueError(f"{ckpt_path} is a converted model (convert.py), not a run to continue: train from it with "
                 f"--init_from={cfg.out_dir} --out_dir=<a new folder>")
        old = {**asdict(Config()), **ckpt["train_config"]}   # an option newer than the checkpoint had its default
        # a model from a checkpoint (convert.py's) has that checkpoint's architecture; block_size stays the run's
        skip = RESUMABLE | (set(MODEL_KEYS) - {"block_size"} if ckpt.get("model_source", "config") != "config" else set())
        diff = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in asdict(cfg).items() if k not in skip and old.get(k) != v]
        old_horizon = old["lr_decay_steps"] if old["lr_decay_steps"] > 0 else old["max_steps"]
        if old_horizon != horizon(cfg):
            diff.append(f"decay horizon (lr_decay_steps, -1 = max_steps): {old_horizon} -> {horizon(cfg)}; "
                        f"pass --lr_decay_steps={old_horizon} to keep the old schedule")
        identity_old = ckpt.get("data", {}).get("identity")
        for name, old_v, new_v in (() if identity_old else (   # a checkpoint without an identity: tokenizer and count only
                ("tokenizer", ckpt["meta"].get("tokenizer_id"), meta["tokenizer_id"]),
                ("train_tokens", ckpt["meta"]["train_tokens"], meta["train_tokens"]))):
            if old_v != new_v:
                diff.append(f"data {name}: {old_v!r} -> {new_v!r}")
        quiet = print if master else (lambda line: None)
        diff += [f"data {c}" for c in data_changes(identity_old, identity, cfg.data_dir, quiet)]
        if diff:
            raise ValueError("cannot resume, the config differs from the checkpoint's:\n  " + "\n  ".join(diff)
                 + "\nuse the checkpoint's values, or a new out_dir with --init_from=scratch")
        refuse_ignored_architecture(cfg, ckpt["model_config"], ckpt_path)
        return ckpt, None, ckpt["model_config"], ckpt.get("model_source", "config")
    for path in (ckpt_path, previous_checkpoint(ckpt_path), sharded, previous_checkpoint(sharded)):
        if os.path.exists(path):
            raise ValueError(f"{path} already exists; " + (
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
        raise ValueError(f"init_from={cfg.init_from!r} is not scratch, resume, or the out_dir of convert.py")
    init = read_checkpoint(path)
    refuse_ignored_architecture(cfg, init["model_config"], path)
    if cfg.block_size > init["model_config"]["block_size"]:   # (its RoPE tables' length, its positions)
        raise ValueError(f"--block_size={cfg.block_size} exceeds the block_size of the model in {path} "
             f"({init['model_config']['block_size']}): train at most that long, or convert the model again with "
             f"convert.py --block_size={cfg.block_size}")
    if init.get("tokenizer_id") is not None and meta["tokenizer_id"] != init["tokenizer_id"]:
        raise ValueError(f"{cfg.data_dir} was tokenized with {meta['tokenizer']!r} but the model in {path} uses "
             f"{init['tokenizer']!r}: prepare the data with --tokenizer set to the model's tokenizer (its tokenizer.json)")
    if meta["vocab_size"] > init["model_config"]["vocab_size"]:
        raise ValueError(f"the data's vocabulary ({meta['vocab_size']}) exceeds the model's ({init['model_config']['vocab_size']})")
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
        raise ValueError(f"the architecture comes from {path}; these options differ from it and would be ignored: "
             + ", ".join(f"--{k}={getattr(cfg, k)!r} (checkpoint: {model_config[k]!r})" for k in keys)
             + ". Drop them (--block_size and --routing_impl may differ)")


def data_changes(old, new, data_dir, say=print):
    """How the data differ from a checkpoint's (data_identity's): one phrase per change, [] for the same tokens. A
    checkpoint without an identity (older) gets one line saying the data could not be checked; other inputs named in
    meta.json with the same tokens get one line too."""
    if old is None:
        say(f"train.py: the checkpoint records no identity of its data (an older checkpoint): {data_dir} is resumed "
            "unchecked beyond its tokenizer and token count")
        return []
    changes = [f"tokenizer {old.get('tokenizer_id')!r} -> {new['tokenizer_id']!r}"] \
        if old.get("tokenizer_id") != new["tokenizer_id"] else []
    for name, f in new["files"].items():
        was = old.get("files", {}).get(name, {})
        if was.get("bytes") != f["bytes"]:
            changes.append(f"{name}: {was.get('bytes')} -> {f['bytes']} bytes")
        elif was.get("sampled_sha256") != f["sampled_sha256"]:
            changes.append(f"{name}: the same size but other tokens (its sampled blocks differ)")
    moved = (old.get("inputs"), old.get("val_inputs")) != (new["inputs"], new["val_inputs"])
    if moved and changes:
        changes.append(f"meta.json inputs {old.get('inputs')} -> {new['inputs']}")
    elif moved:
        say(f"train.py: {data_dir}/meta.json names other inputs ({old.get('inputs')} -> {new['inputs']}), with the same "
            "tokens: resuming")
    return changes


# ---- the runs in a folder (python train.py --list) ---------------------------------------------------------------

def list_runs(folder):
    """One row per train.py run in folder (itself, or a subfolder holding log.jsonl or ckpt.pt): (name, step of its
    checkpoint, residual mode, last logged loss, last val loss, state: running (its lock held), finished (at max_steps),
    stopped (a checkpoint short of them), no checkpoint, or damaged)."""
    rows = []
    for name in [""] + sorted(os.listdir(folder)):
        run = os.path.join(folder, name)
        if not os.path.isdir(run) or not any(os.path.exists(os.path.join(run, f))
                                             for f in ("log.jsonl", "ckpt.pt", SHARDED)):
            continue
        damaged = None
        try:
            records = read_log(os.path.join(run, "log.jsonl"), say=lambda line: None) \
                if os.path.exists(os.path.join(run, "log.jsonl")) else []
        except (OSError, ValueError) as e:   # a line mid-file that is not JSON: this run's row says so, the rest list
            records, damaged = [], str(e).split(": not JSON")[0].rsplit(", ", 1)[-1]
        loss = next((r["loss"] for r in reversed(records) if "loss" in r), None)
        val = next((r["val_loss"] for r in reversed(records) if "val_loss" in r), None)
        step, mode, state = None, "?", "no checkpoint"
        latest = next((os.path.join(run, *f) for f in (("ckpt.pt",), (SHARDED, "meta.pt"))
                       if os.path.exists(os.path.join(run, f[0]))), None)   # (a sharded run's: its meta.pt)
        if latest:
            try:   # the small dicts only: the tensors stay mapped, unread
                ckpt = load_plain(latest)
                step, mode = ckpt.get("step"), ckpt["model_config"].get("residual", "?")
                train_cfg = ckpt.get("train_config") or {}
                target, home = train_cfg.get("max_steps"), train_cfg.get("out_dir")
                state = "converted (convert.py)" if target is None else "finished" if step >= target else \
                    f"stopped ({step}/{target}: --init_from=resume continues it)"
                if target is not None and home and os.path.basename(os.path.normpath(home)) != os.path.basename(
                        os.path.abspath(run)):   # a checkpoint copied here from another run's folder
                    state = f"{state}; its checkpoint was written in {home} (copied or renamed here)"
            except pickle.UnpicklingError:
                state = "refused: its checkpoint asks to run code when loaded"
            except Exception:
                state = "damaged checkpoint (resume takes ckpt.prev.pt)"
        if damaged:
            state += f"; log.jsonl damaged at {damaged}"
        if lock_holder(os.path.join(run, "train.lock")) is not None:
            state = "running"
        rows.append((name or ".", step, mode, loss, val, state))
    return rows


def print_runs(folder):
    """python train.py --list[=FOLDER]: the runs in FOLDER (default out/), one line each."""
    if not os.path.isdir(folder):
        sys.exit(f"train.py: error: --list={folder}: no such folder")
    rows = list_runs(folder)
    print(f"{len(rows)} run(s) in {folder}" + (":" if rows else " (train.py --out_dir=... makes one)"))
    for name, step, mode, loss, val, state in rows:
        print(f"  {name:30s} step {step if step is not None else '-':>7} | {mode:8s} | loss "
              f"{f'{loss:.4f}' if loss is not None else '-':>7} | val_loss {f'{val:.4f}' if val is not None else '-':>7} | "
              f"{state}")


# ---- one run per out_dir ----------------------------------------------------------------------------------------------

def lock_out_dir(out_dir, say=print):
    """out_dir/train.lock names this process (common.take_lock: pid, host, since) until it exits. A lock whose process
    is gone (same host) is taken over with one line; a live one, or one from another host, raises OutDirLocked. A run
    that ends having written nothing leaves no empty out_dir behind."""
    created = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "train.lock")
    try:
        replaced = take_lock(path, "train.py")
    except LockHeld as e:
        pid, host, since = e.holder["pid"], e.holder["host"], e.holder.get("since", "?")
        if host != socket.gethostname():
            raise OutDirLocked(f"{out_dir} is locked by a run on host {host} (pid {pid}, since {since}). If that "
                               f"run has ended, delete {path}; else choose another --out_dir") from None
        raise OutDirLocked(f"{out_dir} is in use by a running {e.holder.get('by', 'train.py')} (pid {pid}, since "
                           f"{since}); wait for it, stop it, or choose another --out_dir") from None
    if replaced is not None:
        say(f"train.py: taking over {path} from " + (f"pid {replaced['pid']} (since {replaced.get('since', '?')}), "
            "which is no longer running" if replaced else "a file that is not a lock this code wrote"))
    atexit.register(unlock_out_dir, path, created)
    return path


def unlock_out_dir(path, created):
    release_lock(path)
    try:
        if created and not os.listdir(os.path.dirname(path)):
            os.rmdir(os.path.dirname(path))
    except OSError:
        pass


# ---- stops: SIGTERM, SIGINT -------------------------------------------------------------------------------------

class StopSignals:
    """SIGTERM (a cluster's preemption) or SIGINT (Ctrl-C) asks the loop to stop after the current step: it saves a
    checkpoint and exits 143 / 130. A second signal exits at once. Under torchrun the processes agree on the step at
    log-interval steps (an all-reduce of the request, where the log syncs anyway)."""

    def __init__(self):
        self.signum = None
        handle_signals(self._handle, signal.SIGTERM, signal.SIGINT)

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
