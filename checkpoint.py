"""
Checkpoints of a train.py run and what they record: ckpt.pt and ckpt.prev.pt (the latest and the one before it; write:
temp file, fsync, read back, rotate), ckpt-stepN.pt (--keep_every: a second name of that save, never rotated), each
read back by content and without running code (load_plain: tensors and plain data only); where a checkpoint came from
(its data's identity, the tree); and a model built from one (load_model: sample.py, eval.py, export.py).

A checkpoint is one torch.save archive: model, optimizer and EMA states, step, every rank's RNG states, and what
train.py adds (configs, data position, tokenizer). save_checkpoint writes it, read_checkpoint / load_latest read it,
restore puts its states back into a run. What a run folder holds beyond it (the resume policy, the runs in a folder,
the lock, the stops) is runs.py's; its log, metrics.py's.

Imports torch and the standard library (numpy inside the RNG functions), and raises instead of exiting: train.py turns
the errors into its one-line messages.
"""
import errno
import filecmp
import json
import mmap
import os
import pickle
import random
import re
import shutil
import subprocess
import time
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from model import GPT, GPTConfig


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (its partial file is removed; the previous checkpoints are untouched)."""


# ---- checkpoints ------------------------------------------------------------------------------------------------------

def previous_checkpoint(path):
    """Where the checkpoint before `path` is kept (out_dir/ckpt.pt -> out_dir/ckpt.prev.pt)."""
    root, ext = os.path.splitext(path)
    return root + ".prev" + ext


def verify_checkpoint(path):
    """Check a torch.save archive by content: every record against the CRC-32 its zip directory holds (torch writes
    them; a damaged byte anywhere changes one), the records spread over threads (zlib releases the GIL). Raises a
    ValueError that calls the file damaged; returns its size in bytes."""
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        records = [(i.filename, i.header_offset, i.compress_size, i.CRC) for i in zf.infolist()]
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            def bad(record):
                name, header, size, crc = record
                start = header + 30 + int.from_bytes(data[header + 26:header + 28], "little") + \
                    int.from_bytes(data[header + 28:header + 30], "little")   # past the local header, name and extra
                view = memoryview(data)[start:start + size]
                try:
                    return None if zlib.crc32(view) == crc else name
                finally:
                    view.release()
            with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
                damaged = [n for n in pool.map(bad, records) if n is not None]
    if damaged:
        raise ValueError(f"checkpoint {path} is damaged: {len(damaged)} of its {len(records)} records fail their CRC "
                         f"check (e.g. {damaged[0]}); its bytes changed after it was written")
    return os.path.getsize(path)


def load_plain(path):
    """torch.load that runs no code: weights_only=True, so the pickle may build tensors and plain data (dicts, lists,
    numbers, strings) and nothing else; a file naming any other function or class (a stranger's ckpt.pt whose pickle
    would call one) is refused before anything in it runs. Memory-mapped: tensors are read when used. Checkpoints of
    this repository written before the numpy RNG state was stored as plain data hold it as a numpy array: numpy's array
    constructor and dtypes are allowed too (they build arrays, nothing else)."""
    import numpy as np
    core = getattr(np, "_core", None) or np.core
    rebuild = core.multiarray._reconstruct
    arrays = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), (rebuild, "numpy.core.multiarray._reconstruct"),
              (rebuild, "numpy._core.multiarray._reconstruct")]
    with torch.serialization.safe_globals(arrays):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def fingerprint(path):
    """What names a checkpoint's exact bytes without reading them: the SHA-256 of its zip directory (each record's
    name, size and CRC-32; verify_checkpoint checks the records against these). Results carry it, so that a model card
    quotes only the results of the weights it ships."""
    import hashlib
    if os.path.isdir(path):   # a sharded checkpoint: its crc.json names every file's CRC-32 the same way
        with open(os.path.join(path, "crc.json"), "rb") as f:
            return "sha256:" + hashlib.sha256(f.read()).hexdigest()
    with zipfile.ZipFile(path) as zf:
        entries = sorted(f"{i.filename}:{i.file_size}:{i.CRC:08x}" for i in zf.infolist())
    return "sha256:" + hashlib.sha256("\n".join(entries).encode()).hexdigest()


def read_checkpoint(path, verify=True):
    """torch.load of a checkpoint (memory-mapped: tensors are read when used), first checked by content
    (verify_checkpoint; verify=False: a look at its keys only), or a ValueError naming the file, what is wrong with it
    and what to do (torch's own message for a truncated or foreign file points elsewhere)."""
    if path.endswith(".safetensors"):
        raise ValueError(f"{path} is a safetensors file (weights alone, e.g. of a Hugging Face model), not a checkpoint "
                         "of this repository: convert its folder with convert.py --hf_dir=<that folder>")
    try:
        if verify and zipfile.is_zipfile(path):
            verify_checkpoint(path)
        ckpt = load_plain(path)
        if not (isinstance(ckpt, dict) and "model" in ckpt and "model_config" in ckpt):
            raise ValueError(f"checkpoint {path} is not a checkpoint of this repository (a torch file without its "
                             "model weights and config)")
        return ckpt
    except ValueError as e:
        if str(e).startswith(f"checkpoint {path} is damaged"):
            raise ValueError(f"{e}{_before_it(path)}") from None
        raise
    except pickle.UnpicklingError as e:   # weights_only's refusal: the pickle names a global outside plain data
        named = re.search(r"GLOBAL ([\w.]+)", str(e))
        raise ValueError(f"checkpoint {path} asks to run {named[1] if named else 'code'} when loaded, which this "
                         "repository never does (its checkpoints hold tensors and plain data only): it was not written "
                         "here or was altered; nothing in it was run") from None
    except Exception as e:
        size = os.path.getsize(path) if os.path.isfile(path) else None
        if size == 0:
            what = "is empty"
        elif size and not zipfile.is_zipfile(path):
            what = "is not a torch.save archive (truncated, or not a checkpoint)"
        else:
            what = f"cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        raise ValueError(f"checkpoint {path} {what}{_before_it(path)}") from e


def _before_it(path):
    prev = previous_checkpoint(path)
    return (f"; try the checkpoint before it, {prev}: pass that file, or move {path} aside (--init_from=resume "
            "does so itself)" if os.path.isfile(prev) and os.path.basename(path) == "ckpt.pt" else
            "; rerun the training that wrote it")


def save_checkpoint(path, model, optimizer, ema, step, extra, cfg, rt):
    """Weights, optimizer, EMA, step, every rank's RNG states and `extra` (configs, data position) to `path`, by
    write_checkpoint (temp file, fsync, read back, rotate: a crash at any point leaves one whole checkpoint). Every
    rank takes part (FSDP gathers); a failed write raises CheckpointWriteError. cfg, rt: train.py's config, runtime."""
    import numpy as np   # only for its RNG state
    t0 = time.time()
    name, keys, pos, has_gauss, gauss = np.random.get_state()   # as plain data (load_plain builds no numpy array)
    rng = {"torch": torch.get_rng_state(), "numpy": {"name": name, "keys": keys.tolist(), "pos": pos,
                                                     "has_gauss": has_gauss, "cached_gaussian": gauss},
           "python": random.getstate(),
           "cuda": torch.cuda.get_rng_state(rt.device) if rt.device_type == "cuda" else None}
    rngs = [None] * rt.world
    if rt.ddp:
        dist.all_gather_object(rngs, rng)
    else:
        rngs = [rng]
    if cfg.fsdp:   # every rank writes its own shards (save_sharded)
        path = os.path.join(os.path.dirname(path), SHARDED)
        size = save_sharded(path, model, optimizer, ema, {"step": step, "rng": rngs, **extra}, rt)
        kept = keep_sharded(path, step) if rt.master and cfg.keep_every and step % cfg.keep_every == 0 else None
        rt.say(f"saved {path} (step {step}, {size / 1e9:.2f} GB in {rt.world} ranks' shards) in {time.time() - t0:.1f} s"
               + (f"; kept as {kept}" if kept else ""))
        return
    model_state, optim_state = model.state_dict(), optimizer.state_dict()
    ema_state = None if ema is None else ema.state_dict(rt.master)
    if rt.master:
        write_checkpoint(path, {"model": model_state, "optimizer": optim_state, "ema": ema_state, "step": step,
                                "rng": rngs, **extra}, step)
        kept = keep_copy(path, step) if cfg.keep_every and step % cfg.keep_every == 0 else None
        rt.say(f"saved {path} (step {step}, {os.path.getsize(path) / 1e9:.2f} GB) in {time.time() - t0:.1f} s"
               + (f"; kept as {kept}" if kept else ""))


def keep_copy(path, step):
    """out_dir/ckpt-step{step}.pt, a copy of the checkpoint just written, checked by content before it lands (a file of
    its own: damage to ckpt.pt never reaches it). One already there is left as it is (a resumed run that saves that step
    again never replaces a kept file). Returns its path."""
    kept = os.path.join(os.path.dirname(path), f"ckpt-step{step}.pt")
    if not os.path.exists(kept):
        try:
            shutil.copyfile(path, kept + ".tmp")
            verify_checkpoint(kept + ".tmp")
            os.replace(kept + ".tmp", kept)
        finally:
            if os.path.exists(kept + ".tmp"):
                os.remove(kept + ".tmp")
    return kept


def write_checkpoint(path, payload, step):
    """torch.save(payload) to `path`, so that a crash at any point leaves one whole checkpoint: written to a temp file,
    flushed to disk and read back (memory-mapped: the archive's index and records, not every byte) before the
    rotation, in which the checkpoint it replaces becomes ckpt.prev.pt. A failed write removes the temp file and
    raises CheckpointWriteError with the one line for the user (write_failure)."""
    tmp = path + ".tmp"
    try:
        torch.save(payload, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        verify_checkpoint(tmp)   # read back whole, by content: what makes a checkpoint "intact" in every message
    except Exception as e:
        message = write_failure(path, tmp, step, e)   # (it looks at the partial file: before its removal)
        if os.path.exists(tmp):
            os.remove(tmp)
        raise CheckpointWriteError(message) from e
    if os.path.exists(path):
        os.replace(path, previous_checkpoint(path))
    os.replace(tmp, path)


def write_failure(path, tmp, step, error):
    """The one line for a checkpoint that could not be written: what stopped the write (write_cause), and which
    checkpoints are intact."""
    cause, advice = write_cause(error, os.path.dirname(os.path.abspath(path)), tmp)
    kept = []
    for p in (path, previous_checkpoint(path)):
        try:
            kept.append(f"{p} (step {read_checkpoint(p)['step']})")
        except (ValueError, FileNotFoundError):   # absent, or itself unreadable: not intact
            pass
    return (f"saving the step-{step} checkpoint failed: {cause}, writing {tmp}; the partial file is removed. "
            + (f"Intact: {', '.join(kept)}. " if kept else "No earlier checkpoint exists. ")
            + f"{advice}, then continue with --init_from=resume")


def write_cause(error, folder, tmp):
    """(what stopped a write, what to do): the errno's own cause where the error chain carries one (torch's zip
    writer often carries none), else what the disk, the process's file-size limit and the folder show."""
    import resource
    code, e = None, error
    while e is not None and code is None:
        code = e.errno if isinstance(e, OSError) and e.errno else None
        e = e.__cause__ or e.__context__
    free = shutil.disk_usage(folder).free
    size_limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    written = os.path.getsize(tmp) if os.path.isfile(tmp) else 0
    if code in (errno.ENOSPC, errno.EDQUOT) or (code is None and free < 2**20):
        what = "the disk quota is used up" if code == errno.EDQUOT else "no space left on the device"
        return f"{what} of {folder} ({free / 1e9:.2f} GB free)", "Free some space"
    if code == errno.EFBIG or (code is None and size_limit != resource.RLIM_INFINITY and written >= size_limit - 2**20):
        limit = "" if size_limit == resource.RLIM_INFINITY else f" ({size_limit:,} bytes)"
        return f"the file outgrew this process's file-size limit{limit}, `ulimit -f`", "Raise it (ulimit -f unlimited)"
    if code == errno.EROFS:
        return f"{folder} is on a read-only file system", "Choose another --out_dir"
    if code in (errno.EACCES, errno.EPERM) or (code is None and not os.access(folder, os.W_OK)):
        return f"no permission to write in {folder}", "Make it writable or choose another --out_dir"
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", "Fix the cause"


def load_latest(ckpt_path, master, say=print):
    """The checkpoint to resume: ckpt_path, or, when it is missing or unreadable, the one before it (one line says
    so; the unreadable file is moved aside, never deleted). A ValueError naming both files when neither can be read."""
    prev, errors = previous_checkpoint(ckpt_path), []
    for path in (ckpt_path, prev):
        if not os.path.exists(path):
            errors.append(f"{path} does not exist")
            continue
        try:
            ckpt = read_sharded(path) if path.endswith(".dcp") else read_checkpoint(path)
        except ValueError as e:
            errors.append(str(e).split(";")[0])
            continue
        if path == prev and master:
            aside = None
            if os.path.exists(ckpt_path):
                aside = f"{ckpt_path}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}"
                os.replace(ckpt_path, aside)
            say(f"train.py: {errors[0]}; resuming from the checkpoint before it, {prev} (step {ckpt['step']}, "
                f"checked)" + (f"; the file that failed is now {aside}" if aside else ""))
        return ckpt
    raise ValueError("--init_from=resume but no checkpoint can be read: " + "; ".join(errors)
                     + ". Start again with --init_from=scratch in a new --out_dir")


def restore(ckpt, model, optimizer, ema, cfg, rt):
    """Optimizer, EMA and RNG states of a resumed checkpoint into a run (the weights are loaded with the model); its
    step. cfg.fsdp: every rank takes part, rank 0's full optimizer state broadcast to the shards."""
    if ckpt.get("sharded"):   # weights, optimizer and EMA, each rank its shards (resharded at another world size)
        if ema is not None and not ckpt.get("ema_keys"):
            raise ValueError("--ema_decay is set but the checkpoint has no EMA weights")
        load_sharded(ckpt["sharded"], model, optimizer, ema)
    elif cfg.fsdp:   # a full checkpoint (written before FSDP runs saved shards): rank 0's, broadcast
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(model, optimizer, ckpt["optimizer"] if rt.master else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    else:
        optimizer.load_state_dict(ckpt["optimizer"])
    if ema is not None and not ckpt.get("sharded"):
        if ckpt.get("ema") is None:
            raise ValueError("--ema_decay is set but the checkpoint has no EMA weights")
        ema.load(ckpt["ema"], rt.device)
    import numpy as np   # only for its RNG state
    rng = ckpt["rng"][rt.rank] if rt.rank < len(ckpt["rng"]) else ckpt["rng"][0]
    torch.set_rng_state(rng["torch"])
    state = rng["numpy"]   # plain data; a tuple holding an array in checkpoints written before
    np.random.set_state((state["name"], np.array(state["keys"], dtype=np.uint32), state["pos"], state["has_gauss"],
                         state["cached_gaussian"]) if isinstance(state, dict) else state)
    random.setstate(rng["python"])
    if rt.device_type == "cuda" and rng.get("cuda") is not None:
        torch.cuda.set_rng_state(rng["cuda"])
    return ckpt["step"]


# ---- sharded checkpoints (FSDP) ---------------------------------------------------------------------------------------
# An FSDP run's checkpoint is a folder, out_dir/ckpt.dcp: torch.distributed.checkpoint, each rank writing its own shards
# of the model, optimizer and EMA states at once (the format torchtitan resumes from; a resume at another world size
# reshards on load), rank 0 the plain rest in meta.pt (what a ckpt.pt holds beside its tensors) and, last, crc.json:
# every file's CRC-32, read back by the rank that wrote it. The folder is checked by content as a ckpt.pt is, rotated
# to ckpt.prev.dcp as ckpt.pt is, and read whole (sample.py, eval.py, export.py) without a process group.
SHARDED = "ckpt.dcp"


def sharded_state(model, optimizer, ema):
    """The states a sharded checkpoint holds, as the live (sharded) tensors that a save reads and a load fills."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    if ema is not None:
        state["ema"] = {name: e for (name, _), e in zip(ema.named, ema.shadow)}
    return state


def _crc(path):
    crc = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            crc = zlib.crc32(chunk, crc)
    return crc


def save_sharded(path, model, optimizer, ema, payload, rt):
    """Every rank: its shards into path.tmp, read back (CRC-32); then rank 0 writes meta.pt (payload: step, RNG states,
    configs) and crc.json, and rotates the folder into place (the one it replaces becomes ckpt.prev.dcp). Every rank
    raises CheckpointWriteError when any failed (the partial folder removed); -> the folder's bytes."""
    import torch.distributed.checkpoint as dcp
    tmp, crcs, error = path + ".tmp", {}, None
    if rt.master:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    try:
        dcp.save(sharded_state(model, optimizer, ema), checkpoint_id=tmp)
        crcs = {f: _crc(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.startswith(f"__{rt.rank}_")}
    except Exception as e:   # (a full disk on any rank: every rank learns of it below)
        error = e
    gathered = [None] * rt.world
    dist.all_gather_object(gathered, (crcs, None if error is None else write_cause(error, os.path.dirname(tmp), tmp)[0]))
    failed = next((why for _, why in gathered if why), None)
    if rt.master and failed is None:
        try:
            torch.save({**payload, "ema_keys": [] if ema is None else [n for n, _ in ema.named]},
                       os.path.join(tmp, "meta.pt"))
            files = {name: crc for c, _ in gathered for name, crc in c.items()}
            files.update({f: _crc(os.path.join(tmp, f)) for f in (".metadata", "meta.pt")})
            with open(os.path.join(tmp, "crc.json"), "w") as f:
                json.dump(files, f, indent=1)
            prev = previous_checkpoint(path)
            shutil.rmtree(prev, ignore_errors=True)
            if os.path.exists(path):
                os.replace(path, prev)
            os.replace(tmp, path)
        except Exception as e:
            failed = write_cause(e, os.path.dirname(tmp), tmp)[0]
    verdict = [failed]
    dist.broadcast_object_list(verdict, 0)
    if verdict[0] is not None:
        if rt.master:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"saving the step-{payload['step']} checkpoint failed: {verdict[0]}, writing {tmp}; the "
                                   f"partial folder is removed ({path} is as it was). Fix the cause, then continue with "
                                   "--init_from=resume")
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) if rt.master else 0


def keep_sharded(path, step):
    """out_dir/ckpt-step{step}.dcp: the folder just written, linked (its files never change after the write; a copy
    where links are not possible). One already there is left as it is."""
    kept = os.path.join(os.path.dirname(path), f"ckpt-step{step}.dcp")
    if not os.path.exists(kept):
        def link(src, dst):
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
        shutil.copytree(path, kept + ".tmp", copy_function=link)
        os.replace(kept + ".tmp", kept)
    return kept


def verify_sharded(path):
    """A sharded checkpoint against its crc.json, the files spread over the ranks of a running job (each reads its
    share; all learn of any damage), or all read here without one. A ValueError that calls it damaged."""
    try:
        with open(os.path.join(path, "crc.json")) as f:
            files = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint {path} is incomplete (no readable crc.json: {type(e).__name__}); a save that did "
                         "not finish, or not a checkpoint of this repository") from None
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    mine = sorted(files)[rank::world]
    bad = [f for f in mine if not os.path.isfile(os.path.join(path, f)) or _crc(os.path.join(path, f)) != files[f]]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, bad)
        bad = [f for b in everyone for f in b]
    if bad:
        raise ValueError(f"checkpoint {path} is damaged: {len(bad)} of its {len(files)} files fail their CRC check "
                         f"(e.g. {bad[0]}); its bytes changed after it was written")


