"""
options.py: every option of every script, read from its definition (train.py's configurator fields, every other
script's argparse options), against a matrix of values; the kinds themselves.
"""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import bench
import bench_routing
import common
import configurator
import convert
import eval as evaluate
import export
import prepare_data
import sample
from options import Count, Device, Path, Real, Seed, rule_of
from support import HERE, launch_env

# every script's options, as its own parser defines them: a new option is in this list by being defined
PARSERS = {"prepare_data.py": prepare_data.parser, "sample.py": sample.parser, "eval.py": evaluate.parser,
           "export.py": export.parser, "convert.py": convert.parser, "bench.py": bench.parser,
           "bench.py routing": bench_routing.parser, "bench.py generate": bench.generate_parser,
           "bench.py ddp": bench.ddp_parser}
OPTIONS = [(script, a.option_strings[0]) for script, make in PARSERS.items() for a in make()._actions
           if a.option_strings and a.option_strings[0] != "-h"] + \
    [("train.py", "--" + key) for key in configurator.RULES]
# the values every option meets; the paths are made per test (an existing file and folder, names with spaces and
# characters outside ASCII, a file that does not exist yet)
VALUES = ["nan", "inf", "-inf", "-1", "0", "1e30", str(2**64), "", "x", "FILE", "DIR", "SPACED_DIR", "NEW_FILE"]


@pytest.fixture
def places(tmp_path):
    """tmp_path/work: the working directory, with an existing file and folders; their names for VALUES."""
    work = tmp_path / "work"
    (work / "a folder").mkdir(parents=True)
    (work / "dir with spaces é ü").mkdir()
    (work / "notes.txt").write_text("a few words\n")
    return work, {"FILE": str(work / "notes.txt"), "DIR": str(work / "a folder"),
                  "SPACED_DIR": str(work / "dir with spaces é ü"), "NEW_FILE": str(work / "dir with spaces é ü" / "ñew.json")}


def tree(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, dirs, files in os.walk(root) for f in dirs + files)


def base_argv(script, places):
    """The options a script needs to parse at all (its required ones and paths that must exist), valid."""
    folder = places["DIR"]
    return {"sample.py": [f"--out_dir={folder}"], "eval.py": [f"--out_dir={folder}"],
            "export.py": [f"--out_dir={folder}", f"--hf_dir={folder}/export"],
            "convert.py": [f"--hf_dir={folder}", f"--out_dir={folder}/converted"]}.get(script, [])


