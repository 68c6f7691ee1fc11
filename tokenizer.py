"""
Tokenizers and what a loss needs of them: tiktoken's encodings by name, a Hugging Face tokenizer.json (a converted
model's, or a Hub model's fetched by name) behind tiktoken's interface, the tokenizer a checkpoint was trained with,
and each token's UTF-8 bytes (bits per byte divides by them). prepare_data.py tokenizes with these; sample.py,
eval.py, convert.py and export.py read text through them.
"""
import json
import os

import numpy as np

from options import Rule

TOKENIZERS = ("gpt2", "cl100k_base", "o200k_base")
GPT2_VOCABS = (50257, 50304)   # GPT-2's vocabulary, and train.py's padding of it to a multiple of 128


class HFTokenizer:
    """A Hugging Face tokenizer.json (e.g. of a converted Llama or Qwen3 checkpoint) behind tiktoken's interface; its
    end-of-text token the first of EOT_NAMES it has (Qwen3: <|endoftext|>, Llama 3: <|end_of_text|>), or `eot`."""
    EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")

    def __init__(self, path, eot=None):
        try:
            from tokenizers import Tokenizer   # only needed for tokenizer.json files
        except ImportError as e:
            raise RuntimeError(f"reading {path} needs `pip install tokenizers`") from e
        self.path = path
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:   # not JSON, or JSON that is not a tokenizer
            raise ValueError(f"{path} is not a Hugging Face tokenizer.json ({str(e).splitlines()[0][:120]})") from None
        self.n_vocab = self.tok.get_vocab_size(with_added_tokens=True)
        names = (eot,) if eot else self.EOT_NAMES
        ids = [self.tok.token_to_id(t) for t in names]
        if all(i is None for i in ids):
            raise ValueError(f"{path}: none of the end-of-text tokens {names} is in the vocabulary"
                             + ("; name one it has with --eot_token" if not eot else ""))
        self.eot_token = next(i for i in ids if i is not None)

    def encode_ordinary(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode(self, text, allowed_special=()):
        return self.encode_ordinary(text)

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)


