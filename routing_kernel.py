"""
Fused Triton routing for attention residuals and MHAR (arXiv 2607.27230: Eq. 2-3, Appendix E), rung 2: the chain of a
whole pass (entry FusedRouter), the math of rung 1 (routing_call.py, one stateless call) over a depth history kept in
one buffer, each source written once. Per site one forward launch and one backward launch; one more a pass for dw.

Forward, site j (_chain_fwd): the newest source s_{j-1} into its slot with its RMS factor, then an online softmax per
head over s_0..s_{j-1} (the newest from registers); the output in the sources' dtype, its log-sum-exp, and for the
backward the output unrounded (fp32).
Backward, site j (_gather_bwd): autograd runs it after every later site's, so it gathers the whole gradient of its
own source n = j-1 over the sites jp = j..N that read it. A program owns a token block over the whole width (every
head: K's sum over heads stays inside it) and recomputes each pair's terms beside s_n, from what the forward and the
later sites' gathers left:
    logit = r_n <w_jp[h], s_n[h]>,  alpha = exp(logit - lse_jp),  da = <G_jp[h], s_n[h]>,  dlogit = alpha (da - c_jp)
    ds_n = sum_jp (alpha G_jp + dlogit r_n w_jp) - (r_n^2 / d) K s_n,   K = sum_jp sum_h dlogit logit
c_jp[h] = sum_n alpha da = <G_jp[h], out_jp[h]> is made once, by site jp's own gather, from its upstream gradient and
the unrounded output (the 16-bit output would add to the gradient's error); it stores c and lse token-major (CL), so a
later gather loads a token's pair of a head in one copy. ds's two sums share one fp32 accumulator (registers bound
how many programs a multiprocessor holds). dw_jp = sum_n sum_tokens dlogit r_n s_n[h] spans every source of site jp:
each gather stores its pairs' dlogit r_n (DLR), and after the gather of s_0 one matrix product over the tokens makes
every pair's terms (_dw_terms: a launch per source left the GPU idle), summed in a fixed order; site 1's backward
returns every site's dq = dw g and dg = dw q. RoutingConfig.stored_logits: the forward stores each pair's logit and the
gathers load it instead of a dot over the head (pays for a single head, whose dot spans the whole width).
Read sharing: a leading forward also runs the next 1-2 sites' softmax on each tile it loads and hands each its fp32
state; the led site resumes it and reads only the sources since. A leading gather also sums source n-1's terms on each
gradient tile; site j-1's gather starts from them and adds only G_{j-1}. Every sum has a fixed order: deterministic,
and the same output with or without sharing.

Layouts (M = B*T tokens, row-major, 64-bit offsets; P = N(N+1)/2 pairs, pair (site jp, source n) is LG's row
jp(jp-1)/2 + n, site-major, and DLR's row nN - n(n-1)/2 + jp - n - 1, source-major): S, GB [N, M, d] the sources and
upstream gradients (activation dtype); fp32 R [N, M], W [N, d] (w = q g), LSE [N, H, M], MIX [N, M, d], CL [N, M, H, 2]
(c, lse), LG, DLR [P, H, M], PDW [splits, P + 1, d]; lead states PACC [L, M, d], PML [L, 2, H, M], PK [M].
Envelope: bf16 / fp16 / fp32 sources, math in fp32; d % H == 0, D = d/H >= 16 (any D, held as up to two power-of-two
column parts); any number of sources (tests: 145); > 2^31 elements a buffer; T = 1. Outside it a ValueError names
the limit (routing_config.check_envelope, beside the launch settings).
Cost model (bf16): 2 bytes a channel per (source, site) pair in the forward and again in the gather, before read
sharing; ~10 more a site (the fp32 output written and read, s_n read again for dw): bench.chain_bytes. Measured:
BENCHMARKS.md.
"""
import weakref

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the model falls back to the reference routing (model.py prints why)
    triton = None

from routing_config import (INTERPRET, Launch, _block_m, _split, announce, check_envelope, config_for, lead_schedule,
                            op_namespace)


def available(device):
    """Can the fused path run for tensors on `device`? (Triton on CUDA, or the interpreter on CPU)."""
    return triton is not None and (torch.device(device).type == "cuda" or INTERPRET)