def parse(script, argv):
    """(accepted?, what the script printed or raised): its own parser, in this process."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            if script == "train.py":
                configurator.parse_args(argv)
            else:
                PARSERS[script]().parse_args(argv)
        return True, ""
    except SystemExit as e:
        return False, err.getvalue() if e.code == 2 else str(e.code)
    except ValueError as e:   # configurator.parse_args raises; train.py turns it into "train.py: error: ..."
        return False, str(e)


def definition(script, option):
    """(the option's rule, whether it is a flag that takes no value)."""
    if script == "train.py":
        return configurator.RULES[option[2:]], False
    action = next(a for a in PARSERS[script]()._actions if option in a.option_strings)
    return rule_of(action), action.nargs == 0


@pytest.mark.parametrize("script,option", OPTIONS, ids=[f"{s} {o}" for s, o in OPTIONS])
def test_every_option_refuses_what_its_rule_refuses(script, option, places, monkeypatch):
    """Each option of each script, read from the definitions, against the matrix of VALUES (nan, inf, -inf, -1, 0,
    1e30, 2^64, '', 'x', an existing file and folder, a folder and a new file under names with spaces and characters
    outside ASCII): the option has a rule; a value its rule refuses ends in one line naming the option, the value and
    the rule, nothing created; a value it takes is taken by the script's own parsing (or refused in one line by a
    rule between options, e.g. a model's heads against its width). Flags refuse any value given to them."""
    work, paths = places
    monkeypatch.chdir(work)
    kind, flag = definition(script, option)
    assert kind is not None, f"{script} {option} has no rule: give it a kind (options.py) where it is defined"
    before = tree(work)
    for value in VALUES:
        value = paths.get(value, value)
        argv = [a for a in base_argv(script, paths) if not a.startswith(option + "=")] + [f"{option}={value}"]
        taken, said = parse(script, argv)
        line = said.strip()
        assert taken or ("\n" not in line and "Traceback" not in line and option[2:] in line), (option, value, said)
        if flag:   # a switch: --force, never --force=VALUE
            assert not taken and "ignored explicit argument" in line, (option, value, said)
            continue
        if script == "train.py":   # (its values are Python literals: the rules see 1e30 as a float, '' as text)
            assert taken or "must" in line, (option, value, said)
            continue
        try:
            kind.convert(value)
            allowed = True
        except ValueError:
            allowed = False
        assert taken or allowed or "must" in line, (option, value, said)
        assert allowed or not taken, (option, value, "taken, but its rule refuses it")
    assert tree(work) == before, f"{script} {option}: parsing created files"


def test_train_options_refuse_by_their_rules():
    """train.py's options as config files and --key=value give them: each rule's refusal is one line naming the key and
    the rule; numbers written as floats (1e3) are whole numbers; text options take digits as text."""
    for argv, said in ((["--seed=-1"], "seed=-1 must be a whole number in [0, 2^64 - 1]"),
                       ([f"--seed={2**64}"], "must be a whole number in [0, 2^64 - 1]"),
                       (["--n_layer=99999999999999999999"], "n_layer=99999999999999999999 must be a whole number in [1, 1,024]"),
                       (["--adam_eps=0"], "adam_eps=0 must be a finite number in (0, 1]"),
                       (["--warmup_steps=99999999999999999999"], "must be a whole number in [0, 1,000,000,000]"),
                       (["--out_dir="], "out_dir='' must be a folder to write"),
                       (["--max_steps=inf"], "max_steps=inf must be a whole number"),
                       (["--hc_streams=1e30"], "hc_streams=1e+30 must be a whole number in [1, 64]")):
        with pytest.raises(ValueError) as e:
            configurator.parse_args(argv)
        assert said in str(e.value) and "\n" not in str(e.value), (argv, str(e.value))
    cfg = configurator.parse_args(["--max_steps=1e3", "--wandb_run_name=2024", f"--seed={2**64 - 1}"])
    assert cfg.max_steps == 1000 and isinstance(cfg.max_steps, int) and cfg.wandb_run_name == "2024"


def test_kinds():
    """The kinds: whole numbers (1e9 and 100_000_000 too), finite ranges, seeds in torch's and numpy's common range,
    paths by kind, resolved against the working directory, an output's folder writable."""
    assert Count(1, 10**10).convert("1e9") == 10**9 and Count(1, 10**10).convert("100_000_000") == 10**8
    for text in ("1.5", "nan", "inf", "0", "11", "x", ""):
        with pytest.raises(ValueError):
            Count(1, 10).convert(text)
    assert Real(0, 1, lo_open=True).convert("1") == 1.0
    for text in ("0", "nan", "-inf", "1.0000001"):
        with pytest.raises(ValueError):
            Real(0, 1, lo_open=True).convert(text)
    seed = Seed().convert(str(2**64 - 1))
    torch.manual_seed(seed)   # both libraries take the top of the range
    import numpy as np
    np.random.default_rng([seed, 3])
    with pytest.raises(ValueError, match="does not exist"):
        Path("file").convert("no/such/file")
    assert Path("out_file", writes="eval results").convert("a/new/file.json") == os.path.abspath("a/new/file.json")
    with pytest.raises(ValueError, match="is a folder"):
        Path("out_file", writes="eval results").convert(HERE)
    if os.geteuid() != 0:   # (root writes anywhere)
        with pytest.raises(ValueError, match="cannot be written"):
            Path("out_dir", writes="run").convert("/proc/no")
    with pytest.raises(AssertionError, match="declares what it writes"):   # an output path without its kind
        Path("out_file")
    with pytest.raises(ValueError):
        Device().convert("gpu")


@pytest.mark.parametrize("argv,said", [
    (["train.py", "--seed=-1"], "train.py: error: seed=-1 must be a whole number in [0, 2^64 - 1]"),
    (["sample.py", "--num_samples=99999999999999999999"], "sample.py: error: --num_samples=99999999999999999999 must be"),
    (["convert.py", "--hf_dir=.", "--out_dir=x", "--block_size=99999999999999999999"], "convert.py: error: --block_size="),
    (["bench.py", "generate", "--prompt=99999999999999999999"], "bench.py generate: error: --prompt=999"),
    (["prepare_data.py", "--max_val_tokens=inf"], "prepare_data.py: error: --max_val_tokens=inf must be a whole number"),
    (["eval.py", "--output=."], "eval.py: error: --output=. is a folder"),
])
def test_a_refusal_is_one_line_from_the_command_line(argv, said, tmp_path):
    """As a user runs the scripts: a refused value exits non-zero with one line on stderr, no traceback, and nothing
    written."""
    r = subprocess.run([sys.executable, os.path.join(HERE, argv[0]), *argv[1:]], capture_output=True, text=True,
                       cwd=tmp_path, env=launch_env(), timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith(said) and "Traceback" not in r.stderr, r.stderr
    assert os.listdir(tmp_path) == []


# ---- the write guard: every path an option writes, against every kind of thing that may already be there ----------

def writes_of(script, option):
    """The artifact kinds an option writes (its Path rule's writes=), or None for an option that writes no path."""
    rule = definition(script, option)[0]
    for r in (rule, getattr(rule, "rule", None), *getattr(rule, "rules", ())):
        if isinstance(r, Path) and r.writes:
            return (r.writes,) if isinstance(r.writes, str) else r.writes
    return None


WRITERS = [(s, o) for s, o in OPTIONS if writes_of(s, o)]


def victims(root):
    """One of each kind of thing a write may meet, made in root: {name: (path, its kind by common.ARTIFACTS)}."""
    root.mkdir()
    def folder(name, files):
        os.makedirs(root / name)
        for f, data in files.items():
            (root / name / f).write_bytes(data if isinstance(data, bytes) else data.encode())
        return root / name
    torch.save({"model": {"w": torch.ones(2)}, "model_config": {}, "step": 4, "train_config": {"max_steps": 8}},
               root / "weights.pt")   # (named otherwise: a folder holding ckpt.pt or log.jsonl is a run's)
    run = folder("run", {"log.jsonl": '{"step": 0, "loss": 9.1}\n'})
    shutil.copyfile(root / "weights.pt", run / "ckpt.pt")
    converted = folder("converted", {})
    torch.save({"model": {}, "model_config": {}, "step": 0, "converted_from": {"hf_dir": "x"}}, converted / "ckpt.pt")
    data = folder("data", {"meta.json": json.dumps({"tokenizer_id": "gpt2", "train_tokens": 10}), "train.bin": b"\0" * 20})
    export_ = folder("export", {"config.json": json.dumps({"exported_from": {"step": 4}}), "model.safetensors": b"w"})
    folder("notes", {"NOTES.txt": "mine\n"})
    (root / "notes.txt").write_text("mine\n")
    (root / "steps.jsonl").write_text('{"step": 0, "loss": 9.1}\n{"step": 10, "loss": 7.2}\n')
    (root / "eval.json").write_text(json.dumps({"written_by": "eval.py", "weights": "raw", "tokenizer": "gpt2"}))
    (root / "bench.json").write_text(json.dumps({"written_by": "bench.py", "rows": []}))
    (root / "routing_bench.json").write_text(json.dumps({"written_by": "bench_routing.py", "rows": []}))
    return {"a checkpoint": (root / "weights.pt", "checkpoint"), "a log": (root / "steps.jsonl", "log"),
            "a run folder": (run, "run"), "a run's checkpoint": (run / "ckpt.pt", "checkpoint"),
            "a converted folder": (converted, "converted"), "a data folder": (data, "data"),
            "a data folder's meta.json": (data / "meta.json", "data file"), "an export folder": (export_, "export"),
            "an export's weights": (export_ / "model.safetensors", "export file"),
            "a user's file": (root / "notes.txt", "file"), "a folder holding a user's file": (root / "notes", "folder"),
            "eval.py results": (root / "eval.json", "eval results"), "a bench record": (root / "bench.json", "bench record"),
            "a routing bench record": (root / "routing_bench.json", "routing bench record")}


def fingerprint(path):
    """Every file under path (or path itself) with its bytes: what must not change."""
    if os.path.isfile(path):
        return open(path, "rb").read()
    return {f: open(os.path.join(path, f), "rb").read() for f in tree(path) if os.path.isfile(os.path.join(path, f))}


@pytest.mark.parametrize("script,option", WRITERS, ids=[f"{s} {o}" for s, o in WRITERS])
def test_every_write_option_replaces_nothing_but_its_own_kind(script, option, places, monkeypatch):
    """Each option that writes a path (found from the definitions: a Path rule with writes=, so a new one is covered by
    declaring it), against each kind of thing already there (a checkpoint, a log, a run folder, a converted folder, a
    data folder and its meta.json, an export folder and its weights, a user's file and a folder holding one, another
    script's results): every kind but the option's own is refused in one line naming the option and what is there,
    and its bytes stay as they were; the option's own kind is taken (the script then replaces it as it says)."""
    work, paths = places
    monkeypatch.chdir(work)
    writes = writes_of(script, option)
    for name, (path, kind) in victims(work / "victims").items():
        assert common.artifact(str(path)) == kind, (name, common.artifact(str(path)))   # the recogniser's premise
        before = fingerprint(path)
        argv = [a for a in base_argv(script, paths) if not a.startswith(option + "=")] + [f"{option}={path}"]
        taken, said = parse(script, argv)
        line = said.strip()
        if kind in writes:
            assert taken or "must be new" not in line, (option, name, said)   # its own kind passes the guard
        elif taken:   # (a folder where a file goes, or the other way: refused by the rule's other half, also one line)
            raise AssertionError(f"{script} {option}={name} was taken: it would replace {common.describe(kind)}")
        else:
            assert "\n" not in line and option[2:] in line and ("must be new" in line or "is a f" in line), (name, said)
        assert fingerprint(path) == before, (script, option, name, "changed")
