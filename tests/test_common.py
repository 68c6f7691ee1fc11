"""
common.py: the one lock (train.lock, prepare.lock) and the process helpers; the floors the modules stand on.
"""

import ast
import glob
import json
import os
import socket

import common
from support import HERE


def test_lock_holder_reads_another_users_process_as_alive(tmp_path, monkeypatch):
    """A lock's holder (common.lock_holder, train.lock's and prepare.lock's alike): gone (no such process) -> None;
    another user's live process (signalling it is refused) or a process on another host -> the holder: the folder
    stays refused."""
    lock = tmp_path / "prepare.lock"
    lock.write_text(json.dumps({"pid": 4242, "host": socket.gethostname(), "by": "prepare_data.py"}))
    for error, alive in ((ProcessLookupError, False), (PermissionError, True)):
        def kill(pid, sig, error=error):
            raise error
        monkeypatch.setattr(os, "kill", kill)
        assert (common.lock_holder(str(lock)) is not None) == alive and common.pid_alive(4242) == alive
    lock.write_text(json.dumps({"pid": 4242, "host": "another-host"}))
    assert common.lock_holder(str(lock))["pid"] == 4242


def test_the_modules_import_in_floors():
    """The repository's modules import one another without a circle, imports inside functions counted: the routing
    files from the lowest up (routing_config <- routing_call <- routing_kernel <- routing_block), the choice between
    chains above them (model.fused_router); common.py below everything, model.py above no file-handling module."""
    own = {os.path.splitext(f)[0] for f in os.listdir(HERE) if f.endswith(".py")}
    graph = {}
    for name in own:
        deps = set()
        for node in ast.walk(ast.parse(open(os.path.join(HERE, name + ".py")).read())):
            if isinstance(node, ast.Import):
                deps |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                deps.add(node.module.split(".")[0])
        graph[name] = (deps & own) - {name}
    done, path = set(), []

    def visit(name):   # depth first; a module met again on the current path closes a circle
        assert name not in path, " -> ".join(path[path.index(name):] + [name])
        if name not in done:
            path.append(name)
            for dep in sorted(graph[name]):
                visit(dep)
            path.pop()
            done.add(name)
    for name in sorted(graph):
        visit(name)
    assert graph["routing_config"] == set() and graph["routing_call"] == {"routing_config"}
    assert "routing_block" not in graph["routing_kernel"] and "model" not in graph["routing_block"]
    # the floors: the ground floor knows nothing of the project; the model knows no files on disk; the data script is
    # a script (train.py and eval.py read its token files), not everyone's library
    assert graph["common"] == set() and graph["options"] <= {"common"} and graph["tokenizer"] <= {"common", "options"}
    reach, todo = set(), ["model"]
    while todo:
        todo += [d for d in graph[todo.pop()] if d not in reach and not reach.add(d)]
    assert not reach & {"checkpoint", "prepare_data", "documents", "common", "options", "tokenizer", "metrics",
                        "train", "configurator"}, reach
    assert sorted(n for n in graph if "prepare_data" in graph[n]) == ["eval", "train"]


def test_a_main_called_from_code_puts_the_callers_signal_handlers_back(tmp_path, data_dir):
    """train.py, export.py and prepare_data.py install SIGINT / SIGTERM handlers for their run (a checkpoint, the
    staged files removed); a main called from a notebook or one's own code puts the caller's back however it ends (a
    run, a refusal), and from a thread other than the main one it runs without them rather than failing."""
    import signal
    import threading

    import export
    import prepare_data
    import train
    from support import TRAIN_ARGS, refusal
    (tmp_path / "run").mkdir()
    (tmp_path / "taken").mkdir()
    calls = {"train.py": lambda: train.main([f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}", *TRAIN_ARGS,
                                             "--max_steps=2", "--eval_interval=2", "--save=False"]),
             "export.py": lambda: refusal(lambda: export.main([f"--out_dir={tmp_path / 'run'}",
                                                               f"--hf_dir={tmp_path / 'taken'}"])),
             "prepare_data.py": lambda: refusal(lambda: prepare_data.main(["--verify", f"--out_dir={tmp_path}"]))}
    mine = {signal.SIGINT: lambda signum, frame: None, signal.SIGTERM: lambda signum, frame: None}
    before = {s: signal.signal(s, h) for s, h in mine.items()}
    try:
        for name, call in calls.items():
            call()
            assert {s: signal.getsignal(s) for s in mine} == mine, name
        said = {}   # the refusals again, from another thread: the same lines, no "signal only works in main thread"
        for name in ("export.py", "prepare_data.py"):
            t = threading.Thread(target=lambda n=name: said.__setitem__(n, calls[n]()))
            t.start()
            t.join()
        assert "exists: pick another folder" in said.get("export.py", ""), said
        assert "--verify needs" in said.get("prepare_data.py", ""), said
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_every_handler_goes_through_common_and_every_main_puts_them_back():
    """The class behind the test above, read from the sources: a signal handler is installed through
    common.handle_signals (signal.signal itself only in common.py, under a script's `if __name__ == "__main__"`, or
    in prepare_data.py's pool worker, a process of its own), and every script's main is wrapped in
    common.keeps_signals, so a handler any main comes to install is put back as the caller had it."""
    def is_main_guard(node):
        return isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)

    scripts = set()
    for path in sorted(glob.glob(os.path.join(HERE, "*.py"))):
        name = os.path.basename(path)
        tree = ast.parse(open(path).read())
        allowed = set()
        for node in tree.body:
            if is_main_guard(node) or (name == "prepare_data.py" and getattr(node, "name", "") == "_init_worker"):
                allowed |= {id(n) for n in ast.walk(node)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and ast.unparse(n.func) == "signal.signal":
                assert name == "common.py" or id(n) in allowed, \
                    f"{name}:{n.lineno} installs a handler with signal.signal: use common.handle_signals in a main"
        if any(is_main_guard(node) for node in tree.body):
            scripts.add(name)
            main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
            assert "keeps_signals" in [ast.unparse(d) for d in main.decorator_list], \
                f"{name}: its main is not wrapped in common.keeps_signals"
    assert {"train.py", "prepare_data.py", "export.py", "bench.py"} <= scripts, scripts   # (the guard is recognised)