def read_sharded(path, whole=False):
    """A sharded checkpoint, checked by content: its meta.pt (step, configs, RNG states) and "sharded": path, for a
    resume to load its shards in place (load_sharded); with whole=True also its full model and EMA weights, read
    here without a process group (eval, sample, export)."""
    verify_sharded(path)
    try:
        ckpt = load_plain(os.path.join(path, "meta.pt"))
    except pickle.UnpicklingError:
        raise ValueError(f"checkpoint {path}/meta.pt asks to run code when loaded, which this repository never does; "
                         "nothing in it was run") from None
    ckpt["sharded"] = path
    if whole:
        import torch.distributed.checkpoint as dcp
        with torch.device("meta"):
            shapes = GPT(GPTConfig.from_dict(ckpt["model_config"])).state_dict()
        state = {"model": {k: torch.empty_like(v, device="cpu") for k, v in shapes.items()}}
        if ckpt.get("ema_keys"):
            state["ema"] = {k: torch.empty_like(state["model"][k], dtype=torch.float32) for k in ckpt["ema_keys"]}
        import warnings
        with warnings.catch_warnings():   # ("no process group: loading in a single process", as meant)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=path, no_dist=not (dist.is_available() and dist.is_initialized()))
        ckpt.update(model=state["model"], ema=state.get("ema"))
    return ckpt


