"""
Launch settings of the fused routing kernels (routing_call.py, routing_kernel.py, routing_block.py): per kernel the
register tile, warps and pipelining depth; which sites share reads (lead_schedule); the entries tuned per width, a
table per card; and the envelope the kernels take. Kept apart so that tuning a width (`python bench.py routing
--tune-train`) edits a table, never a kernel. The lowest of the routing files: it imports none of them.
"""
import functools
import math
import os
import sys
from dataclasses import dataclass, fields, replace

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"   # Triton's CPU interpreter (how CI runs the kernels)


# ---- the settings and their launch geometry --------------------------------------------------------------------------

@dataclass(frozen=True)
class RoutingConfig:
    """How the kernels launch. A kernel's setting is (register-tile elements, warps, pipelining depth of its loop)."""
    name: str = "default"
    fwd: tuple = (4096, 4, 4)                 # _chain_fwd: a program owns a token block of one head
    fwd_lead: tuple | None = (4096, 4, 4)     # a forward that also runs the next sites' softmax; None: none leads
    fwd_lead_sites: int = 1                   # how many later sites a leading forward runs (1 or 2)
    gather: tuple = (1024, 4, 3)              # _gather_bwd: a program owns a token block over every head (1,024
                                              # elements on 4 warps spill at no training width)
    gather_lead: tuple | None = (1024, 4, 3)  # a gather that also sums the previous source's terms; None: none leads
    lead_min: int = 6            # a site leads if it reads >= this many tiles per token (its state: ~4 sources' bytes)
    stored_logits: bool = False  # the forward stores each pair's logit and the gathers load it instead of a dot
    call_fwd: tuple = (4096, 4, 4)     # rung 1's per-call kernels (routing_call.py), tuned at the 8B delta shape
    call_site: tuple = (8192, 8, 3)
    call_sources: tuple = (1024, 2, 3)
    # block routing's (routing_block.py): a program holds a token block over every head; the backward's programs are
    # persistent, block_waves per streaming multiprocessor (each sums its dw terms in registers: one partial a program)
    block_fwd: tuple = (512, 1, 3)
    block_bwd: tuple = (512, 1, 3)
    block_waves: int = 8
    max_block_m: int = 256 if INTERPRET else 64   # tokens per program at most (the interpreter: few, big programs)

    def __post_init__(self):
        if self.fwd_lead_sites not in (1, 2):
            raise ValueError(f"RoutingConfig: fwd_lead_sites={self.fwd_lead_sites}; a leading forward runs 1 or 2 later "
                             "sites")


