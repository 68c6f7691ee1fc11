"""
A Qwen3-style GPT whose residual connection is one knob: baseline, hyper-connections, attention residuals, or
Multi-Head Attention Residuals (MHAR, arXiv 2607.27230).

MHAR in three lines (paper section 2.3, Eq. 3): sources s_0 = embedding, s_j = raw output of sublayer j; site j mixes
s_0..s_{j-1} with logit[n, h] = < q[h], g[h] * RMSNorm(s_n)[h] >, alpha[:, h] = softmax_n(logit[:, h]) and
out[h] = sum_n alpha[n, h] * s_n[h], over H heads (contiguous channel slices of width d/H).
H = 1 is attention residuals (Kimi, arXiv 2603.15031; paper Eq. 2, Appendix B); H > 1 reshapes the same query.

In the paper's order: GPTConfig -> the blocks (RMSNorm, RoPE, Attention, MLP) -> the routing (route_reference, Route,
the depth histories: the new idea) -> HyperConnection (the comparison) -> GPT (forward for every mode, optimizer,
FLOPs). Generation's loop and its KV cache live in generation.py; a model is built from a checkpoint by checkpoint.py
(load_model): this file knows no files on disk.
"""
import functools
import math
import sys
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from generation import Padding, generate

RESIDUAL_MODES = ("baseline", "hyper", "attnres", "mhar", "delta")
ROUTING_IMPLS = ("auto", "fused", "reference")


