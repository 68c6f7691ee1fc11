"""
Launch settings of routing_kernel.py's kernels: per kernel, the register tile, warps and pipelining depth; which sites
share reads (lead_schedule); the entries tuned per width on an H200; the envelope the kernels take; and the launch
itself (Launcher: Triton's path once per kernel, then its compiled launcher directly). Kept apart so that tuning a
width (`python bench.py routing --tune-train`) edits a table, never a kernel.
"""
import functools
import os
import sys
from dataclasses import dataclass, fields, replace

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"   # Triton's CPU interpreter (how CI runs the kernels)


# ---- the settings and their launch geometry --------------------------------------------------------------------------

@dataclass(frozen=True)
class RoutingConfig:
    """How the kernels launch; per kernel (register-tile elements, warps, pipelining depth of the loop over sources)."""
    name: str = "default"
    fwd: tuple = (4096, 4, 4)                 # _chain_fwd
    site: tuple = (16384, 8, 3)               # _chain_bwd_site
    pairs: tuple = (1024, 2, 3)               # the pair pass in _chain_bwd_gather: its tile (warps, stages: the gather's)
    gather: tuple = (1024, 2, 3)              # _chain_bwd_gather
    fwd_lead: tuple | None = (4096, 4, 4)     # a forward that also runs the next sites' softmax; None: none leads
    fwd_lead_sites: int = 1       # how many later sites a leading forward runs (1-3): each reads only the sources since
    gather_lead: tuple | None = (1024, 2, 3)  # a gather that also sums the previous source's terms; None: none leads
    lead_min: int = 6             # a site leads if it reads >= this many tiles per token (its state: ~4 sources' bytes)
    stored_logits: bool = False   # the forward stores each pair's logit and the site pass loads it
    reducers: int = 16            # gather programs per head in the first level of the dw sum (1: one level, no ticket)
    split: tuple = ("fwd", "site")   # kernels that hold a head as two column parts (the gather ran 10% slower split)
    call_fwd: tuple = (4096, 4, 4)   # the per-call kernels, measured at the 8B delta shape (d 4096, H 8, 2 x 4096
    call_site: tuple = (8192, 8, 3)  # tokens): a site tile of 16384 made its 64 calls 72.2 ms instead of 65.7
    call_sources: tuple = (1024, 2, 3)
    # block routing's (routing_block.py): a program holds a token block over every head; the backward's programs are
    # persistent, block_waves per streaming multiprocessor (each sums its dw terms in registers: one partial a program).
    # One-warp programs, 8 a multiprocessor: the best geometric mean on the H200 where every pair of the backward's
    # settings was timed (1B and 350M MHAR, 350M single head: 3.96 ms against 5.31 for 4,096 elements on 4 warps x 2)
    block_fwd: tuple = (512, 1, 3)
    block_bwd: tuple = (512, 1, 3)
    block_waves: int = 8
    max_block_m: int = 256 if INTERPRET else 64   # tokens per program at most (the interpreter: few, big programs)
    direct: bool = True   # the chain calls its compiled kernels' launchers directly (Launcher, below)
    backward: str = "site"   # "gather": routing_gather.GatherChain's backward, no site pass (its queries need start's)
    gather_min_tokens: int = 0   # backward="gather" from this many tokens a pass (B x T); fewer: the site pass's
    gather_logits: bool = False   # the forward stores each pair's logit and routing_gather's gathers load it
    # routing_gather's gather and its leading form: the tile holds a token's every head (ptxas for sm_90: 1024 elements
    # on 4 warps keep every training width at 48-165 registers without spills; the site design's 4096-element gather
    # tile spilled here at d 1024)
    gather_bwd: tuple = (1024, 4, 3)
    gather_bwd_lead: tuple | None = (1024, 4, 3)   # None: no gather leads

    def __post_init__(self):
        if self.fwd_lead_sites not in (1, 2, 3):
            raise ValueError(f"RoutingConfig: fwd_lead_sites={self.fwd_lead_sites}; a leading forward runs 1, 2 or 3 "
                             "later sites")


