"""
options.py: every option of every script, read from its definition (train.py's configurator fields, every other
script's argparse options), against a matrix of values; the kinds themselves.
"""

import contextlib
import io
import os
import subprocess
import sys

import pytest
import torch

import bench
import bench_routing
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
    assert Path("out_file").convert("a/new/file.json") == os.path.abspath("a/new/file.json")
    with pytest.raises(ValueError, match="is a folder"):
        Path("out_file").convert(HERE)
    if os.geteuid() != 0:   # (root writes anywhere)
        with pytest.raises(ValueError, match="cannot be written"):
            Path("out_dir").convert("/proc/no")
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