@dataclass
class GPTConfig:
    vocab_size: int = 50304        # tokenizer vocab padded up to a multiple of 128 (gpt2: 50257 -> 50304)
    block_size: int = 2048         # longest sequence (the training length); RoPE tables are built for it
    n_layer: int = 12              # L blocks = 2L sublayers (attention, MLP, attention, MLP, ...)
    n_head: int = 8                # query heads
    n_kv_head: int = 4             # key/value heads (grouped-query attention)
    n_embd: int = 512              # model width d
    ffn_hidden: int = 1536         # SwiGLU hidden width
    head_dim: int | None = None    # attention head width; None = n_embd / n_head (checkpoints may differ)
    qk_norm: bool = True           # per-head RMSNorm on q and k (Qwen3 has it, Llama does not)
    rope_theta: float = 1e4        # RoPE base
    rope_scaling: dict | None = None  # Llama-3.1 long-context scaling: {"rope_type": "llama3", "factor",
                                   #   "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    norm_eps: float = 1e-6         # eps of every RMSNorm and of the routing key norm
    tie_embeddings: bool = True    # LM head shares the token embedding matrix
    residual: str = "mhar"         # baseline | hyper | attnres | mhar | delta (grafted onto a pretrained model)
    route_heads: int | None = None # routing heads H; None: n_kv_head for mhar (the paper's default), 8 for delta
    route_scale: float = 1.0       # multiplier s on every routing logit (a temperature control; the paper: none, 1)
    route_init_std: float = 0.0    # attnres / mhar: queries N(0, std^2) (0: zero; the paper's FineWeb runs: random)
    route_blocks: int | None = None  # attnres / mhar: None = full routing; n = block routing, 2L sublayers in n blocks
    num_blocks: int = 8            # delta: the layers form num_blocks blocks; completed block deltas are sources
    hc_streams: int = 4            # hyper-connections: number of residual streams n
    hc_dynamic: bool = True        # hyper-connections: dynamic (DHC) or static (SHC) connection weights
    routing_impl: str = "auto"     # auto: fused where it runs (CUDA + Triton), else reference | fused | reference

    def __post_init__(self):
        def bad(msg):
            raise ValueError(msg)
        if self.residual not in RESIDUAL_MODES:
            bad(f"residual={self.residual!r} is not one of {', '.join(RESIDUAL_MODES)}")
        if self.routing_impl not in ROUTING_IMPLS:
            bad(f"routing_impl={self.routing_impl!r} is not one of {', '.join(ROUTING_IMPLS)}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden", "hc_streams"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                bad(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.head_dim is None and self.n_embd % self.n_head:
            bad(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head} (head_dim = n_embd / n_head), "
                "or set head_dim")
        if self.n_head % self.n_kv_head:
            bad(f"n_head={self.n_head} must be divisible by n_kv_head={self.n_kv_head} (grouped-query attention)")
        if not (isinstance(self.hd, int) and self.hd >= 2 and self.hd % 2 == 0):
            bad(f"head_dim={self.hd} must be an even positive integer for RoPE: change n_embd, n_head or head_dim")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in ("llama3", "default"):
            bad(f"rope_scaling={self.rope_scaling} is not supported: only rope_type 'llama3' (Llama-3.1) or 'default'")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") == "llama3":
            keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            wrong = [k for k in keys if isinstance(self.rope_scaling.get(k), bool)
                     or not isinstance(self.rope_scaling.get(k), (int, float)) or not self.rope_scaling[k] > 0]
            if wrong or not self.rope_scaling["high_freq_factor"] > self.rope_scaling["low_freq_factor"]:
                bad(f"rope_scaling={self.rope_scaling}: rope_type llama3 needs {', '.join(keys)}, each a positive "
                    "number, and high_freq_factor > low_freq_factor" + (f" ({', '.join(wrong)} missing or not that)"
                                                                        if wrong else ""))
        if self.residual == "delta" and (not isinstance(self.num_blocks, int) or self.num_blocks < 1
                                         or self.n_layer % self.num_blocks):
            bad(f"num_blocks={self.num_blocks} must divide n_layer={self.n_layer} (blocks of equal length)")
        for name, least, note in (("route_scale", 0, "1: the paper's routing"), ("route_init_std", None,
                                   "0: zero queries"), ("rope_theta", 0, "Qwen3: 1e6"), ("norm_eps", 0, "1e-6")):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and (v > 0 if least == 0 else v >= 0)):
                bad(f"{name}={v!r} must be a finite number {'> 0' if least == 0 else '>= 0'} ({note})")
        if self.route_init_std and self.residual not in ("attnres", "mhar"):
            bad(f"route_init_std={self.route_init_std} is for attnres and mhar, not residual={self.residual!r}")
        if self.route_blocks is not None:
            if self.residual not in ("attnres", "mhar"):
                bad(f"route_blocks={self.route_blocks!r} is for attnres and mhar (block attention residuals), not "
                    f"residual={self.residual!r}: drop it" + (" (delta mode's blocks: num_blocks)" if self.residual == "delta" else ""))
            S = 2 * self.n_layer
            if type(self.route_blocks) is not int or self.route_blocks < 1 or S % self.route_blocks:
                bad(f"route_blocks={self.route_blocks!r} must be a positive divisor of the {S} sublayers (2 x n_layer="
                    f"{self.n_layer}): blocks of equal length, e.g. {self.n_layer} (one layer each), or omit it for full routing")
        if self.residual == "attnres" and self.route_heads not in (None, 1):
            bad(f"residual='attnres' is single-head, got route_heads={self.route_heads}: "
                "use residual='mhar' for several heads")
        H = self.heads
        if not (isinstance(H, int) and 1 <= H <= self.n_embd):
            bad(f"route_heads={H!r} must be an integer in [1, n_embd={self.n_embd}]")
        if self.n_embd % H:
            bad(f"n_embd={self.n_embd} must be divisible by route_heads={H}: "
                f"pick a divisor of {self.n_embd}, e.g. route_heads={self.n_kv_head if self.n_embd % self.n_kv_head == 0 else 1}")

    @property
    def heads(self):
        """Routing heads H actually used: 1 for attnres, route_heads (default n_kv_head; 8 for delta) otherwise."""
        if self.residual == "attnres":
            return 1
        if self.route_heads is not None:
            return self.route_heads
        return 8 if self.residual == "delta" else self.n_kv_head

    @property
    def hd(self):
        """Attention head width."""
        return self.n_embd // self.n_head if self.head_dim is None else self.head_dim

    @property
    def n_sites(self):
        """Routing sites: one per sublayer, plus the final readout except in delta mode."""
        return 2 * self.n_layer + (self.residual != "delta")

    @classmethod
    def from_dict(cls, d):
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# -----------------------------------------------------------------------------
# Qwen3-style building blocks (paper section 3.1 and Appendix I: pre-norm, RMSNorm, SwiGLU, GQA with QK-norm, RoPE)

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # fp32 statistics whatever the input dtype; output keeps the input dtype (bf16 under autocast)
        return F.rms_norm(x.float(), (x.size(-1),), self.weight.float(), self.eps).type_as(x)