def load_tokenizer(name, base_dir=None, eot=None):
    """A tiktoken encoding by name, or a Hugging Face tokenizer.json by path (relative paths are taken
    from base_dir, e.g. a checkpoint's folder), with an actionable error when tiktoken's files cannot be fetched."""
    if name.endswith(".json"):
        path = name if os.path.isabs(name) or base_dir is None else os.path.join(base_dir, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file {path} not found")
        return HFTokenizer(path, eot)
    import tiktoken
    if name not in TOKENIZERS:
        raise ValueError(f"tokenizer={name!r} is not one of {', '.join(TOKENIZERS)}, a path to a tokenizer.json, or a "
                         "Hugging Face model name (e.g. Qwen/Qwen3-0.6B: prepare_data.py fetches its tokenizer.json)")
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # tiktoken downloads its BPE files on first use; offline that fails here
        raise RuntimeError(
            f"could not load the tiktoken encoding {name!r} ({type(e).__name__}: {e}). tiktoken downloads it "
            "once from openaipublic.blob.core.windows.net: connect to the internet, or set TIKTOKEN_CACHE_DIR "
            "to a folder that holds its cached files (e.g. ../shared/data/tiktoken_cache)") from e


def checkpoint_tokenizer(info, vocab_size, override=None):
    """(encoder, name) for a checkpoint (model.checkpoint_info): `override` (--tokenizer) when given, else the
    tokenizer it records. One that records none is read as GPT-2 only when its vocabulary is GPT-2's; any other is
    refused with the fix (a model is never scored or sampled through another model's tokenizer)."""
    name = override or info.get("tokenizer")
    if name is None:
        if vocab_size not in GPT2_VOCABS:
            raise ValueError(f"the checkpoint in {info['dir']} records no tokenizer and its vocabulary ({vocab_size}) "
                             "is not GPT-2's: pass --tokenizer= with the model's tokenizer.json (or a tiktoken name)")
        name = "gpt2"
    enc = load_tokenizer(name, base_dir=info["dir"])
    if enc.n_vocab > vocab_size:
        raise ValueError(f"tokenizer {name!r} has {enc.n_vocab} tokens, more than the model's vocabulary "
                         f"({vocab_size}): not this model's tokenizer; pass its own with --tokenizer=")
    return enc, name


def tokenizer_id(name):
    """What identifies a tokenizer across machines: the tiktoken name, or the sha1 of the tokenizer.json."""
    if not name.endswith(".json"):
        return name
    import hashlib
    with open(name, "rb") as f:
        return "sha1:" + hashlib.sha1(f.read()).hexdigest()


def is_hub_name(name):
    """A Hugging Face model name (owner/model), as opposed to a tiktoken encoding or a local tokenizer.json."""
    return "/" in name and not name.endswith(".json") and not os.path.exists(name) and name.count("/") == 1


def hub_tokenizer(name, revision=None):
    """(local path of the tokenizer.json of Hub model `name` at `revision` (a branch, tag or commit; None: main), the
    model's vocabulary size or None) through huggingface_hub: its cache, else a download; offline, a RuntimeError
    naming the fix."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise RuntimeError(f"--tokenizer={name} names a Hugging Face model: pip install huggingface_hub, or pass a "
                           "local tokenizer.json") from None
    try:
        path = hf_hub_download(name, "tokenizer.json", revision=revision)
    except Exception as e:   # offline, no such model, or a gated one: one line
        raise RuntimeError(f"--tokenizer={name}: could not fetch its tokenizer.json from the Hugging Face Hub "
                           f"({type(e).__name__}); offline, download it where the Hub is reachable and pass "
                           "--tokenizer=path/to/tokenizer.json") from None
    try:   # the model's own (padded) vocabulary, e.g. 151,936 for Qwen3: the paper trains at it
        with open(hf_hub_download(name, "config.json", revision=revision)) as f:
            vocab = json.load(f).get("vocab_size")
    except Exception:
        vocab = None
    return path, vocab


def token_byte_table(enc):
    """The UTF-8 bytes each token id stands for, 0 for special tokens (the end-of-text separator among them), as a
    uint16 array over the vocabulary: bits per byte divides a loss by these (nanochat's evaluate_bpb counts so)."""
    table = np.zeros(enc.n_vocab, dtype=np.uint16)
    if isinstance(enc, HFTokenizer):
        tok = enc.tok
        special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        byte_level = json.loads(tok.to_str()).get("decoder", {}) or {}
        byte_level = byte_level.get("type") == "ByteLevel"
        if byte_level:   # GPT-2's byte <-> character map, inverted: a token's characters are its bytes
            chars = [c for c in range(ord("!"), ord("~") + 1)] + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
            decode = {chr(c): 1 for c in chars}
            decode.update({chr(256 + n): 1 for n in range(256 - len(chars))})
        for i in range(enc.n_vocab):
            if i in special:
                continue
            if byte_level:
                piece = tok.id_to_token(i)
                table[i] = sum(decode.get(ch, len(ch.encode())) for ch in piece) if piece is not None else 0
            else:   # e.g. SentencePiece-style: its text (a lone byte-fallback piece counts its replacement character)
                table[i] = len(tok.decode([i]).encode())
        return table
    special = {enc.encode_single_token(t) for t in enc.special_tokens_set}
    for i in range(enc.n_vocab):
        if i not in special:
            try:
                table[i] = len(enc.decode_single_token_bytes(i))
            except KeyError:   # an id the encoding leaves unused
                pass
    return table


class Tokenizer(Rule):
    """The kind of a --tokenizer option (options.py): a tiktoken encoding by name, a tokenizer.json that exists
    (resolved against the working directory), or with hub=True a Hugging Face model's name (owner/model)."""

    def __init__(self, hub=False):
        self.hub = hub

    def describe(self):
        return f"one of {', '.join(TOKENIZERS)}, an existing tokenizer.json" + (
            ", or a Hugging Face model's name (owner/model)" if self.hub else "")

    def check(self, value):
        if not isinstance(value, str) or not value:
            self.refuse()
        if value in TOKENIZERS or (self.hub and is_hub_name(value)):
            return value
        path = os.path.abspath(os.path.expanduser(value))
        if value.endswith(".json") and os.path.isfile(path):
            return path
        raise ValueError(("does not exist: it" if value.endswith(".json") else "") + f" must be {self.describe()}")

