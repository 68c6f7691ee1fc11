"""
Sample text from a train.py checkpoint.

  python sample.py --out_dir=out/tiny --start="The meaning of life" --max_new_tokens=100
  python sample.py --out_dir=out/tiny --start=FILE:prompt.txt --temperature=0     # greedy
"""
import argparse
import signal
import sys
from contextlib import nullcontext

if __name__ == "__main__":   # Ctrl-C while torch loads: a quiet exit (nothing is written yet)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch

from checkpoint import load_model
from common import check_device, run_script
from tokenizer import checkpoint_tokenizer, load_tokenizer


def check_args(args):
    """A ValueError naming the option, its value and the fix for any value generate cannot take; the prompt text."""
    for name, least in (("num_samples", 1), ("max_new_tokens", 1), ("top_k", 0)):
        if getattr(args, name) < least:
            raise ValueError(f"--{name}={getattr(args, name)} must be >= {least}"
                             + (" (0: sample among all tokens)" if name == "top_k" else ""))
    if not 0 <= args.temperature < float("inf"):   # also NaN
        raise ValueError(f"--temperature={args.temperature} must be a finite number >= 0 (0: greedy)")
    check_device(args.device)
    if args.tokenizer:   # (the checkpoint's own is checked against its vocabulary once it loads)
        load_tokenizer(args.tokenizer)
    if not args.start.startswith("FILE:"):
        return args.start
    path = args.start[5:]
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ValueError(f"--start=FILE:{path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"--start=FILE:{path} is a folder, not a text file") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--start=FILE:{path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="out", help="train.py out_dir (or a ckpt.pt path)")
    p.add_argument("--start", default="\n", help='prompt text, or FILE:path to read it from a file (default "\\n")')
    p.add_argument("--num_samples", type=int, default=1, help="samples to draw")
    p.add_argument("--max_new_tokens", type=int, default=200, help="tokens to generate per sample")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--seed", type=int, default=1337, help="sampling seed")
    p.add_argument("--tokenizer", default=None, help="tiktoken name or tokenizer.json (default: the checkpoint's)")
    args = p.parse_args(argv)
    try:
        start = check_args(args)   # every option, before the model loads
        torch.manual_seed(args.seed)
        model = load_model(args.out_dir, device=args.device)
        enc, name = checkpoint_tokenizer(model.checkpoint_info, model.cfg.vocab_size, args.tokenizer)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        sys.exit(f"sample.py: error: {e}")
    model.eval()
    print(f"tokenizer: {name}", file=sys.stderr)
    ids = enc.encode(start, allowed_special={"<|endoftext|>"}) or [enc.eot_token]
    if len(ids) > model.cfg.block_size:
        print(f"the prompt's {len(ids):,} tokens are cut to their last {model.cfg.block_size:,} (the model's block_size)",
              file=sys.stderr)
    x = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=args.device)
    device_type = "cuda" if args.device.startswith("cuda") else "cpu"
    ctx = torch.autocast(device_type, dtype=torch.bfloat16) if device_type == "cuda" else nullcontext()
    with ctx:
        y = model.generate(x, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None)
    for i, row in enumerate(y.tolist()):
        if i:
            print("-" * 40)
        print(enc.decode(row))


if __name__ == "__main__":
    run_script(main, "sample.py")