def rope_tables(head_dim, n_pos, theta, scaling=None):
    """cos, sin of shape (n_pos, head_dim / 2), fp32. scaling: Llama-3.1's rope_scaling (rope_type llama3),
    which divides the low frequencies by `factor` and blends smoothly between low_freq and high_freq wavelengths."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None and scaling.get("rope_type") == "llama3":
        factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
        lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen - lo) / (hi - lo)).clamp(0, 1)      # 0: long wavelengths, 1: short ones
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    angles = torch.outer(torch.arange(n_pos, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x, cos, sin):
    """x: (B, T, heads, head_dim); rotate the two halves of each head (Qwen3/Llama "rotate_half" layout). cos, sin:
    (T, head_dim / 2), or (B, T, head_dim / 2) where the rows' positions differ (a padded batch)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    """Pre-norm grouped-query attention with per-head RMSNorm on q and k (QK-norm)."""

    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.hd
        d, q, kv = cfg.n_embd, cfg.n_head * cfg.hd, cfg.n_kv_head * cfg.hd
        self.norm = RMSNorm(d, cfg.norm_eps)
        self.q_proj = nn.Linear(d, q, bias=False)
        self.k_proj = nn.Linear(d, kv, bias=False)
        self.v_proj = nn.Linear(d, kv, bias=False)
        self.o_proj = nn.Linear(q, d, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x, cos, sin, cache=None):
        """x (B, T, d) at positions cos/sin. cache: this layer's KVCache slot; the new keys and values are
        appended and the queries attend to every cached position before theirs."""
        B, T, _ = x.shape
        h = self.norm(x)
        q = self.q_proj(h).view(B, T, self.n_head, self.head_dim)
        k = self.k_proj(h).view(B, T, self.n_kv_head, self.head_dim)
        v = self.v_proj(h).view(B, T, self.n_kv_head, self.head_dim)
        q = apply_rope(self.q_norm(q), cos, sin).transpose(1, 2)
        k = apply_rope(self.k_norm(k), cos, sin).transpose(1, 2)
        v, mask = v.transpose(1, 2), None
        if cache is not None:
            k, v, mask = cache.extend(k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and k.size(2) == T,
                                           enable_gqa=self.n_kv_head != self.n_head)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """Pre-norm SwiGLU."""

    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)

    def forward(self, x, cos=None, sin=None, cache=None):  # cos, sin, cache unused: every sublayer takes them
        h = self.norm(x)
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)


# -----------------------------------------------------------------------------
# Routing over the depth history: the one new idea (paper sections 2.2-2.3, Eq. 2-3)
#
# Every sublayer input, and the final readout, is a learned softmax mix over all earlier sublayer outputs
# ("sources"). Each site owns a query q (init 0) and a key-norm gain g (init 1), both (d,). Keys are the
# RMS-normalised sources (RMS over the full width d) times g; values are the raw sources. MHAR reshapes q, g and the
# sources into H contiguous channel slices and runs one softmax per slice, so each slice of the width picks its own
# depth mixture, with the parameters of one head (section 2.3, property i). q = 0 gives the uniform mean over the
# sources, the additive residual stream divided by N: after the next RMSNorm, the baseline's function.

def route_logit(r, dot, n, count):
    """A pair's routing logit (paper Eq. 2): the source's RMS factor r times the head's <q g, s> (dot), so the key is
    RMSNorm(s) * g and there is no temperature. n is the source's place among the site's `count` sources (0 the oldest:
    the embedding, or the null source in delta mode; count - 1 the newest). The fused kernels' twin is
    routing_call._logit, with its gradient in _logit_grad (ROUTING.md)."""
    return r * dot


