"""
Fused Triton routing for attention residuals and MHAR (arXiv 2607.27230: Eq. 2-3, Appendix E): the chain.

Rung 2 of the fused routing (rung 1, one stateless call, and the math: routing_call.py): the chain kernels (_chain_*,
entry FusedRouter), the same math over a whole pass, the history in one buffer, each source read once per site
forward and once per site backward. Autograd runs site j's backward (a function of s_{j-1}, q_j, g_j) after every
later site's, so site j gathers the whole of ds_{j-1}, in two launches per site backward: _chain_bwd_site (the sources
and G_j read once: c, dw partials, each pair's da), then _chain_bwd_gather (s_{j-1} and every later G read once:
ds_{j-1}; dw to dq, dg; and in extra programs the pair pass: alpha, dlogit and K's terms of site j's pairs, per pair
with every head). Neighbouring sites share reads ("read sharing" blocks): a leading forward also runs the softmax of
the next 1-3 sites (RoutingConfig.fwd_lead_sites) over s_0..s_{j-1} and hands each its fp32 state; site j+x resumes
it and reads only s_j..s_{j+x-1} (per led site 8 bytes a channel of state against 2 per source it skips: 2 sites took
MHAR's chains 0.98x at d 512 and 1280, 3 no further); a leading gather also sums source j-2's terms over G_j..G_N,
and site j-1's gather adds only G_{j-1}. Deterministic: every sum has a fixed order.
routing_gather.py: another backward for the same forward, without the site pass (per width); routing_block.py: block
routing's own two kernels.

Layouts (M = B*T tokens, row-major, 64-bit offsets; pair (j, n) is row j(j-1)/2 + n of P = N(N+1)/2): S, GB [N, M, d]
sources, upstream gradients (activation dtype); fp32 R [N, M], W [N, d], LSE, C [N, H, M], DA, LG [P, H, M] (da, logit;
then dlogit, alpha), KP [P, M], lead states PACC [L, M, d], PML [L, 2, H, M] (L led sites), PK [M]. Envelope: bf16 /
fp16 / fp32 sources, math in fp32; d % H == 0, D >= 16 (any D); any number of sources (tests: 145 on CUDA); > 2^31
elements per buffer; T = 1; outside it a ValueError names the limit (routing_config.check_envelope, beside the launch
settings: tile, warps and stages per kernel, tuned per width). Cost: the forward, the site pass and the gather each
read a pair's source (bf16: 2 bytes per channel each); a launch ~4 us per source it reads plus ~26-30 us (H200);
eager, ~240 us of host time per site (routing_config.Launcher calls the compiled launchers directly). Measured:
BENCHMARKS.md.
"""
import functools
import weakref
from dataclasses import replace

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the model falls back to the reference routing (model.py prints why)
    triton = None

from routing_config import (DEFAULT, INTERPRET, TUNED_H200, Launcher, RoutingConfig, _block_m, _split,  # noqa: F401
                            announce, check_envelope, config_for, lead_schedule)

# Triton >= 3.4 passes a compiled kernel's launcher every argument in signature order (what routing_config.Launcher uses)
DIRECT_OK = triton is not None and not INTERPRET and tuple(map(int, triton.__version__.split(".")[:2])) >= (3, 4)


def available(device):
    """Can the fused path run for tensors on `device`? (Triton on CUDA, or the interpreter on CPU)."""
    return triton is not None and (torch.device(device).type == "cuda" or INTERPRET)


# ---- rung 2: the chain of one forward/backward pass (the whole depth history in one buffer) --------------------------

