"""
eval.py and sample.py: every metric against a direct, unbatched computation in the test.
"""

import json
import math
import os
import re
import types

import numpy as np
import pytest
import torch

import checkpoint
import eval as evaluate
import sample
from model import GPT
from support import load_module, refusal, tiny_cfg


def direct_logprob(model, ids, target_pos):
    """log p(ids[t] | ids[:t]) for each t in target_pos, one unbatched forward per call; and greedy hits."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0][0].double()
    logp = torch.log_softmax(logits, -1)
    return [logp[t - 1, ids[t]].item() for t in target_pos], [logits[t - 1].argmax().item() == ids[t] for t in target_pos]


def _request(*args):
    return types.SimpleNamespace(args=args)


def test_wikitext_protocol_matches_direct(eval_ckpt, eval_root):
    model, enc = evaluate.load_model(eval_ckpt["mhar"], "cpu")
    B, S = 16, 8
    text = evaluate.load_task("wikitext2", eval_root)
    toks = enc.encode_ordinary(text)
    n = len(toks)
    assert n > 3 * B and (n - B) % S, "the test text should end in a partial window"
    windows = evaluate.wikitext_windows(n, B)
    assert windows[0] == (0, B, 1) and windows[-1][1] == n and windows[-1][1] - windows[-1][0] < B
    res = evaluate.eval_wikitext2(evaluate.Scorer(model, B, 3, "cpu"), enc, text)
    # each token t >= 1 is predicted once: in window 0 if t < B, else in the window starting at (t // S - 1) * S
    nll = 0.0
    for t in range(1, n):
        s = 0 if t < B else (t // S - 1) * S
        nll -= direct_logprob(model, toks[s:t + 1], [t - s])[0][0]
    assert res["tokens"] == n - 1 and res["words"] == len(text.split())
    assert abs(math.log(res["token_ppl"]) * (n - 1) - nll) < 1e-4 * nll
    assert abs(math.log(res["word_ppl"]) * res["words"] - nll) < 1e-4 * nll
    limited = evaluate.eval_wikitext2(evaluate.Scorer(model, B, 3, "cpu"), enc, text, limit=2)
    assert limited["tokens"] == 2 * B - 1


def test_lambada_and_hellaswag_match_direct(eval_ckpt, eval_root):
    model, enc = evaluate.load_model(eval_ckpt["mhar"], "cpu")
    scorer = evaluate.Scorer(model, 32, 2, "cpu")
    texts = evaluate.load_task("lambada", eval_root)
    res = evaluate.eval_lambada(scorer, enc, texts)
    nlls, hits = [], []
    for text in texts:
        ctx, word = text.rsplit(" ", 1)
        c, w = enc.encode_ordinary(ctx), enc.encode_ordinary(" " + word)
        ids = (c + w)[-33:]                      # the context is cut from the left to the block
        lp, greedy = direct_logprob(model, ids, range(len(ids) - len(w), len(ids)))
        nlls.append(-sum(lp))
        hits.append(all(greedy))
    assert len(enc.encode_ordinary(" floccinaucinihilipilification")) > 3
    assert res["n"] == len(texts) and res["acc"] == sum(hits) / len(hits)
    assert abs(res["nll"] - sum(nlls) / len(nlls)) < 1e-4 * res["nll"]
    # the greedy test: a continuation that is the model's own greedy choice counts as correct, one token off does not
    ctx = enc.encode_ordinary("The history of the city")
    with torch.no_grad():
        nxt = model(torch.tensor([ctx]))[0][0, -1].argmax().item()
        nxt2 = model(torch.tensor([ctx + [nxt]]))[0][0, -1].argmax().item()
    (lp_ok, ok), (_, bad) = scorer.score([(ctx, [nxt, nxt2]), (ctx, [nxt, (nxt2 + 1) % 50257])])
    assert ok and not bad
    rows = evaluate.load_task("hellaswag", eval_root)
    res = evaluate.eval_hellaswag(scorer, enc, rows)
    acc = acc_norm = 0
    for ctx, endings, label in rows:
        c = enc.encode_ordinary(ctx)
        sums = []
        for e in endings:
            w = enc.encode_ordinary(" " + e)
            ids = (c + w)[-33:]
            sums.append(sum(direct_logprob(model, ids, range(len(ids) - len(w), len(ids)))[0]))
        acc += int(np.argmax(sums)) == label
        acc_norm += int(np.argmax([s / len(" " + e) for s, e in zip(sums, endings)])) == label
    assert res == {"acc": acc / len(rows), "acc_norm": acc_norm / len(rows), "n": len(rows)}


def test_eval_cli_json_and_errors(eval_ckpt, eval_root, tmp_path, capsys):
    out = str(tmp_path / "r.json")
    evaluate.main([f"--out_dir={eval_ckpt['mhar']}", f"--data_root={eval_root}", "--limit=2", f"--output={out}",
                   "--batch_size=4", "--block_size=16"])
    res = json.load(open(out))
    assert set(res) == {"wikitext2", "lambada", "hellaswag", "tokenizer", "weights", "written_by", "checkpoint"}
    assert res["tokenizer"] == "gpt2" and res["checkpoint"] == {   # what was scored: export's card checks it
        "file": "ckpt.pt", "step": res["checkpoint"]["step"],
        "fingerprint": checkpoint.fingerprint(os.path.join(eval_ckpt["mhar"], "ckpt.pt"))}
    capsys.readouterr()
    evaluate.main([f"--out_dir={eval_ckpt['mhar']}", f"--data_root={eval_root}", "--limit=1", "--tasks=lambada",
                   f"--output={out}"])   # its own results, of other tasks: replaced, saying so
    assert "eval.py: replacing" in capsys.readouterr().out and set(json.load(open(out))) >= {"lambada", "checkpoint"}
    evaluate.main([f"--out_dir={eval_ckpt['mhar']}", f"--data_root={eval_root}", "--limit=1", "--tasks=lambada"])
    assert os.path.isfile(os.path.join(eval_ckpt["mhar"], "eval.limit1.json"))   # a --limit run: its own file
    assert set(res["wikitext2"]) == {"token_ppl", "word_ppl", "tokens", "words"} and res["wikitext2"]["tokens"] == 31
    assert set(res["lambada"]) == {"acc", "nll", "n"} and res["lambada"]["n"] == 2
    assert set(res["hellaswag"]) == {"acc", "acc_norm", "n"} and res["hellaswag"]["n"] == 2
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "val_loss": 8.0}\n')
    for bad, msg in ((["--tasks=wikitext2,mmlu"], "unknown task"), (["--block_size=64"], "exceeds the model's 32"),
                     (["--data_root=/nonexistent"], "does not exist"),
                     ([f"--output={os.path.join(eval_ckpt['mhar'], 'ckpt.pt')}"], "is a checkpoint"),   # never replaced
                     ([f"--plot={log}", f"--output={out}"],
                      "is eval.py results (JSON): it must be new or an eval.py --plot image")):
        said = refusal(lambda: evaluate.main([f"--out_dir={eval_ckpt['mhar']}", f"--data_root={eval_root}", *bad]))
        assert msg in said, (bad, said)


def test_sample_and_eval_refuse_bad_options_before_loading(tmp_path, eval_ckpt, monkeypatch):
    """sample.py's counts, top_k, temperature, device and prompt file, and eval.py's harness task names, are refused in
    one line before any model loads (the out_dir given has no checkpoint: a load would fail with another message); a
    harness task that needs the Hub while it cannot be reached gets the local-files hint."""
    nowhere = tmp_path / "no_run"   # a folder without a checkpoint: a load would fail with another message
    nowhere.mkdir()
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    for bad, msg in ((["--num_samples=0"], r"--num_samples=0 must be a whole number in \[1, 1,024\]"),
                     (["--max_new_tokens=0"], r"--max_new_tokens=0 must be a whole number in \[1,"),
                     (["--top_k=-5"], r"--top_k=-5 must be a whole number in \[0,"),
                     (["--temperature=-1"], r"--temperature=-1 must be a finite number in \[0, 1e\+06\]"),
                     (["--temperature=nan"], r"--temperature=nan must be a finite number"),
                     (["--device=gpu"], "--device=gpu must be cpu, cuda or cuda:N"),
                     ([f"--start=FILE:{tmp_path / 'missing.txt'}"], "missing.txt: no such file"),
                     ([f"--start=FILE:{tmp_path}"], "is a folder, not a text file"),
                     ([f"--start=FILE:{tmp_path / 'latin1.txt'}"], r"latin1.txt is not UTF-8 text \(byte 3\)"),
                     (["--tokenizer=gpt3"], r"--tokenizer=gpt3 must be one of gpt2, cl100k_base, o200k_base")):
        said = refusal(lambda: sample.main([f"--out_dir={nowhere}", "--device=cpu", *bad]))
        assert said.startswith("sample.py: error: ") and re.search(msg, said), (bad, said)
    for bad, msg in ((["--slices=0"], r"--slices=0 must be a whole number in \[1,"),
                     (["--data_root=/nonexistent"], "--data_root=/nonexistent does not exist"),
                     (["--device=gpu"], "--device=gpu must be cpu, cuda or cuda:N"),
                     ([f"--plot={tmp_path / 'no.jsonl'}"], "--plot=.*no.jsonl does not exist"),
                     ([f"--output={tmp_path}"], "is a folder: it must be a file to write"),
                     (["--probe", f"--data_dir={tmp_path}"], "holds no meta.json"),
                     (["--tokenizer=missing.json"], "--tokenizer=missing.json does not exist")):
        said = refusal(lambda: evaluate.main([f"--out_dir={nowhere}", *bad]))
        assert said.startswith("eval.py: error: ") and re.search(msg, said), (bad, said)
    lm_eval = pytest.importorskip("lm_eval", reason="pip install lm-eval (requirements.txt)")
    with pytest.raises(SystemExit) as e:
        evaluate.main([f"--out_dir={nowhere}", "--harness", "--tasks=lambada_openai,hellaswagg"])
    assert "unknown harness task(s) hellaswagg (hellaswagg: did you mean hellaswag" in str(e.value), e.value

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'allenai/ai2_arc' on the Hub (LocalEntryNotFoundError)")
    monkeypatch.setattr(lm_eval, "simple_evaluate", offline)
    with pytest.raises(SystemExit) as e:
        evaluate.main([f"--out_dir={eval_ckpt['mhar']}", "--harness", "--tasks=arc_easy", "--device=cpu"])
    assert "harness task 'arc_easy' needs the Hugging Face Hub" in str(e.value) and "--data_root=DIR" in str(e.value)


def test_harness_model_matches_direct_computation(eval_ckpt):
    """The lm-evaluation-harness model (eval.harness_lm): loglikelihood, rolling loglikelihood (disjoint windows of
    max_length predictions, the first after the end-of-text token) and greedy generate_until with a stop string
    equal direct computations with the model."""
    pytest.importorskip("lm_eval", reason="pip install lm-eval (requirements.txt)")
    model, enc = evaluate.load_model(eval_ckpt["mhar"], "cpu")
    L = 16
    lm = evaluate.harness_lm(model, enc, max_length=L, batch_size=3, device="cpu", max_gen_toks=12)
    pairs = [("The cat sat on the", " mat"), ("Once upon a time there was a", " princess who lived far away"),
             ("A", " b")]
    got = lm.loglikelihood([_request(c, x) for c, x in pairs], disable_tqdm=True)
    for (ctx, cont), (logp, greedy) in zip(pairs, got):
        c, x = enc.encode_ordinary(ctx), enc.encode_ordinary(cont)
        ids = (c + x)[-(L + 1):]
        lp, hits = direct_logprob(model, ids, range(len(ids) - len(x), len(ids)))
        assert abs(logp - sum(lp)) < 1e-4 and greedy == all(hits)
    text = "Senjo no Valkyria 3 : Unrecorded Chronicles is a tactical role playing video game developed by Sega " * 2
    toks = enc.encode_ordinary(text)
    assert len(toks) > 2 * L
    want, P = 0.0, [enc.eot_token] + toks   # block [a, b) of targets P[a+1 .. b]: the last L tokens before them as input
    for a in range(0, len(toks), L):         # (the first block: from the end-of-text token; the last: full context)
        b = min(a + L, len(toks))
        s0 = max(0, b - L)
        want += sum(direct_logprob(model, P[s0:b + 1], range(a + 1 - s0, b + 1 - s0))[0])
    (rolled,) = lm.loglikelihood_rolling([_request(text)], disable_tqdm=True)
    assert abs(rolled - want) < 1e-3
    prompts = ["The cat sat on the", "One two three four five"]
    outs = lm.generate_until([_request(p, {"until": ["\n\n"], "max_gen_toks": 6}) for p in prompts], disable_tqdm=True)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([enc.encode_ordinary(prompt)])
        ref = enc.decode(model.generate(ids, 6, temperature=0, use_cache=False)[0, ids.size(1):].tolist())
        assert out == ref.split("\n\n")[0]


def test_harness_offline_tasks_and_lambada_agree_with_ours(eval_ckpt, eval_root, tmp_path):
    """eval.py --harness with --data_root runs lm_eval.simple_evaluate on the three local task files (no Hub), and
    the harness' lambada_openai scores the examples as our built-in LAMBADA does (accuracy, perplexity = exp(nll))."""
    pytest.importorskip("lm_eval", reason="pip install lm-eval (requirements.txt)")
    out = str(tmp_path / "h.json")
    res = evaluate.main([f"--out_dir={eval_ckpt['mhar']}", f"--data_root={eval_root}", "--harness", "--limit=3",
                         f"--output={out}", "--batch_size=4", "--block_size=16"])
    assert json.load(open(out)) == res
    assert set(res) == {"wikitext_local", "lambada_openai_local", "hellaswag_local", "tokenizer", "weights", "written_by",
                        "checkpoint"}
    assert {"word_perplexity", "byte_perplexity", "bits_per_byte"} <= set(res["wikitext_local"])
    assert {"acc", "acc_norm"} <= set(res["hellaswag_local"]) and res["hellaswag_local"]["n"] == 3
    ours = evaluate.main([f"--out_dir={eval_ckpt['mhar']}", f"--data_root={eval_root}", "--tasks=lambada", "--limit=3",
                          f"--output={tmp_path / 'o.json'}", "--batch_size=4", "--block_size=16"])["lambada"]
    theirs = res["lambada_openai_local"]
    assert theirs["n"] == ours["n"] == 3 and theirs["acc"] == ours["acc"]
    assert abs(math.log(theirs["perplexity"]) - ours["nll"]) < 1e-6 * max(1.0, ours["nll"])
    offline = load_module(os.path.join(evaluate.HARNESS_TASKS, "offline.py"))
    pages = offline.wikitext_pages(" = A = \n x \n = = B = = \n y \n = C = \n z \n")
    assert pages == [" = A = \n x \n = = B = = \n y \n", " = C = \n z \n"]


