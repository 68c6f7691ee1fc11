"""
Sample text from a train.py checkpoint.

  python sample.py --out_dir=out/tiny --start="The meaning of life" --max_new_tokens=100
  python sample.py --out_dir=out/tiny --start=FILE:prompt.txt --temperature=0     # greedy
One sample streams its tokens as they come (--stream=False: printed when done); several are drawn as one batch.
"""
import signal
import sys
from contextlib import nullcontext

if __name__ == "__main__":   # Ctrl-C while torch loads: a quiet exit (nothing is written yet)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch

from checkpoint import load_model
from common import keeps_signals, run_script
from options import Count, Device, Flag, Maybe, Parser, Path, Real, Seed, Text
from tokenizer import Tokenizer, checkpoint_tokenizer


def prompt_text(args):
    """The prompt: --start's text, or the file FILE:path names (UTF-8), checked before the model loads."""
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


def parser():
    """sample.py's options, each with its kind and range (options.py)."""
    p = Parser(prog="sample.py", description=__doc__)
    p.add_argument("--out_dir", type=Path("any", "a train.py out_dir or a ckpt.pt"), default="out",
                   help="train.py out_dir (or a ckpt.pt path)")
    p.add_argument("--start", type=Text(empty=True), default="\n",
                   help='prompt text, or FILE:path to read it from a file (default "\\n")')
    p.add_argument("--num_samples", type=Count(1, 1024), default=1, help="samples to draw (a batch)")
    p.add_argument("--max_new_tokens", type=Count(1, 2**20), default=200, help="tokens to generate per sample")
    p.add_argument("--temperature", type=Real(0, 1e6), default=0.8, help="softmax temperature; 0 = greedy")
    p.add_argument("--top_k", type=Count(0, 2**24), default=200, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--device", type=Device(), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu | cuda | cuda:N")
    p.add_argument("--seed", type=Seed(), default=1337, help="sampling seed")
    p.add_argument("--tokenizer", type=Maybe(Tokenizer()), default=None,
                   help="tiktoken name or tokenizer.json (default: the checkpoint's)")
    p.add_argument("--stream", type=Flag(), default=True, help="print each token as it comes (one sample at a time)")
    p.add_argument("--ema", action="store_true", help="sample from the checkpoint's EMA weights (train.py --ema_decay)")
    return p


@keeps_signals
def main(argv=None):
    args = parser().parse_args(argv)   # every option by its rule, before the model loads
    try:
        start = prompt_text(args)
        torch.manual_seed(args.seed)
        model = load_model(args.out_dir, device=args.device, ema=args.ema,
                           say=lambda line: print(f"sample.py: {line}", file=sys.stderr))
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
    stream = args.stream and args.num_samples == 1   # several samples are one batch: printed when done
    printed = [""] if stream else None   # the prompt comes with the first token: after the notes of the first forward

    def show(idx):   # the text that the new token completes (a partial UTF-8 character waits for the next)
        text = enc.decode(idx[0].tolist())
        if not text.endswith("\ufffd") and text.startswith(printed[0]):
            print(text[len(printed[0]):], end="", flush=True)
            printed[0] = text
        return False
    with ctx:
        y = model.generate(x, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                           stop=show if stream else None)
    if stream:
        print(enc.decode(y[0].tolist())[len(printed[0]):])
        return
    for i, row in enumerate(y.tolist()):
        if i:
            print("-" * 40)
        print(enc.decode(row))


if __name__ == "__main__":
    run_script(main, "sample.py")