if triton is not None:
    from routing_call import _head_w, _part, _rounded, _rows, _softmax_update, _source   # rung 1's helpers

    # A head is held as up to two column parts (routing_config._split): part b's code sits under `if SPLIT:` (a
    # constexpr); without it part b's variables hold unused placeholders.

    @triton.jit
    def _dot2(x_a, y_a, x_b, y_b, SPLIT: tl.constexpr):
        """Sums of x * y over both parts' last axis (the columns), fp32: [BLOCK_M], or [BLOCK_M, heads] for 3D tiles."""
        out = tl.sum(x_a * y_a, axis=-1)
        if SPLIT:
            out += tl.sum(x_b * y_b, axis=-1)
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
        """_online_softmax_step over one or two column parts; stores the logit r <w, s> as pair `pair` if STORE_LOGITS."""
        logit = r * _dot2(s_a, w_a[None, :], s_b, w_b[None, :], SPLIT)
        if STORE_LOGITS:
            tl.store(LG + (pair * H + h).to(tl.int64) * M + rows64, logit, mask=rmask)
        m_i, l_i, scale, p = _softmax_update(m_i, l_i, logit)
        acc_a = acc_a * scale[:, None] + p[:, None] * s_a
        if SPLIT:
            acc_b = acc_b * scale[:, None] + p[:, None] * s_b
        return m_i, l_i, acc_a, acc_b

    @triton.jit
    def _lead_init(Q, G, h, cols_a, cmask_a, cols_b, cmask_b, D: tl.constexpr, BLOCK_M: tl.constexpr,
                   D_A: tl.constexpr, BLOCK_B: tl.constexpr, SPLIT: tl.constexpr):
        """A led site's empty softmax state (max, denominator, mix parts) and its w parts (part b = a unless SPLIT)."""
        w_a = _head_w(Q, G, h, cols_a, cmask_a, D)
        w_b, acc_b = w_a, tl.zeros((1, 1), tl.float32)
        if SPLIT:
            w_b, acc_b = _head_w(Q, G, h, cols_b, cmask_b, D), tl.zeros((BLOCK_M, BLOCK_B), tl.float32)
        return (tl.full((BLOCK_M,), float("-inf"), tl.float32), tl.zeros((BLOCK_M,), tl.float32),
                tl.zeros((BLOCK_M, D_A), tl.float32), acc_b, w_a, w_b)

    @triton.jit
    def _hand_off(PACC, PML, x, m, l, acc_a, acc_b, ml, tile_a, mask_a, tile_b, mask_b, rmask, M, DM: tl.constexpr,
                  H: tl.constexpr, SPLIT: tl.constexpr):
        """Store led site x's state (x = 0: the next site) as row x of PACC and PML, for its own launch."""
        off, ml = (x * M).to(tl.int64) * DM, ml + (x * 2 * H * M).to(tl.int64)
        tl.store(PML + ml, m, mask=rmask)
        tl.store(PML + H * M + ml, l, mask=rmask)
        tl.store(PACC + off + tile_a, acc_a, mask=mask_a)
        if SPLIT:
            tl.store(PACC + off + tile_b, acc_b, mask=mask_b)

    @triton.jit
    def _lead_state(PACC, PML, x, ml, tile_a, mask_a, tile_b, mask_b, rmask, M, DM: tl.constexpr, H: tl.constexpr,
                    SPLIT: tl.constexpr):
        """Row x of PACC and PML, as _hand_off stored it: (max, denominator, mix parts; part b = a unless SPLIT)."""
        off, ml = (x * M).to(tl.int64) * DM, ml + (x * 2 * H * M).to(tl.int64)
        acc_a = tl.load(PACC + off + tile_a, mask=mask_a, other=0.0)
        acc_b = acc_a
        if SPLIT:
            acc_b = tl.load(PACC + off + tile_b, mask=mask_b, other=0.0)
        return tl.load(PML + ml, mask=rmask, other=float("-inf")), tl.load(PML + H * M + ml, mask=rmask, other=0.0), \
            acc_a, acc_b

    @triton.jit(do_not_specialize=["j", "back"])   # (direct launches reuse one compiled kernel for every j and back)
    def _chain_fwd(
        S, R,       # [N, M, DM] sources, [N, M] fp32 RMS factors; slot j-1 is written here
        NEW, Q, G,  # [M, DM] the newest source s_{j-1} (this site's autograd input, contiguous); [DM] q and g
        W, OUT,     # [N, DM] fp32 w = q*g (row j-1 written, for the gathers); [M, DM] routed output
        LSE, LG,    # [N, H, M] fp32 log-sum-exp (row j-1 written); [P, H, M] fp32 logits (if STORE_LOGITS)
        Q2, G2, Q3, G3, Q4, G4,   # [DM] q and g of sites j+1, j+2, j+3 (read if LEAD >= 1, 2, 3)
        PACC, PML,  # [L, M, DM], [L, 2, H, M] fp32 the led sites' mixes, maxima, denominators (FOLLOW reads one)
        MIX,        # [N, M, DM] fp32 every site's output unrounded (row j-1 written if STORE_MIX)
        M, j, back, eps,   # tokens, this site (1..N), FOLLOW: how many sites after its leader, RMS eps
        DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, D_A: tl.constexpr, BLOCK_B: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, STAGES: tl.constexpr, STORE_LOGITS: tl.constexpr,
        LEAD: tl.constexpr, FOLLOW: tl.constexpr, STORE_MIX: tl.constexpr):
        SPLIT: tl.constexpr = BLOCK_B > 0
        h, pm, rows64, rmask = _rows(M, H, BLOCK_M)
        slot = (j - 1).to(tl.int64) * M * DM
        pair0 = j * (j - 1) // 2   # pair (j, n) of head h: LG + ((pair0 + n) * H + h) * M
        # RMS factor of the newest source over the full width (every head program needs it)
        sumsq = tl.zeros((BLOCK_M,), tl.float32)
        for c0 in tl.static_range(0, DM, BLOCK_C):
            cc = c0 + tl.arange(0, BLOCK_C)
            x = tl.load(NEW + rows64[:, None] * DM + cc[None, :], mask=rmask[:, None] & (cc[None, :] < DM),
                        other=0.0).to(tl.float32)
            sumsq += tl.sum(x * x, axis=1)
        r_new = 1.0 / tl.sqrt(sumsq / DM + eps)
        tl.store(R + (j - 1).to(tl.int64) * M + rows64, r_new, mask=rmask & ((rows64 * 0 + h) == 0))   # one head writes r
        # the newest source into its slot; w = q*g (token block 0 stores it for the backward)
        cols_a, cmask_a, mask_a, tile_a = _part(h, rows64, rmask, 0, D_A, DM, D)
        cols_b, cmask_b, tile_b, mask_b = cols_a, cmask_a, tile_a, mask_a   # part b: placeholders unless SPLIT
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
        m_i, l_i = tl.full((BLOCK_M,), float("-inf"), tl.float32), tl.zeros((BLOCK_M,), tl.float32)
        ml = (h * M).to(tl.int64) + rows64   # this head's rows of PML
        # -- read sharing: LEAD runs the softmax of the next LEAD sites on every tile loaded here too and leaves their
        # states in PML / PACC; a FOLLOW site `back` sites later resumes its state (s_0..s_{j-back-1}) and reads only
        # the sources since. The same operations in the same order as one launch per site: identical output when the
        # lead config lays out tiles as the plain one does
        n0 = 0
        if FOLLOW:
            n0 = j - back
            m_i, l_i, acc_a, acc_b = _lead_state(PACC, PML, back - 1, ml, tile_a, mask_a, tile_b, mask_b, rmask, M, DM,
                                                 H, SPLIT)
        pair1 = pair0 + j   # pair (j+1, n) at pair1 + n, (j+2, n) at pair2 + n, (j+3, n) at pair3 + n
        pair2 = pair1 + j + 1
        pair3 = pair2 + j + 2
        m2, l2, acc2_a, acc2_b, w2_a, w2_b = m_i, l_i, acc_a, acc_b, w_a, w_b   # placeholders unless LEAD >= 1, 2, 3
        m3, l3, acc3_a, acc3_b, w3_a, w3_b = m_i, l_i, acc_a, acc_b, w_a, w_b
        m4, l4, acc4_a, acc4_b, w4_a, w4_b = m_i, l_i, acc_a, acc_b, w_a, w_b
        if LEAD >= 1:
            m2, l2, acc2_a, acc2_b, w2_a, w2_b = _lead_init(Q2, G2, h, cols_a, cmask_a, cols_b, cmask_b, D, BLOCK_M,
                                                            D_A, BLOCK_B, SPLIT)
        if LEAD >= 2:
            m3, l3, acc3_a, acc3_b, w3_a, w3_b = _lead_init(Q3, G3, h, cols_a, cmask_a, cols_b, cmask_b, D, BLOCK_M,
                                                            D_A, BLOCK_B, SPLIT)
        if LEAD >= 3:
            m4, l4, acc4_a, acc4_b, w4_a, w4_b = _lead_init(Q4, G4, h, cols_a, cmask_a, cols_b, cmask_b, D, BLOCK_M,
                                                            D_A, BLOCK_B, SPLIT)
        # -- end of read sharing setup
        for n in tl.range(n0, j - 1, num_stages=STAGES):
            s_a, s_b, r = _source_parts(S, R, n, M, tile_a, mask_a, tile_b, mask_b, rows64, rmask, DM, SPLIT)
            m_i, l_i, acc_a, acc_b = _mix_step(m_i, l_i, acc_a, acc_b, s_a, s_b, r, w_a, w_b, LG, pair0 + n, h, M,
                                               rows64, rmask, H, SPLIT, STORE_LOGITS)
            if LEAD >= 1:   # read sharing: the same tile, the led sites' queries
                m2, l2, acc2_a, acc2_b = _mix_step(m2, l2, acc2_a, acc2_b, s_a, s_b, r, w2_a, w2_b, LG, pair1 + n, h,
                                                   M, rows64, rmask, H, SPLIT, STORE_LOGITS)
            if LEAD >= 2:
                m3, l3, acc3_a, acc3_b = _mix_step(m3, l3, acc3_a, acc3_b, s_a, s_b, r, w3_a, w3_b, LG, pair2 + n,
                                                   h, M, rows64, rmask, H, SPLIT, STORE_LOGITS)
            if LEAD >= 3:
                m4, l4, acc4_a, acc4_b = _mix_step(m4, l4, acc4_a, acc4_b, s_a, s_b, r, w4_a, w4_b, LG,
                                                   pair3 + n, h, M, rows64, rmask, H, SPLIT, STORE_LOGITS)
        # (the newest source stays 16-bit until here: fp32 across the loop cost the 1B shape ~10 registers per thread,
        # one program per SM, and 50% more forward time)
        new_a, new_b = new_a.to(tl.float32), new_b.to(tl.float32)
        m_i, l_i, acc_a, acc_b = _mix_step(m_i, l_i, acc_a, acc_b, new_a, new_b, r_new, w_a, w_b, LG, pair0 + j - 1, h, M,
                                           rows64, rmask, H, SPLIT, STORE_LOGITS)
        if LEAD >= 1:   # read sharing: the led sites' states, handed to their launches
            m2, l2, acc2_a, acc2_b = _mix_step(m2, l2, acc2_a, acc2_b, new_a, new_b, r_new, w2_a, w2_b, LG, pair1 + j - 1,
                                               h, M, rows64, rmask, H, SPLIT, STORE_LOGITS)
            _hand_off(PACC, PML, 0, m2, l2, acc2_a, acc2_b, ml, tile_a, mask_a, tile_b, mask_b, rmask, M, DM, H, SPLIT)
        if LEAD >= 2:
            m3, l3, acc3_a, acc3_b = _mix_step(m3, l3, acc3_a, acc3_b, new_a, new_b, r_new, w3_a, w3_b, LG,
                                               pair2 + j - 1, h, M, rows64, rmask, H, SPLIT, STORE_LOGITS)
            _hand_off(PACC, PML, 1, m3, l3, acc3_a, acc3_b, ml, tile_a, mask_a, tile_b, mask_b, rmask, M, DM, H, SPLIT)
        if LEAD >= 3:
            m4, l4, acc4_a, acc4_b = _mix_step(m4, l4, acc4_a, acc4_b, new_a, new_b, r_new, w4_a, w4_b, LG,
                                               pair3 + j - 1, h, M, rows64, rmask, H, SPLIT, STORE_LOGITS)
            _hand_off(PACC, PML, 2, m4, l4, acc4_a, acc4_b, ml, tile_a, mask_a, tile_b, mask_b, rmask, M, DM, H, SPLIT)
        tl.store(OUT + tile_a, _rounded(acc_a / l_i[:, None], OUT.dtype.element_ty), mask=mask_a)
        if SPLIT:
            tl.store(OUT + tile_b, _rounded(acc_b / l_i[:, None], OUT.dtype.element_ty), mask=mask_b)
        if STORE_MIX:   # the unrounded output, for the backward's c = <G, out> (routing_gather.py)
            tl.store(MIX + slot + tile_a, acc_a / l_i[:, None], mask=mask_a)
            if SPLIT:
                tl.store(MIX + slot + tile_b, acc_b / l_i[:, None], mask=mask_b)
        tl.store(LSE + ((j - 1) * H + h).to(tl.int64) * M + rows64, m_i + tl.log(l_i), mask=rmask)

    @triton.jit
    def _grad_part(GIN, GB, W, slot, j, h, cols, cmask, mask, tile, DM: tl.constexpr, D: tl.constexpr):
        """One column part of site j's upstream gradient (copied into its GB slot, returned in fp32) and of w."""
        g = tl.load(GIN + tile, mask=mask, other=0.0)
        tl.store(GB + slot + tile, g, mask=mask)
        return g.to(tl.float32), tl.load(W + (j - 1) * DM + h * D + cols, mask=cmask, other=0.0)

    @triton.jit(do_not_specialize=["j"])
    def _chain_bwd_site(
        S, R, W, LSE,   # as in _chain_fwd (read)
        GIN, GB,        # [M, DM] this site's upstream gradient, contiguous; [N, M, DM] every site's (slot j-1 written)
        LG, DA,         # [P, H, M] fp32 logits (read if stored, else written), <G, s_n> (pairs (j, 0..j-1) written)
        C, PART, M, j,  # [N, H, M] fp32 c per site (row j-1 written); [token blocks, DM] fp32 partial sums of dw
        DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, D_A: tl.constexpr, BLOCK_B: tl.constexpr,
        BLOCK_M: tl.constexpr, STAGES: tl.constexpr, LOGITS_STORED: tl.constexpr):
        SPLIT: tl.constexpr = BLOCK_B > 0
        h, pm, rows64, rmask = _rows(M, H, BLOCK_M)
        slot = (j - 1).to(tl.int64) * M * DM
        part = PART + pm.to(tl.int64) * DM + h * D
        cols_a, cmask_a, mask_a, tile_a = _part(h, rows64, rmask, 0, D_A, DM, D)
        tile_b, mask_b = tile_a, mask_a
        g_a, w_a = _grad_part(GIN, GB, W, slot, j, h, cols_a, cmask_a, mask_a, tile_a, DM, D)   # (w: unused if stored)
        p_a, q_a = tl.zeros((BLOCK_M, D_A), tl.float32), tl.zeros((BLOCK_M, D_A), tl.float32)
        g_b, w_b, p_b, q_b = g_a, w_a, tl.zeros((1, 1), tl.float32), tl.zeros((1, 1), tl.float32)
        if SPLIT:
            cols_b, cmask_b, mask_b, tile_b = _part(h, rows64, rmask, D_A, BLOCK_B, DM, D)
            g_b, w_b = _grad_part(GIN, GB, W, slot, j, h, cols_b, cmask_b, mask_b, tile_b, DM, D)
            p_b, q_b = tl.zeros((BLOCK_M, BLOCK_B), tl.float32), tl.zeros((BLOCK_M, BLOCK_B), tl.float32)
        site = ((j - 1) * H + h).to(tl.int64) * M + rows64
        lse = tl.load(LSE + site, mask=rmask, other=0.0)
        pair0 = j * (j - 1) // 2
        pair = (pair0 * H + h).to(tl.int64) * M + rows64   # offsets of pair (j, 0) of head h; + n * H * M
        # one pass: c = sum_n alpha da, dw = sum_n alpha r (da - c) s = P - c Q per token; dlogit needs c, known only
        # at the end, so da is stored for the pair pass. (c = <G, out> before the loop would need one accumulator, but
        # out is rounded to 16 bits: 1.1-1.9x the reference's bf16 gradient error.) Each path keeps the instruction
        # order measured best: at the register limit (1B) an address live across the iteration cost it 22%.
        c = tl.zeros((BLOCK_M,), tl.float32)
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
            p_a, q_a = p_a + fp * s_a, q_a + fq * s_a
            if SPLIT:
                p_b, q_b = p_b + fp * s_b, q_b + fq * s_b
            if not LOGITS_STORED:
                off = ((pair0 + n) * H + h).to(tl.int64) * M + rows64
                tl.store(DA + off, da, mask=rmask)
                tl.store(LG + off, logit, mask=rmask)
        tl.store(C + site, c, mask=rmask)
        tl.store(part + cols_a, tl.sum(p_a - c[:, None] * q_a, axis=0), mask=cmask_a)
        if SPLIT:
            tl.store(part + cols_b, tl.sum(p_b - c[:, None] * q_b, axis=0), mask=cmask_b)

    @triton.jit
    def _pair_terms(AL, DL, LSE, C, pair, j, rows64, rmask, M, H: tl.constexpr, BLOCK_H: tl.constexpr):
        """Pair (j, n) = row `pair` for every head [BLOCK_H, rows], from the site pass's logit (AL) and da (DL):
        alpha, dlogit, their offsets and mask, and K's term sum_h dlogit * logit."""
        heads = tl.arange(0, BLOCK_H)
        mask = (heads[:, None] < H) & rmask[None, :]
        site = ((j - 1) * H + heads[:, None]).to(tl.int64) * M + rows64[None, :]
        off = (pair * H + heads[:, None]) * M + rows64[None, :]
        lg = tl.load(AL + off, mask=mask, other=0.0)
        alpha = tl.exp(lg - tl.load(LSE + site, mask=mask, other=0.0))
        dlogit = alpha * (tl.load(DL + off, mask=mask, other=0.0) - tl.load(C + site, mask=mask, other=0.0))
        return alpha, dlogit, off, mask, tl.sum(dlogit * lg, axis=0)

    @triton.jit
    def _pair_pass(q, AL, DL, LSE, C, KP, M, j, H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_MP: tl.constexpr):
        """Program q of site j's pair pass, a token block of one pair with every head: logit and da rewritten in place
        as alpha and dlogit, K's term stored, so that each later gather loads 3 scalars per pair (a per-head gather
        program forming K itself would load every head's). The pairs are a grid axis: a loop over them left the
        paper's shapes 8-16 programs per site running one after another."""
        nbp = tl.cdiv(M, BLOCK_MP)
        rows = (q % nbp) * BLOCK_MP + tl.arange(0, BLOCK_MP)
        pair = (j * (j - 1) // 2 + q // nbp).to(tl.int64)
        alpha, dlogit, off, mask, k = _pair_terms(AL, DL, LSE, C, pair, j, rows.to(tl.int64), rows < M, M, H, BLOCK_H)
        tl.store(AL + off, alpha, mask=mask)
        tl.store(DL + off, dlogit, mask=mask)
        tl.store(KP + pair * M + rows, k, mask=rows < M)

    @triton.jit
    def _own_pair(AL, DL, LSE, C, pair, j, h, rows64, rmask, M, H: tl.constexpr, BLOCK_H: tl.constexpr):
        """alpha and dlogit of head h ([rows, 1]) and K's term of site j's pair `pair`, which no pair pass rewrote."""
        alpha, dlogit, _, _, k = _pair_terms(AL, DL, LSE, C, pair, j, rows64, rmask, M, H, BLOCK_H)
        mine = tl.arange(0, BLOCK_H)[:, None] == h
        return tl.sum(tl.where(mine, alpha, 0.0), axis=0)[:, None], tl.sum(tl.where(mine, dlogit, 0.0), axis=0)[:, None], k

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

    @triton.jit
    def _accumulate(acc_a, u_a, acc_b, u_b, a_h, dl_h, g_a, w_a, g_b, w_b, SPLIT: tl.constexpr):
        """One site's terms of a source's gradient: acc += alpha G, u += dlogit w, on both column parts."""
        acc_a, u_a = acc_a + a_h * g_a, u_a + dl_h * w_a
        if SPLIT:
            acc_b, u_b = acc_b + a_h * g_b, u_b + dl_h * w_b
        return acc_a, u_a, acc_b, u_b

    @triton.jit
    def _site_tiles(GB, W, jp, h, M, tile_a, mask_a, cols_a, cmask_a, tile_b, mask_b, cols_b, cmask_b,
                    DM: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr):
        """Site jp's upstream-gradient tile (fp32) and w, both column parts (part b = part a when not SPLIT)."""
        gbase, wbase = ((jp - 1) * M).to(tl.int64) * DM, (jp - 1) * DM + h * D
        g_a = tl.load(GB + gbase + tile_a, mask=mask_a, other=0.0).to(tl.float32)
        w_a = tl.load(W + wbase + cols_a, mask=cmask_a, other=0.0)[None, :]
        g_b, w_b = g_a, w_a
        if SPLIT:
            g_b = tl.load(GB + gbase + tile_b, mask=mask_b, other=0.0).to(tl.float32)
            w_b = tl.load(W + wbase + cols_b, mask=cmask_b, other=0.0)[None, :]
        return g_a, w_a, g_b, w_b

    @triton.jit(do_not_specialize=["j", "n_sites", "n_blocks", "K", "n_main"])
    def _chain_bwd_gather(
        S, R, W, GB, PART,   # as above (read)
        PART2, TICKET,       # [K, DM] fp32 second-level dw partials; [H] int32 finished first-level sums (0 between)
        DL, AL, KP,          # [P, H, M] fp32 da and logit (the site pass's), rewritten as dlogit and alpha by the pair
        LSE, C,              #   pass, which stores KP [P, M] sum_h dlogit * logit; LSE, C as above (read)
        Q, G, DS, DQG,       # [DM] this site's q and g; [M, DM] ds of source n = j-1; [2, DM] fp32 dq and dg
        PACC, PK,            # [M, DM], [M] fp32 source n-1's sums over sites j..N (LEAD writes, site j-1's FOLLOW reads)
        M, j, n_sites, n_blocks, K, n_main, inv_dm,   # K: first-level dw reducers per head; n_main: gather programs
        DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, D_A: tl.constexpr, BLOCK_B: tl.constexpr,
        BLOCK_M: tl.constexpr, STAGES: tl.constexpr, TWO_LEVEL: tl.constexpr, LEAD: tl.constexpr, FOLLOW: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_MP: tl.constexpr):
        # Programs past n_main run site j's pair pass for its pairs (j, 0..j-2) (.. j-3 if LEAD), which later sites'
        # gathers read; this site's gather programs compute the pairs they read of site j itself from the raw values.
        # (As a launch of its own, the pair pass was a quarter of the eager chain's launches.)
        if tl.program_id(0) >= n_main:
            _pair_pass(tl.program_id(0) - n_main, AL, DL, LSE, C, KP, M, j, H, BLOCK_H, BLOCK_MP)
        else:
            _gather(S, R, W, GB, PART, PART2, TICKET, DL, AL, KP, LSE, C, Q, G, DS, DQG, PACC, PK, M, j, n_sites,
                    n_blocks, K, inv_dm, DM, H, D, D_A, BLOCK_B, BLOCK_M, STAGES, TWO_LEVEL, LEAD, FOLLOW, BLOCK_H)

    @triton.jit
    def _gather(S, R, W, GB, PART, PART2, TICKET, DL, AL, KP, LSE, C, Q, G, DS, DQG, PACC, PK, M, j, n_sites,
                n_blocks, K, inv_dm, DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, D_A: tl.constexpr,
                BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr, STAGES: tl.constexpr, TWO_LEVEL: tl.constexpr,
                LEAD: tl.constexpr, FOLLOW: tl.constexpr, BLOCK_H: tl.constexpr):
        """Site j's gather: the whole gradient of source n = j-1 over the sites j..N that read it, and dq, dg."""
        SPLIT: tl.constexpr = BLOCK_B > 0
        h, pm, rows64, rmask = _rows(M, H, BLOCK_M)
        n = j - 1   # the source this site owns
        src = (n * M).to(tl.int64) * DM
        r = tl.load(R + (n * M).to(tl.int64) + rows64, mask=rmask, other=0.0)
        cols_a, cmask_a, mask_a, tile_a = _part(h, rows64, rmask, 0, D_A, DM, D)
        cols_b, cmask_b, mask_b, tile_b = cols_a, cmask_a, mask_a, tile_a
        s_a = tl.load(S + src + tile_a, mask=mask_a, other=0.0).to(tl.float32)
        # acc: sum_j' alpha_j'[n] G_j' (+ r u of sites j+1..N if FOLLOW), u: sum_j' dlogit_j'[n] w_j',
        # k: sum_j' sum_h dlogit_j'[n, h] logit_j'[n, h]
        acc_a, u_a = tl.zeros((BLOCK_M, D_A), tl.float32), tl.zeros((BLOCK_M, D_A), tl.float32)
        acc_b, u_b = tl.zeros((1, 1), tl.float32), tl.zeros((1, 1), tl.float32)
        if SPLIT:
            cols_b, cmask_b, mask_b, tile_b = _part(h, rows64, rmask, D_A, BLOCK_B, DM, D)
            acc_b, u_b = tl.zeros((BLOCK_M, BLOCK_B), tl.float32), tl.zeros((BLOCK_M, BLOCK_B), tl.float32)
        k, last = tl.zeros((BLOCK_M,), tl.float32), n_sites
        # -- read sharing: FOLLOW starts from the sums site j+1's gather left for this source over sites j+1..N and
        # reads only G_j; LEAD also sums source n-1's terms on every gradient tile it loads
        if FOLLOW:
            acc_a = tl.load(PACC + tile_a, mask=mask_a, other=0.0)
            if SPLIT:
                acc_b = tl.load(PACC + tile_b, mask=mask_b, other=0.0)
            k, last = tl.load(PK + rows64, mask=rmask, other=0.0), j
        acc2_a, u2_a, acc2_b, u2_b, k2 = acc_a, u_a, acc_b, u_b, k   # source n-1's sums (placeholders unless LEAD)
        if LEAD:
            acc2_a, u2_a, k2 = tl.zeros_like(acc_a), tl.zeros_like(u_a), tl.zeros_like(k)
            acc2_b, u2_b = tl.zeros_like(acc_b), tl.zeros_like(u_b)
        # -- end of read sharing setup
        # site j's own pairs, (j, n) and if LEAD (j, n-1), from the site pass's raw values (see _chain_bwd_gather)
        pair = (j * (j - 1) // 2 + n).to(tl.int64)
        a_h, dl_h, kk = _own_pair(AL, DL, LSE, C, pair, j, h, rows64, rmask, M, H, BLOCK_H)
        k += kk
        g_a, w_a, g_b, w_b = _site_tiles(GB, W, j, h, M, tile_a, mask_a, cols_a, cmask_a, tile_b, mask_b, cols_b, cmask_b,
                                         DM, D, SPLIT)
        acc_a, u_a, acc_b, u_b = _accumulate(acc_a, u_a, acc_b, u_b, a_h, dl_h, g_a, w_a, g_b, w_b, SPLIT)
        if LEAD:
            a_h, dl_h, kk = _own_pair(AL, DL, LSE, C, pair - 1, j, h, rows64, rmask, M, H, BLOCK_H)
            k2 += kk
            acc2_a, u2_a, acc2_b, u2_b = _accumulate(acc2_a, u2_a, acc2_b, u2_b, a_h, dl_h, g_a, w_a, g_b, w_b, SPLIT)
        for jp in tl.range(j + 1, last + 1, num_stages=STAGES):   # every later site that reads source n
            pair = (jp * (jp - 1) // 2 + n).to(tl.int64)
            own = (pair * H + h) * M + rows64
            a_h = tl.load(AL + own, mask=rmask, other=0.0)[:, None]
            dl_h = tl.load(DL + own, mask=rmask, other=0.0)[:, None]
            k += tl.load(KP + pair * M + rows64, mask=rmask, other=0.0)
            g_a, w_a, g_b, w_b = _site_tiles(GB, W, jp, h, M, tile_a, mask_a, cols_a, cmask_a, tile_b, mask_b, cols_b,
                                             cmask_b, DM, D, SPLIT)
            acc_a, u_a, acc_b, u_b = _accumulate(acc_a, u_a, acc_b, u_b, a_h, dl_h, g_a, w_a, g_b, w_b, SPLIT)
            if LEAD:   # read sharing: pair (jp, n-1) sits just before pair (jp, n)
                a_h = tl.load(AL + own - H * M, mask=rmask, other=0.0)[:, None]
                dl_h = tl.load(DL + own - H * M, mask=rmask, other=0.0)[:, None]
                k2 += tl.load(KP + (pair - 1) * M + rows64, mask=rmask, other=0.0)
                acc2_a, u2_a, acc2_b, u2_b = _accumulate(acc2_a, u2_a, acc2_b, u2_b, a_h, dl_h, g_a, w_a, g_b, w_b, SPLIT)
        if LEAD:   # read sharing: source n-1's sums, handed to site j-1's gather
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
        # dw from the site pass's n_blocks partials in two levels, a fixed order: the first K token blocks each sum a
        # chunk into PART2[pm]; the last of a head's K to finish (a ticket per head) sums PART2's rows and writes dq,
        # dg. (One program summing every row was the tail of the short gathers, and made small site tiles slow.)
        if not TWO_LEVEL:   # K = 1: the first token block sums them all (no ticket)
            if pm == 0:
                _store_dqg(_sum_rows(PART, 0, n_blocks, h, cols_a, cmask_a, DM, D, D_A, ""), Q, G, DQG, h, cols_a, cmask_a, DM, D)
                if SPLIT:
                    _store_dqg(_sum_rows(PART, 0, n_blocks, h, cols_b, cmask_b, DM, D, BLOCK_B, ""), Q, G, DQG, h, cols_b,
                               cmask_b, DM, D)
        elif pm < K:
            chunk = tl.cdiv(n_blocks, K)
            lo, hi = pm * chunk, tl.minimum(pm * chunk + chunk, n_blocks)
            tl.store(PART2 + pm * DM + h * D + cols_a, _sum_rows(PART, lo, hi, h, cols_a, cmask_a, DM, D, D_A, ""),
                     mask=cmask_a)
            if SPLIT:
                tl.store(PART2 + pm * DM + h * D + cols_b,
                         _sum_rows(PART, lo, hi, h, cols_b, cmask_b, DM, D, BLOCK_B, ""), mask=cmask_b)
            tl.debug_barrier()   # every thread's stores issued before the (releasing) ticket
            if tl.atomic_add(TICKET + h, 1, sem="acq_rel") == K - 1:
                # (.cg: the other programs' rows are read at L2, where their stores went, not through this SM's L1)
                _store_dqg(_sum_rows(PART2, 0, K, h, cols_a, cmask_a, DM, D, D_A, ".cg"), Q, G, DQG, h, cols_a, cmask_a, DM, D)
                if SPLIT:
                    _store_dqg(_sum_rows(PART2, 0, K, h, cols_b, cmask_b, DM, D, BLOCK_B, ".cg"), Q, G, DQG, h, cols_b,
                               cmask_b, DM, D)
                tl.atomic_xchg(TICKET + h, 0)   # ready for the next site's gather


class RoutingChain:
    """The buffers and bookkeeping of one forward/backward pass over all N sites. Contract: sites run forward in order
    1..N and backward in exact reverse order N..1, once; a second forward may not start while the first one's backward
    is pending. Activation checkpointing may wrap sublayers, never routing calls (it would rerun a site's forward)."""

    def __init__(self, n_sites, tokens, d, heads, eps, dtype, device, training, config=None):
        check_envelope(d, heads, dtype)
        cfg = self.config = config or config_for(d, heads)
        announce(cfg, d, heads)
        N, M, H = self.N, self.M, self.H = n_sites, tokens, heads
        self.d, self.D, self.eps, self.dtype, self.training = d, d // heads, eps, dtype, training
        self.launch = {k: self._geometry(k, getattr(cfg, k))   # None: that lead never runs
                       for k in ("fwd", "site", "pairs", "gather", "fwd_lead", "gather_lead")}
        # token blocks of the dw partials; whether the forward stores logits for the site pass
        self.n_blocks, self.stored_logits = triton.cdiv(tokens, self.launch["site"][1]), training and cfg.stored_logits
        f32 = dict(dtype=torch.float32, device=device)
        self.S, self.R = torch.empty(N, M, d, dtype=dtype, device=device), torch.empty(N, M, **f32)
        self.W, self.LSE = torch.empty(N, d, **f32), torch.empty(N, H, M, **f32)
        self.MIX = self.R   # a placeholder: the forward stores the unrounded output only for the gather backward
        if training:
            self._backward_buffers(N, M, d, H, f32)
        fwd, gather = lead_schedule(N, cfg.lead_min, cfg.fwd_lead_sites)
        self.launcher = Launcher(device, DIRECT_OK)
        self.fwd_lead = fwd if self.launch["fwd_lead"] else frozenset()
        lead = self.launch["gather_lead"] if cfg.backward == "site" else cfg.gather_bwd_lead   # (routing_gather's)
        self.gather_lead = gather if lead and training else frozenset()
        # one lead state at a time (the forward's is used up before the backward); else unused placeholders
        led = cfg.fwd_lead_sites if self.fwd_lead else 1   # lead states at once: the forward's, or the gather's one
        self.PACC, self.PML, self.PK = (torch.empty(led, M, d, **f32), torch.empty(led, 2, H, M, **f32),
                                        torch.empty(M, **f32)) if self.fwd_lead or self.gather_lead else (self.R,) * 3
        self.reset()

    def _backward_buffers(self, N, M, d, H, f32):
        P = N * (N + 1) // 2
        self.GB = torch.empty(N, M, d, dtype=self.dtype, device=self.S.device)
        self.DA, self.LG = torch.empty(P, H, M, **f32), torch.empty(P, H, M, **f32)   # da, logit; dlogit, alpha
        self.C, self.KP = torch.empty(N, H, M, **f32), torch.empty(P, M, **f32)
        self.PART = torch.empty(self.n_blocks, d, **f32)
        gathers = [self.launch[k][0][0] // H for k in ("gather", "gather_lead") if self.launch[k]]
        self.K = max(1, min(self.config.reducers, self.n_blocks, *gathers))   # first-level dw reducers, >= 1 row each
        self.PART2, self.TICKET = torch.empty(self.K, d, **f32), torch.zeros(H, dtype=torch.int32, device=self.S.device)

    def _geometry(self, kernel, setting):
        """(grid, BLOCK_M, warps, stages, column or head constexprs) of a chain kernel's launches."""
        if setting is None:
            return None
        tile, warps, stages = setting
        if kernel == "pairs":   # a program per token block and pair, every head (the gather launch's last programs)
            block_h = triton.next_power_of_2(self.H)
            bm = min(1024, triton.next_power_of_2(max(1, tile // block_h)))
            return (triton.cdiv(self.M, bm),), bm, warps, stages, dict(BLOCK_H=block_h)   # (warps: the gather's)
        d_a, block_b, lanes = _split(self.D, split=kernel.removesuffix("_lead") in self.config.split)
        bm = _block_m(tile, lanes, self.config)
        return (triton.cdiv(self.M, bm) * self.H,), bm, warps, stages, dict(D_A=d_a, BLOCK_B=block_b)

    def reset(self, queries=None, gains=None):
        """Ready for a new pass; queries, gains: every site's q and g, which leading forwards read (None: no leads) and
        the gather backward differentiates at site 1."""
        self.live = queries, gains
        self.queries, self.gains = (None, None) if queries is None else ([q.detach() for q in queries],
                                                                          [g.detach() for g in gains])
        self.launcher.refresh(self.config.direct)
        self.following = False   # the previous launch (backward: gather j+1) led this one
        self.behind, self.led = 0, 0   # forward: sites since the last leader (0: none leads this one), how many it led
        self.next_fwd, self.next_bwd, self.sentinel = 1, None, None

    def pending(self):
        """True while a forward's graph is alive and its backward has not finished."""
        return self.sentinel is not None and self.sentinel() is not None and self.next_bwd != 0

    @torch.compiler.disable   # opaque to torch.compile: Triton launches with side effects on the chain
    def route(self, j, new_source, q, g):
        """Site j: new_source (B, T, d) is s_{j-1}, q and g site j's parameters; returns its routed (B, T, d) input."""
        x = new_source.to(self.dtype).reshape(-1, self.d).contiguous()
        grad = self.training and torch.is_grad_enabled()
        return (_RouteSite.apply(x, q, g, self, j, *self.deferred(j)) if grad else self.forward_site(j, x, q, g)).view(
            new_source.shape)

    def deferred(self, j):
        """Parameters whose gradients site j's backward returns besides its own q and g: none here (routing_gather's
        chain returns every site's at site 1)."""
        return ()

    def _expect_forward(self, j):
        if self.next_bwd is not None:
            raise RuntimeError(f"fused routing: site {j} ran forward after this pass's forward had finished. Activation "
                               "checkpointing may wrap sublayers, never routing calls; or use routing_impl='reference'")
        if j != self.next_fwd:
            raise RuntimeError(f"fused routing: site {j} ran forward, expected site {self.next_fwd} (sites run 1..N in order)")

    def forward_site(self, j, new_source, q, g):
        self._expect_forward(j)
        out = torch.empty(self.M, self.d, dtype=self.dtype, device=new_source.device)
        lead = self.config.fwd_lead_sites if j in self.fwd_lead and self.queries is not None and not self.behind else 0
        grid, bm, warps, stages, parts = self.launch["fwd_lead" if lead else "fwd"]
        led = [(self.queries[j + x], self.gains[j + x]) if x < lead else (q, g) for x in range(3)]   # sites j+1..j+3
        (q2, g2), (q3, g3), (q4, g4) = led
        self.launcher.launch(_chain_fwd, ("fwd", lead, self.behind > 0), grid, warps,
                             (new_source, q, g, q2, g2, q3, g3, q4, g4),
                             dict(NEW=new_source, Q=q, G=g, OUT=out, Q2=q2, G2=g2, Q3=q3, G3=g3, Q4=q4, G4=g4, j=j,
                                  back=self.behind), lambda: dict(
            S=self.S, R=self.R, W=self.W, LSE=self.LSE, LG=self.LG if self.training else self.LSE, PACC=self.PACC,
            PML=self.PML, MIX=self.MIX, M=self.M, eps=self.eps, DM=self.d, H=self.H, D=self.D, **parts, BLOCK_M=bm,
            BLOCK_C=min(1024, triton.next_power_of_2(self.d)), STAGES=stages, STORE_LOGITS=self.stored_logits, LEAD=lead,
            FOLLOW=self.behind > 0, STORE_MIX=self.MIX is not self.R))
        if lead:
            self.behind, self.led = 1, lead
        else:
            self.behind = self.behind + 1 if 0 < self.behind < self.led else 0
        self.next_fwd = j + 1
        if j == self.N:
            self.next_bwd, self.following, self.behind = self.N, False, 0
        return out

    def _expect_backward(self, j):
        if self.next_bwd != j:
            expected = "none (the backward already finished)" if self.next_bwd == 0 else f"site {self.next_bwd}"
            raise RuntimeError(f"fused routing: backward reached site {j}, expected {expected}. Backward must run once, in "
                               "exact reverse site order, over the whole chain: a loss built from an intermediate routing "
                               "output, a second backward through one graph, or a routing call inside activation "
                               "checkpointing breaks it. Use routing_impl='reference' for such graphs")

    def backward_site(self, j, grad_out, q, g):
        self._expect_backward(j)
        M, d, H = self.M, self.d, self.H
        grad_out = grad_out.to(self.dtype).contiguous()   # (no copy when it already is)
        grid, bm, warps, stages, parts = self.launch["site"]
        self.launcher.launch(_chain_bwd_site, ("site",), grid, warps, (grad_out,), dict(GIN=grad_out, j=j),
                             lambda: dict(
            S=self.S, R=self.R, W=self.W, LSE=self.LSE, GB=self.GB, LG=self.LG, DA=self.DA, C=self.C, PART=self.PART, M=M,
            DM=d, H=H, D=self.D, **parts, BLOCK_M=bm, STAGES=stages, LOGITS_STORED=self.stored_logits))
        ds = torch.empty(M, d, dtype=self.dtype, device=grad_out.device)
        dqg = torch.empty(2, d, dtype=torch.float32, device=grad_out.device)
        lead = j in self.gather_lead and not self.following
        grid, bm, warps, stages, parts = self.launch["gather_lead" if lead else "gather"]
        (pair_blocks,), bmp, _, _, pair_parts = self.launch["pairs"]   # + the pair pass of pairs (j, 0 .. j-2-lead)
        self.launcher.launch(_chain_bwd_gather, ("gather", lead, self.following),
                             (grid[0] + pair_blocks * max(0, j - 1 - lead),), warps, (q, g),
                             dict(Q=q, G=g, DS=ds, DQG=dqg, j=j), lambda: dict(
            S=self.S, R=self.R, W=self.W, GB=self.GB, PART=self.PART, PART2=self.PART2, TICKET=self.TICKET, DL=self.DA,
            AL=self.LG, KP=self.KP, LSE=self.LSE, C=self.C, PACC=self.PACC, PK=self.PK, M=M, n_sites=self.N,
            n_blocks=self.n_blocks, K=self.K, n_main=grid[0], inv_dm=1.0 / d, DM=d, H=H, D=self.D, **parts, BLOCK_M=bm,
            STAGES=stages, TWO_LEVEL=self.K > 1, LEAD=lead, FOLLOW=self.following, **pair_parts, BLOCK_MP=bmp))
        self.next_bwd, self.following = j - 1, lead
        return ds, dqg[0].to(q.dtype), dqg[1].to(g.dtype)


class _RouteSite(torch.autograd.Function):
    @staticmethod
    def forward(ctx, new_source, q, g, chain, j, *deferred):
        out = chain.forward_site(j, new_source, q, g)
        ctx.chain, ctx.j = chain, j
        ctx.save_for_backward(q, g)   # (saved: activation checkpointing around a routing call then reruns it, and fails)
        if j == 1:   # the graph holds a sentinel: when the graph is freed without backward, the chain is free
            ctx.sentinel = torch.empty(0)
            chain.sentinel = weakref.ref(ctx.sentinel)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        ds, dq, dg, *deferred = ctx.chain.backward_site(ctx.j, grad_out, *ctx.saved_tensors)
        return ds, dq, dg, None, None, *deferred


class FusedRouter:
    """One per model: start() returns a pass's chain, whose route() runs a site. config: a RoutingConfig or config_for."""

    def __init__(self, n_sites, heads, eps, config=None, blocks=None):
        self.N, self.H, self.eps, self.config, self.chain, self.blocks = n_sites, heads, eps, config, None, blocks

    def _chain_for(self, d, tokens, training):
        """The chain class of a pass and its launch settings: a training pass takes the gather backward where the
        settings ask for it and it has at least gather_min_tokens tokens, else the site pass's."""
        cfg = self.config or config_for(d, self.H)
        if self.blocks:   # block routing (route_blocks): routing_block.py, which imports this module
            from routing_block import BlockChain
            return functools.partial(BlockChain, blocks=self.blocks), cfg
        if training and cfg.backward == "gather":
            if tokens >= cfg.gather_min_tokens:
                from routing_gather import GatherChain   # (it imports this module)
                return GatherChain, cfg
            cfg = replace(cfg, backward="site")
        return RoutingChain, cfg

    def start(self, x, queries=None, gains=None):
        """The chain of a pass from x (B, T, d); queries, gains (every site's, in order) let sites lead (lead_schedule)."""
        (B, T, d), c = x.shape, self.chain
        if not torch.is_grad_enabled():
            chain, cfg = self._chain_for(d, B * T, False)
            c = chain(self.N, B * T, d, self.H, self.eps, x.dtype, x.device, False, cfg)
        elif c is not None and c.pending():
            raise RuntimeError("fused routing: a second forward started before the first forward's backward (one depth "
                               "history per model): call backward first, evaluate under torch.no_grad(), or use "
                               "routing_impl='reference'")
        elif c is None or (c.M, c.d, c.dtype, c.R.device) != (B * T, d, x.dtype, x.device):
            self.chain = None   # free the old buffers before allocating new ones
            chain, cfg = self._chain_for(d, B * T, True)
            c = self.chain = chain(self.N, B * T, d, self.H, self.eps, x.dtype, x.device, True, cfg)
        c.reset(queries, gains)
        return c
