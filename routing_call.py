"""
Rung 1 of the fused routing (arXiv 2607.27230: Eq. 2-3, Appendix E): one stateless routing call as Triton kernels, the
algorithm in its plainest fused form, read after model.route_reference. A forward online softmax (_call_fwd), a
backward site pass (_call_bwd_site: c, dw, each source's da and logit) and a source pass (_call_bwd_sources: each ds);
entry route_stack (autograd, stacked sources: delta mode) over call_forward / call_backward (the launches). The
Triton helpers here (tiles of one head or of every head, a source's load, the softmax step) also serve the chains of a
whole pass (routing_kernel.py, routing_block.py), which import them from here: the lowest kernel file.

Math. Site j = 1..N (N = 2L+1) mixes the sources s_0..s_{j-1} (s_0 the embedding, s_n the raw output of sublayer n):
    r_n = (mean_k s_n[k]^2 + eps)^(-1/2) (RMS over the FULL width d),  w = q * g (the key gain folded into the query)
    logit[n, h] = r_n <w[h], s_n[h]> (head h = channels [hD, (h+1)D), D = d/H),  alpha = softmax_n(logit),
    out[h] = sum_n alpha[n, h] s_n[h]
Backward at site j, with G = dLoss/dout:
    da[n, h] = <G[h], s_n[h]>,  c[h] = sum_n alpha[n, h] da[n, h],  dlogit[n, h] = alpha[n, h] (da[n, h] - c[h])
    dw[h] = sum_tokens sum_n dlogit[n, h] r_n s_n[h];   dq = dw g,  dg = dw q
    ds_n = sum_j alpha_j[n] G_j + r_n u - (r_n^2 / d) K s_n over the sites j that read s_n, u[h] = sum_j dlogit_j[n, h]
    w_j[h], K = sum_j sum_h dlogit_j[n, h] logit_j[n, h] (the RMS term's <u, s_n> spans every head; <w_j[h], s_n[h]> =
    logit_j[n, h] / r_n makes it one scalar, so a program that owns one head needs no other head's vectors).

Sources: an optional null vector, then N of an [N, M, d] buffer (M = B*T tokens). Envelope and launch settings:
routing_config.py; measured: BENCHMARKS.md.
"""
from dataclasses import replace

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # routing_kernel.available reports it; the model falls back to the reference routing
    triton = None

from routing_config import DEFAULT, _block_m, announce, check_envelope, config_for, op_namespace


# ---- rung 1: one stateless routing call over stacked sources (the algorithm) -----------------------------------------

