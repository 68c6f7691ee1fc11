"""
Block routing's fused path (Block AttnRes, Kimi arXiv 2603.15031; H > 1 its multi-head form). The definition and the
reference are model.BlockDepthHistory's: the 2L sublayers form n blocks of P = 2L / n; site j mixes the embedding,
each completed block's sum and the open block's partial sum, at most n + 1 sources, on rung 1's kernels
(routing_call.call_forward / call_backward).

Buffers, not stacks. X [n + 1 + N, M, d] holds every source a pass makes, each written once by one add (_add_rms, which
also writes its RMS factors to R): slot 0 the embedding, slot b block b's sum, slot n + 1 + i the partial sum after
sublayer i when i does not close its block. Site j reads slots 0..c-1 and its partial sum where it lies (the kernels'
SKIP), so no site stacks or copies its sources, and the backward keeps only X. A block's gradient is summed over the
sites that read it in dB [n + 1, M, d] (the source pass adds to it: ACCUM), in the sources' dtype as autograd sums the
reference's. Site j's backward runs after every later site's (autograd's order, as for the chain), so dB[b] then holds
the whole gradient of sublayer output i = j - 1 of block b: the later blocks' reads of block b, and every partial sum
of block b from i on (each is o_i plus other terms).

Per (source, site) pair this reads a source three times (forward, site pass, source pass) and adds to its gradient
once; the rest of a site's cost is its launches (~10). Measured: BENCHMARKS.md.
"""
import torch

from routing_call import call_backward, call_forward
from routing_kernel import RoutingChain, announce, check_envelope, config_for, triton

if triton is not None:
    import triton.language as tl

    from routing_call import _rounded

    @triton.jit
    def _add_rms(PREV, NEW, OUT, R, M, eps, DM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                 HAS_PREV: tl.constexpr):
        """OUT = PREV + NEW (NEW alone without PREV) rounded to OUT's dtype, and R its RMS factors: BLOCK_R rows a
        program, each row's columns in chunks of BLOCK_C."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask, sumsq = rows < M, tl.zeros((BLOCK_R,), tl.float32)
        for c0 in tl.static_range(0, DM, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask, off = rmask[:, None] & (cols < DM)[None, :], rows.to(tl.int64)[:, None] * DM + cols[None, :]
            x = tl.load(NEW + off, mask=mask, other=0.0).to(tl.float32)
            if HAS_PREV:
                x += tl.load(PREV + off, mask=mask, other=0.0).to(tl.float32)
            x = _rounded(x, OUT.dtype.element_ty)
            tl.store(OUT + off, x, mask=mask)
            sumsq += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
        tl.store(R + rows, 1.0 / tl.sqrt(sumsq / DM + eps), mask=rmask)


class BlockChain(RoutingChain):
    """Block routing's buffers and bookkeeping for one pass, under RoutingChain's contract (sites run forward 1..N in
    order and backward in exact reverse order, once) and with its checks; FusedRouter(blocks=n) makes it."""

    def __init__(self, n_sites, tokens, d, heads, eps, dtype, device, training, config=None, blocks=1):
        check_envelope(d, heads, dtype)
        self.config = config or config_for(d, heads)
        announce(self.config, d, heads)
        self.N, self.M, self.H, self.d, self.eps, self.dtype = n_sites, tokens, heads, d, eps, dtype
        self.training, self.n, self.P = training, blocks, (n_sites - 1) // blocks
        slots = blocks + 1 + n_sites
        self.X = torch.empty(slots, tokens, d, dtype=dtype, device=device)
        self.R = torch.empty(slots, tokens, dtype=torch.float32, device=device)
        self.dB = torch.empty(blocks + 1, tokens, d, dtype=dtype, device=device) if training else None
        self.BLOCK_C = min(1024, triton.next_power_of_2(d))
        self.BLOCK_R = max(1, 4096 // self.BLOCK_C)
        self.reset()

    def reset(self, queries=None, gains=None):
        """Ready for a new pass (queries, gains: unused, no site leads here)."""
        self.next_fwd, self.next_bwd, self.sentinel, self.lse = 1, None, None, {}

    def block_of(self, i):
        """The block slot of sublayer output i (0: the embedding, slot 0)."""
        return -(-i // self.P)

    def sources(self, j):
        """Site j's sources as the kernels take them: (count, skip): slots 0..count-1, the last one skip slots on."""
        i = j - 1   # the newest source: sublayer i's output (i = 0: the embedding)
        c = 1 + i // self.P   # completed blocks, the embedding included
        return (c, 0) if i % self.P == 0 else (c + 1, self.n + 1 + i - c)

    def forward_site(self, j, new_source, q, g):
        self._expect_forward(j)
        i, P = j - 1, self.P
        dst = self.block_of(i) if i % P == 0 else self.n + 1 + i   # a block closes (or the embedding): its slot
        prev = self.n + i if i > 1 and (i - 1) % P else None       # the partial sum before sublayer i, if any
        _add_rms[(triton.cdiv(self.M, self.BLOCK_R),)](
            PREV=new_source if prev is None else self.X[prev], NEW=new_source, OUT=self.X[dst], R=self.R[dst], M=self.M,
            eps=self.eps, DM=self.d, BLOCK_R=self.BLOCK_R, BLOCK_C=self.BLOCK_C, HAS_PREV=prev is not None, num_warps=4)
        count, skip = self.sources(j)
        out, self.lse[j] = call_forward(self.X, self.R, None, q, g, self.H, self.eps, self.config, count, skip)
        self.next_fwd = j + 1
        if j == self.N:
            self.next_bwd = self.N
        return out

    def backward_site(self, j, grad_out, q, g):
        self._expect_backward(j)
        if j == self.N:
            self.dB.zero_()
        count, skip = self.sources(j)
        _, _, dq, dg = call_backward(self.X, self.R, None, q, g, self.lse.pop(j), grad_out, self.H, self.eps,
                                     self.config, count, skip, dhist=self.dB)
        self.next_bwd = j - 1
        return self.dB[self.block_of(j - 1)].clone(), dq, dg
