"""
The ground floor: what every script needs and nothing of this project's own (nanochat's common.py). A script's entry
point (run_script), the signal handlers a main installs for its own run only (handle_signals, keeps_signals), its
--device check, atomic writes, whether a process is alive, and the one lock that keeps a folder to one writer
(train.py's train.lock, prepare_data.py's prepare.lock). The standard library only (torch inside check_device); it
imports no other file of the repo.
"""
import functools
import json
import os
import re
import signal
import socket
import sys
import threading
import time


def run_script(main, name, note=""):
    """A script's entry point: Ctrl-C ends it with one line (what it leaves behind: `note`) and exit status 130, no
    traceback. (Each script exits quietly on a Ctrl-C while torch is still loading: nothing is written by then.)"""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        main()
    except KeyboardInterrupt:
        print(f"{name}: stopped by Ctrl-C{note}", file=sys.stderr)
        sys.exit(130)


def handle_signals(handler, *signums):
    """`handler` for `signums`, on the main thread only: Python takes handlers there alone, and a main called from
    another thread runs without them (its stop is the caller's)."""
    if threading.current_thread() is threading.main_thread():
        for s in signums:
            signal.signal(s, handler)


def keeps_signals(main):
    """Every script's main: the handlers it installs (handle_signals) are for its run; called from other code (a
    notebook, a test, a script of one's own), it leaves SIGINT and SIGTERM as it found them, however it ends."""
    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return main(*args, **kwargs)
        finally:
            for s, h in before.items():   # None: a handler not set from Python, which Python cannot put back
                handle_signals(signal.SIG_DFL if h is None else h, s)
    return wrapped