def route_reference(sources, q, g, n_heads, eps=1e-6, return_alpha=False):
    """The specification of MHAR routing. sources: (N, B, T, d) -> out (B, T, d) in the sources' dtype.
    With return_alpha, also the softmax weights alpha: (N, B, T, H), fp32. Math in fp32."""
    N, B, T, d = sources.shape
    s = sources.float()
    r = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)               # (N, B, T, 1) RMS factor, full width
    dot = (s * (q.float() * g.float())).view(N, B, T, n_heads, d // n_heads).sum(-1)   # (N, B, T, H) <q g, s> per head
    n = torch.arange(N, device=s.device).view(N, 1, 1, 1)                # each source's place, the oldest 0
    logits = route_logit(r, dot, n, N)                                   # (N, B, T, H)
    alpha = torch.softmax(logits, dim=0)                                 # softmax over sources, per head
    out = (alpha.unsqueeze(-1) * s.view(N, B, T, n_heads, d // n_heads)).sum(0)  # values: raw sources
    out = out.reshape(B, T, d).to(sources.dtype)
    return (out, alpha) if return_alpha else out


class Route(nn.Module):
    """One routing site: a query and a key gain over the width d, split into `heads` heads. A delta site
    (paper section 3.3) also has a learnable null source and the scalar alpha that gates its output. scale
    (GPTConfig.route_scale) multiplies every logit: it is folded into the gain the routing sees, gain() = g * scale
    (logit = r <q, g s x> = s r <q g, x>), so the reference, the fused chain and the per-call kernels all take it
    with no change of their own; scale 1 passes g itself (bitwise the paper's routing)."""

    def __init__(self, dim, heads, eps, delta=False, scale=1.0):
        super().__init__()
        self.heads, self.eps, self.scale = heads, eps, float(scale)
        self.q = nn.Parameter(torch.zeros(dim))   # zero query: uniform mix = residual stream / N at init
        self.g = nn.Parameter(torch.ones(dim))
        if delta:
            self.null = nn.Parameter(torch.zeros(dim))   # a source the site may attend to instead of the history
            self.alpha = nn.Parameter(torch.zeros(1))    # 0: the converted model is the pretrained one, bitwise

    def gain(self):
        """The key gain the routing uses: g, times route_scale when that is not 1."""
        return self.g if self.scale == 1.0 else self.g * self.scale


class DepthHistory:
    """The depth history of one forward pass, with its one operation: route(s) adds s as the newest source s_{j-1}
    and returns site j's routed input. The reference implementation: a list of the sources, stacked at every site and
    routed by route_site (route_reference through GPT._route_stack)."""

    def __init__(self, sites, route_site):
        self.sites, self.route_site = sites, route_site
        self.sources = []   # s_0 .. s_{j-1}, each (B, T, d)

    def route(self, new_source):
        self.sources.append(new_source)
        return self.route_site(self.sites[len(self.sources) - 1], torch.stack(self.sources))   # stacked: (j, B, T, d)


def fused_router(n_sites, heads, eps, config=None, blocks=None):
    """The fused routing of a model: full routing's chain (routing_kernel.py), or with blocks = n block routing's
    (routing_block.py). Chosen here, above the routing files, which import nothing above them."""
    from routing_kernel import FusedRouter
    if not blocks:
        return FusedRouter(n_sites, heads, eps, config)
    from routing_block import BlockChain
    return FusedRouter(n_sites, heads, eps, config, functools.partial(BlockChain, blocks=blocks))


class FusedDepthHistory:
    """The same operation on routing_kernel.py's chain: one [N, B*T, d] buffer holds every source once, each site's
    kernels read it in place, and the backward gathers each source's gradient once."""

    def __init__(self, router, sites, first_source):
        self.sites, self.j, self.gains = sites, 0, [s.gain() for s in sites]
        self.router, self.traced = router, torch.compiler.is_compiling()
        if self.traced:   # torch.compile traces this pass: each site is an operator (routing_kernel.route_site)
            self.training = torch.is_grad_enabled()
        else:
            self.chain = router.start(first_source, [s.q for s in sites], self.gains)

    def route(self, new_source):
        self.j += 1
        site, gain = self.sites[self.j - 1], self.gains[self.j - 1]
        if self.traced:   # (site 1 starts the pass with every site's queries and gains)
            first = self.j == 1
            return self.router.op(new_source, site.q, gain, [s.q for s in self.sites] if first else [],
                                  self.gains if first else [], id(self.router), self.j, self.training)
        return self.chain.route(self.j, new_source, site.q, gain)


class BlockDepthHistory:
    """Block routing (Block AttnRes, Kimi arXiv 2603.15031; H > 1 is its multi-head form): the 2L sublayers form n
    blocks of P = 2L / n in order; inside a block the outputs add up as a residual stream does, and a site routes over
    the embedding, every completed block's sum and the current block's partial sum: at most n + 1 sources where full
    routing has up to 2L + 1. Kimi's pseudocode and the MHAR authors' block modes route a block's first site over the
    block just completed as their "partial" before storing it; here it is stored first: the same sources in the same
    order. Their blocks hold whole layers (P even); here P may be odd, and P = 1 is full routing, bitwise.
    route_site(site, sources) routes one site over its list of sources, stacked: the specification. The fused path,
    routing_block.BlockChain, keeps the same sources in one buffer, each written once, and stacks nothing."""

    def __init__(self, sites, per_block, route_site):
        self.sites, self.per_block, self.route_site = sites, per_block, route_site
        self.blocks, self.partial, self.j = [], None, 0   # completed: s_0 and block sums; the open block's sum

    def route(self, new_source):
        if self.j == 0:
            self.blocks.append(new_source)   # s_0, the embedding: a block of its own
        else:
            self.partial = new_source if self.partial is None else self.partial + new_source
            if self.j % self.per_block == 0:   # the block is complete
                self.blocks.append(self.partial)
                self.partial = None
        self.j += 1
        return self.route_site(self.sites[self.j - 1], self.blocks if self.partial is None else self.blocks + [self.partial])


# -----------------------------------------------------------------------------
# Hyper-connections (Zhu et al., arXiv 2409.19606), the learned-residual comparison of paper Table 1.
#
# n residual streams H (B, T, n, d). Per sublayer a connection matrix A (n, 1+n): column 0 reads the
# sublayer input as a weighted sum of streams, columns 1..n mix the streams; write weights beta (n,) add
# the sublayer output to every stream. Static init: read one-hot e_{k mod n}, mixing = identity, beta = 1,
# so with n copies of the embedding every stream equals the baseline residual stream. Dynamic (DHC)
# adds s * tanh(norm(H) W) with W = 0 and s = 0.01 at init. The paper's norm here is a LayerNorm; we use
# the model's RMSNorm like everywhere else (no biases anywhere).

class HyperConnection(nn.Module):
    def __init__(self, cfg, k):
        super().__init__()
        n, d = cfg.hc_streams, cfg.n_embd
        static = torch.zeros(n, 1 + n)
        static[k % n, 0] = 1.0                      # read stream k mod n
        static[:, 1:] = torch.eye(n)                # streams pass through unchanged
        self.alpha = nn.Parameter(static)
        self.beta = nn.Parameter(torch.ones(n))
        self.dynamic = cfg.hc_dynamic
        if self.dynamic:
            self.norm = RMSNorm(d, cfg.norm_eps)
            self.w_alpha = nn.Parameter(torch.zeros(d, 1 + n))
            self.w_beta = nn.Parameter(torch.zeros(d))
            self.s_alpha = nn.Parameter(torch.full((1,), 0.01))   # shape (1,), not a 0-dim scalar: FSDP2 shards
            self.s_beta = nn.Parameter(torch.full((1,), 0.01))    # no 0-dim parameters

    def forward(self, streams, sublayer, cos, sin):
        # streams: (B, T, n, d). Elementwise products and sums (not einsum/matmul) keep the streams in
        # their own dtype under autocast, like the baseline's fp32 residual stream. read and write are
        # separate methods so that compile_sublayers can compile them around the (separately compiled) sublayer.
        x, a, b = self.read(streams)
        return self.write(streams, a, b, sublayer(x, cos, sin))

    def read(self, streams):
        """The sublayer input (B, T, d) and this token's weights a (.., n, 1+n), b (.., n)."""
        a, b = self.alpha, self.beta
        if self.dynamic:
            hn = self.norm(streams).float()
            a = a + self.s_alpha * torch.tanh(hn @ self.w_alpha.float())   # (B, T, n, 1+n)
            b = b + self.s_beta * torch.tanh(hn @ self.w_beta.float())     # (B, T, n)
        return (a[..., 0, None] * streams).sum(-2).to(streams.dtype), a, b

    def write(self, streams, a, b, y):
        """The new streams: mixed by a, plus the sublayer output y weighted by b."""
        mixed = (a[..., 1:, None] * streams.unsqueeze(-2)).sum(-3)         # sum_n A[n, m] H_n -> (B, T, n, d)
        return (mixed + b[..., None] * y.unsqueeze(-2)).to(streams.dtype)


class GPT(nn.Module):
    _said = set()   # the routing path's one-line notes, each printed once per process

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        d, L = cfg.n_embd, cfg.n_layer
        self.wte = nn.Embedding(cfg.vocab_size, d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(L))
        self.norm = RMSNorm(d, cfg.norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        # mode-specific parameters come last and draw no random numbers, so the shared weights of every
        # mode are identical for the same seed (the residual mechanism is the only difference)
        if cfg.residual in ("attnres", "mhar", "delta"):
            self.routes = nn.ModuleList(Route(d, cfg.heads, cfg.norm_eps, delta=cfg.residual == "delta", scale=cfg.route_scale)
                                        for _ in range(cfg.n_sites))
        if cfg.residual == "hyper":
            self.hyper = nn.ModuleList(HyperConnection(cfg, k) for k in range(2 * L))
        self.reset_buffers()
        self._route = route_reference        # the reference routing (compiled by compile_sublayers)
        self._head = self._head_impl
        self._paths = {}                     # (device type, dtype) -> "fused" | "reference": routing_path
        self._router = None                  # routing_kernel.FusedRouter (fused_router): the fused chains of passes
        if cfg.residual in ("attnres", "mhar"):   # (made now: a compiled forward cannot make it)
            self._router = fused_router(cfg.n_sites, cfg.heads, cfg.norm_eps, None, cfg.route_blocks)
        self._routing_config = None          # routing_config.RoutingConfig of the fused kernels (None: config_for)
        self.routing_observer = None         # called as (site, stacked sources) at every reference-routed site
        self.checkpoint_sublayers = False    # activation checkpointing of every sublayer (never of routing)
        self.z_loss = 0.0                    # logit z-loss coefficient added to the training loss
        self.reset_parameters()

    def reset_buffers(self, device=None, dtype=None):
        """(Re)compute the RoPE tables (not saved in checkpoints), e.g. after building the model on the meta
        device; fp32 unless `dtype` is given."""
        cos, sin = rope_tables(self.cfg.hd, self.cfg.block_size, self.cfg.rope_theta, self.cfg.rope_scaling)
        self.register_buffer("rope_cos", cos.to(device, dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(device, dtype), persistent=False)

    def reset_parameters(self):
        # N(0, 0.02) for every linear and embedding weight (paper Appendix I); norms 1; routing q 0, g 1
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if self.cfg.route_init_std > 0 and not self.wte.weight.is_meta:
            # random queries (the paper's FineWeb runs) from a generator of their own, seeded from the run's seed: the
            # shared weights stay those of every other mode at that seed (the pairing of runs)
            gen = torch.Generator().manual_seed((torch.initial_seed() + 10**9 + 7) % 2**63)
            with torch.no_grad():
                for site in self.routing_sites():
                    site.q.copy_(torch.randn(site.q.shape, generator=gen) * self.cfg.route_init_std)

    def sublayers(self):
        """The 2L sublayers in order: attention, MLP, attention, MLP, ..."""
        return [m for b in self.blocks for m in (b.attn, b.mlp)]

    def routing_sites(self):
        """The routing sites in order (one before every sublayer, then the final readout except in delta mode)."""
        return list(self.routes) if hasattr(self, "routes") else []

    def num_params(self):
        return sum(p.numel() for p in self.parameters())   # tied weights are counted once

    def compile_sublayers(self, **kwargs):
        """torch.compile each sublayer (in place: parameter names stay clean), hyper-connections' stream reads and
        writes, and the LM head + loss; all attention sublayers share one graph, all MLPs another. The reference
        routing compiles with dynamic shapes (one graph for every number of sources); fused routing stays outside."""
        for sub in self.sublayers():
            sub.compile(**kwargs)
        for hc in getattr(self, "hyper", []):   # hyper-connections: their stream reads and writes, fused
            hc.read, hc.write = torch.compile(hc.read, **kwargs), torch.compile(hc.write, **kwargs)
        self._head = torch.compile(self._head_impl, **kwargs)
        if self.cfg.residual in ("attnres", "mhar"):   # used by the reference path (and the fused path's fallback)
            self._route = torch.compile(route_reference, dynamic=True, **kwargs)

    def _head_impl(self, x, targets):
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None
        flat = logits.float().view(-1, logits.size(-1))
        loss = F.cross_entropy(flat, targets.reshape(-1), ignore_index=-1)
        if self.z_loss and torch.is_grad_enabled():   # logit z-loss (PaLM): keeps log Z near 0; training only
            loss = loss + self.z_loss * torch.logsumexp(flat, dim=-1).pow(2).mean()
        # logits returned beside a loss come back detached: the loss carries the gradient. A compiled head whose
        # logits output required grad would get a zero gradient for it, materialised in every backward (AOT autograd
        # fills unused output gradients): a (B, T, vocab) fill every step, GBs at the paper's vocabulary
        return logits.detach(), loss

    def forward(self, idx, targets=None, return_routing=False, cache=None, attention_mask=None):
        """idx (B, T) -> (logits, loss). cache: a KVCache holding the tokens before idx (generation). attention_mask
        (B, tokens before idx + T), 1 for a token and 0 for padding (either side): pad keys are masked out of
        attention and each row's positions count its own tokens only (Hugging Face's convention), so a padded row
        computes what it would alone; routing mixes each token's own depth history and needs no mask."""
        B, T = idx.shape
        start = 0 if cache is None else cache.pos
        if start + T > self.cfg.block_size:
            raise ValueError(f"sequence length {start + T} exceeds block_size={self.cfg.block_size}")
        if attention_mask is not None and not bool(attention_mask.all()):
            if attention_mask.shape != (B, start + T):
                raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)}: it must be (batch, tokens "
                                 f"before idx + idx's) = ({B}, {start + T})")
            valid = attention_mask.bool()
            pos = (valid.long().cumsum(-1) - 1).clamp_min(0)[:, start:]   # (B, T): each row's own positions
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]
            cache = Padding(valid) if cache is None else cache.pad(valid)
        elif cache is not None and cache.step_pos is not None:   # a DecodeGraph step: one token at step_pos
            cos, sin = self.rope_cos[cache.step_pos], self.rope_sin[cache.step_pos]
        else:
            cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]
        x = self.wte(idx)
        routing = [] if return_routing else None   # per site: alpha (N_j, B, T, H), reference routing only
        mode = self.cfg.residual
        if mode == "baseline":   # paper Eq. 1: one additive stream
            for sub in self.sublayers():
                x = x + self._run(sub, x, cos, sin, cache)
        elif mode == "hyper":
            streams = x.unsqueeze(-2).expand(B, T, self.cfg.hc_streams, x.size(-1)).contiguous()
            for hc, sub in zip(self.hyper, self.sublayers()):
                streams = hc(streams, lambda h, c, s, sub=sub: self._run(sub, h, c, s, cache), cos, sin)
            x = streams.sum(-2)                                      # readout: sum of streams
        elif mode == "delta":
            x = self._delta_forward(x, cos, sin, routing, cache)
        else:   # attnres / mhar (Eq. 2-3): every sublayer's input, and the readout, routed over the depth history
            x = x.to(self._act_dtype(x))                             # s_0: the embedding, in the activation dtype
            history = self._history(x, routing)
            h = history.route(x)
            for sub in self.sublayers():
                h = history.route(self._run(sub, h, cos, sin, cache))
            x = h
        if cache is not None:
            cache.advance(T)
        logits, loss = self._head(x, targets)
        return (logits, loss, routing) if return_routing else (logits, loss)

    def _history(self, x, routing):
        """A DepthHistory for one forward pass: the fused chain where it can run (and alpha is not recorded; with
        route_blocks, the block chain), else the reference list (with route_blocks, a BlockDepthHistory)."""
        sites = self.routing_sites()
        fused = routing is None and self.routing_path(x.device, x.dtype) == "fused"
        if fused:   # block routing too (route_blocks: routing_block.py's chain)
            return FusedDepthHistory(self._router, sites, x)
        if self.cfg.route_blocks:
            return BlockDepthHistory(sites, 2 * self.cfg.n_layer // self.cfg.route_blocks,
                                     lambda site, srcs: self._route_stack(site, torch.stack(srcs), routing))
        return DepthHistory(sites, functools.partial(self._route_stack, routing=routing))

    def _route_stack(self, site, stacked, routing=None):
        """Reference routing of one site over its stacked sources (N, B, T, d); records alpha if `routing` is a list."""
        if self.routing_observer is not None:
            self.routing_observer(site, stacked)
        if routing is None:
            return self._route(stacked, site.q, site.gain(), site.heads, site.eps)
        out, alpha = route_reference(stacked, site.q, site.gain(), site.heads, site.eps, return_alpha=True)
        routing.append(alpha)
        return out

    def _delta_forward(self, x, cos, sin, routing, cache=None):
        """Delta form (paper section 3.3, Appendix E; grafting onto a pretrained model): the residual stream x stays,
        and sublayer k reads x + alpha_k * route_k(null_k, embedding, completed block deltas), a block delta being
        the stream at a block's end minus the stream at its start. alpha = 0: the pretrained model, bitwise."""
        per_block = 2 * self.cfg.n_layer // self.cfg.num_blocks   # sublayers per block
        fused = routing is None and self.routing_path(x.device, x.dtype) == "fused"
        history, start = [x], x                                    # embedding; stream at the block's start
        for k, (site, sub) in enumerate(zip(self.routing_sites(), self.sublayers())):
            if k and k % per_block == 0:                           # a block just completed: its delta is a source
                history.append(x - start)
                start = x
            if fused:   # routing_call.route_stack: the history stacked once per block, the null as an extra source
                if k % per_block == 0:
                    from routing_call import rms_factors, route_stack
                    hist = torch.stack(history)                    # (N, B, T, d)
                    r = rms_factors(hist, self.cfg.norm_eps)
                routed = route_stack(hist, site.q, site.gain(), site.heads, site.eps, null=site.null, r=r,
                                     config=self.routing_config)
            else:
                stacked = torch.stack([site.null.to(x.dtype).expand_as(x)] + history)   # sources: (N, B, T, d)
                routed = self._route_stack(site, stacked, routing)
            x = x + self._run(sub, x + site.alpha.to(x.dtype) * routed, cos, sin, cache)
        return x

    def _run(self, sub, h, cos, sin, cache=None):
        if cache is not None:   # generation: attention appends to the cache (every sublayer takes the argument)
            return sub(h, cos, sin, cache)
        if self.checkpoint_sublayers and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(sub, h, cos, sin, use_reentrant=False)
        return sub(h, cos, sin)

    @staticmethod
    def _act_dtype(x):
        # sources live in the activation dtype: bf16 under autocast, else the embedding's dtype
        return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype

    def routing_path(self, device, dtype=torch.float32):
        """Which routing runs for sources of `dtype` on `device`: "fused" (routing_kernel.py) or "reference". With
        routing_impl="auto" (the default), the fused kernels wherever they can run: CUDA with Triton, a head width
        and dtype inside their envelope; a note says which the first time. "fused" asks for them (also on a CPU
        under TRITON_INTERPRET=1) and falls back loudly where they cannot run. Chosen once per device type and dtype."""
        impl, key = self.cfg.routing_impl, (torch.device(device).type, dtype)
        if impl == "reference" or self.cfg.residual not in ("attnres", "mhar", "delta"):
            return "reference"
        if key not in self._paths:
            import routing_config
            import routing_kernel
            why = None
            if routing_kernel.triton is None:
                why = "Triton is not installed"
            elif key[0] != "cuda" and not (impl == "fused" and routing_kernel.available(key[0])):
                why = f"the model is on {key[0]} (the kernels need CUDA" + \
                    (", or TRITON_INTERPRET=1 on a CPU)" if impl == "fused" else ")")
            elif impl == "auto":
                try:
                    routing_config.check_envelope(self.cfg.n_embd, self.cfg.heads, dtype)
                except ValueError as e:
                    why = str(e).removeprefix("fused routing: ").split("; use")[0]
            self._paths[key] = "reference" if why else "fused"
            if impl == "fused" and why:
                self._say(f"*** routing_impl='fused' cannot run: {why}. Using the reference routing instead: slower "
                          "(every site re-stacks the depth history) and O(L^2) activation memory. Set "
                          "routing_impl='reference' to silence this. ***")
            elif impl == "auto":
                self._say(f"routing (routing_impl='auto'): the fused Triton kernels on {key[0]}" if not why else
                          f"routing (routing_impl='auto'): the reference PyTorch routing, since {why}")
        return self._paths[key]

    @property
    def routing_config(self):
        """The fused kernels' launch settings (routing_config.RoutingConfig; None: config_for the width)."""
        return self._routing_config

    @routing_config.setter
    def routing_config(self, config):
        self._routing_config = config
        if self._router is not None:   # the next pass's chain is made with it
            self._router.config = config

    @staticmethod
    def _say(line):
        """One line on stderr, once per process (rank 0 under torchrun; not while torch.compile traces)."""
        rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
        if line not in GPT._said and rank == 0 and not torch.compiler.is_compiling():
            GPT._said.add(line)
            print(line, file=sys.stderr, flush=True)

    # -------------------------------------------------------------------------

    def configure_optimizers(self, weight_decay, learning_rate, betas, eps=1e-8, decay_all=True, fused=None,
                             routing_lr_scale=1.0):
        """AdamW. The paper decays every parameter (its FineWeb version's appendix; decay_all=True, the
        default); decay_all=False puts norms, embeddings, routing and hyper-connection parameters in a no-decay
        group. A group of their own, LR times routing_lr_scale (its "lr_scale", applied by train.py): delta's
        new routing parameters (no decay); attnres / mhar's queries where routing_lr_scale != 1, their decay per
        step (LR x weight decay) kept, so that from q = 0 routing_lr_scale = s trains route_scale = s's model
        (logits see s q; Adam ignores the gradient's scale)."""
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        delta = self.cfg.residual == "delta"
        own = lambda n: n.startswith("routes.") and (delta or routing_lr_scale != 1 and n.endswith(".q"))  # noqa: E731
        routing = [p for n, p in named if own(n)]
        rest = [(n, p) for n, p in named if not own(n)]
        if decay_all:
            groups = [{"params": [p for _, p in rest], "weight_decay": weight_decay}]
        else:
            no_decay = lambda n, p: p.dim() < 2 or n.startswith(("routes.", "hyper.")) or p is self.wte.weight
            groups = [{"params": [p for n, p in rest if not no_decay(n, p)], "weight_decay": weight_decay},
                      {"params": [p for n, p in rest if no_decay(n, p)], "weight_decay": 0.0}]
        if routing:
            decay = weight_decay / routing_lr_scale if decay_all and not delta else 0.0
            groups.append({"params": routing, "weight_decay": decay, "lr_scale": routing_lr_scale})
        fused = all(p.is_cuda for _, p in named) if fused is None else fused
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=learning_rate, betas=betas, eps=eps, fused=fused)

    def flops_per_token(self, seq_len=None):
        """Training FLOPs per token: 6 per matmul parameter (fwd + bwd) plus attention scores and values
        (PaLM appendix B accounting). Routing adds O(N d) per site, negligible, and is not counted."""
        cfg, T = self.cfg, seq_len or self.cfg.block_size
        n = self.num_params() - (0 if cfg.tie_embeddings else self.wte.weight.numel())
        return 6 * n + 12 * cfg.n_layer * cfg.n_embd * T

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True, stop=None, cuda_graph=None):
        """Append max_new_tokens tokens to idx (B, T), every row of one length; temperature 0 means greedy; with the KV
        cache by default. The loop and its options: generation.generate."""
        return generate(self, idx, max_new_tokens, temperature, top_k, use_cache, stop, cuda_graph)

    @classmethod
    def from_state(cls, cfg, state, device=None):
        """A model of cfg whose parameters are the tensors of `state` (a full state dict, no copy, their
        dtype kept): built on the meta device, so nothing is initialised twice (an 8B model loads in seconds)."""
        with torch.device("meta"):
            model = cls(cfg)
        missing, unexpected = model.load_state_dict(state, assign=True, strict=False)
        missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"state dict does not fit the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
        if cfg.tie_embeddings:   # assign=True gives the two names separate parameters: tie them again
            model.lm_head.weight = model.wte.weight
        model.reset_buffers(device)
        return model

