"""
export.py: a checkpoint as a Hugging Face folder (stock transformers, generate(), lm-evaluation-harness).
"""

import functools
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import checkpoint
import convert
import eval as evaluate
import export
import hub
from support import (HERE, HF_CONFIGS, launch_env, refusal, run_train, together, write_hf_checkpoint,
                     write_tiny_tokenizer)


EXPORTS = {"baseline": ["--residual=baseline"], "attnres": ["--residual=attnres"], "mhar": ["--residual=mhar"],
           "hyper": ["--residual=hyper"], "mhar_blocks": ["--residual=mhar", "--route_blocks=2"]}


def hf_offline_env():
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, data_dir, monkeypatch_module):
    """Tiny checkpoints trained 4 steps in each mode (and a delta model converted from a tiny Llama, its routing made
    live), each exported to a Hugging Face folder with export.py's own check: {name: (checkpoint dir, export dir)}."""
    for k, v in hf_offline_env().items():
        monkeypatch_module.setenv(k, v)
    root = tmp_path_factory.mktemp("export")
    runs = together(*[functools.partial(run_train, str(root / name), data_dir, *args, "--max_steps=4",
                                        "--eval_interval=4", "--eval_tokens=512") for name, args in EXPORTS.items()])
    assert all(r.returncode == 0 for r in runs), [r.stdout[-500:] + r.stderr[-2000:] for r in runs]
    hf_dir, delta = str(root / "llama"), str(root / "delta")
    write_hf_checkpoint(hf_dir, HF_CONFIGS["llama"])
    convert.main([f"--hf_dir={hf_dir}", f"--out_dir={delta}", "--dtype=float32", "--num_blocks=2", "--route_heads=2",
                  f"--tokenizer={write_tiny_tokenizer(str(root / 'tokenizer.json'))}"])
    ckpt = torch.load(os.path.join(delta, "ckpt.pt"), weights_only=False)
    gen = torch.Generator().manual_seed(0)
    for name, t in ckpt["model"].items():   # live routing: alpha, queries and null vectors away from their init
        if name.endswith((".alpha", ".q", ".null")):
            t.copy_(torch.randn(t.shape, generator=gen) * (0.5 if name.endswith(".alpha") else 1.0))
    torch.save(ckpt, os.path.join(delta, "ckpt.pt"))
    out = {}
    for name in [*EXPORTS, "delta"]:
        ckpt_dir = delta if name == "delta" else str(root / name)
        export.main([f"--out_dir={ckpt_dir}", f"--hf_dir={root / ('hf_' + name)}"])
        out[name] = (ckpt_dir, str(root / ("hf_" + name)))
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as m:
        yield m


# an exported folder as whoever downloads it loads it: a fresh `python -I` in another folder, transformers alone
LOAD_ELSEWHERE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, remote = sys.argv[1], sys.argv[2] == "1"
hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=remote, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=remote)
prompt = torch.tensor([tok("The castle stood on a hill above the").input_ids])
with torch.no_grad():
    logits = hf(torch.load("idx.pt")).logits
lengths = []
if remote:   # the lengths the model's forward sees: the prompt, then one token a step (the KV cache)
    hf.model.register_forward_pre_hook(lambda m, args, kwargs: lengths.append(args[0].size(1)), with_kwargs=True)
cached = hf.generate(prompt, max_new_tokens=12, do_sample=False)
uncached = hf.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False)
texts = ["The castle stood", "A", "Rain fell on the old stone bridge while"]   # padded on the left, as generation pads
tok.padding_side = "left"
new = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)   # (8 tokens each: no row ends early)
batch = hf.generate(**tok(texts, return_tensors="pt", padding=True), **new)[:, -8:]
alone = [hf.generate(**tok([t], return_tensors="pt"), **new)[0, -8:] for t in texts]
torch.save({"type": type(hf).__name__, "logits": logits, "prompt": prompt, "cached": cached, "uncached": uncached,
            "lengths": lengths[:12], "padded": batch, "alone": torch.stack(alone)}, "out.pt")