DEFAULT = RoutingConfig()
# Per width (d, H), tuned on one H200 at the paper's training microbatches (Table 1): regenerate an entry with
# `python bench.py routing --tune-train --shapes=NAME` (--heads=1 for the single head, --blocks=8 for block_*).
# Why they differ (BENCHMARKS.md has the numbers): one-warp gather tiles keep a program's registers low enough for
# several programs a multiprocessor; the single head loads stored logits (its dot spans the whole width, MHAR's one
# head); two led sites pay only where the forward is short of bandwidth (d 512, d 1280).
TUNED_H200 = {
    (512, 4): dict(fwd=(1024, 2, 4), fwd_lead=(1024, 2, 3), fwd_lead_sites=2, gather=(1024, 1, 3),
                   gather_lead=(1024, 1, 3), block_fwd=(1024, 2, 4), block_bwd=(512, 1, 3), block_waves=16),
    (512, 1): dict(fwd=(512, 1, 3), fwd_lead=(512, 1, 3), gather=(512, 1, 3), gather_lead=(512, 1, 3),
                   stored_logits=True, block_fwd=(512, 1, 3), block_bwd=(1024, 2, 3), block_waves=16),
    (768, 4): dict(fwd=(512, 1, 3), fwd_lead=(512, 1, 4), gather=(512, 1, 3), gather_lead=(512, 1, 3),
                   block_fwd=(512, 1, 3), block_bwd=(2048, 4, 3), block_waves=4),
    (768, 1): dict(fwd=(512, 1, 3), fwd_lead=(512, 1, 3), gather=(512, 1, 3), gather_lead=(512, 1, 3),
                   stored_logits=True),
    (1024, 8): dict(fwd=(1024, 2, 3), fwd_lead=(512, 1, 3), gather=(512, 1, 3), gather_lead=(512, 1, 3),
                    block_fwd=(512, 1, 3), block_bwd=(1024, 2, 3), block_waves=8),
    (1024, 1): dict(fwd=(2048, 4, 3), fwd_lead=(512, 1, 3), gather=(512, 1, 3), gather_lead=(512, 1, 3),
                    stored_logits=True, block_fwd=(512, 1, 3), block_bwd=(512, 1, 3), block_waves=8),
    (1280, 8): dict(fwd_lead=(512, 1, 3), fwd_lead_sites=2, gather=(1024, 2, 4), gather_lead=(512, 1, 3),
                    block_fwd=(512, 1, 3), block_bwd=(512, 1, 3), block_waves=8),
    (1280, 1): dict(fwd=(512, 1, 3), fwd_lead=(16384, 8, 3), gather=(1024, 2, 4), gather_lead=(512, 1, 3),
                    stored_logits=True, block_fwd=(512, 1, 3), block_bwd=(512, 1, 3), block_waves=8),
}


# Tuned the same way on one H100 80GB HBM3 (an H100 of another make runs it too), at the paper's four widths with
# MHAR's head counts; each entry is the tuner's, starting from the H200's: its block_* settings are the H200's, not
# tuned on this card. Against the H200's entries it leads two sites from each forward at d 768 and d 1024 too (less
# bandwidth a multiprocessor to hide behind).
TUNED_H100 = {
    (512, 4): dict(fwd=(512, 1, 4), fwd_lead=(512, 1, 4), fwd_lead_sites=2, gather=(1024, 2, 3),
                   gather_lead=(1024, 1, 3), block_fwd=(1024, 2, 4), block_waves=16),
    (768, 4): dict(fwd=(512, 1, 3), fwd_lead=(512, 1, 4), fwd_lead_sites=2, gather=(512, 1, 3),
                   gather_lead=(512, 1, 4), block_bwd=(2048, 4, 3), block_waves=4),
    (1024, 8): dict(fwd=(512, 1, 4), fwd_lead=(512, 1, 4), fwd_lead_sites=2, gather=(2048, 4, 3),
                    gather_lead=(512, 1, 3), block_bwd=(1024, 2, 3)),
    (1280, 8): dict(fwd=(512, 1, 3), fwd_lead=(512, 1, 4), fwd_lead_sites=2, gather=(1024, 2, 3),
                    gather_lead=(512, 1, 4)),
}


# Each card's table, under a word of its name (torch.cuda.get_device_name()). A card without a table of its own, and
# Triton's CPU interpreter, run the H200's; a width a card's table lacks runs the H200's entry for it.
TABLES = {"H200": TUNED_H200, "H100": TUNED_H100}


def table_card():
    """The key in TABLES of the table this process runs: its GPU's own, else the H200's. Traced by torch.compile
    (is_available and get_device_properties fold to constants there)."""
    if not INTERPRET and torch.cuda.is_available():
        gpu = torch.cuda.get_device_properties().name
        for card in TABLES:
            if card in gpu:
                return card
    return "H200"