def test_probe_on_a_block_model(tmp_path):
    """eval.probe on a block-routed model: a map per site over its few sources (1 + completed and open blocks), and
    the plots name them."""
    torch.manual_seed(0)
    m = GPT(tiny_cfg(residual="mhar", route_heads=2, route_blocks=2))   # 4 sublayers, 2 a block
    res = evaluate.probe(m, torch.randint(0, 96, (2, 12)))
    assert [tuple(x.shape) for x in res["maps"]] == [(2, 1), (2, 2), (2, 2), (2, 3), (2, 3)]
    evaluate.plot_probe(res["maps"], str(tmp_path), "mhar", blocks=2)
    assert all(os.path.getsize(tmp_path / f) > 1000 for f in ("routing_maps.png", "head_deviation.png"))


def test_slice_kl_by_hand_and_through_route_logit(monkeypatch):
    """The Table 6 probe's KL against a hand computation (slice logits r <q g, s> over a quarter of the channels, the
    full logit their sum), and a changed model.route_logit (a bias toward the newest source) reaches it."""
    gen = torch.Generator().manual_seed(1)
    s, q, g = torch.randn(4, 2, 3, 16, generator=gen), torch.randn(16, generator=gen), torch.rand(16, generator=gen) + .5
    r = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)

    def kl(bias):
        part = (r * s * g * q).view(4, 2, 3, 4, 4).sum(-1) + bias       # (N, B, T, slices)
        full = (r * s * g * q).sum(-1, keepdim=True) + bias
        own, shared = part.log_softmax(0), full.log_softmax(0)
        return (own.exp() * (own - shared)).sum(0).mean().item()

    assert abs(evaluate.slice_kl(s, q, g, 4, 1e-6) - kl(0.0)) < 1e-6
    monkeypatch.setattr(evaluate, "route_logit", lambda r, dot, n, count: r * dot + 0.5 * (n == count - 1))
    newest = (torch.arange(4) == 3).float().view(4, 1, 1, 1)
    assert abs(evaluate.slice_kl(s, q, g, 4, 1e-6) - kl(0.5 * newest)) < 1e-6 and abs(kl(0.5 * newest) - kl(0.0)) > 1e-4


