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