def config_for(d, heads, card=None):
    """The launch settings for width d and `heads` routing heads from card's table (None: table_card()), then, for what
    it lacks, the H200's: the tuned entry; for several heads without one, the full routing's settings of the same
    width's entry whose head count is nearest (fewer on a tie); else DEFAULT. A borrowed tile holds as much: a gather
    program holds a token's d channels over every head, a forward program BLOCK_M x d/H of one head's, so a tile of the
    same element count holds the same data at any head count (the per-head scalars aside). Block routing's settings
    are not borrowed: at d 768 with 8 heads H 4's were slower than DEFAULT's (BENCHMARKS). Traced by torch.compile:
    plain lists, no min(default=)."""
    cards = list(dict.fromkeys([card or table_card(), "H200"]))
    for c in cards:
        if (d, heads) in TABLES[c]:
            return replace(DEFAULT, name=f"{c} d={d} H={heads}", **TABLES[c][d, heads])
    for c in cards:
        near = [(abs(math.log2(h / heads)), h) for w, h in TABLES[c] if w == d and h > 1 and heads > 1]
        if near:
            h = min(near)[1]
            full = {k: v for k, v in TABLES[c][d, h].items() if not k.startswith("block_")}
            return replace(DEFAULT, name=f"{c} d={d} H={h}, for H={heads}", **full)
    return DEFAULT


@functools.cache   # once per (config, width)
def announce(config, d, heads):
    """One line on stderr (rank 0) the first time a config runs at a width: which launch settings ran."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank()):
        diff = ", ".join(f"{f.name}={getattr(config, f.name)}" for f in fields(config)
                         if f.name != "name" and getattr(config, f.name) != getattr(DEFAULT, f.name))
        print(f"fused routing (d={d}, H={heads}): launch config {config.name!r}" + (f" ({diff})" if diff else "")
              + _other_card(config), file=sys.stderr, flush=True)


def _other_card(config):
    """Said when a card's table entry runs on another GPU (a card without a table of its own runs the H200's): the card
    was seen for what it is."""
    card = config.name.split()[0]
    if card not in TABLES or INTERPRET or not torch.cuda.is_available():
        return ""
    gpu, own = torch.cuda.get_device_name(), table_card()
    return "" if card in gpu else f"; the {card}'s table on this {gpu}, " + (
        "which has no table of its own" if own == "H200" else f"whose own ({own}) has no entry here")


def _card_said():
    """Which table a tuned entry belongs to: the GPU's, under a word of its name in TABLES."""
    if INTERPRET or not torch.cuda.is_available():
        return "Triton's CPU interpreter (timings there say nothing of a GPU)"
    gpu = torch.cuda.get_device_name()
    card = table_card()
    return (f"this {gpu}, for TABLES[{card!r}]" if card in gpu else
            f"this {gpu}, for a table of its own (TABLES[<a word of {gpu!r}>], beside the H200's)")


def _spec(value):
    """What Triton can specialise a kernel on in one argument: a tensor's dtype and 16-byte alignment, else the value."""
    return (value.dtype, value.data_ptr() % 16 == 0) if isinstance(value, torch.Tensor) else value