DEFAULT = RoutingConfig()
# Per width (d, H), tuned on one H200 at the paper's training microbatches (Table 1) by `bench.py routing --tune-train`
# and A/B runs (BENCHMARKS.md). At 1B (heads of 128 + 32 columns) stored logits cost the kernels 16% / 8% (registers)
# and the two-level dw sum 0.8%; at 100M the paired gather was no faster (5.85 ms either way). The backward without
# the site pass (backward="gather", results/gather_backward/ab.py: both backwards in one process) is chosen where it
# was faster in the chain and in the step: the single head at d 512 (chain 0.70x; step 0.84x -> 0.90x of the
# baseline's tokens/s) and d 1024 (0.62x; 0.75x -> 0.84x), MHAR at 1B (0.92x; 0.80x -> 0.82x), for ~0.7 GB more
# memory (its fp32 site outputs). Elsewhere it was within 4% or slower (d 768: 1.08-1.14x, on DEFAULT's settings).
# The single head's every kernel then tuned at its training microbatch (results/gather_backward/tune_h1_full_h200.txt):
# one-warp gather tiles took the chain 6.54 -> 4.46 ms at d 512, 10.30 -> 6.57 at d 768, 9.82 -> 6.87 at d 1024 (gather
# backward), 15.10 -> 11.53 at d 1280 (site backward). MHAR's gather backward then tuned the same way (one process,
# results/gather_backward/tune_mhar_h200.txt): 5.89 -> 5.51 ms at d 512 (site -> gather), 10.17 -> 7.58 at d 768,
# 9.45 -> 8.86 at d 1024, 13.5 -> 11.30 at d 1280 (its leading gather); then dw's product in one launch a pass took
# every gather-backward chain 0.85-0.96x (the single head's d 1280 then too). gather_min_tokens: while dw ran per site,
# the site backward was faster at the paper's Table 5 shapes (fewer tokens: d 512, 4,096 tokens, 1.72 against 1.87 ms;
# d 1024, 1,024 tokens, 2.87 against 3.12) and MHAR's entries set it; since dw runs once the gather backward is the
# faster there too (1.54 against 1.73 ms; 2.43 against 2.87), and no entry sets it. gather_logits (the gathers load the
# forward's logits): the single head's chains 0.98x / 0.98x / 0.92x / 0.90x at d 512 / 768 / 1024 / 1280, MHAR's
# 1.00-1.15x (slower), results/gather_backward/logits_ab_h200.txt, and 1.01-1.10x from a token-major layout
# (logits_token_major_ab_h200.txt): so the single-head entries set it.
# With one accumulator in the gathers (routing_gather.py's header) the leading gather's one-warp tile at d 1280 went
# from among the slowest (13.66 against 11.30 ms, tune_mhar_h200.txt) to the fastest: the 1B chains 9.95 -> 8.76 ms
# (MHAR), 8.92 -> 7.66 (single head), results/gather_backward/accumulator_tune_h200.txt; at the other widths that
# retune moved < 1% (within the noise: their tiles kept).
# MHAR's gathers at d 512 take two tokens a program on one warp (1,024 elements): site w and each later site's c and
# lse then serve two tokens, 168 / 239 registers alone / leading against 124 / 135: its 100M chain 0.984x (4.59 ->
# 4.51 ms, errors identical); alone 0.995x, leading 0.990x; at d 768 and 1024 the leading form 1.12x / 1.58x (the
# register file: 255 and spills at d 1024), the single head at d 512 1.02x (gather_backward/two_tokens_ab_h200.txt).
# fwd_lead_sites (a leading forward runs the next 2 or 3 sites' softmax; results/forward_sharing/): MHAR's chains
# 0.98x at d 512 and d 1280 with 2 (in two processes each); d 1024 1.00x with 2, 0.99x with 3: within the noise, kept
# at 1; at d 768 a one-warp leading tile (DEFAULT's had stood) 0.95-0.96x, 2 sites on it no better; the single head
# none (0.99-1.06x, and 1.26x / 4.4x at d 1280, whose leading tile is 16,384 elements). d 768's other forwards on a
# one-warp 512-element tile (DEFAULT's 4,096-element, 4-warp tile held 255 registers and spilled): its MHAR chain
# 0.96x (6.68-6.89 against 6.97-7.09 ms, three rounds; results/gather_backward/fwd768_ab_h200.txt). Register caps
# (Triton's maxnreg) on the forwards and the gathers paid nowhere beyond 1% (maxnreg_ab_h200.txt): none ships.
# block_fwd, block_bwd, block_waves: block routing's (n = 8), tuned the same way (`bench.py routing --blocks=8
# --tune-train`, which searches block_bwd x block_waves together: one at a time left 1B MHAR at 4.70 ms, the product
# found 3.91); the backward's time moved up to 2x between tiles and again between wave counts: each width has its own.
TUNED_H200 = {
    (512, 4): dict(fwd=(1024, 2, 4), site=(512, 1, 3), gather=(1024, 2, 4), fwd_lead=(1024, 2, 3), fwd_lead_sites=2,
                   gather_lead=None, stored_logits=True, block_fwd=(1024, 2, 4), block_bwd=(512, 1, 3), block_waves=16,
                   backward="gather", gather_bwd=(1024, 1, 3), gather_bwd_lead=(1024, 1, 3)),
    # the single head: every kernel tuned (site, pairs, gather: the site-pass backward's, used when it is forced)
    (512, 1): dict(fwd=(512, 1, 3), site=(1024, 2, 4), pairs=(512, 1, 3), gather=(4096, 4, 3), fwd_lead=(512, 1, 3),
                   gather_lead=(4096, 4, 4), backward="gather", gather_bwd=(512, 1, 3), gather_bwd_lead=(512, 1, 3),
                   gather_logits=True, block_fwd=(512, 1, 3), block_bwd=(1024, 2, 3), block_waves=16),
    (768, 4): dict(fwd=(512, 1, 3), fwd_lead=(512, 1, 4), block_fwd=(512, 1, 3), block_bwd=(2048, 4, 3), block_waves=4,
                   backward="gather", gather_bwd=(512, 1, 3), gather_bwd_lead=(512, 1, 3)),
    (768, 1): dict(fwd=(512, 1, 3), gather=(4096, 4, 3), fwd_lead=(512, 1, 3), gather_lead=(512, 1, 3),
                   backward="gather", gather_bwd=(512, 1, 3), gather_bwd_lead=(512, 1, 3), gather_logits=True),
    (1024, 8): dict(fwd=(1024, 2, 3), site=(512, 1, 3), gather=(4096, 4, 4), fwd_lead=(512, 1, 3),
                    gather_lead=(4096, 4, 4), stored_logits=True, block_fwd=(512, 1, 3), block_bwd=(1024, 2, 3),
                    block_waves=8, backward="gather", gather_bwd=(512, 1, 3), gather_bwd_lead=(512, 1, 3)),
    (1024, 1): dict(fwd=(2048, 4, 3), site=(4096, 4, 4), pairs=(8192, 8, 3), gather=(8192, 8, 4), fwd_lead=(512, 1, 3),
                    gather_lead=(4096, 4, 4), backward="gather", gather_bwd=(512, 1, 3), gather_bwd_lead=(512, 1, 3),
                    gather_logits=True, block_fwd=(512, 1, 3), block_bwd=(512, 1, 3), block_waves=8),
    (1280, 8): dict(site=(4096, 4, 4), fwd_lead=(512, 1, 3), fwd_lead_sites=2, gather_lead=(1024, 2, 4), reducers=1,
                    backward="gather", gather_bwd=(1024, 2, 4), gather_bwd_lead=(512, 1, 3), block_fwd=(512, 1, 3),
                    block_bwd=(512, 1, 3), block_waves=8),
    # the gather backward since dw's product runs once a pass: 11.03 ms against the site backward's 11.50 (was 12.14)
    (1280, 1): dict(fwd=(512, 1, 3), site=(512, 1, 3), pairs=(4096, 4, 3), gather=(16384, 8, 3), fwd_lead=(16384, 8, 3),
                    gather_lead=(512, 1, 3), backward="gather", gather_bwd=(1024, 2, 4), gather_bwd_lead=(512, 1, 3),
                    gather_logits=True, block_fwd=(512, 1, 3), block_bwd=(512, 1, 3), block_waves=8),
}