"""


@pytest.mark.parametrize("name", [*EXPORTS, "delta"])
def test_export_loads_in_transformers(exported, name, tmp_path):
    """AutoModelForCausalLM loads the folder offline in a `python -I` process whose working directory is elsewhere (no
    module of this repository importable: the baseline as a stock Qwen3 model without remote code; every other mode
    through modeling_mhar.py and the modules copied beside it): its logits are this repository's within 1e-5 (fp32),
    generate() gives the same greedy 12-token continuation as GPT.generate, through model.py's KV cache (one new token
    a forward after the prompt) and without it; a batch of three prompts padded on the left continues each as alone."""
    ckpt_dir, hf_dir = exported[name]
    remote = name != "baseline"
    idx = torch.randint(0, 250, (2, 40), generator=torch.Generator().manual_seed(1))
    torch.save(idx, tmp_path / "idx.pt")
    r = subprocess.run([sys.executable, "-I", "-c", LOAD_ELSEWHERE, hf_dir, str(int(remote))], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600, env=hf_offline_env())
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert got["type"] == ("Qwen3ForCausalLM" if name == "baseline" else "MHARForCausalLM")
    ours = checkpoint.load_model(ckpt_dir).eval()
    with torch.no_grad():
        a = ours(idx)[0]
    assert (a - got["logits"]).abs().max().item() <= 1e-5 * max(1.0, a.abs().max().item())
    want = ours.generate(got["prompt"], 12, temperature=0)
    assert torch.equal(got["cached"], want) and torch.equal(got["uncached"], want), (got, want)
    if remote:
        assert got["lengths"] == [got["prompt"].size(1)] + [1] * 11, got["lengths"]
    assert torch.equal(got["padded"], got["alone"]), (got["padded"], got["alone"])


def test_export_tokenizer_is_the_checkpoints(exported):
    """The exported GPT-2 tokenizer (built from tiktoken's cached files) encodes and decodes as tiktoken's gpt2 does,
    with <|endoftext|> as its end-of-text (and beginning) token; a converted model's tokenizer.json is copied."""
    import tiktoken
    from transformers import AutoTokenizer
    tok, enc = AutoTokenizer.from_pretrained(exported["mhar"][1]), tiktoken.get_encoding("gpt2")
    for text in ("Hello world", "  leading spaces\nand tabs\t, naïve café 1,234.5!", "日本語のテキスト", "a<|endoftext|>b"):
        assert tok(text).input_ids == enc.encode(text, allowed_special="all"), text
        assert tok.decode(enc.encode(text, allowed_special="all")) == text
    assert tok.eos_token == tok.bos_token == "<|endoftext|>" and tok.eos_token_id == 50256
    delta_hf = exported["delta"][1]
    assert open(os.path.join(delta_hf, "tokenizer.json")).read() == \
        open(os.path.join(exported["delta"][0], "tokenizer.json")).read()
    assert AutoTokenizer.from_pretrained(delta_hf).eos_token == "<|end_of_text|>"


def test_export_of_a_baseline_converts_back(exported, tmp_path):
    """A baseline export is a Qwen3 folder, so convert.py reads it back: the weights are the original's bitwise, and
    the converted model (delta routing at alpha = 0) computes the original's logits bitwise."""
    ckpt_dir, hf_dir = exported["baseline"]
    out = str(tmp_path / "back")
    convert.main([f"--hf_dir={hf_dir}", f"--out_dir={out}", "--dtype=float32", "--num_blocks=1"])
    original, back = checkpoint.load_model(ckpt_dir).eval(), checkpoint.load_model(out).eval()
    state = back.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in original.state_dict().items())
    idx = torch.randint(0, 250, (2, 30))
    with torch.no_grad():
        assert torch.equal(original(idx)[0], back(idx)[0])