class Launch:
    """One kernel at one grid and warp count, with the arguments that stay fixed for a pass (its buffers, widths, tile
    shapes, flags) bound once, and the rest given by name on each call. The kernel gets them all positionally, in its
    own order. An eager step launches about two kernels per routing site, and Triton's own launch binds, specialises
    and looks up every argument at every call (BENCHMARKS has the host cost per launch): so the first launch of each
    key goes through Triton, which compiles or finds the kernel and returns it, and later launches with that key call
    the compiled kernel itself (Triton's public CompiledKernel[grid](*args), given what Triton's own launch gives it).
    The key holds all Triton can specialise on among the per-call arguments (_spec) and the current device (a compiled
    kernel's handles are its device's); the bound arguments are the same at every call. A kernel Triton returned is
    also kept for every Launch of the same kernel, warps and bound arguments' specs (COMPILED): a pass without a
    backward makes a chain of its own (FusedRouter.start), whose launches would otherwise each be a first. Under the
    interpreter, and on Triton before 3.3 (whose compiled kernels took another argument list), every launch is
    Triton's."""

    COMPILED = {}   # (kernel, warps, bound arguments' specs, key) -> the kernel Triton returned, for every Launch
    COMPILED_MAX = 4096   # entries; past it COMPILED starts again (an eval of many sequence lengths adds one a length)

    def __init__(self, kernel, grid, num_warps, per_call, **bound):
        names = list(kernel.arg_names)
        given = set(bound) | set(per_call)
        if given != set(names) or set(bound) & set(per_call):
            raise TypeError(f"Launch({kernel.__name__}): missing {sorted(set(names) - given)}, unknown "
                            f"{sorted(given - set(names))}, both bound and per call {sorted(set(bound) & set(per_call))}")
        self.num_warps, self.bound, self.grid = num_warps, bound, (*grid, 1, 1)[:3]   # (a compiled kernel's: 3 axes)
        self.template = [bound.get(name) for name in names]
        self.slot = {name: names.index(name) for name in per_call}
        self.kernel = kernel[grid]
        self.compiled = None if INTERPRET or triton_version() < (3, 3) else {}   # key -> its compiled kernel's launch
        self.shared = (kernel, num_warps, *map(_spec, self.template))   # (a per-call slot's None: the same in each)

    def __call__(self, **per_call):
        if per_call.keys() != self.slot.keys():
            raise TypeError(f"Launch: given {sorted(per_call)}, expected {sorted(self.slot)}")
        args = self.template.copy()
        for name, slot in self.slot.items():
            args[slot] = per_call[name]
        if self.compiled is None:
            self.kernel(*args, num_warps=self.num_warps)
            return
        key = (torch.cuda.current_device(), *map(_spec, map(per_call.__getitem__, self.slot)))
        launch = self.compiled.get(key)
        if launch is not None:
            launch(*args)
            return
        compiled = self.COMPILED.get((self.shared, key))
        if compiled is None:   # Triton launches it, and returns the kernel it compiled or found
            if len(self.COMPILED) >= self.COMPILED_MAX:
                self.COMPILED.clear()
            compiled = self.COMPILED[self.shared, key] = self.kernel(*args, num_warps=self.num_warps)
        else:
            compiled[self.grid](*args)
        self.compiled[key] = compiled[self.grid]


def triton_version():
    """Triton's (major, minor)."""
    import triton
    return tuple(int(x) for x in triton.__version__.split(".")[:2])


def op_namespace(module, home, op):
    """The torch.library namespace of a routing module's operators: mhar for the repository's own module (named home),
    else one of its own: a copy imported under another name (an exported folder's, which transformers loads as a
    package of its own) or imported again registers its operators beside its own state."""
    import zlib
    base = "mhar" if module == home else f"mhar_{zlib.crc32(module.encode()):08x}"
    ns, k = base, 1
    while hasattr(getattr(torch.ops, ns), op):
        ns, k = f"{base}_{k}", k + 1
    return ns