def load_sharded(path, model, optimizer, ema):
    """A sharded checkpoint's states into a sharded run, in place, each rank its own (resharded where the world size
    is not the saving run's); the optimizer's moments are made first (a zero step) so there is somewhere to load them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    state = sharded_state(model, optimizer, ema)
    dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())   # (a run of one process without FSDP)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


# ---- what a checkpoint says it came from: the data and the tree ----------------------------------------------------

def keep_tokenizer(out_dir, tokenizer, master):
    """The tokenizer a checkpoint records: a tiktoken name as it is; a tokenizer.json copied into out_dir (rank 0) and
    recorded by that name, read from the checkpoint's folder: the run keeps its own, so that moving the data folder or
    the converted model it came from breaks no sample.py, eval.py or export.py."""
    if not tokenizer.endswith(".json") or not os.path.isfile(tokenizer):
        return tokenizer
    kept = os.path.join(out_dir, "tokenizer.json")
    if master and not (os.path.isfile(kept) and filecmp.cmp(tokenizer, kept, shallow=False)):
        shutil.copyfile(tokenizer, kept + ".tmp")
        os.replace(kept + ".tmp", kept)
    return "tokenizer.json"


def data_identity(meta, files):
    """What a resume checks the data against: meta.json's tokenizer and inputs, and per token file its size and the
    SHA-256 of its sampled blocks (`files`, from prepare_data.check_files). No paths: a folder moved elsewhere holds the
    same data."""
    return {"tokenizer_id": meta.get("tokenizer_id"), "inputs": meta.get("inputs"), "val_inputs": meta.get("val_inputs"),
            "files": files}


def git_revision():
    """The tree's commit (+dirty), or $MHAR_REVISION when set: a copy whose .git is missing or not its own (a GPU
    host's, say) names its tree by the revision set where git runs."""
    if os.environ.get("MHAR_REVISION"):
        return os.environ["MHAR_REVISION"] + " (MHAR_REVISION)"
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---- a model from its checkpoint (sample.py, eval.py, export.py; nanochat's checkpoint_manager.build_model) ---------

def checkpoint_path(path):
    """The checkpoint a path names: a ckpt.pt file or a sharded folder as they are; an out_dir's ckpt.pt, or its
    ckpt.dcp where an FSDP run left only that."""
    if os.path.isdir(path) and not path.rstrip("/").endswith(".dcp"):
        return os.path.join(path, SHARDED if not os.path.exists(os.path.join(path, "ckpt.pt")) and
                            os.path.isdir(os.path.join(path, SHARDED)) else "ckpt.pt")
    return path


def load_model(path_or_out_dir, device="cpu", ckpt=None, ema=False, say=None):
    """The model of a train.py checkpoint (a ckpt.pt file, or the out_dir holding one), checked by content
    (read_checkpoint), in fp32 on `device`; ckpt: that file already read. ema: its EMA weights (train.py --ema_decay)
    instead of the raw ones; say(line), where given, is told when the checkpoint holds EMA weights not asked for.
    model.checkpoint_info: its step, tokenizer, training config, folder (where a tokenizer.json lives) and weights."""
    path = checkpoint_path(path_or_out_dir)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}: pass a ckpt.pt file or the out_dir of a train.py run")
    ckpt = (read_sharded(path, whole=True) if path.rstrip("/").endswith(".dcp") else read_checkpoint(path)) \
        if ckpt is None else ckpt
    state = ckpt["model"]
    if ema:
        if not ckpt.get("ema"):
            raise ValueError(f"{path} holds no EMA weights (its run trained without --ema_decay): drop --ema")
        state = {**state, **ckpt["ema"]}   # the EMA covers the trained parameters; the rest (tied, frozen) as saved
    elif ckpt.get("ema") and say is not None:
        say(f"{path} also holds EMA weights (--ema_decay={(ckpt.get('train_config') or {}).get('ema_decay')}): "
            "these are the raw weights; --ema takes the EMA")
    model = GPT.from_state(GPTConfig.from_dict(ckpt["model_config"]), state).float()
    model.checkpoint_info = {k: ckpt.get(k) for k in ("step", "tokenizer", "train_config")}
    model.checkpoint_info.update(dir=os.path.dirname(os.path.abspath(path.rstrip("/"))), weights="ema" if ema else "raw",
                                 file=os.path.basename(path.rstrip("/")), fingerprint=fingerprint(path))
    return model.to(device)
