"""
Local copies of the paper's Table 2 tasks for lm-evaluation-harness, read from files laid out like ../shared/data/eval
(`eval.py --harness --data_root=DIR`: the harness passes data_root to these functions as task metadata). The tasks
score exactly as the harness' own wikitext, lambada_openai and hellaswag do: their prompts, targets and metrics come
from the harness' modules, imported here. Where the local files differ from the Hub sets:
  wikitext        the raw WikiText-2 test file, split into articles at its top-level headings (" = Title = "); the
                  Hub's EleutherAI/wikitext_document_level has one page per article of the same text (not compared
                  here page by page: its split may differ where an article's title line is unusual).
  lambada_openai  the same 5,153 texts as EleutherAI/lambada_openai (default config, test).
  hellaswag       a text export without ctx_a, ctx_b and activity_label: its `ctx` is "activity_label: ctx_a ctx_b"
                  with the [header] markers already removed, so the query is preprocess(ctx) (the harness:
                  preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())) and ctx_b's first letter
                  keeps the file's case. Rows that do carry the Hub's fields are processed as the harness does.
"""
import json
import lzma
import os
import re

import datasets
from lm_eval.tasks.hellaswag.utils import preprocess, process_docs
from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer  # noqa: F401 (YAML)

TITLE = re.compile(r"^ = [^=].* = $")   # a top-level heading line of the raw file (sections are " = = ... = = ")


def _path(data_root, rel):
    if not data_root:
        raise ValueError("the local harness tasks need data_root (eval.py --data_root=DIR)")
    for path in (os.path.join(data_root, rel), os.path.join(data_root, rel) + ".xz"):
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{os.path.join(data_root, rel)}[.xz] not found (--data_root must hold {rel})")


def _jsonl(path):
    with (lzma.open(path, "rt", encoding="utf-8") if path.endswith(".xz") else open(path, encoding="utf-8")) as f:
        return [json.loads(line) for line in f if line.strip()]


def wikitext_pages(text):
    """The raw file's articles, each from its title line to the next (lines kept as they are)."""
    pages = []
    for line in text.splitlines(keepends=True):
        if TITLE.match(line.rstrip("\n")) or not pages:
            pages.append("")
        pages[-1] += line
    return [p for p in pages if p.strip()]


def wikitext(data_root=None, **_):
    with open(_path(data_root, "wikitext-2-raw/wiki.test.raw"), encoding="utf-8") as f:
        return datasets.DatasetDict(test=datasets.Dataset.from_dict({"page": wikitext_pages(f.read())}))


def lambada_openai(data_root=None, **_):
    rows = _jsonl(_path(data_root, "lambada/lambada_test.jsonl"))
    return datasets.DatasetDict(test=datasets.Dataset.from_dict({"text": [r["text"] for r in rows]}))


def hellaswag(data_root=None, **_):
    rows = _jsonl(_path(data_root, "hellaswag/hellaswag_val.jsonl"))
    if rows and all(k in rows[0] for k in ("ctx_a", "ctx_b", "activity_label")):   # the Hub's fields
        return datasets.DatasetDict(validation=process_docs(datasets.Dataset.from_list(rows)))
    docs = {"query": [preprocess(r["ctx"]) for r in rows], "choices": [[preprocess(e) for e in r["endings"]] for r in rows],
            "label": [str(r["label"]) for r in rows]}
    return datasets.DatasetDict(validation=datasets.Dataset.from_dict(docs))