if triton is not None:   # the helpers every kernel file uses, then rung 1's kernels
    @triton.jit
    def _rounded(x, dtype: tl.constexpr):
        """x (fp32) in dtype, rounded to nearest even (the GPU's bf16 cast; the CPU interpreter would truncate)."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        return x.to(dtype)

    @triton.jit
    def _rows(M, H: tl.constexpr, BLOCK_M: tl.constexpr):
        """Head h, token block pm (heads vary fastest: a token block's programs share L2), 64-bit rows, row mask."""
        pid = tl.program_id(0)
        h, pm = pid % H, pid // H
        rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        return h, pm, rows.to(tl.int64), rows < M

    @triton.jit
    def _part(h, rows64, rmask, C0: tl.constexpr, BLOCK: tl.constexpr, DM: tl.constexpr, D: tl.constexpr):
        """Columns [C0, C0 + BLOCK) of head h (masked to D): column mask, tile mask, tile offsets in [M, DM]."""
        cols = C0 + tl.arange(0, BLOCK)
        cmask = cols < D
        return cols, cmask, rmask[:, None] & cmask[None, :], rows64[:, None] * DM + h * D + cols[None, :]

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

    # -- the routing math, once. Every kernel (here, routing_kernel.py, routing_block.py) makes every pair's logit with
    # _logit, steps its online softmax with _softmax_update and carries the logit's gradient to the query and the source
    # with _logit_grad, each told which source it scores: a change to the logit is made here and in model.route_logit,
    # its twin in the reference (ROUTING.md)

    @triton.jit
    def _logit(r, dot, n, count):
        """A pair's routing logit from its source's RMS factor r and the head's dot product dot = <w[h], s[h]> (w = q g,
        the key gain folded into the query): r <w, s>, no temperature (paper Eq. 2). n is the source's place among the
        site's `count` sources (0 the oldest: the embedding, or the null source first in delta mode; count - 1 the
        newest), as model.route_logit numbers them. Any shapes that broadcast."""
        return r * dot

    @triton.jit
    def _logit_grad(dlogit, r, logit, n, count):
        """The logit's gradient dlogit carried to _logit's inputs: (dlogit d logit / d dot, dlogit r d logit / dr). The
        first is what dw gets times s and ds times w; the second, summed over heads (K), gives ds's RMS term -(r^2 / d)
        K s (d r / d s = -(r^3 / d) s). For r <w, s>: (dlogit r, dlogit logit). n, count: as _logit's."""
        return dlogit * r, dlogit * logit

    @triton.jit
    def _softmax_update(m_i, l_i, logit):
        """New running max, denominator, the factor that rescales the old mix, and the new source's weight."""
        m_new = tl.maximum(m_i, logit)
        scale, p = tl.exp(m_i - m_new), tl.exp(logit - m_new)
        return m_new, l_i * scale + p, scale, p

    @triton.jit
    def _dot2(x_a, y_a, x_b, y_b, SPLIT: tl.constexpr):
        """Sums of x * y over both column parts' last axis, fp32: [BLOCK_M], or [BLOCK_M, heads] for 3D tiles. A head
        is held as up to two power-of-two column parts (routing_config._split); without SPLIT (a constexpr) part b's
        variables hold unused placeholders."""
        out = tl.sum(x_a * y_a, axis=-1)
        if SPLIT:
            out += tl.sum(x_b * y_b, axis=-1)
        return out

    @triton.jit
    def _heads_part(rows64, rmask, C0: tl.constexpr, BW: tl.constexpr, DM: tl.constexpr, H: tl.constexpr,
                    D: tl.constexpr, BH: tl.constexpr):
        """Columns [C0, C0 + BW) of every head (masked to D): offsets and mask of a [BLOCK_M, BH, BW] tile of an [M, DM]
        matrix, and of the [BH, BW] tile of a row of W (the chains' whole-width programs)."""
        heads, cols = tl.arange(0, BH), C0 + tl.arange(0, BW)
        woff, wmask = (heads * D)[:, None] + cols[None, :], (heads < H)[:, None] & (cols < D)[None, :]
        return rows64[:, None, None] * DM + woff[None, :, :], rmask[:, None, None] & wmask[None, :, :], woff, wmask

    @triton.jit
    def _load(X, base, off_a, mask_a, off_b, mask_b, SPLIT: tl.constexpr):
        """Both column parts of a tile at X + base, in fp32 (part b = part a when not SPLIT)."""
        x_a = tl.load(X + base + off_a, mask=mask_a, other=0.0).to(tl.float32)
        x_b = x_a
        if SPLIT:
            x_b = tl.load(X + base + off_b, mask=mask_b, other=0.0).to(tl.float32)
        return x_a, x_b

    @triton.jit
    def _zeros(BLOCK_M: tl.constexpr, BH: tl.constexpr, D_A: tl.constexpr, BLOCK_B: tl.constexpr, SPLIT: tl.constexpr):
        """A zero [BLOCK_M, BH, part] accumulator per column part (part b's = part a's when not SPLIT), a zero a token."""
        a = tl.zeros((BLOCK_M, BH, D_A), tl.float32)
        b = a
        if SPLIT:
            b = tl.zeros((BLOCK_M, BH, BLOCK_B), tl.float32)
        return a, b, tl.zeros((BLOCK_M,), tl.float32)

    # Sources: an optional null vector (broadcast over tokens; delta mode) as row 0 of DA / LG, then N of HIST [., M, d]
    # with RMS factors R [., M]. A program owns a (token block, head): a [BLOCK_M, BLOCK_D] tile, D padded to 2^k.

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
    def _online_softmax_step(m_i, l_i, acc, s, r, w, n, count):
        """Add source s (tile, fp32; the n-th of count) with RMS factor r to the running max m_i, denominator l_i and
        mix acc."""
        m_i, l_i, scale, p = _softmax_update(m_i, l_i, _logit(r, tl.sum(s * w[None, :], axis=1), n, count))
        return m_i, l_i, acc * scale[:, None] + p[:, None] * s

    @triton.jit
    def _call_fwd(
        HIST, R,        # [N, M, DM] history sources, [N, M] fp32 RMS factors
        NULL, Q, G,     # [DM] the null source (read if HAS_NULL), query and key gain
        OUT, LSE,       # [M, DM] routed output (the history's dtype), [H, M] fp32 log-sum-exp (for backward)
        M, N, eps,      # tokens, history sources, RMS eps
        DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_C: tl.constexpr, STAGES: tl.constexpr, HAS_NULL: tl.constexpr):
        h, pm, rows64, rmask = _rows(M, H, BLOCK_M)
        cols, cmask, mask, tile = _part(h, rows64, rmask, 0, BLOCK_D, DM, D)
        w = _head_w(Q, G, h, cols, cmask, D)
        m_i, l_i = tl.full((BLOCK_M,), float("-inf"), tl.float32), tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        if HAS_NULL:
            s, r = _null_source(NULL, h, cols, cmask, eps, DM, D, BLOCK_M, BLOCK_D, BLOCK_C)
            m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, r, w, 0, N + 1)
        for n in tl.range(0, N, num_stages=STAGES):   # each source tile is read once
            s, r = _source(HIST, R, n, M, tile, mask, rows64, rmask, DM)
            m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, r, w, n + HAS_NULL, N + HAS_NULL)
        tl.store(OUT + tile, _rounded(acc / l_i[:, None], OUT.dtype.element_ty), mask=mask)
        tl.store(LSE + h.to(tl.int64) * M + rows64, m_i + tl.log(l_i), mask=rmask)

    @triton.jit
    def _call_pass_step(c, acc_p, acc_q, s, r, w, n, count, g_up, lse, DA, LG, off, rmask):
        """One source of the backward site pass (the n-th of count): accumulate c, P, Q; store da and the logit."""
        logit = _logit(r, tl.sum(s * w[None, :], axis=1), n, count)
        alpha, da = tl.exp(logit - lse), tl.sum(g_up * s, axis=1)
        tl.store(DA + off, da, mask=rmask)
        tl.store(LG + off, logit, mask=rmask)
        # dlogit = alpha da - alpha c, and c is known only after the last source: both parts' terms, each linear in it
        p, _ = _logit_grad(alpha * da, r, logit, n, count)
        q, _ = _logit_grad(alpha, r, logit, n, count)
        return c + alpha * da, acc_p + p[:, None] * s, acc_q + q[:, None] * s

    @triton.jit
    def _call_bwd_site(
        HIST, R, NULL, Q, G, LSE,   # as in _call_fwd (read); GOUT [M, DM] the upstream gradient, contiguous
        GOUT, DA, LG, C,            # DA, LG [HAS_NULL + N, H, M] fp32 per-source da, logit; C [H, M] fp32 c
        PART, M, N, eps,            # [token blocks, DM] fp32 partial sums of dw
        DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_C: tl.constexpr, STAGES: tl.constexpr, HAS_NULL: tl.constexpr):
        # dw = sum_n alpha r (da - c) s = P - c Q per token, in one pass: c is known only at the end
        h, pm, rows64, rmask = _rows(M, H, BLOCK_M)
        cols, cmask, mask, tile = _part(h, rows64, rmask, 0, BLOCK_D, DM, D)
        w = _head_w(Q, G, h, cols, cmask, D)
        g_up = tl.load(GOUT + tile, mask=mask, other=0.0).to(tl.float32)
        lse = tl.load(LSE + h.to(tl.int64) * M + rows64, mask=rmask, other=0.0)
        c, acc_p, acc_q = tl.zeros((BLOCK_M,), tl.float32), tl.zeros((BLOCK_M, BLOCK_D), tl.float32), \
            tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        if HAS_NULL:
            s, r = _null_source(NULL, h, cols, cmask, eps, DM, D, BLOCK_M, BLOCK_D, BLOCK_C)
            c, acc_p, acc_q = _call_pass_step(c, acc_p, acc_q, s, r, w, 0, N + 1, g_up, lse, DA, LG,
                                              h.to(tl.int64) * M + rows64, rmask)
        for n in tl.range(0, N, num_stages=STAGES):
            s, r = _source(HIST, R, n, M, tile, mask, rows64, rmask, DM)
            c, acc_p, acc_q = _call_pass_step(c, acc_p, acc_q, s, r, w, n + HAS_NULL, N + HAS_NULL, g_up, lse, DA, LG,
                                              ((n + HAS_NULL) * H + h).to(tl.int64) * M + rows64, rmask)
        tl.store(C + h.to(tl.int64) * M + rows64, c, mask=rmask)
        tl.store(PART + pm.to(tl.int64) * DM + h * D + cols, tl.sum(acc_p - c[:, None] * acc_q, axis=0), mask=cmask)

    @triton.jit
    def _call_source_grad(s, r, g_up, w, n, count, DA, LG, lse_all, c_all, heads, hmask, own, rows64, M, inv_dm,
                          H: tl.constexpr):
        """ds of source n of count: alpha G + r dlogit w - (r^2 / d) K s, K = sum_h dlogit logit (all heads;
        _logit_grad)."""
        off = ((n * H + heads[:, None]) * M).to(tl.int64) + rows64[None, :]
        lg = tl.load(LG + off, mask=hmask, other=0.0)
        alpha = tl.exp(lg - lse_all)
        dlogit = alpha * (tl.load(DA + off, mask=hmask, other=0.0) - c_all)
        d_dot, d_rms = _logit_grad(dlogit, r[None, :], lg, n, count)
        k, a_h, dd_h = tl.sum(d_rms, axis=0), tl.sum(tl.where(own, alpha, 0.0), axis=0), \
            tl.sum(tl.where(own, d_dot, 0.0), axis=0)
        return a_h[:, None] * g_up + dd_h[:, None] * w[None, :] - (r * r * k * inv_dm)[:, None] * s

    @triton.jit
    def _call_bwd_sources(
        HIST, R, NULL, Q, G, LSE, GOUT, DA, LG, C,   # as above (read)
        DHIST, PARTNULL, M, N, eps, inv_dm,   # [N, M, DM] the history's gradient; [token blocks, DM] the null's
        DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,   # partials
        BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, STAGES: tl.constexpr, HAS_NULL: tl.constexpr):
        # K couples the heads: each program loads every head's scalars of a source (a [BLOCK_H, BLOCK_M] tile)
        h, pm, rows64, rmask = _rows(M, H, BLOCK_M)
        cols, cmask, mask, tile = _part(h, rows64, rmask, 0, BLOCK_D, DM, D)
        heads = tl.arange(0, BLOCK_H)
        hmask, own = (heads[:, None] < H) & rmask[None, :], heads[:, None] == h
        w = _head_w(Q, G, h, cols, cmask, D)
        g_up = tl.load(GOUT + tile, mask=mask, other=0.0).to(tl.float32)
        hoff = (heads[:, None] * M).to(tl.int64) + rows64[None, :]
        lse_all, c_all = tl.load(LSE + hoff, mask=hmask, other=0.0), tl.load(C + hoff, mask=hmask, other=0.0)
        if HAS_NULL:
            s, r = _null_source(NULL, h, cols, cmask, eps, DM, D, BLOCK_M, BLOCK_D, BLOCK_C)
            ds = _call_source_grad(s, r, g_up, w, 0, N + 1, DA, LG, lse_all, c_all, heads, hmask, own, rows64, M,
                                   inv_dm, H)
            tl.store(PARTNULL + pm.to(tl.int64) * DM + h * D + cols, tl.sum(tl.where(mask, ds, 0.0), axis=0), mask=cmask)
        for n in tl.range(0, N, num_stages=STAGES):
            s, r = _source(HIST, R, n, M, tile, mask, rows64, rmask, DM)
            ds = _call_source_grad(s, r, g_up, w, n + HAS_NULL, N + HAS_NULL, DA, LG, lse_all, c_all, heads, hmask,
                                   own, rows64, M, inv_dm, H)
            tl.store(DHIST + (n * M).to(tl.int64) * DM + tile, _rounded(ds, DHIST.dtype.element_ty), mask=mask)