def _block_m(tile, width, config):
    """Tokens per program: the power of two that fills `tile` register elements at this head width."""
    if INTERPRET:   # the interpreter runs programs one by one: few, large ones
        return config.max_block_m
    return min(config.max_block_m, 1 << max(0, (tile // width).bit_length() - 1))


def _split(D):
    """(D_A, BLOCK_B, lanes) of a head of width D held as two power-of-two column parts, a = [0, D_A) and b = [D_A, D_A +
    BLOCK_B) masked to D: 160 = 128 + 32, where one tile would pad to 256 (37.5% of the registers idle); a power of two
    is one part (BLOCK_B = 0). Only called where Triton is."""
    from triton import next_power_of_2
    p = 1 << (D.bit_length() - 1)
    if p == D:
        return D, 0, D
    b = next_power_of_2(D - p)
    return p, b, p + b


def check_envelope(d, heads, dtype):
    """Raise a ValueError naming the limit when the fused kernels cannot take this shape."""
    if d % heads:
        raise ValueError(f"fused routing: d={d} is not divisible by route_heads={heads}")
    if d // heads < 16:
        raise ValueError(f"fused routing: head width d/H = {d}/{heads} = {d // heads} is below 16 (H <= d/16); "
                         "use fewer route_heads or routing_impl='reference'")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fused routing: dtype {dtype} is not supported (bf16, fp16, fp32); use routing_impl='reference'")


def lead_schedule(N, lead_min, fwd_sites=1):
    """Leading sites (forward, gather), from the longest reads down while a leader reads >= lead_min: every
    (fwd_sites + 1)-th forward (each leads the fwd_sites after it), every other gather."""
    return (frozenset(j for j in range(N - fwd_sites, 0, -fwd_sites - 1) if j >= lead_min),   # site j reads j sources
            frozenset(j for j in range(2, N + 1, 2) if N - j + 1 >= lead_min))  # gather j reads N - j + 1 gradients


# ---- the tuner that writes a card's table (bench.py routing --tune-train) --------------------------------------------

TUNABLE = ("fwd", "fwd_lead", "fwd_lead_sites", "gather", "gather_lead", "stored_logits")   # the chain's settings
BLOCK_TUNABLE = ("block_fwd", "block_bwd", "block_waves")   # block routing's (--blocks)
# every setting DEFAULT and the tables ship is a candidate, so a retune can find them again (a test checks it)
CANDIDATES = [(512, 1, 3), (512, 1, 4), (1024, 1, 3), (1024, 2, 3), (1024, 2, 4), (1024, 4, 3), (2048, 4, 3),
              (4096, 4, 3), (4096, 4, 4), (4096, 8, 3), (8192, 8, 3), (8192, 8, 4), (16384, 8, 3)]
CHOICES = {"fwd_lead_sites": (1, 2), "stored_logits": (False, True),
           "block_waves": (1, 2, 4, 8, 16, 32)}   # programs a multiprocessor: up to 32, for one-warp programs


def tune(kernels, shapes, time_fn, candidates=CANDIDATES):
    """Coordinate descent, from config_for(d, H), over each setting in `kernels` at each shape (name, L, d, H, B, T),
    each candidate timed by time_fn(config, L, d, H, B, T) -> ms; _lead settings may also pick None (no sharing);
    block_bwd and block_waves, when both are asked for, are searched as a product (one at a time can stop short of it).
    Prints every timing and each width's entry for the table of the card it ran on (TABLES); returns the configs."""
    joint = "block_bwd" in kernels and "block_waves" in kernels
    tuned = []
    for name, L, d, H, B, T in shapes:
        cfg = config_for(d, H)
        for kernel in [k for k in kernels if not (joint and k == "block_waves")]:
            if joint and kernel == "block_bwd":
                options = [dict(block_bwd=c, block_waves=w) for c in candidates for w in CHOICES["block_waves"]]
            else:
                options = [{kernel: c} for c in CHOICES.get(kernel, candidates + ([None] if kernel.endswith("_lead") else []))]
            results = []
            for option in options:
                try:
                    ms = time_fn(replace(cfg, **option), L, d, H, B, T)
                except Exception as e:   # e.g. out of shared memory or registers: skip the candidate
                    print(f"tune {name} {option}: failed: {str(e)[:200]}", flush=True)
                    continue
                results.append((ms, str(option), option))
                print(f"tune {name} {str(option):44s} {ms:7.3f} ms", flush=True)
            cfg = replace(cfg, **min(results)[2])
        entry = {f.name: getattr(cfg, f.name) for f in fields(cfg)
                 if f.name != "name" and getattr(cfg, f.name) != getattr(DEFAULT, f.name)}
        print(f"tuned ({d}, {H}) on {_card_said()}: {entry}", flush=True)
        tuned.append(replace(cfg, name=f"tuned d={d} H={H}"))   # (its launch line says so, not the table it began from)
    return tuned
