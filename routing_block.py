"""
Block routing's fused path (Block AttnRes, Kimi arXiv 2603.15031; H > 1 its multi-head form). The definition and the
reference are model.BlockDepthHistory's: the 2L sublayers form n blocks of P = 2L / n; site j mixes the embedding,
each completed block's sum and the open block's partial sum, at most n + 1 sources. The math is rung 1's
(routing_call.py's header); what this file adds is where a pass keeps its sources and how few launches a site needs.

Buffers, not stacks. X [n + 1 + N, M, d] holds every source a pass makes, each written once: slot 0 the embedding,
slot b block b's sum, slot n + 1 + i the partial sum after sublayer i when i does not close its block. Site j reads
slots 0..c-2 and its newest source last (slot `last`), so no site stacks or copies its sources, and the backward keeps
only X. A block's gradient is summed over the sites that read it in dB [n + 1, M, d], in the sources' dtype as
autograd sums the reference's. Site j's backward runs after every later site's (autograd's order, as for the chain),
so dB[b] then holds the whole gradient of sublayer output i = j - 1 of block b: the later blocks' reads of block b,
and every partial sum of block b from i on (each is o_i plus other terms).

One launch per site each way. A site's sources are few (5.4 on average at n = 8) and so are its tokens (2-16 K at
the training microbatches), so a site costs what its launches cost: on rung 1's kernels a site takes ~11 (an add with
the RMS factors, the forward, the site pass, the source pass, dw's sum and casts, a copy of the returned gradient).
Here a program owns a token block over the whole width, every head, so one program has all that a token's terms need
(the RMS factor's sum over d, K's sum over heads):
- _block_fwd: the newest source (the open block's sum so far plus the sublayer output) made, stored with its RMS
  factor, and routed in the same launch, last in the online softmax, from registers.
- _block_bwd: two loops over the site's sources, c = sum_n alpha da first, then each source's gradient added to its
  block's (the second loop's reads hit L2) and written once more as the returned gradient for the newest; dw's terms
  summed per program (persistent programs over the token blocks: few partials). dq and dg of every site are made at
  site 1 from all sites' partials (one sum), when start() was given the queries and gains; else at each site.
Bytes per site (bf16, units of M d 2 bytes, c sources): forward c + 1 read (the older sources, the sublayer output,
the previous sum) and 2 written; backward 3c + 2 from HBM (c + G read; dB read and written; the newest's gradient)
and c from L2. The backward's time moves with its tile and again with its programs per multiprocessor
(block_waves), so each width has its own (routing_config); its dw partials (PART, fp32, sites x programs x d) grow
with the programs. Measured: BENCHMARKS.md.
"""
import torch

from routing_config import Launch, _block_m, _split, announce, check_envelope, config_for
from routing_kernel import RoutingChain, triton   # the chain's contract: site order, checks, route()