def test_export_scores_in_lm_eval_as_eval_py(exported, eval_root):
    """`lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True` (the README's line, through the installed
    console script, from another folder) on the local task files gives eval.py --harness's LAMBADA accuracy and
    perplexity and WikiText perplexities on the same checkpoint."""
    pytest.importorskip("lm_eval", reason="pip install lm-eval (requirements.txt)")
    ckpt_dir, hf_dir = exported["mhar"]
    evaluate.main([f"--out_dir={ckpt_dir}", "--harness", f"--data_root={eval_root}", "--tasks=lambada_openai,wikitext",
                   "--limit=3", "--batch_size=4"])
    ours = json.load(open(os.path.join(ckpt_dir, "eval_harness.limit3.json")))
    out = os.path.join(os.path.dirname(hf_dir), "lm_eval_out")
    console = os.path.join(os.path.dirname(sys.executable), "lm_eval")   # the README's command: the console script,
    assert os.path.isfile(console), console                               # run from another folder
    r = subprocess.run([console, "--model", "hf", "--model_args",
                        f"pretrained={hf_dir},trust_remote_code=True,dtype=float32", "--tasks",
                        "lambada_openai_local,wikitext_local", "--include_path", os.path.join(HERE, "harness_tasks"),
                        "--metadata", json.dumps({"data_root": eval_root}), "--limit", "3", "--device", "cpu",
                        "--batch_size", "4", "--output_path", out], capture_output=True, text=True, timeout=600,
                       env=launch_env(), cwd=os.path.dirname(hf_dir))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    theirs = json.load(open(glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True)[0]))["results"]
    lam, wiki = theirs["lambada_openai_local"], theirs["wikitext_local"]
    assert lam["acc,none"] == ours["lambada_openai_local"]["acc"]
    assert lam["perplexity,none"] == pytest.approx(ours["lambada_openai_local"]["perplexity"], rel=1e-5)
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert wiki[f"{metric},none"] == pytest.approx(ours["wikitext_local"][metric], rel=1e-5), metric