def config_for(d, heads):
    """The launch settings for width d and `heads` routing heads: the tuned entry, or DEFAULT."""
    tuned = TUNED_H200.get((d, heads))
    return DEFAULT if tuned is None else replace(DEFAULT, name=f"H200 d={d} H={heads}", **tuned)


@functools.cache   # once per (config, width)
def announce(config, d, heads):
    """One line on stderr (rank 0) the first time a config runs at a width: which launch settings ran."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank()):
        diff = ", ".join(f"{f.name}={getattr(config, f.name)}" for f in fields(config)
                         if f.name != "name" and getattr(config, f.name) != getattr(DEFAULT, f.name))
        print(f"fused routing (d={d}, H={heads}): launch config {config.name!r}" + (f" ({diff})" if diff else ""),
              file=sys.stderr, flush=True)


def _block_m(tile, width, config):
    """Tokens per program: the power of two that fills `tile` register elements at this head width."""
    if INTERPRET:   # the interpreter runs programs one by one: few, large ones
        return config.max_block_m
    return min(config.max_block_m, 1 << max(0, (tile // width).bit_length() - 1))


def _split(D, split=True):
    """(D_A, BLOCK_B, lanes) of a head of width D held as two power-of-two column parts, a = [0, D_A) and b = [D_A, D_A +
    BLOCK_B) masked to D: split, 160 = 128 + 32, where one tile would pad to 256 (37.5% of the registers idle); else
    D_A = D padded to 2^k, BLOCK_B = 0 (the kernels' launch geometry: only called where Triton is)."""
    from triton import next_power_of_2
    p = 1 << (D.bit_length() - 1)
    if p == D or not split:
        return next_power_of_2(D), 0, next_power_of_2(D)
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


# ---- the launch itself ------------------------------------------------------------------------------------------------

class Launcher:
    """How a chain launches its kernels: launch(kernel, key, grid, warps, fresh, varying, fixed) is
    kernel[grid](**fixed(), **varying, num_warps=warps); fixed() builds the arguments that stay the same for the chain's
    life, `varying` the rest (same order at every call), `fresh` its tensors. Triton's own launch binds and specialises
    every argument at each call, and a chain launches a few specialisations 3N times per pass: so a key's first launch
    goes through Triton and keeps the compiled kernel and its arguments in signature order, and later launches fill in
    `varying` and call the launcher (eager chain: 0.62-0.69x the wall time on an H200 host). The fresh tensors' dtypes
    join the key; one off 16-byte alignment takes Triton's path (it specialises on it)."""

    def __init__(self, device, direct_ok):
        import triton
        self.ok, self.direct, self.bound = direct_ok, False, {}   # bound: key -> (launcher, kernel, metadata, args, slots)
        dev = torch.device(device)   # the launcher's stream is its device's (index None: the current device)
        self.device = torch.cuda.current_device() if dev.index is None and direct_ok and dev.type == "cuda" else dev.index
        self._stream = triton.runtime.driver.active.get_current_stream if direct_ok else None

    def refresh(self, wanted):
        """Direct launches if wanted and possible: launch hooks (a profiler's) need Triton's own launch path."""
        import triton
        hooks = triton.knobs.runtime
        self.direct = wanted and self.ok and all(
            h is None or getattr(h, "calls", None) == [] for h in (hooks.launch_enter_hook, hooks.launch_exit_hook))

    def launch(self, kernel, key, grid, warps, fresh, varying, fixed):
        key = (key, *[t.dtype for t in fresh])
        aligned = not any([t.data_ptr() & 15 for t in fresh])
        bound = self.bound.get(key) if aligned and self.direct else None
        if bound is not None:
            launcher, function, meta, args, slots = bound
            for i, v in zip(slots, varying.values()):
                args[i] = v
            launcher(*grid, *(1,) * (3 - len(grid)), self._stream(self.device), function, meta, None, None, None, *args)
            for i in slots:   # hold no tensor past its launch
                args[i] = None
            return
        args = {**fixed(), **varying}
        compiled = kernel[grid](**args, num_warps=warps)
        if aligned and self.direct:
            compiled, names = getattr(compiled, "result", lambda: compiled)(), kernel.arg_names
            self.bound[key] = (compiled.run, compiled.function, compiled.packed_metadata, [args[n] for n in names],
                               [names.index(k) for k in varying])
            for i in self.bound[key][4]:
                self.bound[key][3][i] = None
