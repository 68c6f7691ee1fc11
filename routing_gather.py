"""
The routing chain's backward without a site pass (RoutingConfig.backward = "gather"): routing_kernel.RoutingChain's
forward, another backward. Same math as routing_kernel.py's header; what changes is where each term is made.

Site j's backward there reads its sources twice: a site pass (c_j, dw_j, every pair's da) and the gather of source j-1
(every later site's upstream gradient). Here the gather alone, one launch per site: its program owns a token block of
source n = j-1 over the whole width (every head: K's sum over heads stays in the program) and visits the sites
jp = j..N that read it, each pair's terms recomputed beside s_n from what the forward and the earlier gathers left:
    logit = r_n <w_jp[h], s_n[h]>,  alpha = exp(logit - lse_jp),  da = <G_jp[h], s_n[h]>,  dlogit = alpha (da - c_jp)
where c_jp[h] = sum_n alpha da = <G_jp[h], out_jp[h]>, made once at site jp's own gather from its upstream gradient and
its unrounded output (the forward keeps it in fp32: the bf16 output gave 1.1-1.9x the reference's gradient error).
With RoutingConfig.gather_logits the forward stores each pair's logit and the gathers load it instead: one fp32 load a
token and head against a dot over the head. A single head's dot spans the whole width, and loading took its chains
0.98x / 0.98x / 0.92x / 0.90x at d 512 / 768 / 1024 / 1280; for MHAR loading cost more than its per-head dots
(1.00-1.15x from [P, H, M], 1.01-1.10x from a token-major [P, M, H]: the forward's stores of them, and one more small
copy a pair; see below): the single-head entries set it.
Each later pair also needs site jp's c and lse, H values each a token. A program's [BLOCK_M, H] tile of them sits in
every lane of its warp, so each head's scalar is its own 4-byte cp.async in every lane: 2H copies a pair beside 4-8
16-byte copies of the gradient, 6-7% of MHAR's chain (ablation on an H200). Site j's gather therefore writes (c_j,
lse_j) token-major as one pair a head, CL [N, M, H, 2] (tl.join), and the later gathers load a pair with one 8-byte
copy a head (tl.split): MHAR's chains 0.98x / 0.96x / 0.99x at 100M / 350M / 1B, the single head's 0.99-1.00x.
ds_n's two sums over sites, sum alpha G_jp and sum dlogit r_n w_jp, share one fp32 accumulator (a second one cost the
one-warp programs d/32 registers a thread: the H200's launched gathers went 168 -> 128 at d 512 leading and 236 -> 168
at d 1024 alone; occupancy 12.5% -> 18.75% at d 1024 (ncu); MHAR's chains 0.88-0.99x, the single head's 0.90-0.99x).
dw_jp = sum_n sum_tokens dlogit r_n s_n[h] spans every source of site jp, so it is final only when the gather of s_0
ends: each gather stores its pairs' dlogit r_n, and once the last one is done a matrix product over the tokens, one
launch for every pair (a launch per source was 12-16% of the chain: small grids), makes each pair's terms (fp32,
summed in a fixed order); site 1's backward returns every site's dq and dg.
Read sharing as there: a leading gather also sums source n-1's terms on each gradient tile and hands them on.
Cost model: per (source, site) pair and channel the forward's 2 bytes (bf16) and the gather's 2, against 6 with the site
pass, less what sharing saves; per site ~10 more (the fp32 output written and read, s_n read again for dw). Memory:
the fp32 outputs [N, M, d] and dw's per-pair partial terms instead of the site pass's per-pair logits and K terms.
Measured on an H200 (BENCHMARKS.md), each backward tuned at its width, one process: at the training microbatches
0.80x / 0.71x / 0.74x of the site-pass chain's time for the single head at d 512 / 768 / 1024 and 0.92x / 0.75x /
0.94x / 0.77x for MHAR at d 512 / 768 / 1024 / 1280, mostly on one-warp 512-element tiles (one token a program); at the
paper's Table 5 shapes (1,024-4,096 tokens) MHAR's was 1.09x at d 512 and d 1024 (RoutingConfig.gather_min_tokens
kept the site pass there). dw's product once a pass then took the chains 0.85-0.96x (5.17 / 7.27 / 8.28 / 10.17 ms for
MHAR) and those two below the site pass's (0.89x, 0.85x): every tuned width takes the gather backward. With one
accumulator (and d 1280's leading gathers on one warp): 4.75 / 7.14 / 7.31 / 8.80 ms for MHAR, 3.97 / 5.96 / 5.74 /
7.64 for the single head (stored logits), each below MHAR's at its width; with c and lse token-major (and d 768's
forward on one warp) 4.59 / 6.53-6.59 / 7.09-7.10 / 8.65-8.68 ms for MHAR, 3.95 / 5.79-5.84 / 5.74-5.79 / 7.68 for
the single head (H200, one process: results/gather_backward/scalars_ab_h200.txt, variants_ab_h200.txt); then two
tokens a program at d 512 and dw on two tf32 products (dw_precision): 4.37 / 6.93 / 8.37 ms for MHAR at 100M / 350M /
1B, 3.81 for the single head at 100M (dw_precision_ab_h200.txt). The gathers are latency-bound (ncu at d 1024 before
CL: 18.75% occupancy, DRAM ~47% busy).
"""
import torch
import triton
import triton.language as tl

