"""
Fused Triton routing for attention residuals / MHAR: the whole depth history of one forward/backward
pass lives in one buffer, each source is read once per site forward and once per site backward.

Math (SPEC section 1, the paper's routing equation). Site j = 1..N (N = 2L+1) mixes sources s_0..s_{j-1}:
    r_n          = (mean_k s_n[k]^2 + eps)^(-1/2)          RMS over the FULL width d
    w            = q * g                                    (the key gain folded into the query)
    logit[n, h]  = r_n <w[h], s_n[h]>                       head h = channels [hD, (h+1)D), D = d / H
    alpha        = softmax_n(logit),   out[h] = sum_n alpha[n, h] s_n[h]
Backward at site j with upstream gradient G_j = dLoss/dout_j:
    da[n, h] = <G_j[h], s_n[h]>,  c[h] = sum_n alpha[n, h] da[n, h],  dlogit[n, h] = alpha[n, h] (da[n, h] - c[h])
    dw[h]    = sum_tokens sum_n dlogit[n, h] r_n s_n[h];   dq = dw * g,  dg = dw * q
    ds_n     = sum_{j > n} alpha_j[n] G_j  +  r_n u  -  (r_n^2 / d) K s_n,
               u[h] = sum_{j > n} dlogit_j[n, h] w_j[h],   K = sum_{j > n} sum_h dlogit_j[n, h] logit_j[n, h]
    (the RMS term needs <u, s_n> over the full width; <w_j[h], s_n[h]> = logit_j[n, h] / r_n turns it into
    the scalar K, so a program that owns one head never needs the other heads' vectors.)

Order of work. Autograd sees site j as a function of the newest source s_{j-1} (its input) and q_j, g_j.
Backward runs sites in reverse (N, N-1, ..., 1): when site j's backward runs, every later site's G is
known, so the gradient of s_{j-1} is gathered there once, completely, and returned to autograd.
    forward, site j   (_route_fwd):    write s_{j-1} and r_{j-1} into the buffer, online softmax over the
                                       j sources (each tile read once), store out and the per-head
                                       log-sum-exp; at the widths in STORED_LOGITS also each pair's logit
    backward, site j  (_route_bwd_site): read the j sources and G_j once: c, dw partials, and the per-pair
                                       scalar da (dlogit needs c, known only after the loop); the logit
                                       is loaded, or recomputed and stored (other widths)
    backward, pairs   (_route_bwd_pairs): site j's per-pair scalars, one program per (token block, source)
                                       with every head: alpha and dlogit in place of logit and da, and
                                       the head sum dlogit * logit that K needs (one scalar per pair)
    backward, gather  (_route_bwd_gather): read s_{j-1} once and G_{j'} of every site j' >= j once, with
                                       3 scalars per pair (its head's alpha and dlogit, the pair's K
                                       term); write ds_{j-1}; its first token blocks also reduce dq, dg
                                       (two levels, the last to finish sums the first level's rows)
Neighbouring sites share reads (v14, ahead_schedule): a leading forward also runs site j+1's online softmax over
s_0..s_{j-1}, one load of each tile serving both queries, and leaves its state (max, denominator, unnormalised
fp32 mix) for site j+1's launch, which adds only s_j; a leading gather also sums source j-2's terms over the
gradients G_j..G_N it loads anyway, and site j-1's gather adds only G_{j-1}. The forward does the same operations
in the same order as one launch per site (bitwise the same output where the leading launch's config, fwd_lead,
lays its tiles out as the plain one's does).
Deterministic: dw is reduced from per-program partials in a fixed order (the gather's one atomic, a ticket, only
picks which program runs the last, fixed-order sum); nothing else is accumulated across programs.

Layouts (M = B*T tokens, row-major, 64-bit offsets):
    S   [N, M, d]  sources, activation dtype      R   [N, M]     fp32 RMS factors
    W   [N, d]     fp32 w = q*g per site           LSE [N, H, M]  fp32 per-site log-sum-exp
    GB  [N, M, d]  upstream gradients, act. dtype  C   [N, H, M]  fp32 c per site
    DA, LG [P, H, M] fp32 per-pair da and logit (after the pair pass: dlogit and alpha), pair (j, n) at
                   j(j-1)/2 + n, P = N(N+1)/2          KP  [P, M]     fp32 sum_h dlogit * logit per pair
    PACC [M, d], PML [2, H, M], PK [M]  fp32 the one partial a leading launch hands the next (forward, then gather)
Dtypes: sources and gradients bf16 / fp16 / fp32; every reduction and the softmax in fp32.
Envelope: d % H == 0, D = d/H >= 16 (any D: the forward and the site pass hold a head as two power-of-two
column parts, D = 160 as 128 + 32, so a width that is a sum of two powers of two has no padded lanes); any number of
sources (tests: 145 on CUDA, up to 7 in CPU CI); M up to at least 2^21 tokens (64-bit offsets, checked
on an H200); T = 1 allowed. Outside it: ValueError naming the limit.

Cost model (bytes per (source, site) pair and channel; P = N(N+1)/2 pairs per token):
    forward reads each source once per site                                  2 bytes (bf16)
    backward site pass reads each source once per site                       2 bytes
    backward gather reads each site's stored G once per source it mixes      2 bytes
 => ~6 P d bytes per token (plus O(N d) for writing sources, outputs and gradients), against ~14 for a
    kernel that reads twice in backward and read-modify-writes an fp32 gradient buffer per pair.
    100M (d512, N25, 4096 tokens): 4.1 GB -> 0.98 ms at the H200's measured 4.18 TB/s copy bandwidth.
    Shared reads (v14) take the forward's 2 bytes toward ~1 (a follower reads 1 source and an fp32 partial, ~4
    sources' bytes written and read, instead of j + 1), and the gather's likewise where its pairing pays.
    Measured (BENCHMARKS.md), v5: 1.96 / 3.79 / 9.46 ms GPU time at the paper's Table 5 shapes (100M / 350M /
    1B), 50% / 49% / 54% of copy bandwidth; v7b: 2.14 / 3.65 / 8.38 ms, and 6.76 / 11.59 / 15.84 ms at the
    training microbatches (v5: 6.88 / 13.28 / 18.20); v8: 6.38 / 11.02 / 15.82 ms at the training
    microbatches and 1.92 / 3.28 / 8.39 ms at the Table 5 shapes; v13: 6.08 / 10.86 / 15.83 ms and
    1.87 / 3.29 / 8.39 ms; v14 (this file): 5.84-5.91 / 9.44 / 14.65 ms and 1.75 / 2.93 / 7.77 ms. Per site
    (100M training shape, v8): each kernel costs ~4 us per source it reads, i.e. copy bandwidth, plus ~26-30 us
    fixed (its O(d) reads and writes, at a fraction of that bandwidth).
    What limits it (Nsight Compute, 1B): too few warps to hide latency (the site pass needs ~250 registers per
    thread for its two fp32 accumulators: 8 warps per SM), and, up to v5, the gather's per-pair scalar loads of all H heads in every head's program (4H loads and H exps per pair and
    token: 83% of L1 throughput at 1B). v6 gave one gather program a token block with every head: 1.7-2.6x
    slower (1.3-1.5x at its best tile; not profiled, BENCHMARKS.md). v7 keeps per-head gather programs and
    moves the all-heads work to the small pair pass, once per pair: the gather loads 3 scalars per pair.
    Eager wall time is bound by ~120 us of Python per Triton launch; train.py --cuda_graph replays the whole
    step instead.
"""
import math
import os
import sys
import weakref

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the model falls back to the reference routing (model.py prints why)
    triton = None

# per kernel: (elements per [BLOCK_M, BLOCK_D] register tile, warps per program, software-pipelining depth of
# the loop over sources). fwd, site, gather: chosen with python routing_kernel.py --bench --tune on an H200
# (BENCHMARKS.md; the gather's tile before v7). pairs ([BLOCK_H, BLOCK_M] scalar tiles, no loop: stages unused):
# the best at all three training shapes with --tune-train when its programs still looped over the sources.
CONFIG = {"fwd": (4096, 4, 4), "site": (16384, 8, 3), "gather": (1024, 2, 3), "pairs": (1024, 2, 3)}
# per model width (d, H): configs measured at that model's training microbatch (paper Table 1: 100M 8 x 2048,
# 350M 4 x 1024, 1B 2 x 1024) on an H200, which can differ from the Table 5 shapes' best; kernels not listed use
# CONFIG, as do other widths. --tune-train of v7 (results/kernel/routing_v7_tune_train_h200.txt): 1B, the 350M gather;
# of v8b (routing_v8b_tune_train_h200.txt): 350M fwd; the extended tune of v8c (routing_v8c_tune_100m_h200.txt): 100M
# fwd, gather; the site pass at 100M / 350M: v13's A/B (chain_v13_h200.txt; small tiles pay off once the gather
# reduces their many dw partials in parallel). "fwd_lead" / "gather_lead": the launches that also do the next site's
# share (AHEAD_MIN; default: the kernel's own config), None where pairing did not pay; --tune-train of v14
# (routing_v14_tune_lead_*_h200.txt): at 100M the paired gather was no faster (5.85 ms unpaired, 5.85 at best paired).
SHAPE_CONFIG = {
    (512, 4): {"site": (512, 1, 3), "fwd": (1024, 2, 4), "gather": (1024, 2, 4),
               "fwd_lead": (1024, 2, 3), "gather_lead": None},
    (1024, 8): {"gather": (4096, 4, 4), "site": (512, 1, 3), "fwd": (1024, 2, 3),
                "fwd_lead": (512, 1, 3), "gather_lead": (4096, 4, 4)},
    (1280, 8): {"site": (4096, 4, 4), "fwd_lead": (512, 1, 3), "gather_lead": (1024, 2, 4)},
}
# model widths (d, H) whose forward stores each (site, source) logit for the backward site pass, which then loads it
# instead of a second dot product per source: site pass 2.54 -> 2.16 ms and 3.80 -> 3.64 ms per chain at the 100M /
# 350M training shapes, forward +1.5% / -1%. At 1B (heads of 160 = 128 + 32 columns) both kernels ran slower
# storing (forward +16%, site pass +8%: register pressure), so that width recomputes, as do widths not measured
# (BENCHMARKS.md, routing v8).
STORED_LOGITS = {(512, 4), (1024, 8)}
# kernels that split a head whose width is not a power of two into two column parts (_split); the gather is
# bound by its per-pair scalar loads, not by lanes, and ran 10% slower split at the 1B shape (BENCHMARKS.md)
SPLIT = ("fwd", "site")
# the delta-mode kernels (_delta_fwd, _delta_bwd_site, _delta_bwd_sources): measured at the 8B shape
# (d 4096, H 8, 2 x 4096 tokens): a site tile of 16384 made the 64 calls 72.2 ms against 65.7 ms with 8192
DELTA_CONFIG = {"fwd": (4096, 4, 4), "site": (8192, 8, 3), "sources": (1024, 2, 3)}
# programs per head that share the first level of the gather's dw reduction (_route_bwd_gather): with one, the 100M
# chain took 9.8 ms at its site tile of 512 (4096 partial rows summed by one program per head), 6.58 ms with 4 and
# 6.08-6.14 ms with 16 (results/kernel/chain_v13_reduce_split_h200.txt)
REDUCE_SPLIT = 16
# widths whose gather keeps one reducer (the first token block sums every partial, no ticket code compiled in): at
# 1B (128 partial rows) the two-level code cost the chain 0.8% whatever the split; one reducer matches v8
SINGLE_REDUCER = {(1280, 8)}
# v14: neighbouring sites share reads. A site's forward may also run the next site's softmax over the sources both
# read (the next launch then reads 1 source, not j + 1), and a site's gather may also sum the previous source's terms
# over the gradients both read (the next gather then reads 1 gradient, not N - j + 2). Each pairing writes an fp32
# [M, d] partial that the follower reads back, ~4 sources' worth of 16-bit bytes, so a site leads only when it reads
# at least AHEAD_MIN tiles per token; pairs are taken where they save most (forward: down from the last site, gather:
# up from the first source). None: no pairing.
AHEAD_MIN = 6
# tokens per program at most; Triton's CPU interpreter runs programs one by one, so it gets big blocks
MAX_BLOCK_M = 256 if os.environ.get("TRITON_INTERPRET", "0") == "1" else 64


