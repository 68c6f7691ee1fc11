"""
Where prepare_data.py's text comes from: documents read in order from local files (--input: a file, a glob or a
folder of .jsonl / .jsonl.gz / .jsonl.xz / .txt / .parquet; a `text` field per row, a .txt file one document), or
streamed from FineWeb-Edu on the Hugging Face Hub. A bad row, byte or file is an error naming the file and line.
"""
import glob
import gzip
import json
import lzma
import os

from options import Rule

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.xz", ".txt", ".parquet")
HUB_DATASET, HUB_CONFIG = "HuggingFaceFW/fineweb-edu", "sample-10BT"


def resolve_inputs(spec):
    """A file, a glob or a directory -> sorted list of supported files."""
    if os.path.isdir(spec):
        paths = [os.path.join(root, f) for root, _, files in os.walk(spec) for f in files]
    elif any(c in spec for c in "*?["):
        paths = glob.glob(spec, recursive=True)
    elif os.path.isfile(spec):
        return [spec]
    else:
        raise FileNotFoundError(f"--input={spec}: no such file or directory")
    paths = sorted(p for p in paths if p.endswith(SUFFIXES))
    if not paths:
        raise FileNotFoundError(f"--input={spec}: no {'/'.join(SUFFIXES)} files found")
    return paths


def read_documents(paths, text_field="text", progress=None):
    """Yield the text of every document in the given files, in order; progress(n): n more bytes of the files read."""
    progress = progress or (lambda n: None)
    for path in paths:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq
            pf = pq.ParquetFile(path)
            if text_field not in pf.schema_arrow.names:
                raise KeyError(f"{path}: no column {text_field!r} (columns: {pf.schema_arrow.names}); use --text_field=")
            for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
                yield from (t for t in batch.column(0).to_pylist() if t)
            progress(os.path.getsize(path))
        elif path.endswith(".txt"):
            try:
                with open(path, encoding="utf-8") as f:
                    yield f.read()
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); convert it to UTF-8") from None
            progress(os.path.getsize(path))
        else:
            yield from _jsonl_texts(path, text_field, progress)


def _jsonl_texts(path, text_field, progress):
    """The text field of every row of a .jsonl[.gz|.xz] file; bad rows are errors naming the file and line."""
    opener = {".gz": gzip.open, ".xz": lzma.open}.get(os.path.splitext(path)[1], lambda f, mode: f)
    lineno, done = 0, 0
    try:
        with open(path, "rb") as file, opener(file, "rb") as f:   # bytes, decoded line by line: a bad byte is
            for lineno, raw in enumerate(f, 1):                      # reported at its own line
                if lineno % 64 == 0 and file.seekable():   # the compressed bytes read so far (a pipe: at its end)
                    progress(file.tell() - done)
                    done = file.tell()
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start} of the line); "
                                     "convert the file to UTF-8") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not a JSON object ({e.msg}, column {e.colno})") from None
                if not isinstance(row, dict) or text_field not in row:
                    raise KeyError(f"{path}:{lineno}: no field {text_field!r} (fields: "
                                   f"{list(row) if isinstance(row, dict) else type(row).__name__}); use --text_field=")
                text = row[text_field]
                if text is not None and not isinstance(text, str):
                    raise ValueError(f"{path}:{lineno}: field {text_field!r} holds {type(text).__name__} "
                                     f"{str(text)[:40]!r}, not a string")
                if text:
                    yield text
    except (EOFError, lzma.LZMAError, gzip.BadGzipFile) as e:
        raise ValueError(f"{path}: the compressed file is damaged or truncated after line {lineno} ({e})") from None
    progress(max(0, os.path.getsize(path) - done))


def hub_documents(text_field="text"):
    try:
        from datasets import load_dataset  # imported lazily: only the Hub path needs it
    except ImportError as e:
        raise RuntimeError("streaming FineWeb-Edu needs `pip install datasets`; or pass local files with --input=") from e
    offline = (f"could not stream {HUB_DATASET} ({HUB_CONFIG}) from the Hugging Face Hub ({{}}); without a network, "
               "pass local files: --input=FILE_OR_DIR (and --val_input=)")
    try:
        ds = load_dataset(HUB_DATASET, name=HUB_CONFIG, split="train", streaming=True)
        for row in ds:
            if row[text_field]:
                yield row[text_field]
    except (OSError, ConnectionError, TimeoutError) as e:   # requests' and the Hub client's errors derive from these
        raise RuntimeError(offline.format(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")) from None


class Inputs(Rule):
    """The kind of --input and --val_input: a file, a folder or a glob that names at least one supported file."""

    def describe(self):
        return f"a file, a folder or a glob naming {'/'.join(SUFFIXES)} files"

    def check(self, value):
        if not isinstance(value, str) or not value.strip():
            self.refuse()
        try:
            resolve_inputs(value)
        except FileNotFoundError:
            raise ValueError(f"names no {'/'.join(SUFFIXES)} file: it must be {self.describe()}") from None
        return value