from routing_call import _rounded
from routing_config import INTERPRET, _block_m, _split
from routing_kernel import RoutingChain, _dot2


@triton.jit
def _part(rows64, rmask, C0: tl.constexpr, BW: tl.constexpr, DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
          BH: tl.constexpr):
    """Columns [C0, C0 + BW) of every head (masked to D): offsets and mask of a [BLOCK_M, BH, BW] tile of an [M, DM]
    matrix, and of the [BH, BW] tile of a row of W."""
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
def _site_w(W, jp, woff_a, wmask_a, woff_b, wmask_b, DM: tl.constexpr, SPLIT: tl.constexpr):
    """Site jp's w, both parts ([1, BH, part])."""
    w_a, w_b = _load(W, (jp - 1) * DM, woff_a, wmask_a, woff_b, wmask_b, SPLIT)
    return w_a[None, :, :], w_b[None, :, :]


@triton.jit
def _pair(acc_a, acc_b, k, s_a, s_b, r, g_a, g_b, c, w_a, w_b, lse, DLR, row, LG, lrow, hoff, hmask, M64,
          H: tl.constexpr, SPLIT: tl.constexpr, LOGITS_STORED: tl.constexpr):
    """Pair (site jp, source n): acc += alpha G + dlogit r_n w, k += sum_h dlogit logit; dlogit r_n stored as DLR row
    `row` (the dw product's operand). s, g: [BLOCK_M, BH, part] fp32 tiles, r: [BLOCK_M], c: [BLOCK_M, BH]. The logit
    is recomputed, or with LOGITS_STORED loaded from the forward's row `lrow` of LG."""
    if LOGITS_STORED:
        logit = tl.load(LG + lrow * H * M64 + hoff, mask=hmask, other=0.0)
    else:
        logit = r[:, None] * _dot2(s_a, w_a, s_b, w_b, SPLIT)
    alpha = tl.exp(logit - lse)
    dlogit = alpha * (_dot2(g_a, s_a, g_b, s_b, SPLIT) - c)
    rdl = dlogit * r[:, None]
    tl.store(DLR + row * H * M64 + hoff, rdl, mask=hmask)
    acc_a = acc_a + alpha[:, :, None] * g_a + rdl[:, :, None] * w_a
    if SPLIT:
        acc_b = acc_b + alpha[:, :, None] * g_b + rdl[:, :, None] * w_b
    return acc_a, acc_b, k + tl.sum(dlogit * logit, axis=1)