def check_device(device):
    """The scripts' --device, checked before anything loads: a ValueError naming the value and the fix."""
    import torch
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"--device={device!r} is not one of cpu, cuda, cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device={device} but CUDA is not available; use --device=cpu")
    if ":" in device and int(device.split(":")[1]) >= torch.cuda.device_count():
        raise ValueError(f"--device={device} but this machine has {torch.cuda.device_count()} CUDA device(s): "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")


def write_atomic(path, data):
    """Bytes (or text) to path through a temp file and a rename: a reader sees the old file or the new one; a failed
    write (a full disk) leaves neither a partial file nor its temp file."""
    try:
        with open(path + ".tmp", "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(path + ".tmp", path)
    finally:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")


def pid_alive(pid):
    """Is process pid running on this machine? (Another user's counts: signalling it is refused, not failed.)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_dtensor(t):   # an FSDP2 shard? (torch.distributed.tensor is imported by FSDP runs alone: no module, no DTensor)
    return "torch.distributed.tensor" in sys.modules and isinstance(t, sys.modules["torch.distributed.tensor"].DTensor)


# ---- what a path holds: the artifacts the scripts write, recognised by content --------------------------------------

# Every path a script writes is declared with the kind it writes (options.Path(..., writes=KIND)); an existing path is
# written only when it holds that kind already (or is an empty folder). Everything else, a checkpoint, a log, a data
# folder, another script's output or a user's file, is refused before any work: nothing a user made is replaced.
ARTIFACTS = {
    "checkpoint": "a checkpoint (a torch.save archive)",
    "log": "a run's log (JSON lines of steps and evals)",
    "run": "a train.py run folder (its checkpoints and log)",
    "run file": "a file of a train.py run folder",
    "converted": "a convert.py folder (a converted model's checkpoint)",
    "data": "a prepare_data.py data folder",
    "data file": "a file of a prepare_data.py data folder",
    "export": "an export.py folder",
    "export file": "a file of an export.py folder",
    "eval results": "eval.py results (JSON)",
    "probe": "an eval.py --probe folder",
    "plot": "an eval.py --plot image",
    "bench record": "a bench.py record (JSON)",
    "routing bench record": "a bench_routing.py record (JSON)",
    "bench traces": "a bench.py --profile folder of traces",
    "file": "a file of none of these kinds (someone's own)",
    "folder": "a folder of other things (someone's own files or folders)",
}
WRITTEN_BY = {"eval.py": "eval results", "eval.py --probe": "probe", "bench.py": "bench record",
              "bench_routing.py": "routing bench record", "bench.py --profile": "bench traces"}   # a JSON record's "written_by" -> its kind
PLOT_MARK = "mhar eval.py --plot"   # the PNG text chunk (Software) that marks eval.py's plots


def artifact(path):
    """The kind of what is at path (a key of ARTIFACTS), by its content and, for a file no content test claims, by the
    folder it is in; "empty" for an empty folder, None where nothing is. Reads a few KB at most."""
    if not os.path.lexists(path):
        return None
    if os.path.isdir(path):
        return _folder_kind(path)
    kind = _file_kind(path)
    if kind != "file":
        return kind
    parent = _folder_kind(os.path.dirname(os.path.abspath(path)))
    return {"run": "run file", "converted": "run file", "data": "data file", "export": "export file",
            "probe": "probe", "bench traces": "bench traces", "checkpoint": "checkpoint"}.get(parent, "file")


def _json(path, limit=1 << 20):
    try:
        if os.path.getsize(path) > limit:
            return None
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _file_kind(path):
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return "file"
    if head.startswith(b"PK"):   # a zip: torch.save's archive holds a pickle record named .../data.pkl
        import zipfile
        try:
            with zipfile.ZipFile(path) as z:
                if any(n.endswith("/data.pkl") or n == "data.pkl" for n in z.namelist()):
                    return "checkpoint"
        except (OSError, zipfile.BadZipFile):
            pass
        return "file"
    if head.startswith(b"\x89PNG") and PLOT_MARK.encode() in head:
        return "plot"
    if head.lstrip().startswith(b"{"):
        obj = _json(path)
        if isinstance(obj, dict):
            if obj.get("written_by") in WRITTEN_BY:
                return WRITTEN_BY[obj["written_by"]]
            if obj.get("weights") in ("raw", "ema") and "tokenizer" in obj:   # eval.py's results before written_by
                return "eval results"
            if isinstance(obj.get("rows"), list):   # bench records before written_by
                return "routing bench record" if "copy_gbps" in obj else "bench record"
        first = head.split(b"\n", 1)[0]
        try:
            if isinstance(json.loads(first), dict) and "step" in json.loads(first):
                return "log"
        except ValueError:
            pass
    return "file"


def _folder_kind(path):
    try:
        names = set(os.listdir(path))
    except OSError:
        return "folder"
    if not names:
        return "empty"
    config = _json(os.path.join(path, "config.json")) if "config.json" in names else None
    if isinstance(config, dict) and "exported_from" in config:
        return "export"
    meta = _json(os.path.join(path, "meta.json"), 1 << 24) if "meta.json" in names else None
    if (isinstance(meta, dict) and {"tokenizer_id", "train_tokens"} <= meta.keys()) or names & {"prepare.lock",
                                                                                                  ".incomplete"}:
        return "data"   # (or one being prepared)
    traces = _json(os.path.join(path, "traces.json")) if "traces.json" in names else None
    if isinstance(traces, dict) and traces.get("written_by") == "bench.py --profile":
        return "bench traces"
    probe = _json(os.path.join(path, "probe.json")) if "probe.json" in names else None
    if isinstance(probe, dict) and (probe.get("written_by") == "eval.py --probe" or "routing_maps.png" in names):
        return "probe"
    if "ckpt.pt" in names and _converted(os.path.join(path, "ckpt.pt")):
        return "converted"
    if {"crc.json", ".metadata"} <= names:   # a sharded checkpoint (an FSDP run's ckpt.dcp)
        return "checkpoint"
    if names & {"ckpt.pt", "ckpt.prev.pt", "ckpt.dcp", "log.jsonl", "train.lock"} or any(n.startswith("ckpt-step")
                                                                                         for n in names):
        return "run"
    return "folder"


def _converted(path):
    """Is the checkpoint at path convert.py's? Its pickle record (small: the tensors are records of their own) names
    converted_from, a key only convert.py writes."""
    import zipfile
    try:
        with zipfile.ZipFile(path) as z:
            name = next(n for n in z.namelist() if n.endswith("data.pkl"))
            return b"converted_from" in z.read(name)
    except (OSError, StopIteration, zipfile.BadZipFile):
        return False


def describe(kind):
    return ARTIFACTS.get(kind, "an empty folder" if kind == "empty" else str(kind))


def check_target(path, writes, folder):
    """The write guard: path may be written by a script that writes `writes` (a kind of ARTIFACTS, or a tuple of them)
    when nothing is there, when it holds that kind, or (a folder) when it is empty; a ValueError naming what is there
    otherwise. -> the kind found (None: nothing)."""
    kinds = (writes,) if isinstance(writes, str) else tuple(writes)
    kind = artifact(path)
    if kind is None or kind in kinds or (folder and kind == "empty"):
        return kind
    raise ValueError(f"is {describe(kind)}: it must be new{', an empty folder' if folder else ''} or "
                     f"{' or '.join(map(describe, kinds))}, so that nothing else is replaced; choose another path")


# ---- one writer per folder ------------------------------------------------------------------------------------------

class LockHeld(RuntimeError):
    """A lock held by a live process, or by one on another host (where whether it lives cannot be known)."""

    def __init__(self, path, holder):
        self.path, self.holder = path, holder
        super().__init__(f"{path} is held by {holder.get('by', 'a process')} (pid {holder['pid']} on {holder['host']}, "
                         f"since {holder.get('since', '?')})")


def read_lock(path):
    """The holder a lock file names, {"pid", "host", "since", "by"}; None where there is no lock or it cannot be read
    (not a lock this code wrote)."""
    try:
        with open(path) as f:
            holder = json.load(f)
        return {**holder, "pid": int(holder["pid"]), "host": str(holder["host"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def lock_holder(path):
    """The holder of the lock at path while it holds it (alive on this host, or on another host), else None."""
    holder = read_lock(path)
    if holder is None or (holder["host"] == socket.gethostname() and not pid_alive(holder["pid"])):
        return None
    return holder


def take_lock(path, by):
    """Take the lock at path for this process (`by`: the program, named to whoever finds it held). The lock file is
    written whole and hard-linked into place, so of two processes that start together exactly one gets it. A lock
    whose process is gone (this host) or that cannot be read is taken over; -> the holder it named ({} where it could
    not be read) for the caller's line, or None. A live holder, or one on another host, raises LockHeld."""
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"), "by": by}
    mine, replaced = f"{path}.{os.getpid()}.new", None
    write_atomic(mine, json.dumps(me))
    try:
        for _ in range(3):
            try:
                os.link(mine, path)
                return replaced
            except FileExistsError:
                pass
            holder = read_lock(path)
            if holder is not None and lock_holder(path) is not None:
                raise LockHeld(path, holder)
            # stale or unreadable: move it aside (a rename moves a given file for exactly one process), and put it
            # back if what moved is not what was read (another process's fresh lock, taken in between)
            aside = f"{path}.{os.getpid()}.stale"
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                continue
            moved = read_lock(aside)
            if moved != holder:
                try:
                    os.link(aside, path)
                finally:
                    os.remove(aside)
                if moved is not None:
                    raise LockHeld(path, moved)
                continue
            os.remove(aside)
            replaced = holder or {}
        raise LockHeld(path, read_lock(path) or {"pid": "?", "host": "?"})
    finally:
        os.remove(mine)


def release_lock(path):
    """Remove the lock at path if this process holds it."""
    holder = read_lock(path)
    if holder is not None and holder["pid"] == os.getpid() and holder["host"] == socket.gethostname():
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