if triton is not None:
    import triton.language as tl

    # a [BLOCK_M, heads, columns] tile in one or two column parts, as the chain's gathers hold it
    from routing_call import _dot2, _heads_part, _load, _logit, _logit_grad, _rounded, _softmax_update, _zeros

    @triton.jit
    def _tiles(t, M, DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, D_A: tl.constexpr,
               BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr):
        """Token block t over every head: rows, both column parts' offsets and masks, [BLOCK_M, BH] offsets into an
        [H, M] matrix and their mask."""
        rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask, rows64 = rows < M, rows.to(tl.int64)
        off_a, mask_a, _, _ = _heads_part(rows64, rmask, 0, D_A, DM, H, D, BH)
        off_b, mask_b = off_a, mask_a
        if BLOCK_B > 0:
            off_b, mask_b, _, _ = _heads_part(rows64, rmask, D_A, BLOCK_B, DM, H, D, BH)
        heads = tl.arange(0, BH)
        hoff, hmask = (heads * M).to(tl.int64)[None, :] + rows64[:, None], rmask[:, None] & (heads < H)[None, :]
        return rows64, rmask, off_a, mask_a, off_b, mask_b, hoff, hmask

    @triton.jit
    def _query(Q, G, DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, D_A: tl.constexpr,
               BLOCK_B: tl.constexpr):
        """w = q * g per head, both column parts ([1, BH, part], fp32); and the parts' offsets and masks in a row."""
        rows0 = tl.zeros((1,), tl.int64)
        _, _, woff_a, wmask_a = _heads_part(rows0, rows0 == 0, 0, D_A, DM, H, D, BH)
        woff_b, wmask_b = woff_a, wmask_a
        if BLOCK_B > 0:
            _, _, woff_b, wmask_b = _heads_part(rows0, rows0 == 0, D_A, BLOCK_B, DM, H, D, BH)
        q_a, q_b = _load(Q, 0, woff_a, wmask_a, woff_b, wmask_b, BLOCK_B > 0)
        g_a, g_b = _load(G, 0, woff_a, wmask_a, woff_b, wmask_b, BLOCK_B > 0)
        return (q_a * g_a)[None, :, :], (q_b * g_b)[None, :, :], woff_a, wmask_a, woff_b, wmask_b

    @triton.jit
    def _mix(m_i, l_i, acc_a, acc_b, s_a, s_b, r, w_a, w_b, n, count, SPLIT: tl.constexpr):
        """Source n of count into the online softmax of every head: running max, denominator and mix ([BLOCK_M, BH,
        part])."""
        m_i, l_i, scale, p = _softmax_update(m_i, l_i, _logit(r[:, None], _dot2(s_a, w_a, s_b, w_b, SPLIT), n, count))
        acc_a = acc_a * scale[:, :, None] + p[:, :, None] * s_a
        if SPLIT:
            acc_b = acc_b * scale[:, :, None] + p[:, :, None] * s_b
        return m_i, l_i, acc_a, acc_b

    @triton.jit(do_not_specialize=["M", "count", "dst", "prev", "j"])   # (they vary by site: one kernel for all)
    def _block_fwd(
        X, R, NEW, Q, G,   # [slots, M, DM] sources, [slots, M] fp32 RMS factors; [M, DM] the sublayer output; [DM] q, g
        OUT, LSE,          # [M, DM] the routed output (X's dtype), [N, H, M] fp32 log-sum-exp (row j written)
        M, count, dst, prev, j, eps,   # the site reads slots 0..count-2 and then dst, the newest, made here
        DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, D_A: tl.constexpr, BLOCK_B: tl.constexpr,
        BLOCK_M: tl.constexpr, STAGES: tl.constexpr, HAS_PREV: tl.constexpr):
        SPLIT: tl.constexpr = BLOCK_B > 0
        M64 = M.to(tl.int64)
        rows64, rmask, off_a, mask_a, off_b, mask_b, hoff, hmask = _tiles(tl.program_id(0), M, DM, H, D, BH, D_A,
                                                                          BLOCK_B, BLOCK_M)
        # the newest source: NEW plus the open block's sum before it (slot prev), rounded to X's dtype as an add in
        # that dtype rounds, stored once in slot dst with its RMS factor over the whole width
        x_a, x_b = _load(NEW, 0, off_a, mask_a, off_b, mask_b, SPLIT)
        if HAS_PREV:
            p_a, p_b = _load(X, prev * M64 * DM, off_a, mask_a, off_b, mask_b, SPLIT)
            x_a += p_a
            if SPLIT:
                x_b += p_b
        x_a = _rounded(x_a, X.dtype.element_ty)
        tl.store(X + dst * M64 * DM + off_a, x_a, mask=mask_a)
        x_a = x_a.to(tl.float32)
        sumsq = tl.sum(tl.sum(x_a * x_a, axis=2), axis=1)
        if SPLIT:
            x_b = _rounded(x_b, X.dtype.element_ty)
            tl.store(X + dst * M64 * DM + off_b, x_b, mask=mask_b)
            x_b = x_b.to(tl.float32)
            sumsq += tl.sum(tl.sum(x_b * x_b, axis=2), axis=1)
        r_new = 1.0 / tl.sqrt(sumsq / DM + eps)
        tl.store(R + dst * M64 + rows64, r_new, mask=rmask)
        # the online softmax over the older sources, then the newest from registers
        w_a, w_b, _, _, _, _ = _query(Q, G, DM, H, D, BH, D_A, BLOCK_B)
        m_i, l_i = tl.full((BLOCK_M, BH), float("-inf"), tl.float32), tl.zeros((BLOCK_M, BH), tl.float32)
        acc_a, acc_b, _ = _zeros(BLOCK_M, BH, D_A, BLOCK_B, SPLIT)
        for n in tl.range(0, count - 1, num_stages=STAGES):
            s_a, s_b = _load(X, n * M64 * DM, off_a, mask_a, off_b, mask_b, SPLIT)
            m_i, l_i, acc_a, acc_b = _mix(m_i, l_i, acc_a, acc_b, s_a, s_b,
                                          tl.load(R + n * M64 + rows64, mask=rmask, other=0.0), w_a, w_b, n, count,
                                          SPLIT)
        m_i, l_i, acc_a, acc_b = _mix(m_i, l_i, acc_a, acc_b, x_a, x_b, r_new, w_a, w_b, count - 1, count, SPLIT)
        inv = (1.0 / l_i)[:, :, None]
        tl.store(OUT + off_a, _rounded(acc_a * inv, OUT.dtype.element_ty), mask=mask_a)
        if SPLIT:
            tl.store(OUT + off_b, _rounded(acc_b * inv, OUT.dtype.element_ty), mask=mask_b)
        tl.store(LSE + j * H * M64 + hoff, m_i + tl.log(l_i), mask=hmask)

    @triton.jit
    def _pair_terms(X, R, slot, n, count, M64, rows64, rmask, off_a, mask_a, off_b, mask_b, w_a, w_b, g_a, g_b, lse,
                    DM: tl.constexpr, SPLIT: tl.constexpr):
        """Source n of a site's count, in `slot` (both parts, fp32), its RMS factor, and per head its logit, alpha and
        da."""
        s_a, s_b = _load(X, slot * M64 * DM, off_a, mask_a, off_b, mask_b, SPLIT)
        r = tl.load(R + slot * M64 + rows64, mask=rmask, other=0.0)
        logit = _logit(r[:, None], _dot2(s_a, w_a, s_b, w_b, SPLIT), n, count)
        return s_a, s_b, r, logit, tl.exp(logit - lse), _dot2(g_a, s_a, g_b, s_b, SPLIT)

    @triton.jit
    def _add_grad(DB, GO, base, ds, off, mask, ACCUM: tl.constexpr, newest):
        """ds added to its block's gradient (ACCUM; else it starts it), in DB's dtype; the newest source's also to
        GO."""
        if ACCUM:
            ds += tl.load(DB + base + off, mask=mask, other=0.0).to(tl.float32)
        ds = _rounded(ds, DB.dtype.element_ty)
        tl.store(DB + base + off, ds, mask=mask)
        if newest:
            tl.store(GO + off, ds, mask=mask)

    @triton.jit(do_not_specialize=["M", "count", "last", "j"])
    def _block_bwd(
        X, R, Q, G, LSE,   # as in _block_fwd (read)
        GOUT, DB, GO,      # [M, DM] the upstream gradient; [n + 1, M, DM] the blocks' gradients; [M, DM] the newest's
        PART,              # [N, programs, DM] fp32 dw partials (row j written)
        M, count, last, j, n_tiles, inv_dm,   # sources: slots 0..count-2, then `last`; their gradients: DB 0..count-1
        DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, D_A: tl.constexpr, BLOCK_B: tl.constexpr,
        BLOCK_M: tl.constexpr, STAGES: tl.constexpr, ACCUM: tl.constexpr):
        SPLIT: tl.constexpr = BLOCK_B > 0
        pid, programs, M64 = tl.program_id(0), tl.num_programs(0), M.to(tl.int64)
        w_a, w_b, woff_a, wmask_a, woff_b, wmask_b = _query(Q, G, DM, H, D, BH, D_A, BLOCK_B)
        dw_a, dw_b, _ = _zeros(1, BH, D_A, BLOCK_B, SPLIT)
        for t in range(pid, n_tiles, programs):   # persistent: a program's dw terms summed in registers
            rows64, rmask, off_a, mask_a, off_b, mask_b, hoff, hmask = _tiles(t, M, DM, H, D, BH, D_A, BLOCK_B,
                                                                              BLOCK_M)
            g_a, g_b = _load(GOUT, 0, off_a, mask_a, off_b, mask_b, SPLIT)
            lse = tl.load(LSE + j * H * M64 + hoff, mask=hmask, other=0.0)
            c = tl.zeros((BLOCK_M, BH), tl.float32)
            for n in tl.range(0, count, num_stages=STAGES):   # c = sum_n alpha da, per token and head
                slot = n + (last - n) * (n == count - 1)
                s_a, s_b, r, logit, alpha, da = _pair_terms(X, R, slot, n, count, M64, rows64, rmask, off_a, mask_a,
                                                            off_b, mask_b, w_a, w_b, g_a, g_b, lse, DM, SPLIT)
                c += alpha * da
            for n in tl.range(0, count, num_stages=STAGES):   # ds_n = alpha G + r dlogit w - (r^2 / d) K s_n
                slot = n + (last - n) * (n == count - 1)
                s_a, s_b, r, logit, alpha, da = _pair_terms(X, R, slot, n, count, M64, rows64, rmask, off_a, mask_a,
                                                            off_b, mask_b, w_a, w_b, g_a, g_b, lse, DM, SPLIT)
                d_dot, d_rms = _logit_grad(alpha * (da - c), r[:, None], logit, n, count)
                rdl = d_dot[:, :, None]
                kr = (r * r * tl.sum(d_rms, axis=1) * inv_dm)[:, None, None]
                _add_grad(DB, GO, n * M64 * DM, alpha[:, :, None] * g_a + rdl * w_a - kr * s_a, off_a, mask_a, ACCUM,
                          n == count - 1)
                dw_a += tl.sum(rdl * s_a, axis=0)[None, :, :]
                if SPLIT:
                    _add_grad(DB, GO, n * M64 * DM, alpha[:, :, None] * g_b + rdl * w_b - kr * s_b, off_b, mask_b,
                              ACCUM, n == count - 1)
                    dw_b += tl.sum(rdl * s_b, axis=0)[None, :, :]
        base = (j * programs + pid).to(tl.int64) * DM
        tl.store(PART + base + woff_a[None, :, :], dw_a, mask=wmask_a[None, :, :])
        if SPLIT:
            tl.store(PART + base + woff_b[None, :, :], dw_b, mask=wmask_b[None, :, :])