def test_probe_kl_maps_and_plots(eval_ckpt, eval_root, tmp_path):
    gen = torch.Generator().manual_seed(0)
    sources = torch.randn(5, 2, 3, 32, generator=gen)
    g = torch.ones(32)
    assert evaluate.slice_kl(sources, torch.zeros(32), g, 4, 1e-6) == 0.0             # q = 0: every slice uniform
    assert evaluate.slice_kl(sources, torch.randn(32, generator=gen), g, 4, 1e-6) > 1e-3
    probe_dir = str(tmp_path / "probe")
    summary = evaluate.main(["--probe", f"--out_dir={eval_ckpt['attnres']}", f"--data_root={eval_root}",
                             f"--probe_dir={probe_dir}", "--batch_size=2", "--block_size=16"])
    t6 = summary["table6"]
    assert t6["kl_learned"] > 0 and t6["kl_null"] > 0 and abs(t6["excess"] - (t6["kl_learned"] - t6["kl_null"])) < 1e-12
    assert len(summary["maps"]) == 5 and all(abs(sum(row) - 1) < 1e-5 for m in summary["maps"] for row in m)
    for f in ("routing_maps.png", "head_deviation.png"):
        assert os.path.getsize(os.path.join(probe_dir, f)) > 1000
    assert json.load(open(os.path.join(probe_dir, "probe.json")))["table6"] == t6
    summary = evaluate.main(["--probe", f"--out_dir={eval_ckpt['mhar']}", f"--data_root={eval_root}",
                             f"--probe_dir={probe_dir}2", "--batch_size=2", "--block_size=16"])
    assert summary["table6"] is None and len(summary["maps"][0]) == 2   # H = 2: two rows per site
    log = tmp_path / "run" / "log.jsonl"
    log.parent.mkdir()
    log.write_text("".join(json.dumps({"step": s, "loss": 5 - s / 10}) + "\n" for s in range(1, 20))
                   + json.dumps({"step": 10, "val_loss": 4.2}) + "\n")
    evaluate.main(["--plot", str(log), f"--output={tmp_path / 'c.png'}"])
    assert os.path.getsize(tmp_path / "c.png") > 1000


def test_sample_streams_the_same_text_after_its_notes(eval_ckpt):
    """sample.py streams the text it prints when done (the same seed: the same tokens), and the notes of the first
    forward (stderr: which routing runs) come before the prompt, not inside the text on a terminal."""
    import subprocess
    import sys

    from support import HERE, launch_env
    run = lambda *extra, **kw: subprocess.run(  # noqa: E731
        [sys.executable, os.path.join(HERE, "sample.py"), f"--out_dir={eval_ckpt['mhar']}", "--device=cpu",
         "--start=The quick", "--max_new_tokens=8", "--seed=1", *extra], text=True, env=launch_env(), timeout=300, **kw)
    streamed, whole = run(capture_output=True), run("--stream=False", capture_output=True)
    assert streamed.returncode == whole.returncode == 0, (streamed.stderr, whole.stderr)
    assert streamed.stdout == whole.stdout and streamed.stdout.startswith("The quick"), (streamed.stdout, whole.stdout)
    merged = run(stdout=subprocess.PIPE, stderr=subprocess.STDOUT).stdout   # as a terminal shows both
    assert "routing (routing_impl='auto')" in merged, merged
    assert merged.index("routing (routing_impl='auto')") < merged.index("The quick"), merged