@torch.no_grad()
def rms_factors(hist, eps):
    """fp32 RMS factors (N, ...) of stacked sources (N, ..., d), not differentiated (route_stack's backward is)."""
    return torch.rsqrt(torch.linalg.vector_norm(hist, dim=-1, dtype=torch.float32).pow_(2).div_(hist.size(-1)).add_(eps))


def _call_launch(setting, M, d, heads, config):
    """(grid, BLOCK_M, warps, stages, shape constexprs) of a per-call kernel."""
    (tile, warps, stages), block_d = setting, triton.next_power_of_2(d // heads)
    bm = _block_m(tile, block_d, config)
    shape = dict(DM=d, H=heads, D=d // heads, BLOCK_M=bm, BLOCK_D=block_d, BLOCK_C=min(1024, triton.next_power_of_2(d)))
    return (triton.cdiv(M, bm) * heads,), bm, warps, stages, shape


def call_forward(hist, r, null, q, g, heads, eps, config):
    """Rung 1's forward over the sources hist [N, M, d] with RMS factors r [N, M]: (out [M, d], lse [heads, M])."""
    M, d = hist.shape[1:]
    grid, _, warps, stages, shape = _call_launch(config.call_fwd, M, d, heads, config)
    out, lse = torch.empty(M, d, dtype=hist.dtype, device=hist.device), r.new_empty(heads, M)
    _call_fwd[grid](HIST=hist, R=r, NULL=q if null is None else null, Q=q, G=g, OUT=out, LSE=lse, M=M, N=len(hist),
                    eps=eps, **shape, STAGES=stages, HAS_NULL=int(null is not None), num_warps=warps)
    return out, lse


def call_backward(hist, r, null, q, g, lse, gout, heads, eps, config):
    """Rung 1's backward (site pass, source pass), sources as call_forward's: (dhist, dnull, dq, dg)."""
    (M, d), H, has_null, n = hist.shape[1:], heads, int(null is not None), len(hist)
    args = dict(HIST=hist, R=r, NULL=null if has_null else q, Q=q, G=g, LSE=lse, GOUT=gout.to(hist.dtype).contiguous(),
                M=M, N=n, eps=eps, HAS_NULL=has_null)
    da, lg, c = r.new_empty(n + has_null, H, M), r.new_empty(n + has_null, H, M), r.new_empty(H, M)
    grid, bm, warps, stages, shape = _call_launch(config.call_site, M, d, H, config)
    part = r.new_empty(triton.cdiv(M, bm), d)   # (r: fp32)
    _call_bwd_site[grid](**args, DA=da, LG=lg, C=c, PART=part, **shape, STAGES=stages, num_warps=warps)
    grid, bm, warps, stages, shape = _call_launch(config.call_sources, M, d, H, config)
    partnull, dhist = r.new_empty(triton.cdiv(M, bm), d) if has_null else part, torch.empty_like(hist)
    _call_bwd_sources[grid](**args, DA=da, LG=lg, C=c, DHIST=dhist, PARTNULL=partnull, inv_dm=1.0 / d, **shape,
                            BLOCK_H=triton.next_power_of_2(H), STAGES=stages, num_warps=warps)
    dw, dnull = part.sum(0), partnull.sum(0).to(null.dtype) if has_null else None
    return dhist, dnull, (dw * g.float()).to(q.dtype), (dw * q.float()).to(g.dtype)


class _RouteCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hist, r, null, q, g, heads, eps, config):
        ctx.heads, ctx.eps, ctx.config, r = heads, eps, config, rms_factors(hist, eps) if r is None else r
        out, lse = call_forward(hist, r, null, q, g, heads, eps, config)
        ctx.save_for_backward(hist, r, null, q, g, lse)
        return out

    @staticmethod
    def backward(ctx, gout):
        dhist, dnull, dq, dg = call_backward(*ctx.saved_tensors, gout, ctx.heads, ctx.eps, ctx.config)
        return dhist, None, dnull, dq, dg, None, None, None


def route_stack(sources, q, g, heads, eps, null=None, r=None, config=None):
    """model.route_reference fused: stacked sources (N, B, T, d) -> (B, T, d); null (d,) an extra first source (delta
    mode), r = rms_factors(sources) when calls share it. Stateless: composes with FSDP and activation checkpointing.
    Inside torch.compile the call is an operator (route_call below), so a compiled delta model has no graph break."""
    N, B, T, d = sources.shape
    config = config or config_for(d, heads)
    hist = sources.flatten(1, 2).contiguous()
    r = rms_factors(hist, eps) if r is None else r.reshape(N, B * T).contiguous()
    null = None if null is None else null.to(sources.dtype).contiguous()
    if torch.compiler.is_compiling():
        return getattr(torch.ops, NAMESPACE).route_call(hist, r, null, q, g, heads, eps, call_settings(config)
                                                        )[0].view(B, T, d)
    _announced(config, d, heads, sources.dtype)
    return _RouteCall.apply(hist, r, null, q, g, heads, eps, config).view(B, T, d)


def _announced(config, d, heads, dtype):
    check_envelope(d, heads, dtype)
    announce(config, d, heads)


# ---- the call inside torch.compile: one operator ----------------------------------------------------------------------
# A compiled region cannot trace a Triton launch that takes a config object: there the call is an operator
# (torch.library), opaque to the compiler, over tensors, numbers and the launch settings its kernels read (as ints);
# its backward is an operator too. Eager calls take _RouteCall directly (the same kernels, without the dispatch).
NAMESPACE = op_namespace(__name__, "routing_call", "route_call")
CALL_FIELDS = ("call_fwd", "call_site", "call_sources")   # (with max_block_m: all of a config the per-call kernels read)


def call_settings(config):
    return [x for f in CALL_FIELDS for x in getattr(config, f)] + [config.max_block_m]


def from_settings(settings):
    return replace(DEFAULT, **{f: tuple(settings[3 * i:3 * i + 3]) for i, f in enumerate(CALL_FIELDS)},
                   max_block_m=settings[-1])


@torch.library.custom_op(f"{NAMESPACE}::route_call", mutates_args=())
def route_call(hist: torch.Tensor, r: torch.Tensor, null: torch.Tensor | None, q: torch.Tensor, g: torch.Tensor,
               heads: int, eps: float, config: list[int]) -> list[torch.Tensor]:
    """call_forward as an operator: [out [M, d], lse [heads, M]]."""
    _announced(config := from_settings(config), hist.size(-1), heads, hist.dtype)
    return list(call_forward(hist, r, null, q, g, heads, eps, config))


@route_call.register_fake
def _(hist, r, null, q, g, heads, eps, config):
    return [hist.new_empty(hist.shape[1:]), r.new_empty(heads, hist.size(1))]


@torch.library.custom_op(f"{NAMESPACE}::route_call_backward", mutates_args=())
def route_call_backward(hist: torch.Tensor, r: torch.Tensor, null: torch.Tensor | None, q: torch.Tensor,
                        g: torch.Tensor, lse: torch.Tensor, gout: torch.Tensor, heads: int, eps: float,
                        config: list[int]) -> list[torch.Tensor]:
    """call_backward as an operator: [dhist, dq, dg] and dnull where there is a null."""
    dhist, dnull, dq, dg = call_backward(hist, r, null, q, g, lse, gout, heads, eps, from_settings(config))
    return [dhist, dq, dg] + ([dnull] if dnull is not None else [])


@route_call_backward.register_fake
def _(hist, r, null, q, g, lse, gout, heads, eps, config):
    return [torch.empty_like(hist), torch.empty_like(q), torch.empty_like(g)] + (
        [torch.empty_like(null)] if null is not None else [])


def _setup_route_call(ctx, inputs, output):
    hist, r, null, q, g, heads, eps, config = inputs
    ctx.save_for_backward(hist, r, null, q, g, output[1])
    ctx.heads, ctx.eps, ctx.config = heads, eps, config


def _route_call_grad(ctx, grads):   # (the grads of [out, lse]; lse's is None: nothing downstream reads it)
    gout = grads[0]
    hist, r, null, q, g, lse = ctx.saved_tensors
    dhist, dq, dg, *dnull = getattr(torch.ops, NAMESPACE).route_call_backward(hist, r, null, q, g, lse, gout, ctx.heads,
                                                                               ctx.eps, ctx.config)
    return dhist, None, dnull[0] if dnull else None, dq, dg, None, None, None


route_call.register_autograd(_route_call_grad, setup_context=_setup_route_call)