class BlockChain(RoutingChain):
    """Block routing's buffers and bookkeeping for one pass, under RoutingChain's contract (sites run forward 1..N in
    order and backward in exact reverse order, once) and with its checks; model.fused_router(blocks=n) makes it."""

    def __init__(self, n_sites, tokens, d, heads, eps, dtype, device, training, config=None, blocks=1):
        if type(blocks) is not int or blocks < 1 or (n_sites - 1) % blocks:
            raise ValueError(f"block routing: blocks={blocks!r} must be a positive divisor of the {n_sites - 1} "
                             f"sublayers ({n_sites} sites)")
        check_envelope(d, heads, dtype)
        self.config = config or config_for(d, heads)
        announce(self.config, d, heads)
        self.N, self.M, self.H, self.d, self.eps, self.dtype = n_sites, tokens, heads, d, eps, dtype
        self.training, self.n, self.P = training, blocks, (n_sites - 1) // blocks
        f32 = dict(dtype=torch.float32, device=device)
        self.X = torch.empty(blocks + 1 + n_sites, tokens, d, dtype=dtype, device=device)
        self.R, self.LSE = torch.empty(len(self.X), tokens, **f32), torch.empty(n_sites, heads, tokens, **f32)
        # a program holds a token block over every head, each head in one or two power-of-two column parts
        bh, (d_a, block_b, lanes) = triton.next_power_of_2(heads), _split(d // heads)
        self.shape = dict(DM=d, H=heads, D=d // heads, BH=bh, D_A=d_a, BLOCK_B=block_b)
        self.geometry = {k: (_block_m(tile, bh * lanes, self.config), warps, stages)   # (BLOCK_M, warps, stages)
                         for k, (tile, warps, stages) in (("block_fwd", self.config.block_fwd),
                                                          ("block_bwd", self.config.block_bwd))}
        self.tiles = triton.cdiv(tokens, self.geometry["block_bwd"][0])
        cuda = torch.device(device).type == "cuda"
        sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 2   # (the interpreter: 2)
        self.programs = min(self.tiles, self.config.block_waves * sms)   # the backward's, persistent
        if training:
            self.dB = torch.empty(blocks + 1, tokens, d, dtype=dtype, device=device)
            self.PART = torch.empty(n_sites, self.programs, d, **f32)
        bm, warps, stages = self.geometry["block_fwd"]
        self.fwd_launch = Launch(_block_fwd, (triton.cdiv(tokens, bm),), warps,
                                 ("NEW", "Q", "G", "OUT", "count", "dst", "prev", "j", "HAS_PREV"), X=self.X, R=self.R,
                                 LSE=self.LSE, M=tokens, eps=eps, **self.shape, BLOCK_M=bm, STAGES=stages)
        if training:
            bm, warps, stages = self.geometry["block_bwd"]
            self.bwd_launch = Launch(_block_bwd, (self.programs,), warps,
                                     ("Q", "G", "GOUT", "GO", "count", "last", "j", "ACCUM"), X=self.X, R=self.R,
                                     LSE=self.LSE, DB=self.dB, PART=self.PART, M=tokens, n_tiles=self.tiles,
                                     inv_dm=1.0 / d, **self.shape, BLOCK_M=bm, STAGES=stages)
        self.reset()

    def reset(self, queries=None, gains=None):
        """Ready for a new pass; queries, gains (every site's): site 1's backward returns every site's dq and dg."""
        self.live = queries, gains
        self.next_fwd, self.next_bwd, self.sentinel = 1, None, None

    def sources(self, j):
        """Site j's sources as the kernels take them: (count, skip): slots 0..count-1, the last one skip slots on."""
        i = j - 1   # the newest source: sublayer i's output (i = 0: the embedding)
        c = 1 + i // self.P   # completed blocks, the embedding included
        return (c, 0) if i % self.P == 0 else (c + 1, self.n + 1 + i - c)

    def deferred(self, j):
        return (*self.live[0], *self.live[1]) if j == 1 and self.live[0] is not None else ()

    def forward_site(self, j, new_source, q, g):
        self._expect_forward(j)
        i, P = j - 1, self.P
        count, skip = self.sources(j)
        prev = self.n + i if i > 1 and (i - 1) % P else None   # the open block's sum before sublayer i, if any
        out = torch.empty(self.M, self.d, dtype=self.dtype, device=new_source.device)
        self.fwd_launch(NEW=new_source, Q=q, G=g, OUT=out, count=count, dst=count - 1 + skip, prev=prev or 0, j=j - 1,
                        HAS_PREV=prev is not None)
        self.next_fwd = j + 1
        if j == self.N:
            self.next_bwd = self.N
        return out

    def backward_site(self, j, grad_out, q, g):
        self._expect_backward(j)
        count, skip = self.sources(j)
        grad_out = grad_out.to(self.dtype).contiguous()
        go = torch.empty_like(grad_out)
        first = j == self.N   # the first backward starts every block's gradient (site N reads them all)
        self.bwd_launch(Q=q, G=g, GOUT=grad_out, GO=go, count=count, last=count - 1 + skip, j=j - 1, ACCUM=not first)
        self.next_bwd = j - 1
        queries, gains = self.live
        if queries is None:   # no queries given: this site's dq and dg now
            dw = self.PART[j - 1].sum(0)
            return go, (dw * g.float()).to(q.dtype), (dw * q.float()).to(g.dtype)
        if j > 1:
            return go, None, None
        dw = self.PART.sum(1)   # [N, d]: every site's, a fixed order
        dq, dg = dw * torch.stack(gains).float(), dw * torch.stack(queries).float()
        return (go, None, None, *[x.to(t.dtype) for x, t in zip(dq, queries)],
                *[x.to(t.dtype) for x, t in zip(dg, gains)])