if triton is not None:
    from routing_call import (_dot2, _head_w, _heads_part, _load, _logit, _logit_grad, _part, _rounded, _rows,
                              _softmax_update, _source, _zeros)

    # ---- the forward: one launch a site, a program a (token block, head) ---------------------------------------------

    @triton.jit
    def _source_parts(S, R, n, M, tile_a, mask_a, tile_b, mask_b, rows64, rmask, DM: tl.constexpr, SPLIT: tl.constexpr):
        """Source n's column parts (fp32; part b = part a when not SPLIT) and RMS factors."""
        s_a, r = _source(S, R, n, M, tile_a, mask_a, rows64, rmask, DM)
        s_b = s_a
        if SPLIT:
            s_b = tl.load(S + (n * M).to(tl.int64) * DM + tile_b, mask=mask_b, other=0.0).to(tl.float32)
        return s_a, s_b, r

    @triton.jit
    def _mix_step(m_i, l_i, acc_a, acc_b, s_a, s_b, r, w_a, w_b, n, j, LG, h, M, rows64, rmask, H: tl.constexpr,
                  SPLIT: tl.constexpr, STORE_LOGITS: tl.constexpr):
        """_online_softmax_step of site j (j sources) over one or two column parts for source n; stores the logit as
        pair (j, n) if STORE_LOGITS."""
        logit = _logit(r, _dot2(s_a, w_a[None, :], s_b, w_b[None, :], SPLIT), n, j)
        if STORE_LOGITS:
            tl.store(LG + ((j * (j - 1) // 2 + n) * H + h).to(tl.int64) * M + rows64, logit, mask=rmask)
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

    @triton.jit(do_not_specialize=["j", "back"])   # (one compiled kernel for every j and back)
    def _chain_fwd(
        S, R,       # [N, M, DM] sources, [N, M] fp32 RMS factors; slot j-1 is written here
        NEW, Q, G,  # [M, DM] the newest source s_{j-1} (this site's autograd input, contiguous); [DM] q and g
        W, OUT,     # [N, DM] fp32 w = q*g (row j-1 written, for the gathers); [M, DM] routed output
        LSE, LG,    # [N, H, M] fp32 log-sum-exp (row j-1 written); [P, H, M] fp32 logits (if STORE_LOGITS)
        Q2, G2, Q3, G3,   # [DM] q and g of sites j+1, j+2 (read if LEAD >= 1, 2)
        PACC, PML,  # [L, M, DM], [L, 2, H, M] fp32 the led sites' mixes, maxima, denominators (FOLLOW reads one)
        MIX,        # [N, M, DM] fp32 every site's output unrounded (row j-1 written if STORE_MIX: for the backward)
        M, j, back, eps,   # tokens, this site (1..N), FOLLOW: how many sites after its leader, RMS eps
        DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, D_A: tl.constexpr, BLOCK_B: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, STAGES: tl.constexpr, STORE_LOGITS: tl.constexpr,
        LEAD: tl.constexpr, FOLLOW: tl.constexpr, STORE_MIX: tl.constexpr):
        SPLIT: tl.constexpr = BLOCK_B > 0
        h, pm, rows64, rmask = _rows(M, H, BLOCK_M)
        slot = (j - 1).to(tl.int64) * M * DM
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
        m2, l2, acc2_a, acc2_b, w2_a, w2_b = m_i, l_i, acc_a, acc_b, w_a, w_b   # placeholders unless LEAD >= 1, 2
        m3, l3, acc3_a, acc3_b, w3_a, w3_b = m_i, l_i, acc_a, acc_b, w_a, w_b
        if LEAD >= 1:
            m2, l2, acc2_a, acc2_b, w2_a, w2_b = _lead_init(Q2, G2, h, cols_a, cmask_a, cols_b, cmask_b, D, BLOCK_M,
                                                            D_A, BLOCK_B, SPLIT)
        if LEAD >= 2:
            m3, l3, acc3_a, acc3_b, w3_a, w3_b = _lead_init(Q3, G3, h, cols_a, cmask_a, cols_b, cmask_b, D, BLOCK_M,
                                                            D_A, BLOCK_B, SPLIT)
        # -- end of read sharing setup
        for n in tl.range(n0, j - 1, num_stages=STAGES):
            s_a, s_b, r = _source_parts(S, R, n, M, tile_a, mask_a, tile_b, mask_b, rows64, rmask, DM, SPLIT)
            m_i, l_i, acc_a, acc_b = _mix_step(m_i, l_i, acc_a, acc_b, s_a, s_b, r, w_a, w_b, n, j, LG, h, M,
                                               rows64, rmask, H, SPLIT, STORE_LOGITS)
            if LEAD >= 1:   # read sharing: the same tile, the led sites' queries
                m2, l2, acc2_a, acc2_b = _mix_step(m2, l2, acc2_a, acc2_b, s_a, s_b, r, w2_a, w2_b, n, j + 1, LG, h,
                                                   M, rows64, rmask, H, SPLIT, STORE_LOGITS)
            if LEAD >= 2:
                m3, l3, acc3_a, acc3_b = _mix_step(m3, l3, acc3_a, acc3_b, s_a, s_b, r, w3_a, w3_b, n, j + 2, LG,
                                                   h, M, rows64, rmask, H, SPLIT, STORE_LOGITS)
        # (the newest source stays 16-bit until here: fp32 across the loop cost the 1B shape ~10 registers per thread,
        # one program per SM, and a slower forward)
        new_a, new_b = new_a.to(tl.float32), new_b.to(tl.float32)
        m_i, l_i, acc_a, acc_b = _mix_step(m_i, l_i, acc_a, acc_b, new_a, new_b, r_new, w_a, w_b, j - 1, j, LG, h, M,
                                           rows64, rmask, H, SPLIT, STORE_LOGITS)
        if LEAD >= 1:   # read sharing: the led sites' states, handed to their launches
            m2, l2, acc2_a, acc2_b = _mix_step(m2, l2, acc2_a, acc2_b, new_a, new_b, r_new, w2_a, w2_b, j - 1, j + 1, LG,
                                               h, M, rows64, rmask, H, SPLIT, STORE_LOGITS)
            _hand_off(PACC, PML, 0, m2, l2, acc2_a, acc2_b, ml, tile_a, mask_a, tile_b, mask_b, rmask, M, DM, H, SPLIT)
        if LEAD >= 2:
            m3, l3, acc3_a, acc3_b = _mix_step(m3, l3, acc3_a, acc3_b, new_a, new_b, r_new, w3_a, w3_b, j - 1, j + 2,
                                               LG, h, M, rows64, rmask, H, SPLIT, STORE_LOGITS)
            _hand_off(PACC, PML, 1, m3, l3, acc3_a, acc3_b, ml, tile_a, mask_a, tile_b, mask_b, rmask, M, DM, H, SPLIT)
        tl.store(OUT + tile_a, _rounded(acc_a / l_i[:, None], OUT.dtype.element_ty), mask=mask_a)
        if SPLIT:
            tl.store(OUT + tile_b, _rounded(acc_b / l_i[:, None], OUT.dtype.element_ty), mask=mask_b)
        if STORE_MIX:   # the unrounded output, for the backward's c = <G, out>
            tl.store(MIX + slot + tile_a, acc_a / l_i[:, None], mask=mask_a)
            if SPLIT:
                tl.store(MIX + slot + tile_b, acc_b / l_i[:, None], mask=mask_b)
        tl.store(LSE + ((j - 1) * H + h).to(tl.int64) * M + rows64, m_i + tl.log(l_i), mask=rmask)

    # ---- the backward: one gather a site, a program a token block over every head; dw once a pass ---------------

    @triton.jit
    def _site_w(W, jp, woff_a, wmask_a, woff_b, wmask_b, DM: tl.constexpr, SPLIT: tl.constexpr):
        """Site jp's w, both parts ([1, BH, part])."""
        w_a, w_b = _load(W, (jp - 1) * DM, woff_a, wmask_a, woff_b, wmask_b, SPLIT)
        return w_a[None, :, :], w_b[None, :, :]

    @triton.jit
    def _pair(acc_a, acc_b, k, s_a, s_b, r, g_a, g_b, c, w_a, w_b, lse, n, jp, DLR, row, LG, hoff, hmask, M64,
              H: tl.constexpr, SPLIT: tl.constexpr, LOGITS_STORED: tl.constexpr):
        """Pair (site jp, source n): acc += alpha G + dlogit r_n w, k += sum_h dlogit logit; dlogit r_n stored as DLR row
        `row` (the dw product's operand). s, g: [BLOCK_M, BH, part] fp32 tiles, r: [BLOCK_M], c: [BLOCK_M, BH]. The logit
        is recomputed, or with LOGITS_STORED loaded from the forward's LG (pair (jp, n): row jp (jp - 1) / 2 + n)."""
        if LOGITS_STORED:
            logit = tl.load(LG + (jp * (jp - 1) // 2 + n) * H * M64 + hoff, mask=hmask, other=0.0)
        else:
            logit = _logit(r[:, None], _dot2(s_a, w_a, s_b, w_b, SPLIT), n, jp)
        alpha = tl.exp(logit - lse)
        dlogit = alpha * (_dot2(g_a, s_a, g_b, s_b, SPLIT) - c)
        rdl, d_rms = _logit_grad(dlogit, r[:, None], logit, n, jp)
        tl.store(DLR + row * H * M64 + hoff, rdl, mask=hmask)
        acc_a = acc_a + alpha[:, :, None] * g_a + rdl[:, :, None] * w_a
        if SPLIT:
            acc_b = acc_b + alpha[:, :, None] * g_b + rdl[:, :, None] * w_b
        return acc_a, acc_b, k + tl.sum(d_rms, axis=1)

    @triton.jit
    def _store_ds(DS, acc, s, r, k, inv_dm, off, mask):
        """ds_n = sum_j (alpha G_j + dlogit r_n w_j) - (r^2 / d) K s_n on one column part."""
        ds = acc - (r * r * k * inv_dm)[:, None, None] * s
        tl.store(DS + off, _rounded(ds, DS.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["j", "M"])   # (an int argument that equals 1 would become a constant: M.to fails)
    def _gather_bwd(
        S, R, W, LSE, MIX,  # the forward's: [N, M, DM] sources, [N, M] RMS factors, [N, DM] w, [N, H, M] lse, [N, M, DM] mix
        LG,                 # LOGITS_STORED: the forward's [P, H, M] logits, site-major (pair (jp, n): row jp (jp-1)/2 + n)
        GIN, GB, CL,        # [M, DM] site j's upstream gradient; [N, M, DM] every site's (slot j-1 written);
                            # [N, M, H, 2] c and lse, token-major (a token's 2H scalars of a site in one row; slot j-1 written)
        DLR, DS,            # [P, H, M] fp32 dlogit r_n per pair, source-major (pairs (j..N, n) written); [M, DM] ds_n
        PACC, PK,           # [M, DM], [M] fp32 source n-1's sums over sites j..N (LEAD writes, site j-1's FOLLOW reads)
        M, j, N, inv_dm,
        DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, D_A: tl.constexpr, BLOCK_B: tl.constexpr,
        BLOCK_M: tl.constexpr, STAGES: tl.constexpr, LEAD: tl.constexpr, FOLLOW: tl.constexpr,
        LOGITS_STORED: tl.constexpr):
        SPLIT: tl.constexpr = BLOCK_B > 0
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask, rows64, M64 = rows < M, rows.to(tl.int64), M.to(tl.int64)
        off_a, mask_a, woff_a, wmask_a = _heads_part(rows64, rmask, 0, D_A, DM, H, D, BH)
        off_b, mask_b, woff_b, wmask_b = off_a, mask_a, woff_a, wmask_a
        if SPLIT:
            off_b, mask_b, woff_b, wmask_b = _heads_part(rows64, rmask, D_A, BLOCK_B, DM, H, D, BH)
        heads = tl.arange(0, BH)
        hoff, hmask = (heads * M).to(tl.int64)[None, :] + rows64[:, None], rmask[:, None] & (heads < H)[None, :]
        toff = (rows64[:, None] * (2 * H) + heads[None, :] * 2)[:, :, None] + tl.arange(0, 2)[None, None, :]   # CL's (c, lse)
        tmask = tl.broadcast_to(hmask[:, :, None], (BLOCK_M, BH, 2))
        n = j - 1   # the source this gather owns
        slot = n * M64 * DM
        s_a, s_b = _load(S, slot, off_a, mask_a, off_b, mask_b, SPLIT)
        r = tl.load(R + n * M64 + rows64, mask=rmask, other=0.0)
        row0 = n * N - n * (n - 1) // 2 - j   # source n's pairs: site jp at row row0 + jp
        # site j's own terms: its upstream gradient, kept for the gathers of older sources, and c_j = <G_j, out_j>
        g_a, g_b = _load(GIN, 0, off_a, mask_a, off_b, mask_b, SPLIT)
        tl.store(GB + slot + off_a, g_a.to(GB.dtype.element_ty), mask=mask_a)   # (exact: G_j is in GB's dtype)
        if SPLIT:
            tl.store(GB + slot + off_b, g_b.to(GB.dtype.element_ty), mask=mask_b)
        mix_a, mix_b = _load(MIX, slot, off_a, mask_a, off_b, mask_b, SPLIT)
        c = _dot2(g_a, mix_a, g_b, mix_b, SPLIT)
        acc_a, acc_b, k = _zeros(BLOCK_M, BH, D_A, BLOCK_B, SPLIT)
        last = N
        # -- read sharing: FOLLOW starts from the sums site j+1's gather left for this source over sites j+1..N and reads
        # only G_j; LEAD also sums source n-1's terms on every gradient tile it loads
        if FOLLOW:
            acc_a, acc_b = _load(PACC, 0, off_a, mask_a, off_b, mask_b, SPLIT)
            k, last = tl.load(PK + rows64, mask=rmask, other=0.0), j
        s2_a, s2_b, r2, row2 = s_a, s_b, r, row0   # source n-1's tiles and sums (placeholders unless LEAD)
        acc2_a, acc2_b, k2 = acc_a, acc_b, k
        if LEAD:
            s2_a, s2_b = _load(S, slot - M64 * DM, off_a, mask_a, off_b, mask_b, SPLIT)
            r2, row2 = tl.load(R + (n - 1) * M64 + rows64, mask=rmask, other=0.0), (n - 1) * N - (n - 1) * (n - 2) // 2 - n
            acc2_a, acc2_b, k2 = _zeros(BLOCK_M, BH, D_A, BLOCK_B, SPLIT)
        # -- end of read sharing setup
        w_a, w_b = _site_w(W, j, woff_a, wmask_a, woff_b, wmask_b, DM, SPLIT)
        lse = tl.load(LSE + n * H * M64 + hoff, mask=hmask, other=0.0)   # site j's, from the forward
        tl.store(CL + n * M64 * 2 * H + toff, tl.join(c, lse), mask=tmask)   # for the gathers of older sources
        acc_a, acc_b, k = _pair(acc_a, acc_b, k, s_a, s_b, r, g_a, g_b, c, w_a, w_b, lse, n, j, DLR, row0 + j, LG, hoff,
                                hmask, M64, H, SPLIT, LOGITS_STORED)
        if LEAD:
            acc2_a, acc2_b, k2 = _pair(acc2_a, acc2_b, k2, s2_a, s2_b, r2, g_a, g_b, c, w_a, w_b, lse, n - 1, j, DLR,
                                       row2 + j, LG, hoff, hmask, M64, H, SPLIT, LOGITS_STORED)
        for jp in tl.range(j + 1, last + 1, num_stages=STAGES):   # every later site that reads source n
            g_a, g_b = _load(GB, (jp - 1) * M64 * DM, off_a, mask_a, off_b, mask_b, SPLIT)
            c, lse = tl.split(tl.load(CL + (jp - 1) * M64 * 2 * H + toff, mask=tmask, other=0.0))
            w_a, w_b = _site_w(W, jp, woff_a, wmask_a, woff_b, wmask_b, DM, SPLIT)
            acc_a, acc_b, k = _pair(acc_a, acc_b, k, s_a, s_b, r, g_a, g_b, c, w_a, w_b, lse, n, jp, DLR, row0 + jp, LG,
                                    hoff, hmask, M64, H, SPLIT, LOGITS_STORED)
            if LEAD:   # read sharing: the same gradient tile, the previous source
                acc2_a, acc2_b, k2 = _pair(acc2_a, acc2_b, k2, s2_a, s2_b, r2, g_a, g_b, c, w_a, w_b, lse, n - 1, jp, DLR,
                                           row2 + jp, LG, hoff, hmask, M64, H, SPLIT, LOGITS_STORED)
        if LEAD:   # read sharing: source n-1's sums, handed to site j-1's gather
            tl.store(PACC + off_a, acc2_a, mask=mask_a)
            if SPLIT:
                tl.store(PACC + off_b, acc2_b, mask=mask_b)
            tl.store(PK + rows64, k2, mask=rmask)
        _store_ds(DS, acc_a, s_a, r, k, inv_dm, off_a, mask_a)
        if SPLIT:
            _store_ds(DS, acc_b, s_b, r, k, inv_dm, off_b, mask_b)

    @triton.jit(do_not_specialize=["M"])
    def _dw_terms(DLR, S, PDW, N, M, tokens_per_split, P1, DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                  BLOCK_J: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, PRECISION: tl.constexpr):
        """Every pair's terms of dw over one split of the tokens, one launch once every gather is done: the program of
        source n, sites n+1+i for i in its block of BLOCK_J, and a column block of head h writes
        PDW[split, row0 + i, cols] = sum over the split's tokens t of DLR[row0 + i, h, t] * s_n[t, cols] (fp32 sums; the
        products as PRECISION says: dw_precision)."""
        cb, nb, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n, jb = nb // tl.cdiv(N, BLOCK_J), nb % tl.cdiv(N, BLOCK_J)
        J, row0 = N - n, n * N - n * (n - 1) // 2   # source n's sites n+1 .. N: pair rows row0 ..
        h, c = cb // tl.cdiv(D, BLOCK_C), (cb % tl.cdiv(D, BLOCK_C)) * BLOCK_C + tl.arange(0, BLOCK_C)
        cols, cmask = h * D + c, c < D   # a column block of head h
        i = jb * BLOCK_J + tl.arange(0, BLOCK_J)
        M64 = M.to(tl.int64)
        acc = tl.zeros((BLOCK_J, BLOCK_C), tl.float32)
        t0 = split * tokens_per_split
        t1 = tl.where(jb * BLOCK_J < J, tl.minimum(t0 + tokens_per_split, M), t0)   # a block past source n's sites: none
        for t in range(t0, t1, BLOCK_T):
            ts = t + tl.arange(0, BLOCK_T)
            x = tl.load(DLR + ((row0 + i) * H + h).to(tl.int64)[:, None] * M64 + ts[None, :],
                        mask=(i < J)[:, None] & (ts < M)[None, :], other=0.0)
            y = tl.load(S + n * M64 * DM + ts.to(tl.int64)[:, None] * DM + cols[None, :],
                        mask=(ts < M)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            if PRECISION == "tf32x2":   # y exact in tf32 (16-bit sources): x = its tf32 bits + the rest, two products
                x_hi = (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
                acc = tl.dot(x - x_hi, y, acc, input_precision="tf32")
                acc = tl.dot(x_hi, y, acc, input_precision="tf32")
            else:
                acc = tl.dot(x, y, acc, input_precision=PRECISION)
        tl.store(PDW + (split * P1 + row0 + i).to(tl.int64)[:, None] * DM + cols[None, :], acc,
                 mask=(i < J)[:, None] & cmask[None, :])


def dw_precision(dtype, device):
    """dw's product on tensor cores where they take tf32 (sm_80+), at close to fp32's accuracy: "tf32x2" for 16-bit
    sources (exact in tf32, so dlogit r_n's high and low tf32 parts against them: two products), "tf32x3" for fp32
    sources (three: the sources' low parts too), else "ieee" FMAs. Its time is its tensor-core instructions."""
    device = torch.device(device)
    if device.type != "cuda" or INTERPRET or torch.cuda.get_device_capability(device) < (8, 0):
        return "ieee"
    return "tf32x3" if dtype == torch.float32 else "tf32x2"


def dw_launch(N, M, H, D):
    """_dw_terms' (sites, tokens a step, columns) a program, token splits and warps: each program reads its DLR rows and
    s_n columns once, so wider blocks re-read less; the splits fill the GPU (~2,048 programs over every source, >= 512
    tokens each). 16 tokens a step on 4 warps: 32 spill the IEEE product's registers."""
    bj, bc = 32, min(64, triton.next_power_of_2(D))
    programs = H * triton.cdiv(D, bc) * N * triton.cdiv(N, bj)
    return bj, 64 if INTERPRET else 16, bc, max(1, min(triton.cdiv(M, 512), triton.cdiv(2048, programs))), 4


class RoutingChain:
    """The buffers and bookkeeping of one forward/backward pass over all N sites. Contract: sites run forward in order
    1..N and backward in exact reverse order N..1, once; a second forward may not start while the first one's backward
    is pending; site 1's backward returns every site's dq and dg, so a training pass starts with every site's queries
    and gains (FusedRouter.start). Activation checkpointing may wrap sublayers, never routing calls (it would rerun a
    site's forward)."""

    def __init__(self, n_sites, tokens, d, heads, eps, dtype, device, training, config=None):
        check_envelope(d, heads, dtype)
        cfg = self.config = config or config_for(d, heads)
        announce(cfg, d, heads)
        N, M, H = self.N, self.M, self.H = n_sites, tokens, heads
        self.d, self.D, self.eps, self.dtype, self.training = d, d // heads, eps, dtype, training
        f32 = dict(dtype=torch.float32, device=device)
        self.S, self.R = torch.empty(N, M, d, dtype=dtype, device=device), torch.empty(N, M, **f32)
        self.W, self.LSE = torch.empty(N, d, **f32), torch.empty(N, H, M, **f32)
        self.stored_logits = training and cfg.stored_logits
        self.MIX, self.LG = self.R, self.LSE   # placeholders: a training pass's backward needs them
        if training:
            self._backward_buffers(N, M, d, H, f32)
        fwd, gather = lead_schedule(N, cfg.lead_min, cfg.fwd_lead_sites)
        self.fwd_lead = fwd if cfg.fwd_lead else frozenset()
        self.gather_lead = gather if cfg.gather_lead and training else frozenset()
        # one lead state at a time (the forward's is used up before the backward); else unused placeholders
        led = cfg.fwd_lead_sites if self.fwd_lead else 1   # lead states at once: the forward's, or the gather's one
        self.PACC, self.PML, self.PK = (torch.empty(led, M, d, **f32), torch.empty(led, 2, H, M, **f32),
                                        torch.empty(M, **f32)) if self.fwd_lead or self.gather_lead else (self.R,) * 3
        self._launches(N, M, d, H, cfg)
        self.reset()

    def _launches(self, N, M, d, H, cfg):
        """Each kernel's Launch, with and without leading (routing_config.Launch: the pass's buffers and shapes bound)."""
        d_a, block_b, lanes = _split(self.D)   # (160 = 128 + 32, not 256 padded)
        bh = triton.next_power_of_2(H)
        self.fwd_launch, self.gather_launch = {}, {}
        for lead, setting in ((False, cfg.fwd), (True, cfg.fwd_lead)):
            if setting:   # a program owns a token block of one head
                tile, warps, stages = setting
                bm = _block_m(tile, lanes, cfg)
                self.fwd_launch[lead] = Launch(
                    _chain_fwd, (triton.cdiv(M, bm) * H,), warps, ("NEW", "Q", "G", "OUT", "Q2", "G2", "Q3", "G3", "j",
                                                                   "back", "FOLLOW"),
                    S=self.S, R=self.R, W=self.W, LSE=self.LSE, LG=self.LG, PACC=self.PACC, PML=self.PML, MIX=self.MIX,
                    M=M, eps=self.eps, DM=d, H=H, D=self.D, D_A=d_a, BLOCK_B=block_b,
                    BLOCK_C=min(1024, triton.next_power_of_2(d)), BLOCK_M=bm, STAGES=stages,
                    STORE_LOGITS=self.stored_logits, LEAD=cfg.fwd_lead_sites if lead else 0,
                    STORE_MIX=self.MIX is not self.R)
        for lead, setting in ((False, cfg.gather), (True, cfg.gather_lead)):
            if setting and self.training:   # a program owns a token block over every head
                tile, warps, stages = setting
                bm = _block_m(tile, bh * lanes, cfg)
                self.gather_launch[lead] = Launch(
                    _gather_bwd, (triton.cdiv(M, bm),), warps, ("GIN", "DS", "j", "FOLLOW"),
                    S=self.S, R=self.R, W=self.W, LSE=self.LSE, MIX=self.MIX, LG=self.LG, GB=self.GB, CL=self.CL,
                    DLR=self.DLR, PACC=self.PACC, PK=self.PK, M=M, N=N, inv_dm=1.0 / d, DM=d, H=H, D=self.D, BH=bh,
                    D_A=d_a, BLOCK_B=block_b, BLOCK_M=bm, STAGES=stages, LEAD=lead, LOGITS_STORED=self.stored_logits)

    def _backward_buffers(self, N, M, d, H, f32):
        P = N * (N + 1) // 2
        self.GB = torch.empty(N, M, d, dtype=self.dtype, device=self.S.device)
        self.MIX, self.CL = torch.empty(N, M, d, **f32), torch.empty(N, M, H, 2, **f32)
        self.DLR = torch.empty(P, H, M, **f32)
        if self.stored_logits:
            self.LG = torch.empty(P, H, M, **f32)
        # dw's product (dw_launch): PDW [splits, P + 1, d] holds every pair's partial terms (row P stays 0), summed
        # once at the end: site jp's pairs are rows SITE_PAIRS[jp-1]
        self.dw_launch, self.dw_precision = dw_launch(N, M, H, self.D), dw_precision(self.dtype, self.S.device)
        self.PDW = torch.zeros(self.dw_launch[3], P + 1, d, **f32)
        rows = [[n * N - n * (n - 1) // 2 + jp - n - 1 for n in range(jp)] + [P] * (N - jp) for jp in range(1, N + 1)]
        self.SITE_PAIRS = torch.tensor(rows, device=self.S.device)

    def reset(self, queries=None, gains=None):
        """Ready for a new pass; queries, gains: every site's q and g, which leading forwards read and site 1's
        backward differentiates (None: no leads, and no backward)."""
        self.live = queries, gains
        self.queries, self.gains = (None, None) if queries is None else ([q.detach() for q in queries],
                                                                          [g.detach() for g in gains])
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
        """Parameters whose gradients site j's backward returns besides its own q and g: site 1's, every site's."""
        if self.live[0] is None:
            raise RuntimeError("fused routing: the backward returns every site's dq and dg at site 1: start the chain "
                               "with every site's queries and gains (FusedRouter.start(x, queries, gains))")
        return (*self.live[0], *self.live[1]) if j == 1 else ()

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
        (q2, g2), (q3, g3) = [(self.queries[j + x], self.gains[j + x]) if x < lead else (q, g) for x in range(2)]
        self.fwd_launch[lead > 0](NEW=new_source, Q=q, G=g, OUT=out, Q2=q2, G2=g2, Q3=q3, G3=g3, j=j, back=self.behind,
                                  FOLLOW=self.behind > 0)
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
        M, d, H, N = self.M, self.d, self.H, self.N
        grad_out = grad_out.to(self.dtype).contiguous()   # (no copy when it already is)
        ds = torch.empty(M, d, dtype=self.dtype, device=grad_out.device)
        lead = j in self.gather_lead and not self.following
        self.gather_launch[lead](GIN=grad_out, DS=ds, j=j, FOLLOW=self.following)
        self.next_bwd, self.following = j - 1, lead
        if j > 1:
            return ds, None, None
        # the last site: every pair's dlogit r_n is in DLR, so dw's product runs once over every pair, then dw_j = the
        # sum over splits, then over site j's pairs (fixed order)
        bj, bt, bc, splits, warps = self.dw_launch
        per_split = triton.cdiv(triton.cdiv(M, splits), bt) * bt
        _dw_terms[(H * triton.cdiv(self.D, bc), N * triton.cdiv(N, bj), splits)](
            DLR=self.DLR, S=self.S, PDW=self.PDW, N=N, M=M, tokens_per_split=per_split, P1=self.PDW.size(1), DM=d, H=H,
            D=self.D, BLOCK_J=bj, BLOCK_T=bt, BLOCK_C=bc, PRECISION=self.dw_precision, num_warps=warps)
        dw = self.PDW.sum(0)[self.SITE_PAIRS].sum(1)   # [N, d]
        queries, gains = self.live
        dq, dg = dw * torch.stack(gains).float(), dw * torch.stack(queries).float()
        return ds, None, None, *[x.to(q.dtype) for x, q in zip(dq, queries)], *[x.to(g.dtype) for x, g in zip(dg, gains)]


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
    """One per model: start() returns a pass's chain, whose route() runs a site. config: a RoutingConfig (None:
    config_for the width); chain: the chain class, RoutingChain or block routing's (model.fused_router chooses). Its
    id() names it to the operators below (ROUTERS)."""

    def __init__(self, n_sites, heads, eps, config=None, chain=RoutingChain):
        self.N, self.H, self.eps, self.config, self.make, self.chain = n_sites, heads, eps, config, chain, None
        self.current = None   # the chain of the pass under way (the operators' implementations find it here)
        self.op = getattr(torch.ops, NAMESPACE).route_site   # a site as an operator (torch.compile: see below)
        ROUTERS[id(self)] = self

    def start(self, x, queries=None, gains=None, training=None):
        """The chain of a pass from x (B, T, d); queries, gains: every site's, in order (a training pass needs them).
        training: whether a backward will follow (None: grad mode says)."""
        (B, T, d), c = x.shape, self.chain
        if not (torch.is_grad_enabled() if training is None else training):
            c = self.make(self.N, B * T, d, self.H, self.eps, x.dtype, x.device, False, self.config)
        elif c is not None and c.pending():
            raise RuntimeError("fused routing: a second forward started before the first forward's backward (one depth "
                               "history per model): call backward first, evaluate under torch.no_grad(), or use "
                               "routing_impl='reference'")
        elif c is None or (c.M, c.d, c.dtype, c.R.device, c.config) != (B * T, d, x.dtype, x.device,
                                                                         self.config or config_for(d, self.H)):
            self.chain = None   # free the old buffers before allocating new ones
            c = self.chain = self.make(self.N, B * T, d, self.H, self.eps, x.dtype, x.device, True, self.config)
        c.reset(queries, gains)
        self.current = c
        return c


# ---- the chain inside torch.compile: one operator a site --------------------------------------------------------------
# A compiled region traces Python, and a chain's buffers and site order cannot be traced: there each site is an
# operator (torch.library), opaque to the compiler, taking tensors and the integer that names its router; its
# implementation runs the chain as route() does, and its backward is an operator too. model.FusedDepthHistory calls
# these while torch.compile traces (torch.compile(model): 0 graph breaks for the fused routing) and route() otherwise:
# the same kernels, without the operators' dispatch in eager steps.
ROUTERS = weakref.WeakValueDictionary()   # id -> FusedRouter


NAMESPACE = op_namespace(__name__, "routing_kernel", "route_site")   # (a copy of this file: its own, beside its ROUTERS)


@torch.library.custom_op(f"{NAMESPACE}::route_site", mutates_args=())
def route_site(new_source: torch.Tensor, q: torch.Tensor, g: torch.Tensor, queries: list[torch.Tensor],
               gains: list[torch.Tensor], router: int, j: int, training: bool) -> torch.Tensor:
    """Site j of the pass of router `router`: RoutingChain.route's forward. Site 1 starts the pass with every site's
    queries and gains (its backward returns their gradients)."""
    r = ROUTERS[router]
    c = r.start(new_source, queries, gains, training) if j == 1 else r.current
    x = new_source.to(c.dtype).reshape(-1, c.d).contiguous()
    return c.forward_site(j, x, q, g).view(new_source.shape).to(new_source.dtype)


@route_site.register_fake
def _(new_source, q, g, queries, gains, router, j, training):
    return torch.empty_like(new_source)


@torch.library.custom_op(f"{NAMESPACE}::route_site_backward", mutates_args=())
def route_site_backward(grad_out: torch.Tensor, q: torch.Tensor, g: torch.Tensor, queries: list[torch.Tensor],
                        gains: list[torch.Tensor], router: int, j: int) -> list[torch.Tensor]:
    """Site j's backward (RoutingChain.backward_site): the gradient of its new source, and at site 1 every site's dq
    and dg after it."""
    c = ROUTERS[router].current
    ds, _, _, *deferred = c.backward_site(j, grad_out.reshape(-1, c.d), q, g)
    return [ds.view(grad_out.shape).to(grad_out.dtype), *[t.clone() for t in deferred]]   # (rows of one tensor)


@route_site_backward.register_fake
def _(grad_out, q, g, queries, gains, router, j):
    return [torch.empty_like(grad_out), *[torch.empty_like(t) for t in (*queries, *gains)]]


def _setup_route_site(ctx, inputs, output):
    new_source, q, g, queries, gains, router, j, training = inputs
    ctx.save_for_backward(q, g, *queries, *gains)
    ctx.router, ctx.j, ctx.n = router, j, len(queries)


def _route_site_grad(ctx, grad_out):
    q, g, *params = ctx.saved_tensors
    ds, *deferred = getattr(torch.ops, NAMESPACE).route_site_backward(grad_out, q, g, params[:ctx.n], params[ctx.n:],
                                                                      ctx.router, ctx.j)
    return ds, None, None, list(deferred[:ctx.n]), list(deferred[ctx.n:]), None, None, None


route_site.register_autograd(_route_site_grad, setup_context=_setup_route_site)