def available(device):
    """Can the fused path run for tensors on `device`? (Triton on CUDA, or the interpreter on CPU)."""
    if triton is None:
        return False
    if torch.device(device).type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:

    @triton.jit
    def _rounded(x, dtype: tl.constexpr):
        """x (fp32) in dtype, rounded to nearest even. The GPU's cast already does this for bf16; Triton's CPU
        interpreter truncates, so the bf16 rounding is spelled out to make CPU tests check what the GPU computes."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        return x.to(dtype)

    @triton.jit
    def _rows(M, H: tl.constexpr, BLOCK_M: tl.constexpr):
        """This program's head h and token block pm (heads vary fastest: the H programs of a token block
        share L2 lines), its rows (64-bit: M * DM may pass 2^31) and their mask."""
        pid = tl.program_id(0)
        h = pid % H
        pm = pid // H
        rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        return h, pm, rows.to(tl.int64), rows < M

    @triton.jit
    def _part(h, rows64, rmask, C0: tl.constexpr, BLOCK: tl.constexpr, DM: tl.constexpr, D: tl.constexpr):
        """Columns [C0, C0 + BLOCK) of head h, masked to the head's width D: their offsets within the head,
        the column mask, the tile mask, and the tile's offsets in an [M, DM] row-major matrix."""
        cols = C0 + tl.arange(0, BLOCK)
        cmask = cols < D
        return cols, cmask, rmask[:, None] & cmask[None, :], rows64[:, None] * DM + h * D + cols[None, :]

    @triton.jit
    def _head_tile(M, DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """One [BLOCK_M, BLOCK_D] tile over the whole head (BLOCK_D = D padded to a power of two): the delta kernels."""
        h, pm, rows64, rmask = _rows(M, H, BLOCK_M)
        cols, cmask, mask, tile = _part(h, rows64, rmask, 0, BLOCK_D, DM, D)
        return h, pm, rows64, cols, rmask, cmask, mask, tile

    @triton.jit
    def _head_w(Q, G, h, cols, cmask, D: tl.constexpr):
        """w = q * g on columns `cols` of head h, fp32 (the key gain folded into the query)."""
        return tl.load(Q + h * D + cols, mask=cmask, other=0.0).to(tl.float32) * \
            tl.load(G + h * D + cols, mask=cmask, other=0.0).to(tl.float32)

    @triton.jit
    def _source(S, R, n, M, tile, mask, rows64, rmask, DM: tl.constexpr):
        """Tile of source n of a [N, M, DM] buffer (fp32) and its RMS factors from R [N, M]."""
        s = tl.load(S + (n * M).to(tl.int64) * DM + tile, mask=mask, other=0.0).to(tl.float32)
        return s, tl.load(R + (n * M).to(tl.int64) + rows64, mask=rmask, other=0.0)

    @triton.jit
    def _softmax_update(m_i, l_i, logit):
        """New running max, denominator, the factor that rescales the old mix, and the new source's weight."""
        m_new = tl.maximum(m_i, logit)
        scale = tl.exp(m_i - m_new)
        p = tl.exp(logit - m_new)
        return m_new, l_i * scale + p, scale, p

    @triton.jit
    def _online_softmax_step(m_i, l_i, acc, s, r, w):
        """Add source s (tile, fp32) with RMS factor r to the running max m_i, denominator l_i and mix acc."""
        m_i, l_i, scale, p = _softmax_update(m_i, l_i, r * tl.sum(s * w[None, :], axis=1))
        return m_i, l_i, acc * scale[:, None] + p[:, None] * s

    # The chain kernels hold a head of width D as up to two power-of-two column parts (_split): a = [0, D_A) and,
    # when BLOCK_B > 0, b = [D_A, D_A + BLOCK_B) masked to D. D = 160 runs as 128 + 32 with no padded lanes, where
    # one power-of-two tile would pad it to 256 (37.5% of the registers and instructions idle). Part b's code sits
    # under `if SPLIT:` (a constexpr: compiled out when one part covers the head); without it, its variables hold
    # part a's tensors (or a [1, 1] zero accumulator) as unused placeholders.

    @triton.jit
    def _dot2(x_a, y_a, x_b, y_b, SPLIT: tl.constexpr):
        """Row sums of x * y over both parts, [BLOCK_M] fp32."""
        out = tl.sum(x_a * y_a, axis=1)
        if SPLIT:
            out += tl.sum(x_b * y_b, axis=1)
        return out

    @triton.jit
    def _source_parts(S, R, n, M, tile_a, mask_a, tile_b, mask_b, rows64, rmask, DM: tl.constexpr, SPLIT: tl.constexpr):
        """Source n's column parts (fp32; part b = part a when not SPLIT) and RMS factors."""
        s_a, r = _source(S, R, n, M, tile_a, mask_a, rows64, rmask, DM)
        s_b = s_a
        if SPLIT:
            s_b = tl.load(S + (n * M).to(tl.int64) * DM + tile_b, mask=mask_b, other=0.0).to(tl.float32)
        return s_a, s_b, r

    @triton.jit
    def _mix_step(m_i, l_i, acc_a, acc_b, s_a, s_b, r, w_a, w_b, LG, pair, h, M, rows64, rmask, H: tl.constexpr,
                  SPLIT: tl.constexpr, STORE_LOGITS: tl.constexpr):
        """_online_softmax_step over a head held as one or two column parts; the source's logit r <w, s> is stored as
        pair `pair` (LG [P, H, M]) when STORE_LOGITS."""
        logit = r * _dot2(s_a, w_a[None, :], s_b, w_b[None, :], SPLIT)
        if STORE_LOGITS:
            tl.store(LG + (pair * H + h).to(tl.int64) * M + rows64, logit, mask=rmask)
        m_i, l_i, scale, p = _softmax_update(m_i, l_i, logit)
        acc_a = acc_a * scale[:, None] + p[:, None] * s_a
        if SPLIT:
            acc_b = acc_b * scale[:, None] + p[:, None] * s_b
        return m_i, l_i, acc_a, acc_b

    @triton.jit(do_not_specialize=["j"])
    def _route_fwd(
        S,      # [N, M, DM] sources; slot j-1 is written here with the newest source
        R,      # [N, M] fp32 RMS factors; slot j-1 is written here
        NEW,    # [M, DM] the newest source s_{j-1} (this site's autograd input), contiguous
        Q, G,   # [DM] this site's query and key gain
        W,      # [N, DM] fp32 w = q*g; row j-1 is written here (read again by the backward gathers)
        OUT,    # [M, DM] routed output, activation dtype
        LSE,    # [N, H, M] fp32 log-sum-exp of the logits; row j-1 is written here
        LG,     # [P, H, M] fp32 per-pair logits; pairs (j, 0..j-1) are written here when STORE_LOGITS (training)
        Q2, G2, # [DM] the next site's query and key gain (read if LEAD)
        PACC,   # [M, DM] fp32 the next site's unnormalised mix over s_0..s_{j-1} (written if LEAD, read if FOLLOW)
        PML,    # [2, H, M] fp32 its running max and denominator (same)
        M, j, eps,
        DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, D_A: tl.constexpr, BLOCK_B: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, STAGES: tl.constexpr, STORE_LOGITS: tl.constexpr,
        LEAD: tl.constexpr, FOLLOW: tl.constexpr,
    ):
        # LEAD: site j also runs site j+1's online softmax over the sources both read (s_0..s_{j-1}), one load of each
        # tile serving both queries, and leaves its state (max, denominator, unnormalised mix) in PML / PACC.
        # FOLLOW (site j-1 led): resume that state and add only the newest source. The same operations in the same
        # order as one launch over all j sources (identical results when both launches use one tile layout; a
        # different fwd_lead config may reduce a row's dot product in another order); site j reads 1 source, not j.
        SPLIT: tl.constexpr = BLOCK_B > 0
        h, pm, rows64, rmask = _rows(M, H, BLOCK_M)
        slot = (j - 1).to(tl.int64) * M * DM
        pair0 = j * (j - 1) // 2   # pair (j, n) of head h: LG + ((pair0 + n) * H + h) * M

        # RMS factor of the newest source over the full width (every head program needs it)
        sumsq = tl.zeros((BLOCK_M,), tl.float32)
        for c0 in tl.static_range(0, DM, BLOCK_C):
            cc = c0 + tl.arange(0, BLOCK_C)
            x = tl.load(NEW + rows64[:, None] * DM + cc[None, :], mask=rmask[:, None] & (cc[None, :] < DM), other=0.0)
            x = x.to(tl.float32)
            sumsq += tl.sum(x * x, axis=1)
        r_new = 1.0 / tl.sqrt(sumsq / DM + eps)
        tl.store(R + (j - 1).to(tl.int64) * M + rows64, r_new, mask=rmask & ((rows64 * 0 + h) == 0))   # one head writes r

        # the newest source into its slot; w = q*g (token block 0 stores it for the backward)
        cols_a, cmask_a, mask_a, tile_a = _part(h, rows64, rmask, 0, D_A, DM, D)
        tile_b, mask_b = tile_a, mask_a
        new_a = tl.load(NEW + tile_a, mask=mask_a, other=0.0)
        tl.store(S + slot + tile_a, new_a, mask=mask_a)
        w_a = _head_w(Q, G, h, cols_a, cmask_a, D)
        tl.store(W + (j - 1) * DM + h * D + cols_a, w_a, mask=cmask_a & ((cols_a * 0 + pm) == 0))
        acc_a = tl.zeros((BLOCK_M, D_A), tl.float32)
        new_b, w_b, acc_b = new_a, w_a, tl.zeros((1, 1), tl.float32)
        if SPLIT:
            cols_b, cmask_b, mask_b, tile_b = _part(h, rows64, rmask, D_A, BLOCK_B, DM, D)
            new_b = tl.load(NEW + tile_b, mask=mask_b, other=0.0)
            tl.store(S + slot + tile_b, new_b, mask=mask_b)
            w_b = _head_w(Q, G, h, cols_b, cmask_b, D)
            tl.store(W + (j - 1) * DM + h * D + cols_b, w_b, mask=cmask_b & ((cols_b * 0 + pm) == 0))
            acc_b = tl.zeros((BLOCK_M, BLOCK_B), tl.float32)

        # online softmax over the older sources, then the newest one from registers
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        ml = (h * M).to(tl.int64) + rows64   # this head's rows of PML
        if FOLLOW:   # s_0..s_{j-2}: mixed by site j-1's launch
            m_i = tl.load(PML + ml, mask=rmask, other=float("-inf"))
            l_i = tl.load(PML + H * M + ml, mask=rmask, other=0.0)
            acc_a = tl.load(PACC + tile_a, mask=mask_a, other=0.0)
            if SPLIT:
                acc_b = tl.load(PACC + tile_b, mask=mask_b, other=0.0)
        # the next site's state (placeholders unless LEAD)
        m2, l2, acc2_a, acc2_b, w2_a, w2_b = m_i, l_i, acc_a, acc_b, w_a, w_b
        pair1 = pair0 + j   # pair (j+1, n) at pair1 + n
        if LEAD:
            w2_a = _head_w(Q2, G2, h, cols_a, cmask_a, D)
            acc2_a = tl.zeros((BLOCK_M, D_A), tl.float32)
            if SPLIT:
                w2_b = _head_w(Q2, G2, h, cols_b, cmask_b, D)
                acc2_b = tl.zeros((BLOCK_M, BLOCK_B), tl.float32)
        # (the logits are kept for the backward site pass, which then needs neither w nor a second dot product)
        if not FOLLOW:
            for n in tl.range(0, j - 1, num_stages=STAGES):
                s_a, s_b, r = _source_parts(S, R, n, M, tile_a, mask_a, tile_b, mask_b, rows64, rmask, DM, SPLIT)
                m_i, l_i, acc_a, acc_b = _mix_step(m_i, l_i, acc_a, acc_b, s_a, s_b, r, w_a, w_b, LG, pair0 + n, h, M,
                                                   rows64, rmask, H, SPLIT, STORE_LOGITS)
                if LEAD:
                    m2, l2, acc2_a, acc2_b = _mix_step(m2, l2, acc2_a, acc2_b, s_a, s_b, r, w2_a, w2_b, LG, pair1 + n, h,
                                                       M, rows64, rmask, H, SPLIT, STORE_LOGITS)
        # (the newest source stays in its 16-bit dtype until here: in fp32 across the loop it costs the 1B shape
        # ~10 registers per thread, one fewer program per SM, and 50% more forward time)
        new_a, new_b = new_a.to(tl.float32), new_b.to(tl.float32)
        m_i, l_i, acc_a, acc_b = _mix_step(m_i, l_i, acc_a, acc_b, new_a, new_b, r_new, w_a, w_b, LG, pair0 + j - 1, h, M,
                                           rows64, rmask, H, SPLIT, STORE_LOGITS)
        if LEAD:
            m2, l2, acc2_a, acc2_b = _mix_step(m2, l2, acc2_a, acc2_b, new_a, new_b, r_new, w2_a, w2_b, LG, pair1 + j - 1,
                                               h, M, rows64, rmask, H, SPLIT, STORE_LOGITS)
            tl.store(PML + ml, m2, mask=rmask)
            tl.store(PML + H * M + ml, l2, mask=rmask)
            tl.store(PACC + tile_a, acc2_a, mask=mask_a)
            if SPLIT:
                tl.store(PACC + tile_b, acc2_b, mask=mask_b)
        tl.store(OUT + tile_a, _rounded(acc_a / l_i[:, None], OUT.dtype.element_ty), mask=mask_a)
        if SPLIT:
            tl.store(OUT + tile_b, _rounded(acc_b / l_i[:, None], OUT.dtype.element_ty), mask=mask_b)
        tl.store(LSE + ((j - 1) * H + h).to(tl.int64) * M + rows64, m_i + tl.log(l_i), mask=rmask)

    @triton.jit
    def _grad_part(GIN, GB, W, slot, j, h, cols, cmask, mask, tile, DM: tl.constexpr, D: tl.constexpr):
        """One column part of site j's upstream gradient (copied into its GB slot, returned in fp32) and of w."""
        g = tl.load(GIN + tile, mask=mask, other=0.0)
        tl.store(GB + slot + tile, g, mask=mask)
        return g.to(tl.float32), tl.load(W + (j - 1) * DM + h * D + cols, mask=cmask, other=0.0)

    @triton.jit(do_not_specialize=["j"])
    def _route_bwd_site(
        S, R, W, LSE,   # as in _route_fwd (read)
        GIN,            # [M, DM] upstream gradient of this site's output, contiguous
        GB,             # [N, M, DM] upstream gradients of every site; slot j-1 is written here
        LG,             # [P, H, M] fp32 per-pair logits: read if the forward stored them, else written here
        DA,             # [P, H, M] fp32 per-pair <G, s_n>; pairs (j, 0..j-1) written here
        C,              # [N, H, M] fp32 c = sum_n alpha da per site; row j-1 written here
        PART,           # [num_token_blocks, DM] fp32 per-program partial sums of dw
        M, j,
        DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, D_A: tl.constexpr, BLOCK_B: tl.constexpr,
        BLOCK_M: tl.constexpr, STAGES: tl.constexpr, LOGITS_STORED: tl.constexpr,
    ):
        SPLIT: tl.constexpr = BLOCK_B > 0
        h, pm, rows64, rmask = _rows(M, H, BLOCK_M)
        slot = (j - 1).to(tl.int64) * M * DM
        part = PART + pm.to(tl.int64) * DM + h * D
        cols_a, cmask_a, mask_a, tile_a = _part(h, rows64, rmask, 0, D_A, DM, D)
        tile_b, mask_b = tile_a, mask_a
        g_a, w_a = _grad_part(GIN, GB, W, slot, j, h, cols_a, cmask_a, mask_a, tile_a, DM, D)   # (w: unused if
        p_a = tl.zeros((BLOCK_M, D_A), tl.float32)                                               # LOGITS_STORED)
        q_a = tl.zeros((BLOCK_M, D_A), tl.float32)
        g_b, w_b, p_b, q_b = g_a, w_a, tl.zeros((1, 1), tl.float32), tl.zeros((1, 1), tl.float32)
        if SPLIT:
            cols_b, cmask_b, mask_b, tile_b = _part(h, rows64, rmask, D_A, BLOCK_B, DM, D)
            g_b, w_b = _grad_part(GIN, GB, W, slot, j, h, cols_b, cmask_b, mask_b, tile_b, DM, D)
            p_b = tl.zeros((BLOCK_M, BLOCK_B), tl.float32)
            q_b = tl.zeros((BLOCK_M, BLOCK_B), tl.float32)
        site = ((j - 1) * H + h).to(tl.int64) * M + rows64
        lse = tl.load(LSE + site, mask=rmask, other=0.0)
        pair0 = j * (j - 1) // 2
        pair = (pair0 * H + h).to(tl.int64) * M + rows64   # offsets of pair (j, 0) of head h; + n * H * M

        # one pass over the sources: c = sum_n alpha da, and dw = sum_n alpha r (da - c) s = P - c Q per token.
        # dlogit = alpha (da - c) needs c, which is known only at the end: store da per pair and let the pair
        # pass form dlogit (no second pass here). c from <G, out> before the loop would need one accumulator, but
        # out exists only rounded to 16 bits: 1.1-1.9x the reference's bf16 gradient error (BENCHMARKS.md, v8a).
        c = tl.zeros((BLOCK_M,), tl.float32)
        # The two paths differ only in where the logit comes from; each keeps the instruction order measured best
        # (BENCHMARKS.md, v8c / v8e): the 1B site pass is at its register limit, where an address kept live across
        # the iteration cost it 22%.
        for n in tl.range(0, j, num_stages=STAGES):
            s_a, s_b, r = _source_parts(S, R, n, M, tile_a, mask_a, tile_b, mask_b, rows64, rmask, DM, SPLIT)
            if LOGITS_STORED:
                off = pair + (n * M).to(tl.int64) * H
                alpha = tl.exp(tl.load(LG + off, mask=rmask, other=0.0) - lse)
                da = _dot2(g_a, s_a, g_b, s_b, SPLIT)
                tl.store(DA + off, da, mask=rmask)
                c += alpha * da
                fq = (alpha * r)[:, None]
                fp = fq * da[:, None]
            else:
                logit = r * _dot2(s_a, w_a[None, :], s_b, w_b[None, :], SPLIT)
                alpha = tl.exp(logit - lse)
                da = _dot2(g_a, s_a, g_b, s_b, SPLIT)
                c += alpha * da
                fp = (alpha * da * r)[:, None]
                fq = (alpha * r)[:, None]
            p_a += fp * s_a
            q_a += fq * s_a
            if SPLIT:
                p_b += fp * s_b
                q_b += fq * s_b
            if not LOGITS_STORED:
                off = ((pair0 + n) * H + h).to(tl.int64) * M + rows64
                tl.store(DA + off, da, mask=rmask)
                tl.store(LG + off, logit, mask=rmask)
        tl.store(C + site, c, mask=rmask)
        tl.store(part + cols_a, tl.sum(p_a - c[:, None] * q_a, axis=0), mask=cmask_a)
        if SPLIT:
            tl.store(part + cols_b, tl.sum(p_b - c[:, None] * q_b, axis=0), mask=cmask_b)

    @triton.jit
    def _sum_rows(PART, lo, hi, h, cols, cmask, DM: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                  CACHE: tl.constexpr):
        """Rows [lo, hi) of a [rows, DM] fp32 matrix summed in a fixed order, on columns `cols` of head h."""
        RB: tl.constexpr = 16
        acc = tl.zeros((BLOCK,), tl.float32)
        for b0 in range(lo, hi, RB):
            b = b0 + tl.arange(0, RB)
            part = tl.load(PART + b.to(tl.int64)[:, None] * DM + h * D + cols[None, :],
                           mask=(b[:, None] < hi) & cmask[None, :], other=0.0, cache_modifier=CACHE)
            acc += tl.sum(part, axis=0)
        return acc

    @triton.jit
    def _store_dqg(dw, Q, G, DQG, h, cols, cmask, DM: tl.constexpr, D: tl.constexpr):
        """dq = dw g, dg = dw q on columns `cols` of head h."""
        q = tl.load(Q + h * D + cols, mask=cmask, other=0.0).to(tl.float32)
        g = tl.load(G + h * D + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(DQG + h * D + cols, dw * g, mask=cmask)
        tl.store(DQG + DM + h * D + cols, dw * q, mask=cmask)

    @triton.jit(do_not_specialize=["j"])
    def _route_bwd_pairs(
        LSE, C,           # [N, H, M] fp32 (read)
        DA, LG,           # [P, H, M] fp32: site j's pairs hold da and logit; rewritten as dlogit and alpha
        KP,               # [P, M] fp32 sum_h dlogit * logit of site j's pairs (written)
        M, j,
        H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr,
    ):
        # One program per (token block, source n of site j) with every head ([BLOCK_H, BLOCK_M] tiles, tokens
        # contiguous): each per-pair scalar is read, exponentiated and written once, where the gathers' per-head
        # programs would each need every head's scalars for K (the RMS term couples the heads). Given the site's
        # lse and c the sources are independent, so they are a grid axis (a loop over them left a site's
        # M / BLOCK_M programs, 8-16 at the paper's shapes, to run one after another).
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = (j * (j - 1) // 2 + tl.program_id(1)).to(tl.int64)
        rows64 = rows.to(tl.int64)
        heads = tl.arange(0, BLOCK_H)
        rmask = rows < M
        mask = (heads[:, None] < H) & rmask[None, :]
        site = ((j - 1) * H + heads[:, None]).to(tl.int64) * M + rows64[None, :]
        off = (pair * H + heads[:, None]) * M + rows64[None, :]
        lg = tl.load(LG + off, mask=mask, other=0.0)
        alpha = tl.exp(lg - tl.load(LSE + site, mask=mask, other=0.0))
        dlogit = alpha * (tl.load(DA + off, mask=mask, other=0.0) - tl.load(C + site, mask=mask, other=0.0))
        tl.store(LG + off, alpha, mask=mask)
        tl.store(DA + off, dlogit, mask=mask)
        tl.store(KP + pair * M + rows64, tl.sum(dlogit * lg, axis=0), mask=rmask)

    @triton.jit(do_not_specialize=["j", "n_sites", "n_blocks", "K"])
    def _route_bwd_gather(
        S, R, W, GB, PART,                   # as above (read)
        PART2,                               # [K, DM] fp32 second-level dw partials (written, then read)
        TICKET,                              # [H] int32 per-head count of finished first-level reductions (0 between
                                             # launches: the last program resets it)
        DL, AL,                              # [P, H, M] fp32 per-pair dlogit and alpha (the pair pass's output)
        KP,                                  # [P, M] fp32 sum_h dlogit * logit per pair
        Q, G,                                # [DM] this site's query and key gain
        DS,                                  # [M, DM] gradient of source n = j-1, activation dtype
        DQG,                                 # [2, DM] fp32 gradients of q and g of this site
        PACC,                                # [M, DM] fp32 source n-1's sum over sites j..N (written if LEAD, read
        PK,                                  # [M] fp32 and its K over them                  by site j-1 if FOLLOW)
        M, j, n_sites, n_blocks, K, inv_dm,
        DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, D_A: tl.constexpr, BLOCK_B: tl.constexpr,
        BLOCK_M: tl.constexpr, STAGES: tl.constexpr, TWO_LEVEL: tl.constexpr,
        LEAD: tl.constexpr, FOLLOW: tl.constexpr,
    ):
        # LEAD: one load of each gradient tile G_j' (j' = j..N) serves source n = j-1 and source n-1, whose sum over
        # those sites (alpha G + r dlogit w, and K) is left in PACC / PK. FOLLOW (site j+1 led): start from that sum
        # and read only this site's G_j. Source n-1's gather then reads 1 gradient instead of N - j + 2.
        SPLIT: tl.constexpr = BLOCK_B > 0
        h, pm, rows64, rmask = _rows(M, H, BLOCK_M)
        n = j - 1
        src = (n * M).to(tl.int64) * DM
        r = tl.load(R + (n * M).to(tl.int64) + rows64, mask=rmask, other=0.0)
        cols_a, cmask_a, mask_a, tile_a = _part(h, rows64, rmask, 0, D_A, DM, D)
        tile_b, mask_b = tile_a, mask_a
        s_a = tl.load(S + src + tile_a, mask=mask_a, other=0.0).to(tl.float32)
        acc_a = tl.zeros((BLOCK_M, D_A), tl.float32)     # sum_j' alpha_j'[n] G_j'  (+ r u of sites j+1..N if FOLLOW)
        u_a = tl.zeros((BLOCK_M, D_A), tl.float32)       # sum_j' dlogit_j'[n] w_j'
        acc_b, u_b = tl.zeros((1, 1), tl.float32), tl.zeros((1, 1), tl.float32)
        if SPLIT:
            cols_b, cmask_b, mask_b, tile_b = _part(h, rows64, rmask, D_A, BLOCK_B, DM, D)
            acc_b = tl.zeros((BLOCK_M, BLOCK_B), tl.float32)
            u_b = tl.zeros((BLOCK_M, BLOCK_B), tl.float32)
        k = tl.zeros((BLOCK_M,), tl.float32)             # sum_j' sum_h dlogit_j'[n, h] logit_j'[n, h]
        last = n_sites
        if FOLLOW:
            acc_a = tl.load(PACC + tile_a, mask=mask_a, other=0.0)
            if SPLIT:
                acc_b = tl.load(PACC + tile_b, mask=mask_b, other=0.0)
            k = tl.load(PK + rows64, mask=rmask, other=0.0)
            last = j
        acc2_a, u2_a, acc2_b, u2_b, k2 = acc_a, u_a, acc_b, u_b, k   # source n-1's sums (placeholders unless LEAD)
        if LEAD:
            acc2_a, u2_a, k2 = tl.zeros_like(acc_a), tl.zeros_like(u_a), tl.zeros_like(k)
            acc2_b, u2_b = tl.zeros_like(acc_b), tl.zeros_like(u_b)
        for jp in tl.range(j, last + 1, num_stages=STAGES):   # every site that reads source n
            pair = (jp * (jp - 1) // 2 + n).to(tl.int64)
            own = (pair * H + h) * M + rows64
            a_h = tl.load(AL + own, mask=rmask, other=0.0)[:, None]
            dl_h = tl.load(DL + own, mask=rmask, other=0.0)[:, None]
            k += tl.load(KP + pair * M + rows64, mask=rmask, other=0.0)
            gbase = ((jp - 1) * M).to(tl.int64) * DM
            wbase = (jp - 1) * DM + h * D
            g_a = tl.load(GB + gbase + tile_a, mask=mask_a, other=0.0).to(tl.float32)
            w_a = tl.load(W + wbase + cols_a, mask=cmask_a, other=0.0)[None, :]
            acc_a += a_h * g_a
            u_a += dl_h * w_a
            g_b, w_b = g_a, w_a
            if SPLIT:
                g_b = tl.load(GB + gbase + tile_b, mask=mask_b, other=0.0).to(tl.float32)
                w_b = tl.load(W + wbase + cols_b, mask=cmask_b, other=0.0)[None, :]
                acc_b += a_h * g_b
                u_b += dl_h * w_b
            if LEAD:   # pair (jp, n-1) sits just before pair (jp, n)
                a_h = tl.load(AL + own - H * M, mask=rmask, other=0.0)[:, None]
                dl_h = tl.load(DL + own - H * M, mask=rmask, other=0.0)[:, None]
                k2 += tl.load(KP + (pair - 1) * M + rows64, mask=rmask, other=0.0)
                acc2_a += a_h * g_a
                u2_a += dl_h * w_a
                if SPLIT:
                    acc2_b += a_h * g_b
                    u2_b += dl_h * w_b
        if LEAD:
            r2 = tl.load(R + ((n - 1) * M).to(tl.int64) + rows64, mask=rmask, other=0.0)[:, None]
            tl.store(PACC + tile_a, acc2_a + r2 * u2_a, mask=mask_a)
            if SPLIT:
                tl.store(PACC + tile_b, acc2_b + r2 * u2_b, mask=mask_b)
            tl.store(PK + rows64, k2, mask=rmask & ((rows64 * 0 + h) == 0))   # one head writes K (the same in all)
        rk = (r * r * k * inv_dm)[:, None]
        tl.store(DS + tile_a, _rounded(acc_a + r[:, None] * u_a - rk * s_a, DS.dtype.element_ty), mask=mask_a)
        if SPLIT:
            s_b = tl.load(S + src + tile_b, mask=mask_b, other=0.0).to(tl.float32)
            tl.store(DS + tile_b, _rounded(acc_b + r[:, None] * u_b - rk * s_b, DS.dtype.element_ty), mask=mask_b)

        # this site's dw from the site pass's n_blocks partials, in two levels and a fixed order (deterministic):
        # the first K token blocks each sum a contiguous chunk of them into PART2[pm]; the last of a head's K programs
        # to finish (a ticket per head) sums PART2's K rows in order and writes dq = dw g, dg = dw q. One program
        # summing all n_blocks rows alone was the tail of the short gathers, and made small site-pass tiles slow.
        if not TWO_LEVEL:   # K = 1: the first token block sums them all (no ticket)
            if pm == 0:
                dw_a = _sum_rows(PART, 0, n_blocks, h, cols_a, cmask_a, DM, D, D_A, "")
                _store_dqg(dw_a, Q, G, DQG, h, cols_a, cmask_a, DM, D)
                if SPLIT:
                    dw_b = _sum_rows(PART, 0, n_blocks, h, cols_b, cmask_b, DM, D, BLOCK_B, "")
                    _store_dqg(dw_b, Q, G, DQG, h, cols_b, cmask_b, DM, D)
        elif pm < K:
            chunk = tl.cdiv(n_blocks, K)
            lo = pm * chunk
            hi = tl.minimum(lo + chunk, n_blocks)
            tl.store(PART2 + pm * DM + h * D + cols_a, _sum_rows(PART, lo, hi, h, cols_a, cmask_a, DM, D, D_A, ""),
                     mask=cmask_a)
            if SPLIT:
                tl.store(PART2 + pm * DM + h * D + cols_b,
                         _sum_rows(PART, lo, hi, h, cols_b, cmask_b, DM, D, BLOCK_B, ""), mask=cmask_b)
            tl.debug_barrier()   # every thread's stores issued before the (releasing) ticket
            if tl.atomic_add(TICKET + h, 1, sem="acq_rel") == K - 1:
                # (.cg: the other programs' rows are read at L2, where their stores went, not through this SM's L1)
                dw_a = _sum_rows(PART2, 0, K, h, cols_a, cmask_a, DM, D, D_A, ".cg")
                _store_dqg(dw_a, Q, G, DQG, h, cols_a, cmask_a, DM, D)
                if SPLIT:
                    dw_b = _sum_rows(PART2, 0, K, h, cols_b, cmask_b, DM, D, BLOCK_B, ".cg")
                    _store_dqg(dw_b, Q, G, DQG, h, cols_b, cmask_b, DM, D)
                tl.atomic_xchg(TICKET + h, 0)   # ready for the next site's gather

    # ---- per-call routing for delta mode (SPEC section 5): a few sources, no chain state --------------
    # Sources of a call: the site's null vector (broadcast over tokens) first, then the stacked history
    # HIST [N, M, d] (embedding + completed block deltas) with RMS factors R [N, M] computed once per block.

    @triton.jit
    def _null_source(NULL, h, cols, cmask, eps, DM: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
        """The null vector's tile (its head slice, broadcast over the rows) and RMS factor (per row)."""
        sumsq = 0.0
        for c0 in tl.static_range(0, DM, BLOCK_C):
            cc = c0 + tl.arange(0, BLOCK_C)
            v = tl.load(NULL + cc, mask=cc < DM, other=0.0).to(tl.float32)
            sumsq += tl.sum(v * v, axis=0)
        r = tl.zeros((BLOCK_M,), tl.float32) + 1.0 / tl.sqrt(sumsq / DM + eps)
        s = tl.zeros((BLOCK_M, BLOCK_D), tl.float32) + tl.load(NULL + h * D + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        return s, r

    @triton.jit
    def _delta_fwd(
        HIST, R,        # [N, M, DM] history sources, [N, M] fp32 RMS factors
        NULL, Q, G,     # [DM] this site's null source, query and key gain
        OUT,            # [M, DM] routed output, the history's dtype
        LSE,            # [H, M] fp32 log-sum-exp of the logits (saved for backward)
        M, N, eps,
        DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, STAGES: tl.constexpr,
    ):
        h, pm, rows64, cols, rmask, cmask, mask, tile = _head_tile(M, DM, H, D, BLOCK_M, BLOCK_D)
        w = _head_w(Q, G, h, cols, cmask, D)
        s, r = _null_source(NULL, h, cols, cmask, eps, DM, D, BLOCK_M, BLOCK_D, BLOCK_C)
        m_i, l_i, acc = _online_softmax_step(tl.full((BLOCK_M,), float("-inf"), tl.float32), tl.zeros((BLOCK_M,), tl.float32),
                                             tl.zeros((BLOCK_M, BLOCK_D), tl.float32), s, r, w)
        for n in tl.range(0, N, num_stages=STAGES):
            s, r = _source(HIST, R, n, M, tile, mask, rows64, rmask, DM)
            m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, r, w)
        tl.store(OUT + tile, _rounded(acc / l_i[:, None], OUT.dtype.element_ty), mask=mask)
        tl.store(LSE + h.to(tl.int64) * M + rows64, m_i + tl.log(l_i), mask=rmask)

    @triton.jit
    def _delta_pass_step(c, acc_p, acc_q, s, r, w, g_up, lse, DA, LG, off, rmask):
        """One source of the backward site pass: accumulate c, P, Q; store da and the logit."""
        logit = r * tl.sum(s * w[None, :], axis=1)
        alpha = tl.exp(logit - lse)
        da = tl.sum(g_up * s, axis=1)
        tl.store(DA + off, da, mask=rmask)
        tl.store(LG + off, logit, mask=rmask)
        return c + alpha * da, acc_p + (alpha * da * r)[:, None] * s, acc_q + (alpha * r)[:, None] * s

    @triton.jit
    def _delta_bwd_site(
        HIST, R, NULL, Q, G, LSE,   # as in _delta_fwd (read)
        GOUT,                       # [M, DM] upstream gradient, contiguous
        DA, LG,                     # [N+1, H, M] fp32 per-source da and logit (source 0 = the null vector)
        C,                          # [H, M] fp32 c = sum_n alpha da
        PART,                       # [num_token_blocks, DM] fp32 partial sums of dw
        M, N, eps,
        DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, STAGES: tl.constexpr,
    ):
        h, pm, rows64, cols, rmask, cmask, mask, tile = _head_tile(M, DM, H, D, BLOCK_M, BLOCK_D)
        w = _head_w(Q, G, h, cols, cmask, D)
        g_up = tl.load(GOUT + tile, mask=mask, other=0.0).to(tl.float32)
        lse = tl.load(LSE + h.to(tl.int64) * M + rows64, mask=rmask, other=0.0)
        s, r = _null_source(NULL, h, cols, cmask, eps, DM, D, BLOCK_M, BLOCK_D, BLOCK_C)
        c, acc_p, acc_q = _delta_pass_step(tl.zeros((BLOCK_M,), tl.float32), tl.zeros((BLOCK_M, BLOCK_D), tl.float32),
                                           tl.zeros((BLOCK_M, BLOCK_D), tl.float32), s, r, w, g_up, lse, DA, LG,
                                           h.to(tl.int64) * M + rows64, rmask)
        for n in tl.range(0, N, num_stages=STAGES):
            s, r = _source(HIST, R, n, M, tile, mask, rows64, rmask, DM)
            c, acc_p, acc_q = _delta_pass_step(c, acc_p, acc_q, s, r, w, g_up, lse, DA, LG,
                                               ((n + 1) * H + h).to(tl.int64) * M + rows64, rmask)
        tl.store(C + h.to(tl.int64) * M + rows64, c, mask=rmask)
        tl.store(PART + pm.to(tl.int64) * DM + h * D + cols, tl.sum(acc_p - c[:, None] * acc_q, axis=0), mask=cmask)

    @triton.jit
    def _delta_source_grad(s, r, g_up, w, n, DA, LG, lse_all, c_all, heads, hmask, own, rows64, M, inv_dm, H: tl.constexpr):
        """ds of one source: alpha G + r dlogit w - (r^2 / d) K s, K = sum_h dlogit logit (all heads)."""
        off = ((n * H + heads[:, None]) * M).to(tl.int64) + rows64[None, :]
        lg = tl.load(LG + off, mask=hmask, other=0.0)
        alpha = tl.exp(lg - lse_all)
        dlogit = alpha * (tl.load(DA + off, mask=hmask, other=0.0) - c_all)
        k = tl.sum(dlogit * lg, axis=0)
        a_h = tl.sum(tl.where(own, alpha, 0.0), axis=0)
        dl_h = tl.sum(tl.where(own, dlogit, 0.0), axis=0)
        return a_h[:, None] * g_up + (r * dl_h)[:, None] * w[None, :] - (r * r * k * inv_dm)[:, None] * s

    @triton.jit
    def _delta_bwd_sources(
        HIST, R, NULL, Q, G, LSE, GOUT, DA, LG, C,   # as above (read)
        DHIST,                                       # [N, M, DM] gradient of the history, its dtype
        PARTNULL,                                    # [num_token_blocks, DM] fp32 partial sums of the null's gradient
        M, N, eps, inv_dm,
        DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, STAGES: tl.constexpr,
    ):
        h, pm, rows64, cols, rmask, cmask, mask, tile = _head_tile(M, DM, H, D, BLOCK_M, BLOCK_D)
        heads = tl.arange(0, BLOCK_H)
        hmask = (heads[:, None] < H) & rmask[None, :]
        own = heads[:, None] == h
        w = _head_w(Q, G, h, cols, cmask, D)
        g_up = tl.load(GOUT + tile, mask=mask, other=0.0).to(tl.float32)
        hoff = (heads[:, None] * M).to(tl.int64) + rows64[None, :]
        lse_all = tl.load(LSE + hoff, mask=hmask, other=0.0)
        c_all = tl.load(C + hoff, mask=hmask, other=0.0)
        s, r = _null_source(NULL, h, cols, cmask, eps, DM, D, BLOCK_M, BLOCK_D, BLOCK_C)
        ds = _delta_source_grad(s, r, g_up, w, 0, DA, LG, lse_all, c_all, heads, hmask, own, rows64, M, inv_dm, H)
        tl.store(PARTNULL + pm.to(tl.int64) * DM + h * D + cols, tl.sum(tl.where(mask, ds, 0.0), axis=0), mask=cmask)
        for n in tl.range(0, N, num_stages=STAGES):
            s, r = _source(HIST, R, n, M, tile, mask, rows64, rmask, DM)
            ds = _delta_source_grad(s, r, g_up, w, n + 1, DA, LG, lse_all, c_all, heads, hmask, own, rows64, M, inv_dm, H)
            tl.store(DHIST + (n * M).to(tl.int64) * DM + tile, _rounded(ds, DHIST.dtype.element_ty), mask=mask)



def _block_m(tile, width):
    """Tokens per program: the power of two that fills `tile` register elements at this head width."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":   # no registers to spare there: fewer, larger programs
        return MAX_BLOCK_M
    return min(MAX_BLOCK_M, 1 << max(0, (tile // width).bit_length() - 1))


def _split(D, split=True):
    """The chain kernels' column parts of a head of width D: (D_A, BLOCK_B, lanes). Split: D_A is the largest power
    of two below D and BLOCK_B covers the rest, so D = 160 runs as 128 + 32 with no padded lanes (one
    power-of-two tile would pad it to 256: 37.5% of the registers and instructions idle). One part (D a power of
    two, or split=False): D_A is D padded to a power of two and BLOCK_B = 0 compiles part b out."""
    p = 1 << (D.bit_length() - 1)
    if p == D or not split:
        d_a = triton.next_power_of_2(D)
        return d_a, 0, d_a
    b = triton.next_power_of_2(D - p)
    return p, b, p + b


def ahead_schedule(N):
    """Leading sites (forward, gather) of an N-site chain: forward site j mixes site j+1's older sources, gather j
    sums source j-2's gradients; site j reads j sources forward and N - j + 1 gradients in the gather."""
    if AHEAD_MIN is None:
        return frozenset(), frozenset()
    fwd = frozenset(j for j in range(N - 1, 0, -2) if j >= AHEAD_MIN)
    gather = frozenset(j for j in range(2, N + 1, 2) if N - j + 1 >= AHEAD_MIN)
    return fwd, gather


def check_envelope(d, heads, dtype):
    """Raise a ValueError naming the limit when the fused kernels cannot take this shape."""
    if d % heads:
        raise ValueError(f"fused routing: d={d} is not divisible by route_heads={heads}")
    if d // heads < 16:
        raise ValueError(f"fused routing: head width d/H = {d}/{heads} = {d // heads} is below 16 (H <= d/16); "
                         "use fewer route_heads or routing_impl='reference'")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fused routing: dtype {dtype} is not supported (bf16, fp16, fp32); use routing_impl='reference'")


class RoutingChain:
    """The buffers and the bookkeeping of one forward/backward pass over all N sites.

    Contract: sites run forward in order 1..N and backward in exact reverse order N..1, once; a second
    forward may not start while the first one's backward is pending. Activation checkpointing may wrap
    sublayers, never routing calls (their recomputation would run a site's forward during backward)."""

    def __init__(self, n_sites, tokens, d, heads, eps, dtype, device, training):
        check_envelope(d, heads, dtype)
        self.N, self.M, self.d, self.H, self.D, self.eps = n_sites, tokens, d, heads, d // heads, eps
        self.dtype, self.device, self.training = dtype, device, training
        self.launch = {}   # kernel -> (grid, BLOCK_M, num_warps, stages, column or head constexprs)
        own = SHAPE_CONFIG.get((d, heads), {})
        for name in list(CONFIG) + ["fwd_lead", "gather_lead"]:
            base = name.removesuffix("_lead")
            if name in own and own[name] is None:   # this width does not pair sites in that kernel
                self.launch[name] = None
                continue
            tile, warps, stages = own.get(name) or own.get(base) or CONFIG[base]
            if name == "pairs":   # a program per token block and source (the grid's second axis), every head
                block_h = triton.next_power_of_2(heads)
                bm = min(1024, triton.next_power_of_2(max(1, tile // block_h)))
                self.launch[name] = ((triton.cdiv(tokens, bm),), bm, warps, stages, dict(BLOCK_H=block_h))
                continue
            d_a, block_b, lanes = _split(self.D, split=base in SPLIT)
            bm = _block_m(tile, lanes)
            self.launch[name] = ((triton.cdiv(tokens, bm) * heads,), bm, warps, stages, dict(D_A=d_a, BLOCK_B=block_b))
        self.n_blocks = triton.cdiv(tokens, self.launch["site"][1])   # token blocks of the dw partials
        self.stored_logits = training and (d, heads) in STORED_LOGITS   # the forward writes them for the site pass
        N, M, H = n_sites, tokens, heads
        self.S = torch.empty(N, M, d, dtype=dtype, device=device)
        self.R = torch.empty(N, M, dtype=torch.float32, device=device)
        self.W = torch.empty(N, d, dtype=torch.float32, device=device)
        self.LSE = torch.empty(N, H, M, dtype=torch.float32, device=device)
        if training:
            P = N * (N + 1) // 2
            self.GB = torch.empty(N, M, d, dtype=dtype, device=device)
            self.DA = torch.empty(P, H, M, dtype=torch.float32, device=device)   # da, then dlogit
            self.LG = torch.empty(P, H, M, dtype=torch.float32, device=device)   # logits (forward), then alpha
            self.C = torch.empty(N, H, M, dtype=torch.float32, device=device)
            self.KP = torch.empty(P, M, dtype=torch.float32, device=device)
            self.PART = torch.empty(self.n_blocks, d, dtype=torch.float32, device=device)
            # the gather's first-level dw reducers: at most REDUCE_SPLIT programs per head, each over >= 1 partial row
            split = 1 if (d, heads) in SINGLE_REDUCER else REDUCE_SPLIT
            gathers = [self.launch[k][0][0] // heads for k in ("gather", "gather_lead") if self.launch[k]]
            self.K = max(1, min(split, self.n_blocks, *gathers))
            self.PART2 = torch.empty(self.K, d, dtype=torch.float32, device=device)
            self.TICKET = torch.zeros(heads, dtype=torch.int32, device=device)
        self.fwd_lead, self.gather_lead = ahead_schedule(N)
        if self.launch["fwd_lead"] is None:
            self.fwd_lead = frozenset()
        if self.launch["gather_lead"] is None or not training:
            self.gather_lead = frozenset()
        if self.fwd_lead or self.gather_lead:   # one partial at a time: the forward's is used up before the backward
            self.PACC = torch.empty(M, d, dtype=torch.float32, device=device)
            self.PML = torch.empty(2, H, M, dtype=torch.float32, device=device)
            self.PK = torch.empty(M, dtype=torch.float32, device=device)
        else:
            self.PACC = self.PML = self.PK = self.R   # unused placeholders
        self.following = False   # the previous launch (forward: site j-1; backward: gather j+1) led this one
        self.next_fwd, self.next_bwd, self.sentinel = 1, None, None

    def matches(self, n_sites, tokens, d, heads, dtype, device):
        return (self.N, self.M, self.d, self.H, self.dtype, self.S.device) == (n_sites, tokens, d, heads, dtype, torch.device(device))

    def pending(self):
        """True while a forward's graph is alive and its backward has not finished."""
        return self.sentinel is not None and self.sentinel() is not None and self.next_bwd != 0

    def forward_site(self, j, new_source, q, g, q_next=None, g_next=None):
        if self.next_bwd is not None:
            raise RuntimeError(
                f"fused routing: site {j} ran forward after this pass's forward had finished (its backward is pending "
                "or running). Activation checkpointing may wrap sublayers, never routing calls; or use routing_impl='reference'")
        if j != self.next_fwd:
            raise RuntimeError(f"fused routing: site {j} ran forward, expected site {self.next_fwd} (sites run 1..N in order)")
        M, d = self.M, self.d
        out = torch.empty(M, d, dtype=self.dtype, device=new_source.device)
        lead = j in self.fwd_lead and q_next is not None and not self.following
        grid, bm, warps, stages, parts = self.launch["fwd_lead" if lead else "fwd"]
        _route_fwd[grid](self.S, self.R, new_source, q, g, self.W, out, self.LSE, self.LG if self.training else self.LSE,
                         q_next if lead else q, g_next if lead else g, self.PACC, self.PML,
                         M, j, self.eps, DM=d, H=self.H, D=self.D, **parts, BLOCK_M=bm,
                         BLOCK_C=min(1024, triton.next_power_of_2(d)), STAGES=stages, STORE_LOGITS=self.stored_logits,
                         LEAD=lead, FOLLOW=self.following, num_warps=warps)
        self.next_fwd, self.following = j + 1, lead
        if j == self.N:
            self.next_bwd, self.following = self.N, False
        return out

    def backward_site(self, j, grad_out, q, g):
        if self.next_bwd != j:
            expected = "none (the backward already finished)" if self.next_bwd == 0 else f"site {self.next_bwd}"
            raise RuntimeError(
                f"fused routing: backward reached site {j}, expected {expected}. Backward must run once, in exact "
                "reverse site order, over the whole chain: a loss built from an intermediate routing output, a "
                "second backward through the same graph, or a routing call inside activation checkpointing breaks "
                "it. Use routing_impl='reference' for such graphs")
        M, d = self.M, self.d
        if grad_out.dtype != self.dtype or not grad_out.is_contiguous():
            grad_out = grad_out.to(self.dtype).contiguous()
        grid, bm, warps, stages, parts = self.launch["site"]
        _route_bwd_site[grid](self.S, self.R, self.W, self.LSE, grad_out, self.GB, self.LG, self.DA, self.C, self.PART,
                              M, j, DM=d, H=self.H, D=self.D, **parts, BLOCK_M=bm,
                              STAGES=stages, LOGITS_STORED=self.stored_logits, num_warps=warps)
        grid, bm, warps, _, parts = self.launch["pairs"]
        _route_bwd_pairs[grid + (j,)](self.LSE, self.C, self.DA, self.LG, self.KP, M, j, H=self.H, **parts,
                                      BLOCK_M=bm, num_warps=warps)
        ds = torch.empty(M, d, dtype=self.dtype, device=grad_out.device)
        dqg = torch.empty(2, d, dtype=torch.float32, device=grad_out.device)
        lead = j in self.gather_lead and not self.following
        grid, bm, warps, stages, parts = self.launch["gather_lead" if lead else "gather"]
        _route_bwd_gather[grid](self.S, self.R, self.W, self.GB, self.PART, self.PART2, self.TICKET, self.DA, self.LG,
                                self.KP, q, g, ds, dqg, self.PACC, self.PK, M, j, self.N, self.n_blocks, self.K, 1.0 / d,
                                DM=d, H=self.H, D=self.D, **parts, BLOCK_M=bm, STAGES=stages, TWO_LEVEL=self.K > 1,
                                LEAD=lead, FOLLOW=self.following, num_warps=warps)
        self.next_bwd, self.following = j - 1, lead
        return ds, dqg[0].to(q.dtype), dqg[1].to(g.dtype)


class _Sentinel:
    pass


class _RouteSite(torch.autograd.Function):
    @staticmethod
    def forward(ctx, new_source, q, g, chain, j, q_next, g_next):
        out = chain.forward_site(j, new_source, q, g, q_next, g_next)
        ctx.chain, ctx.j = chain, j
        ctx.save_for_backward(q, g)
        if j == 1:   # the graph holds the sentinel: when the graph is freed without backward, the chain is free
            ctx.sentinel = _Sentinel()
            chain.sentinel = weakref.ref(ctx.sentinel)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, g = ctx.saved_tensors
        ds, dq, dg = ctx.chain.backward_site(ctx.j, grad_out, q, g)
        return ds, dq, dg, None, None, None, None


class FusedRouter:
    """One per model. start() returns the chain of one forward pass (buffers reused across steps);
    route() runs one site. Forward-only passes (torch.no_grad) get their own buffers."""

    def __init__(self, n_sites, heads, eps):
        self.N, self.H, self.eps = n_sites, heads, eps
        self.chain = None

    def start(self, x):
        B, T, d = x.shape
        if not torch.is_grad_enabled():
            return RoutingChain(self.N, B * T, d, self.H, self.eps, x.dtype, x.device, training=False)
        c = self.chain
        if c is not None and c.pending():
            raise RuntimeError(
                "fused routing: a second forward started before the first forward's backward. The fused path "
                "keeps one depth history per model: call backward first, run evaluation under torch.no_grad(), "
                "or use routing_impl='reference'")
        if c is None or not c.matches(self.N, B * T, d, self.H, x.dtype, x.device):
            self.chain = c = None   # free the old buffers before allocating new ones
            c = self.chain = RoutingChain(self.N, B * T, d, self.H, self.eps, x.dtype, x.device, training=True)
        c.next_fwd, c.next_bwd, c.sentinel, c.following = 1, None, None, False
        return c

    @staticmethod
    @torch.compiler.disable   # opaque to torch.compile: Triton launches with side effects on the chain
    def route(chain, j, new_source, q, g, q_next=None, g_next=None):
        """Site j of the chain; new_source (B, T, d) is s_{j-1}; returns the routed (B, T, d) input. q_next, g_next:
        site j+1's query and gain, which let this launch share its reads with site j+1's (ahead_schedule); their
        gradients come from site j+1's call."""
        B, T, d = new_source.shape
        x = new_source.to(chain.dtype).reshape(B * T, d).contiguous()
        if q_next is not None:
            q_next, g_next = q_next.detach(), g_next.detach()
        if chain.training and torch.is_grad_enabled():
            out = _RouteSite.apply(x, q, g, chain, j, q_next, g_next)
        else:
            out = chain.forward_site(j, x, q, g, q_next, g_next)
        return out.view(B, T, d)


# ---- delta mode: one stateless autograd Function per routing call ---------------------------------------

def rms_factors(hist, eps):
    """fp32 RMS factors (N, ...) of stacked sources (N, ..., d), computed once per block of delta sites.
    Not differentiated: route_delta's backward carries the RMS term itself."""
    with torch.no_grad():
        ms = torch.linalg.vector_norm(hist, dim=-1, dtype=torch.float32).pow_(2).div_(hist.size(-1))
        return torch.rsqrt(ms.add_(eps))


class _DeltaRoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hist, r, null, q, g, heads, eps):
        N, M, d = hist.shape
        check_envelope(d, heads, hist.dtype)
        D = d // heads
        block_d = triton.next_power_of_2(D)
        tile, warps, stages = DELTA_CONFIG["fwd"]
        bm = _block_m(tile, block_d)
        out = torch.empty(M, d, dtype=hist.dtype, device=hist.device)
        lse = torch.empty(heads, M, dtype=torch.float32, device=hist.device)
        _delta_fwd[(triton.cdiv(M, bm) * heads,)](hist, r, null, q, g, out, lse, M, N, eps, DM=d, H=heads, D=D,
                                                   BLOCK_M=bm, BLOCK_D=block_d, BLOCK_C=min(1024, triton.next_power_of_2(d)),
                                                   STAGES=stages, num_warps=warps)
        ctx.save_for_backward(hist, r, null, q, g, lse)
        ctx.heads, ctx.eps = heads, eps
        return out

    @staticmethod
    def backward(ctx, gout):
        hist, r, null, q, g, lse = ctx.saved_tensors
        N, M, d = hist.shape
        H, D = ctx.heads, d // ctx.heads
        block_d, block_c = triton.next_power_of_2(D), min(1024, triton.next_power_of_2(d))
        gout = gout.to(hist.dtype).contiguous()
        scal = dict(dtype=torch.float32, device=hist.device)
        da, lg, c = torch.empty(N + 1, H, M, **scal), torch.empty(N + 1, H, M, **scal), torch.empty(H, M, **scal)
        tile, warps, stages = DELTA_CONFIG["site"]
        bm = _block_m(tile, block_d)
        part = torch.empty(triton.cdiv(M, bm), d, **scal)
        _delta_bwd_site[(triton.cdiv(M, bm) * H,)](hist, r, null, q, g, lse, gout, da, lg, c, part, M, N, ctx.eps,
                                                    DM=d, H=H, D=D, BLOCK_M=bm, BLOCK_D=block_d, BLOCK_C=block_c,
                                                    STAGES=stages, num_warps=warps)
        tile, warps, stages = DELTA_CONFIG["sources"]
        bm = _block_m(tile, block_d)
        dhist = torch.empty_like(hist)
        partnull = torch.empty(triton.cdiv(M, bm), d, **scal)
        _delta_bwd_sources[(triton.cdiv(M, bm) * H,)](hist, r, null, q, g, lse, gout, da, lg, c, dhist, partnull,
                                                       M, N, ctx.eps, 1.0 / d, DM=d, H=H, D=D, BLOCK_M=bm,
                                                       BLOCK_D=block_d, BLOCK_C=block_c,
                                                       BLOCK_H=triton.next_power_of_2(H), STAGES=stages, num_warps=warps)
        dw = part.sum(0)
        return (dhist, None, partnull.sum(0).to(null.dtype), (dw * g.float()).to(q.dtype), (dw * q.float()).to(g.dtype),
                None, None)


@torch.compiler.disable
def route_delta(hist, r, null, q, g, heads, eps):
    """Delta-mode routing of one site: sources = [null, *hist]; hist (N, B, T, d), r = rms_factors(hist).
    Stateless (each call saves its own inputs), so it composes with FSDP and activation checkpointing."""
    N, B, T, d = hist.shape
    out = _DeltaRoute.apply(hist.reshape(N, B * T, d).contiguous(), r.reshape(N, B * T).contiguous(),
                            null.to(hist.dtype).contiguous(), q, g, heads, eps)
    return out.view(B, T, d)


# -----------------------------------------------------------------------------
# quick check and timing: python routing_kernel.py [--bench]

def _chain(route_site, source0, qs, gs, sublayer):
    """N routing sites; source j = sublayer(j, output of site j), like a model with its sublayers."""
    x = source0
    for j in range(len(qs)):
        x = route_site(j, x, qs[j], gs[j], *((qs[j + 1], gs[j + 1]) if j + 1 < len(qs) else (None, None)))
        if j < len(qs) - 1:
            x = sublayer(j, x)
    return x


def _reference_site(model_route):
    hist = []

    def site(j, x, q, g, *_):
        if j == 0:
            hist.clear()
        hist.append(x)
        return model_route(torch.stack(hist), q, g)
    return site


def main(argv):
    from model import route_reference
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not available("cpu"):
        sys.exit("routing_kernel.py: no CUDA device; run with TRITON_INTERPRET=1 for the CPU interpreter")
    # correctness: fused vs reference, every gradient, on an awkward shape (and the paper's shapes on a GPU)
    shapes = [(5, 1, 33, 96, 4, torch.float32)]
    if device == "cuda":
        shapes += [(25, 2, 2048, 512, 4, torch.bfloat16), (49, 1, 1024, 1024, 8, torch.bfloat16), (73, 1, 1024, 1280, 8, torch.bfloat16)]
    for N, B, T, d, H, dtype in shapes:
        errs = check_against_reference(N, B, T, d, H, dtype, device)
        print(f"check N={N} B={B} T={T} d={d} H={H} {str(dtype):15s} " + " ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    if "--bench" not in argv or device != "cuda":
        return
    if "--check-large" in argv:   # 64-bit offsets: 2^21 tokens x d 1024 = 2^31 elements per source
        print("check 2^21 tokens:", check_large(device), flush=True)
    from triton.testing import do_bench
    x = torch.empty(2**28, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), return_mode="median")
    copy_bw = 2 * x.numel() * 2 / ms / 1e6     # GB/s: bytes read + written over milliseconds
    print(f"device-to-device copy: {copy_bw:.0f} GB/s ({torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__})")
    del x, y
    if "--delta" in argv:   # issue 4 only: delta routing of an 8B Llama (32 layers, 8 blocks), 2 x 4096 tokens
        rows = []
        for impl in ("fused", "reference-ckpt"):
            t, mem = time_delta(impl, device)
            rows.append(dict(shape="8B-delta", impl=impl, ms=t, peak_gb=mem))
            print(f"8B delta   {impl:15s} {t:8.1f} ms  peak {mem:.2f} GB  (64 sites, H 8, 2 x 4096 tokens, d 4096)", flush=True)
        print(f"fused is {rows[1]['ms'] / rows[0]['ms']:.2f}x faster than the checkpointed reference")
        return _write_rows(rows, copy_bw)
    shapes = [("100M", 12, 512, 4, 2, 2048), ("350M", 24, 1024, 8, 1, 1024), ("1B", 36, 1280, 8, 1, 1024),
              ("100M-train", 12, 512, 4, 8, 2048), ("350M-train", 24, 1024, 8, 4, 1024), ("1B-train", 36, 1280, 8, 2, 1024)]
    tune = [a for a in argv if a.startswith("--tune")]
    if tune:   # --tune[=KERNELS]: Table 5 shapes -> CONFIG; --tune-train[=KERNELS]: each training shape -> SHAPE_CONFIG
        per_shape = tune[0].startswith("--tune-train")
        lead = ("fwd_lead", "gather_lead") if per_shape else ()   # a width's own choice (None: no pairing there)
        kernels = tune[0].split("=", 1)[1].split(",") if "=" in tune[0] else ("site", "gather", "fwd", "pairs") + lead
        if any(k not in tuple(CONFIG) + lead for k in kernels):
            sys.exit(f"routing_kernel.py: --tune=KERNEL[,KERNEL]: one of {', '.join(tuple(CONFIG) + lead)} (the _lead "
                     "kernels with --tune-train)")
        tune_configs(kernels, [s for s in shapes if s[0].endswith("train")] if per_shape else shapes[:3], per_shape, device)
    if "--cpu-profile" in argv:   # where the eager chain's host time goes (100M shape)
        from torch.profiler import ProfilerActivity, profile
        step = _fused_step(25, 2, 2048, 512, 4, device)
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)
    ref_compiled = torch.compile(route_reference, dynamic=True)
    rows = []
    for name, L, d, H, B, T in shapes:
        N = 2 * L + 1
        pairs = N * (N + 1) // 2
        bytes6 = 6 * pairs * B * T * d
        for impl in ("fused", "fused-graph", "compiled", "eager"):
            if impl in ("compiled", "eager") and name.endswith("train"):
                continue
            t, mem = time_chain(impl.split("-")[0], N, B, T, d, H, device, ref_compiled, graph=impl.endswith("graph"))
            gbps = bytes6 / t / 1e6
            rows.append(dict(shape=name, impl=impl, ms=t, gbps=gbps, copy_frac=gbps / copy_bw, peak_gb=mem))
            print(f"{name:11s} {impl:11s} {t:8.2f} ms  {gbps:6.0f} GB/s (6 B/pair-elem, {100 * gbps / copy_bw:4.1f}% of copy)"
                  f"  peak {mem:.2f} GB", flush=True)
        if not name.endswith("train"):
            try:
                print(f"{name:11s} fused kernels (profiler, ms): {profile_chain(N, B, T, d, H, device)}", flush=True)
            except Exception as e:   # the profiler's event fields move between torch versions
                print(f"profiler failed: {e!r}")
    _write_rows(rows, copy_bw)


# every config in CONFIG and SHAPE_CONFIG is a candidate, so --tune / --tune-train can find them again: (512, 1, 3) is
# the site pass's tile at 100M / 350M since v13 (chain_v13_h200.txt), (1024, 2, 4) v8c's 100M fwd and gather
TUNE_CANDIDATES = [(512, 1, 3), (1024, 2, 3), (1024, 2, 4), (2048, 4, 3), (4096, 4, 3), (4096, 4, 4), (4096, 8, 3),
                   (8192, 8, 3), (8192, 8, 4), (16384, 8, 3)]


def tune_configs(kernels, shapes, per_shape, device, candidates=TUNE_CANDIDATES):
    """Coordinate descent over each kernel's (tile, warps, stages) on GPU time (graph replay): the best geometric
    mean over the shapes into CONFIG, or (per_shape) the best at each shape into SHAPE_CONFIG[(d, H)]."""
    for group in ([[s] for s in shapes] if per_shape else [shapes]):
        table = SHAPE_CONFIG.setdefault(tuple(group[0][2:4]), {}) if per_shape else CONFIG
        for kernel in kernels:
            results = []
            seen = set()
            for cand in candidates + ([None] if kernel.endswith("_lead") else []):
                key = cand[:2] if kernel == "pairs" else cand   # the pair pass has no loop: stages change nothing
                if key in seen:
                    continue
                seen.add(key)
                table[kernel] = cand
                try:
                    times = [time_chain("fused", 2 * L + 1, B, T, d, H, device, None, graph=True)[0]
                             for _, L, d, H, B, T in group]
                except Exception as e:   # e.g. out of shared memory or registers: skip the candidate
                    print(f"tune {kernel:6s} {_cand_name(cand)}: failed: {str(e)[:200]}")
                    continue
                results.append((math.prod(times) ** (1 / len(times)), str(cand), cand, times))
                print(f"tune {kernel:6s} {_cand_name(cand)}: "
                      + " | ".join(f"{s[0]} {t:6.2f} ms" for s, t in zip(group, times)), flush=True)
            table[kernel] = min(results)[2]
    print("tuned", "SHAPE_CONFIG =" if per_shape else "CONFIG =", SHAPE_CONFIG if per_shape else CONFIG, flush=True)


def _cand_name(cand):
    return "no pairing           " if cand is None else f"tile {cand[0]:5d} warps {cand[1]} stages {cand[2]}"


def _write_rows(rows, copy_bw):
    if os.environ.get("OUT"):   # the device tool's output folder
        import json
        with open(os.path.join(os.environ["OUT"], "routing_bench.json"), "w") as f:
            json.dump({"copy_gbps": copy_bw, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


def _peak_gb(step):
    """Peak memory one call of step() allocates above what is allocated before it, in GB."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def time_delta(impl, device, B=2, T=4096, d=4096, H=8, n_layer=32, num_blocks=8):
    """All 2L delta routing calls of a forward + backward: block b's sites mix null + b + 1 history sources.
    reference-ckpt: route_reference on the stacked sources, each call under activation checkpointing (as the
    paper's reference), fused: route_delta. Returns (median ms, peak GB above the inputs)."""
    from model import route_reference
    from triton.testing import do_bench
    gen = torch.Generator(device=device).manual_seed(0)
    history = [torch.randn(B, T, d, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_(True)
               for _ in range(num_blocks)]
    sites = [[(torch.randn(d, device=device) * 0.1).requires_grad_(True) for _ in range(3)] for _ in range(2 * n_layer)]
    up = torch.randn(B, T, d, device=device, dtype=torch.bfloat16)
    per_block = 2 * n_layer // num_blocks

    def ref_call(stacked, null, q, g):
        return route_reference(torch.cat([null.to(stacked.dtype).expand(1, *stacked.shape[1:]), stacked]), q, g, H)

    def step():
        total = None
        for k, (null, q, g) in enumerate(sites):
            if k % per_block == 0:
                hist = torch.stack(history[: k // per_block + 1])
                r = rms_factors(hist, 1e-6) if impl == "fused" else None
            if impl == "fused":
                out = route_delta(hist, r, null, q, g, H, 1e-6)
            else:
                out = torch.utils.checkpoint.checkpoint(ref_call, hist, null, q, g, use_reentrant=False)
            total = out if total is None else total + out
        total.backward(up)
    step()                      # compile
    return do_bench(step, warmup=1, rep=1, return_mode="median"), _peak_gb(step)


def check_large(device):
    """Forward + backward over 2 sites at 2^21 tokens x d 1024 (offsets past 2^31); compare the last rows."""
    from model import route_reference
    M, d, H = 2**21, 1024, 8
    src = torch.randn(1, M, d, device=device, dtype=torch.bfloat16)
    q = [torch.randn(d, device=device) for _ in range(2)]
    g = [torch.ones(d, device=device) for _ in range(2)]
    s0 = src.clone().requires_grad_(True)
    chain = FusedRouter(2, H, 1e-6).start(s0)
    o1 = FusedRouter.route(chain, 1, s0, q[0], g[0])
    s1 = o1 * 0.5 + 1.0
    out = FusedRouter.route(chain, 2, s1, q[1], g[1])
    up = torch.randn_like(out)
    out.backward(up)
    tail = slice(M - 4096, M)   # the last rows: their offsets are beyond 2^31 elements
    a = src[:, tail].detach().clone().requires_grad_(True)
    b = a * 0.5 + 1.0
    ref = route_reference(torch.stack([a, b]), q[1], g[1], H)
    ref.backward(up[:, tail])
    rel = lambda x, y: ((x.float() - y.float()).norm() / y.float().norm()).item()
    return {"out": rel(out[:, tail], ref), "d_source0": rel(s0.grad[:, tail], a.grad)}


def check_against_reference(N, B, T, d, H, dtype, device):
    """Max relative error of fused vs reference (fp32 math in both) for out and every gradient."""
    from model import route_reference
    gen = torch.Generator(device="cpu").manual_seed(N * 7 + d)
    src0 = (torch.randn(B, T, d, generator=gen)).to(device=device, dtype=dtype)
    qs = [torch.randn(d, generator=gen).to(device) * 0.5 for _ in range(N)]
    gs = [(1 + 0.2 * torch.randn(d, generator=gen)).to(device) for _ in range(N)]
    up = torch.randn(B, T, d, generator=gen).to(device=device, dtype=dtype)
    shift = [torch.randn(B, T, d, generator=gen).to(device=device, dtype=dtype) for _ in range(N)]
    sublayer = lambda j, x: torch.tanh(x) + shift[j]     # non-linear, so every gradient path matters
    results = []
    for impl in ("fused", "reference"):
        s0 = src0.clone().requires_grad_(True)
        q = [x.clone().requires_grad_(True) for x in qs]
        g = [x.clone().requires_grad_(True) for x in gs]
        if impl == "fused":
            router = FusedRouter(N, H, 1e-6)
            chain = router.start(s0)
            out = _chain(lambda j, x, *qg: FusedRouter.route(chain, j + 1, x, *qg), s0, q, g, sublayer)
        else:
            out = _chain(_reference_site(lambda st, qq, gg: route_reference(st, qq, gg, H)), s0, q, g, sublayer)
        (out.float() * up.float()).sum().backward()
        results.append([out, s0.grad] + [x.grad for x in q] + [x.grad for x in g])
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
    f, r = results
    return {"out": rel(f[0], r[0]), "d_source0": rel(f[1], r[1]),
            "dq": rel(torch.cat(f[2:2 + N]), torch.cat(r[2:2 + N])),     # site 1's dq is 0: compare all sites at once
            "dg": rel(torch.cat(f[2 + N:]), torch.cat(r[2 + N:]))}


def profile_chain(N, B, T, d, H, device):
    """GPU time per kernel over one fused chain forward + backward."""
    from torch.profiler import ProfilerActivity, profile
    step = _fused_step(N, B, T, d, H, device)
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    total = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            key = next((k for k in ("_route_fwd", "_route_bwd_site", "_route_bwd_pairs", "_route_bwd_gather") if k in e.key), "other")
            total[key] = total.get(key, 0.0) + t / 1e3
    return {k: round(v, 3) for k, v in sorted(total.items())}


def _fused_step(N, B, T, d, H, device):
    src = torch.randn(B, T, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    qs = [(torch.randn(d, device=device) * 0.5).requires_grad_(True) for _ in range(N)]
    gs = [torch.ones(d, device=device, requires_grad=True) for _ in range(N)]
    up = torch.randn(B, T, d, device=device, dtype=torch.bfloat16)
    shift = torch.randn(B, T, d, device=device, dtype=torch.bfloat16)
    router = FusedRouter(N, H, 1e-6)

    def step():
        chain = router.start(src)
        out = _chain(lambda j, x, *qg: FusedRouter.route(chain, j + 1, x, *qg), src, qs, gs, lambda j, x: x + shift)
        out.backward(up)
    return step


def time_chain(impl, N, B, T, d, H, device, ref_compiled, graph=False):
    from model import route_reference
    from triton.testing import do_bench
    src = torch.randn(B, T, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    qs = [(torch.randn(d, device=device) * 0.5).requires_grad_(True) for _ in range(N)]
    gs = [torch.ones(d, device=device, requires_grad=True) for _ in range(N)]
    up = torch.randn(B, T, d, device=device, dtype=torch.bfloat16)
    shift = torch.randn(B, T, d, device=device, dtype=torch.bfloat16)
    sublayer = lambda j, x: x + shift      # cheapest sublayer that keeps the sources distinct (fwd: one add)
    router = FusedRouter(N, H, 1e-6)
    fn = ref_compiled if impl == "compiled" else route_reference

    def step():
        if impl == "fused":
            chain = router.start(src)
            out = _chain(lambda j, x, *qg: FusedRouter.route(chain, j + 1, x, *qg), src, qs, gs, sublayer)
        else:
            out = _chain(_reference_site(lambda st, q, g: fn(st, q, g, H)), src, qs, gs, sublayer)
        out.backward(up)
    step()                      # compile
    router.chain = None         # measure memory from scratch: the chain's buffers count
    mem = _peak_gb(step)
    if graph:   # GPU time alone: replay the whole chain from a CUDA graph (no Python, no launch gaps)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            step()
        return do_bench(cuda_graph.replay, warmup=50, rep=300, return_mode="median"), mem
    return do_bench(step, warmup=50, rep=300, return_mode="median"), mem


if __name__ == "__main__":
    main(sys.argv[1:])