def test_export_shards_its_weights(exported, tmp_path, monkeypatch):
    """Weights above the shard size go to several safetensors files with transformers' index (export.py's check then
    loads them back through it: the logits still match)."""
    monkeypatch.setattr(hub, "SHARD_BYTES", 200_000)
    out = tmp_path / "sharded"
    export.main([f"--out_dir={exported['mhar'][0]}", f"--hf_dir={out}"])
    index = json.load(open(out / "model.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((out / f).is_file() for f in files) and not (out / "model.safetensors").exists()


def test_export_refusals(exported, tmp_path):
    """Bad input gets one line naming the value and the fix, and nothing is written: a file that is not a checkpoint, a
    torch file without this repository's weights, a folder without one, an existing export (until --force, which
    replaces it), the checkpoint's own folder, a tokenizer with no Hugging Face file, an unknown mode."""
    ckpt_dir, hf_dir = exported["mhar"]
    junk, foreign = tmp_path / "junk.pt", tmp_path / "foreign.pt"
    junk.write_bytes(os.urandom(4096))
    torch.save({"weights": torch.zeros(3)}, foreign)
    cl100k = tmp_path / "cl100k"
    cl100k.mkdir()
    ckpt = torch.load(os.path.join(ckpt_dir, "ckpt.pt"), weights_only=False)
    torch.save({**ckpt, "tokenizer": "cl100k_base"}, cl100k / "ckpt.pt")
    odd = tmp_path / "odd"
    odd.mkdir()
    torch.save({**ckpt, "model_config": {**ckpt["model_config"], "residual": "mystery"}}, odd / "ckpt.pt")
    target = tmp_path / "new_export"
    for args, msg in (([f"--out_dir={junk}"], r"is not a torch.save archive"),
                      ([f"--out_dir={foreign}"], r"is not a checkpoint of this repository"),
                      ([f"--out_dir={tmp_path}"], r"no checkpoint there"),
                      ([f"--out_dir={ckpt_dir}", f"--hf_dir={hf_dir}"], r"exists: pick another folder, or pass --force"),
                      ([f"--out_dir={ckpt_dir}", f"--hf_dir={ckpt_dir}", "--force"], r"is a train.py run folder"),
                      ([f"--out_dir={cl100k}"], r"tokenizer 'cl100k_base': export writes GPT-2's or a tokenizer.json"),
                      ([f"--out_dir={odd}"], r"residual='mystery' is not one of"),
                      ([f"--out_dir={ckpt_dir}", "--dtype=float16"], r"--dtype=float16 must be one of float32, bfloat16")):
        argv = args if any(a.startswith("--hf_dir") for a in args) else [*args, f"--hf_dir={target}"]
        said = refusal(lambda: export.main(argv))
        assert re.search(msg, said), (args, said)
        assert not target.exists() and not glob.glob(str(tmp_path / ".export-*"))
    shutil.copytree(hf_dir, target)   # an earlier export: --force replaces what export.py wrote there, nothing else
    (target / "NOTES.txt").write_text("a user's notes beside the export")
    (target / "model.safetensors").write_bytes(b"the earlier export's weights")
    config = json.load(open(target / "config.json"))
    config["exported_from"]["files"].append("old.txt")   # a file an earlier export wrote, which this one does not
    (target / "config.json").write_text(json.dumps(config))
    (target / "old.txt").write_text("a file of the previous export")
    export.main([f"--out_dir={ckpt_dir}", f"--hf_dir={target}", "--force", "--dtype=bfloat16", "--check=False"])
    assert json.load(open(target / "config.json"))["dtype"] == "bfloat16" and not (target / "old.txt").exists()
    assert (target / "NOTES.txt").read_text() == "a user's notes beside the export"
    assert (target / "model.safetensors").read_bytes() != b"the earlier export's weights"
    assert oct(os.stat(target).st_mode & 0o777) == "0o755" and not glob.glob(str(tmp_path / ".replaced-*"))
    (target / "tokenizer.json").unlink()   # a file of the user's by a name the export writes: refused, nothing lost
    config = json.load(open(target / "config.json"))
    config["exported_from"]["files"].remove("tokenizer.json")
    (target / "config.json").write_text(json.dumps(config))
    (target / "tokenizer.json").write_text("mine")
    said = refusal(lambda: export.main([f"--out_dir={ckpt_dir}", f"--hf_dir={target}", "--force", "--check=False"]))
    assert "holds tokenizer.json, which export.py did not write there" in said and \
        (target / "tokenizer.json").read_text() == "mine" and not glob.glob(str(tmp_path / ".export-*"))


def test_export_force_never_deletes_what_it_did_not_write(exported, tmp_path):
    """--force replaces an earlier export only: a parent of the checkpoint (with the run and a sibling run in it), or a
    folder export.py did not write, is refused in one line and left as it was."""
    ckpt_dir, _ = exported["baseline"]
    out = tmp_path / "OUT"
    shutil.copytree(ckpt_dir, out / "run1")
    (out / "run2").mkdir()
    (out / "run2" / "ckpt.pt").write_bytes(b"a sibling run")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not an export")
    before = {p: os.path.getsize(p) for p in glob.glob(str(tmp_path / "**"), recursive=True) if os.path.isfile(p)}
    for hf_dir, msg in ((out, "is a folder of other things"), (mine, "is a folder of other things"),
                        (out / "run1", "is a train.py run folder")):
        said = refusal(lambda: export.main([f"--out_dir={out / 'run1'}", f"--hf_dir={hf_dir}", "--force",
                                            "--check=False"]))
        assert msg in said, said
    assert before == {p: os.path.getsize(p) for p in glob.glob(str(tmp_path / "**"), recursive=True) if os.path.isfile(p)}


def test_export_generates_in_lm_eval_batches_as_alone(exported):
    """lm-evaluation-harness's HFLM pads its generation batches on the left: generate_until at batch size 3 gives each
    of three prompts of different lengths the text it gets at batch size 1 (the attention mask honoured)."""
    pytest.importorskip("lm_eval", reason="pip install lm-eval (requirements.txt)")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    _, hf_dir = exported["mhar"]
    prompts = ["The castle stood on a hill", "A", "Rain fell on the old stone bridge while the town slept and"]
    requests = [Instance("generate_until", {}, (p, {"until": ["\n\n\n"], "max_gen_toks": 6, "do_sample": False}), i)
                for i, p in enumerate(prompts)]
    texts = {}
    for batch in (1, 3):
        lm = HFLM(pretrained=hf_dir, trust_remote_code=True, batch_size=batch, device="cpu", dtype="float32")
        texts[batch] = lm.generate_until(requests, disable_tqdm=True)
    assert texts[3] == texts[1] and len(texts[1]) == 3, texts


def test_export_folder_is_ready_to_share(exported):
    """Every export: a model card (README.md: YAML metadata the Hub reads, the run's last validation loss, how to load
    it, with trust_remote_code=True for the tokenizer too where the model needs it), no absolute path in its configs,
    the folder readable by others (0755, as save_pretrained makes it)."""
    from huggingface_hub import ModelCard
    for name, (ckpt_dir, hf_dir) in exported.items():
        card = ModelCard.load(os.path.join(hf_dir, "README.md"))   # as the Hub reads it
        meta, body = card.data.to_dict(), card.text
        assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation", meta
        assert meta["license"] == "other" and "mhar" in meta["tags"] and ("custom_code" in meta["tags"]) == (name != "baseline")
        remote = name != "baseline"
        assert ("AutoTokenizer.from_pretrained(PATH, trust_remote_code=False)" in body) == remote, body
        assert open(os.path.join(hf_dir, "LICENSE")).read() == open(os.path.join(HERE, "LICENSE")).read()
        if name != "delta":   # its run's validation loss, in the card's model-index too
            assert [r.metric_type for r in card.data.eval_results] == ["loss"], card.data.eval_results
        if name != "delta":   # (a converted model has no run of its own)
            assert "validation loss" in body and "at step 4" in body, body
        for f in ("config.json", "generation_config.json", "tokenizer_config.json"):   # (tokenizer.json: a vocabulary)
            text = open(os.path.join(hf_dir, f)).read()
            assert not re.search(r'"/[^"]', text) and os.path.abspath(ckpt_dir) not in text, (f, text[:300])
        assert oct(os.stat(hf_dir).st_mode & 0o777) == "0o755"


def test_export_stopped_by_sigterm_leaves_nothing(exported, tmp_path):
    """SIGTERM while the folder is checked (a python -I process, seconds long): exit 143, one line, no staging folder
    left beside --hf_dir, no --hf_dir."""
    import signal
    ckpt_dir, _ = exported["mhar"]
    target = tmp_path / "stopped"
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "export.py"), f"--out_dir={ckpt_dir}", f"--hf_dir={target}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env())
    for line in p.stdout:   # the folder is staged and written; its check starts
        if "checking the folder" in line:
            assert glob.glob(str(tmp_path / ".export-*"))
            p.send_signal(signal.SIGTERM)
            break
    rest, err = p.communicate(timeout=120)
    assert p.returncode == 143, (rest, err)
    assert err.strip().splitlines() == [f"export.py: stopped by SIGTERM; nothing was written ({target} is as it was)"]
    assert not target.exists() and not glob.glob(str(tmp_path / ".export-*")), os.listdir(tmp_path)


def test_ema_weights_where_the_checkpoint_has_them(tmp_path, data_dir):
    """A run trained with --ema_decay holds EMA weights beside the raw ones: export.py --ema writes them (the card and
    config.json say which), sample.py and eval.py take --ema too; without --ema the raw weights, with one line saying
    the EMA is there; --ema on a checkpoint without one is refused in one line."""
    from safetensors.torch import load_file
    out = tmp_path / "ema_run"
    r = run_train(str(out), data_dir, "--max_steps=4", "--eval_interval=4", "--ema_decay=0.5")
    assert r.returncode == 0, r.stderr[-2000:]
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    for ema, key in ((True, "ema"), (False, "model")):
        hf = tmp_path / f"hf_{key}"
        export.main([f"--out_dir={out}", f"--hf_dir={hf}", "--check=False", *(["--ema"] if ema else [])])
        weights = load_file(str(hf / "model.safetensors"))
        assert torch.equal(weights["model.routes.3.q"], ckpt[key]["routes.3.q"].float())
        assert json.load(open(hf / "config.json"))["exported_from"]["weights"] == ("ema" if ema else "raw")
        assert ("weights: ema" if ema else "weights: raw") in (hf / "README.md").read_text()
    assert not torch.equal(ckpt["ema"]["routes.3.q"], ckpt["model"]["routes.3.q"])   # (the two differ: a real test)
    said = subprocess.run([sys.executable, os.path.join(HERE, "sample.py"), f"--out_dir={out}", "--device=cpu",
                           "--max_new_tokens=2"], capture_output=True, text=True, env=launch_env())
    assert said.returncode == 0 and "also holds EMA weights" in said.stderr and "--ema takes the EMA" in said.stderr
    took = subprocess.run([sys.executable, os.path.join(HERE, "sample.py"), f"--out_dir={out}", "--device=cpu",
                           "--max_new_tokens=2", "--ema"], capture_output=True, text=True, env=launch_env())
    assert took.returncode == 0 and "also holds EMA" not in took.stderr, took.stderr
    plain = tmp_path / "plain"
    assert run_train(str(plain), data_dir, "--max_steps=2", "--eval_interval=2").returncode == 0
    assert "holds no EMA weights (its run trained without --ema_decay): drop --ema" in refusal(
        lambda: export.main([f"--out_dir={plain}", f"--hf_dir={tmp_path / 'x'}", "--ema", "--check=False"]))


def test_export_card_loads_with_any_licence_text(exported, tmp_path):
    """--license with text that is not a Hub identifier ("custom: see LICENSE", a colon in it): the card is "other"
    with that text as its license_name, and huggingface_hub's ModelCard.load reads it (YAML quoted by ModelCardData)."""
    from huggingface_hub import ModelCard
    ckpt_dir, _ = exported["baseline"]
    export.main([f"--out_dir={ckpt_dir}", f"--hf_dir={tmp_path / 'hf'}", "--check=False", "--license=custom: see LICENSE"])
    data = ModelCard.load(tmp_path / "hf" / "README.md").data
    assert (data.license, data.license_name) == ("other", "custom-see-license")
    export.main([f"--out_dir={ckpt_dir}", f"--hf_dir={tmp_path / 'hf2'}", "--check=False", "--license=apache-2.0"])
    assert ModelCard.load(tmp_path / "hf2" / "README.md").data.license == "apache-2.0"


def test_export_card_quotes_only_the_results_of_its_weights(exported, tmp_path, capsys):
    """The model card quotes eval.py results only where they scored exactly the exported weights (the checkpoint's
    fingerprint and raw / EMA, as eval.py records them); results of another checkpoint, of the EMA for a raw export,
    or that record no weights are left out, each named in one line; the validation loss is the eval at the
    checkpoint's own step."""
    ckpt_dir, _ = exported["mhar"]
    run = tmp_path / "run"
    run.mkdir()
    for f in ("ckpt.pt", "log.jsonl"):   # (not other tests' results beside it)
        shutil.copyfile(os.path.join(ckpt_dir, f), run / f)
    ckpt = str(run / "ckpt.pt")
    mine = {"file": "ckpt.pt", "step": 4, "fingerprint": checkpoint.fingerprint(ckpt)}
    results = {"eval.json": {"written_by": "eval.py", "lambada": {"acc": 0.25}, "weights": "raw", "checkpoint": mine},
               "eval.limit5.json": {"lambada": {"acc": 0.5}, "weights": "ema", "checkpoint": mine},
               "eval-step2.json": {"lambada": {"acc": 0.75}, "weights": "raw",
                                   "checkpoint": {**mine, "step": 2, "fingerprint": "sha256:other"}},
               "eval_harness.json": {"lambada": {"acc": 0.125}, "weights": "raw", "tokenizer": "gpt2"}}
    for name, r in results.items():
        (run / name).write_text(json.dumps(r))
    export.main([f"--out_dir={run}", f"--hf_dir={tmp_path / 'hf'}", "--check=False"])
    card, said = (tmp_path / "hf" / "README.md").read_text(), capsys.readouterr().out
    assert "eval.py (eval.json): lambada: acc 0.25" in card and "acc 0.5" not in card and "acc 0.75" not in card
    from huggingface_hub import ModelCard
    index = ModelCard.load(tmp_path / "hf" / "README.md").data.eval_results   # model-index: the same, no more
    assert sorted((r.dataset_type, r.metric_type, r.metric_value) for r in index) == [
        ("held-out split of its training text", "loss", index[0].metric_value), ("lambada", "acc", 0.25)], index
    assert "acc 0.125" not in card and "validation loss (its run's held-out split)" in card and "at step 4" in card
    for name, why in (("eval.limit5.json", "ckpt.pt at step 4 (ema weights)"), ("eval-step2.json", "at step 2 (raw"),
                      ("eval_harness.json", "weights it does not record")):
        assert f"the model card leaves out {name}: it scored" in said and why in said, said


def test_export_checks_the_tokenizer_it_ships(exported, tmp_path):
    """A checkpoint's tokenizer.json that changed after training (cut short here) is refused in one line naming it,
    by its identity (the sha1 the checkpoint records), before anything is written."""
    ckpt_dir, _ = exported["delta"]
    run = tmp_path / "delta"
    shutil.copytree(ckpt_dir, run)
    text = (run / "tokenizer.json").read_text()
    (run / "tokenizer.json").write_text(text[:len(text) // 2])
    said = refusal(lambda: export.main([f"--out_dir={run}", f"--hf_dir={tmp_path / 'hf'}", "--check=False"]))
    assert "tokenizer.json is not the file it was trained with" in said and not (tmp_path / "hf").exists(), said


def test_one_export_into_a_folder_at_a_time(exported, tmp_path):
    """An export into a folder that another export.py is writing (its lock held) is refused in one line naming it; the
    temporary folder of an export that was killed (its process gone) is removed by the next export there."""
    import common
    ckpt_dir, _ = exported["baseline"]
    target, lock = tmp_path / "hf", tmp_path / ".hf.export.lock"
    common.take_lock(str(lock), "export.py")   # held by this live process
    try:
        said = refusal(lambda: export.main([f"--out_dir={ckpt_dir}", f"--hf_dir={target}", "--check=False"]))
    finally:
        common.release_lock(str(lock))
    assert f"is being written by another export.py (pid {os.getpid()}" in said and not target.exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".export-{int(dead.stdout)}-abc123"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half written")
    export.main([f"--out_dir={ckpt_dir}", f"--hf_dir={target}", "--check=False"])
    assert not stale.exists() and (target / "config.json").exists() and not lock.exists()


# what a user of transformers does with a routed export beyond loading it, in a fresh `python -I` elsewhere
API_ELSEWHERE = """
import sys, warnings, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder = sys.argv[1]
hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)   # a stock tokenizer: no code of the folder
n, vocab = hf.config.max_position_embeddings, hf.config.vocab_size
prompt = torch.tensor([tok("The castle stood on a hill above the").input_ids])
beam = dict(num_beams=3, num_return_sequences=3, max_new_tokens=6, do_sample=False)
long = torch.randint(0, tok.vocab_size, (2, n - 4), generator=torch.Generator().manual_seed(0))
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    past = hf.generate(long, max_new_tokens=12, min_new_tokens=12, do_sample=False)   # 8 past the training length
x = torch.randint(0, tok.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
grads = []
for on in (False, True):
    hf.train()
    hf.zero_grad()
    if on:
        hf.gradient_checkpointing_enable()
    hf(x, labels=x).loss.backward()
    grads.append([p.grad.clone() for p in hf.parameters() if p.grad is not None])
hf.eval()
torch.save({"beam": hf.generate(prompt, **beam), "beam_uncached": hf.generate(prompt, use_cache=False, **beam),
            "past": past, "past_uncached": hf.generate(long, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                                       use_cache=False),
            "n": n, "warned": [str(w.message) for w in said], "grads": grads, "tokenizer": type(tok).__name__,
            "checkpointing": hf.is_gradient_checkpointing}, "api.pt")
"""


@pytest.mark.parametrize("name", [n for n in [*EXPORTS, "delta"] if n != "baseline"])
def test_export_takes_the_transformers_api(exported, name, tmp_path):
    """A routed export in a fresh `python -I` elsewhere (transformers alone): beam search with the cache returns what
    it returns without one; generate() runs 8 tokens past the training length, as a stock model does (transformers'
    own notice, no exception), with the cache and without it alike; gradient_checkpointing_enable() checkpoints the
    sublayers and the gradients equal those without it; AutoTokenizer loads it with trust_remote_code=False (no code
    of the folder, no prompt)."""
    _, hf_dir = exported[name]
    r = subprocess.run([sys.executable, "-I", "-c", API_ELSEWHERE, hf_dir], cwd=tmp_path, capture_output=True,
                       text=True, env=hf_offline_env(), stdin=subprocess.DEVNULL, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.load(tmp_path / "api.pt")
    assert torch.equal(got["beam"], got["beam_uncached"]) and got["beam"].shape[0] == 3
    assert got["past"].shape[1] == got["n"] + 8 and torch.equal(got["past"], got["past_uncached"])
    assert "Do you wish to run the custom code" not in r.stdout + r.stderr and got["tokenizer"]
    assert got["checkpointing"] and len(got["grads"][0]) == len(got["grads"][1]) > 0
    for plain, recomputed in zip(*got["grads"]):
        assert torch.equal(plain, recomputed)