@triton.jit
def _zeros(BLOCK_M: tl.constexpr, BH: tl.constexpr, D_A: tl.constexpr, BLOCK_B: tl.constexpr, SPLIT: tl.constexpr):
    """A zero accumulator per column part (part b's = part a's when not SPLIT) and a zero per token."""
    a = tl.zeros((BLOCK_M, BH, D_A), tl.float32)
    b = a
    if SPLIT:
        b = tl.zeros((BLOCK_M, BH, BLOCK_B), tl.float32)
    return a, b, tl.zeros((BLOCK_M,), tl.float32)


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
    # a head is held as one or two power-of-two column parts (routing_config._split), every head in one program
    SPLIT: tl.constexpr = BLOCK_B > 0
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask, rows64, M64 = rows < M, rows.to(tl.int64), M.to(tl.int64)
    off_a, mask_a, woff_a, wmask_a = _part(rows64, rmask, 0, D_A, DM, H, D, BH)
    off_b, mask_b, woff_b, wmask_b = off_a, mask_a, woff_a, wmask_a
    if SPLIT:
        off_b, mask_b, woff_b, wmask_b = _part(rows64, rmask, D_A, BLOCK_B, DM, H, D, BH)
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
    site0 = j * (j - 1) // 2   # LG's first row of site j (of site jp in the loop: `site`)
    acc_a, acc_b, k = _pair(acc_a, acc_b, k, s_a, s_b, r, g_a, g_b, c, w_a, w_b, lse, DLR, row0 + j, LG, site0 + n, hoff,
                            hmask, M64, H, SPLIT, LOGITS_STORED)
    if LEAD:
        acc2_a, acc2_b, k2 = _pair(acc2_a, acc2_b, k2, s2_a, s2_b, r2, g_a, g_b, c, w_a, w_b, lse, DLR, row2 + j, LG,
                                   site0 + n - 1, hoff, hmask, M64, H, SPLIT, LOGITS_STORED)
    for jp in tl.range(j + 1, last + 1, num_stages=STAGES):   # every later site that reads source n
        g_a, g_b = _load(GB, (jp - 1) * M64 * DM, off_a, mask_a, off_b, mask_b, SPLIT)
        c, lse = tl.split(tl.load(CL + (jp - 1) * M64 * 2 * H + toff, mask=tmask, other=0.0))
        w_a, w_b = _site_w(W, jp, woff_a, wmask_a, woff_b, wmask_b, DM, SPLIT)
        site = jp * (jp - 1) // 2
        acc_a, acc_b, k = _pair(acc_a, acc_b, k, s_a, s_b, r, g_a, g_b, c, w_a, w_b, lse, DLR, row0 + jp, LG, site + n,
                                hoff, hmask, M64, H, SPLIT, LOGITS_STORED)
        if LEAD:   # read sharing: the same gradient tile, the previous source
            acc2_a, acc2_b, k2 = _pair(acc2_a, acc2_b, k2, s2_a, s2_b, r2, g_a, g_b, c, w_a, w_b, lse, DLR, row2 + jp, LG,
                                       site + n - 1, hoff, hmask, M64, H, SPLIT, LOGITS_STORED)
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
    sources (exact in tf32, so x's high and low tf32 parts against them: two products), "tf32x3" for fp32 sources (three:
    the sources' low parts too), else "ieee" FMAs. On an H200 at the training microbatches tf32x3 took dw's kernel
    0.15-0.3 ms below IEEE FMAs, and tf32x2 0.36 -> 0.22 ms (100M), 0.48 -> 0.29 (350M), 0.70 -> 0.41 (1B) below
    tf32x3, errors equal to 3-4 digits (BENCHMARKS.md): the product's time is its tensor-core instructions (~13 of a
    block's 32 rows are real at 100M)."""
    device = torch.device(device)
    if device.type != "cuda" or INTERPRET or torch.cuda.get_device_capability(device) < (8, 0):
        return "ieee"
    return "tf32x3" if dtype == torch.float32 else "tf32x2"


def dw_launch(N, M, H, D):
    """_dw_terms' (sites, tokens a step, columns) a program, token splits and warps: each program reads its DLR rows and
    s_n columns once, so wider blocks re-read less; the splits fill the GPU (~2,048 programs over every source, >= 512
    tokens each). 16 tokens a step on 4 warps: with 32, the IEEE product holds 255 registers and spills; 128 with 16
    (Triton 3.6 for sm_90, compiled as launched). The tf32x3 product at 32 tokens on 4 warps, 32 or 64 on 8 took dw's
    kernel 1.00-1.12x and 1.30-1.43x the time of 16 on 4 at the training microbatches on an H200 (BENCHMARKS.md)."""
    bj, bc = 32, min(64, triton.next_power_of_2(D))
    programs = H * triton.cdiv(D, bc) * N * triton.cdiv(N, bj)
    return bj, 64 if INTERPRET else 16, bc, max(1, min(triton.cdiv(M, 512), triton.cdiv(2048, programs))), 4


class GatherChain(RoutingChain):
    """RoutingChain with the gather backward: the forward also keeps each site's unrounded output; the backward is one
    launch per site plus dw's product, and site 1's returns every site's dq and dg (start() must be given them)."""

    def _backward_buffers(self, N, M, d, H, f32):
        self.GB = torch.empty(N, M, d, dtype=self.dtype, device=self.S.device)
        self.MIX, self.CL = torch.empty(N, M, d, **f32), torch.empty(N, M, H, 2, **f32)
        self.DLR = torch.empty(N * (N + 1) // 2, H, M, **f32)
        # dw's product (dw_launch): PDW [splits, P + 1, d] holds every pair's partial terms (row P stays 0), summed
        # once at the end: site jp's pairs are rows SITE_PAIRS[jp-1].
        P = N * (N + 1) // 2
        self.dw_launch = dw_launch(N, M, H, self.D)
        self.dw_precision = dw_precision(self.dtype, self.S.device)
        self.PDW = torch.zeros(self.dw_launch[3], P + 1, d, **f32)
        rows = [[n * N - n * (n - 1) // 2 + jp - n - 1 for n in range(jp)] + [P] * (N - jp) for jp in range(1, N + 1)]
        self.SITE_PAIRS = torch.tensor(rows, device=self.S.device)
        # a program holds every head of its tokens (gather_bwd, gather_bwd_lead: tile elements, warps, stages)
        bh, (d_a, block_b, lanes) = triton.next_power_of_2(H), _split(self.D)   # (160 = 128 + 32, not 256 padded)
        shape = dict(DM=d, H=H, D=self.D, BH=bh, D_A=d_a, BLOCK_B=block_b)
        self.gather_launch = {lead: (_block_m(setting[0], bh * lanes, self.config), *setting[1:], shape) for lead, setting
                              in ((False, self.config.gather_bwd), (True, self.config.gather_bwd_lead)) if setting}
        # the gathers recompute each pair's logit, or load the forward's (RoutingConfig.gather_logits)
        self.stored_logits = self.config.gather_logits
        self.LG = torch.empty(P, H, M, **f32) if self.stored_logits else self.LSE   # (else a placeholder)

    def deferred(self, j):
        if self.live[0] is None:
            raise RuntimeError("fused routing: the gather backward returns every site's dq and dg at site 1: start the "
                               "chain with every site's queries and gains (FusedRouter.start(x, queries, gains))")
        return (*self.live[0], *self.live[1]) if j == 1 else ()

    def backward_site(self, j, grad_out, q, g):
        self._expect_backward(j)
        M, d, H, N = self.M, self.d, self.H, self.N
        grad_out = grad_out.to(self.dtype).contiguous()
        ds = torch.empty(M, d, dtype=self.dtype, device=grad_out.device)
        lead = j in self.gather_lead and not self.following
        bm, warps, stages, shape = self.gather_launch[lead]
        self.launcher.launch(_gather_bwd, ("gather_bwd", lead, self.following), (triton.cdiv(M, bm),), warps,
                             (grad_out, ds), dict(GIN=grad_out, DS=ds, j=j), lambda: dict(
            S=self.S, R=self.R, W=self.W, LSE=self.LSE, MIX=self.MIX, LG=self.LG, GB=self.GB, CL=self.CL, DLR=self.DLR,
            PACC=self.PACC, PK=self.PK, M=M, N=N, inv_dm=1.0 / d, **shape, BLOCK_M=bm, STAGES=stages, LEAD=lead,
            FOLLOW=self.following, LOGITS_STORED=self.stored_logits))
        self.next_bwd, self.following = j - 1, lead
        if j > 1:
            return ds, None, None
        # the last site: every pair's dlogit r_n is in DLR, so dw's product runs once over every pair, then dw_j = the
        # sum over splits, then over site j's pairs (fixed order)
        bj, bt, bc, splits, warps = self.dw_launch
        per_split = triton.cdiv(triton.cdiv(M, splits), bt) * bt
        self.launcher.launch(_dw_terms, ("dw",), (H * triton.cdiv(self.D, bc), N * triton.cdiv(N, bj), splits), warps, (),
                             {}, lambda: dict(
            DLR=self.DLR, S=self.S, PDW=self.PDW, N=N, M=M, tokens_per_split=per_split, P1=self.PDW.size(1), DM=d, H=H,
            D=self.D, BLOCK_J=bj, BLOCK_T=bt, BLOCK_C=bc, PRECISION=self.dw_precision))
        dw = self.PDW.sum(0)[self.SITE_PAIRS].sum(1)   # [N, d]
        queries, gains = self.live
        dq, dg = dw * torch.stack(gains).float(), dw * torch.stack(queries).float()
        return ds, None, None, *[x.to(q.dtype) for x, q in zip(dq, queries)], *[x.to(g.dtype) for x, g in zip(dg, gains)]
