"""
Generation: GPT.generate's loop and its one piece of state, the KV cache. graphs.DecodeGraph replays the one-token
steps as CUDA graphs. A reader of the method never needs this file: routing keeps no state across positions.
"""
import torch

from graphs import DecodeGraph


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True, stop=None, cuda_graph=None):
    """Append max_new_tokens tokens to idx (B, T), every row of one length; temperature 0 means greedy. With the
    KV cache (the default) each new token costs one position's forward. The context is the last block_size
    tokens: a longer prompt is cut to them, and when the cache is full it restarts from the last block_size / 2
    tokens (uncached generation slides a full window instead, so past block_size the two may differ).
    stop(idx) -> bool: end early when it holds (checked after every token). cuda_graph (None: on CUDA, for
    DecodeGraph.MIN_TOKENS new tokens or more): replay each one-token step as a CUDA graph (DecodeGraph)."""
    L = model.cfg.block_size
    if cuda_graph is None:
        cuda_graph = idx.is_cuda and max_new_tokens >= DecodeGraph.MIN_TOKENS
    cache, fed, step = None, 0, None   # fed: tokens of idx the cache holds; step: the graphed decode step
    for _ in range(max_new_tokens):
        if not use_cache:
            logits, _ = model(idx[:, -L:])
        elif cache is None or cache.pos == L:   # (re)start: prefill the last tokens
            keep = min(idx.size(1), L if cache is None else L // 2)
            if cache is None:
                cache = KVCache(model, idx.size(0), L, dtype=model._act_dtype(model.wte.weight))
            cache.pos, fed = 0, idx.size(1) - keep
            logits, _ = model(idx[:, fed:], cache=cache)
            fed = idx.size(1)
        elif cuda_graph and step is not False:
            if step is None:
                step = DecodeGraph.capture(model, cache, idx[:, -1:], say=model._say)
            logits = step(idx[:, -1:]) if step else model(idx[:, -1:], cache=cache)[0]
            fed = idx.size(1)
        else:
            logits, _ = model(idx[:, fed:], cache=cache)
            fed = idx.size(1)
        logits = logits[:, -1, :].float()
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1)
        idx = torch.cat((idx, nxt), dim=1)
        if stop is not None and stop(idx):
            break
    return idx


class KVCache:
    """Keys and values of every attention layer for generation: (B, n_kv_head, max_len, head_dim) per layer, filled
    left to right. It is the only state generation needs in any residual mode: routing (and hyper-connections, and
    delta mode) mix each token's own depth history, the outputs of earlier sublayers at the same position, so a new
    token computes its whole history itself; only attention reads other positions.

        cache = KVCache(model, batch=B, max_len=model.cfg.block_size)
        logits, _ = model(prompt, cache=cache)      # positions 0 .. T-1
        logits, _ = model(next_token, cache=cache)  # position T, and so on"""

    def __init__(self, model, batch, max_len=None, device=None, dtype=None):
        cfg, w = model.cfg, model.wte.weight
        self.max_len = max_len or cfg.block_size
        if self.max_len > cfg.block_size:
            raise ValueError(f"KVCache max_len={self.max_len} exceeds block_size={cfg.block_size} (the RoPE tables)")
        shape = (batch, cfg.n_kv_head, self.max_len, cfg.hd)
        self.k = [torch.zeros(shape, device=device or w.device, dtype=dtype or w.dtype) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.pos, self.layer = 0, 0   # tokens cached; the next attention layer in this forward
        self.step_pos = None          # DecodeGraph's one-token steps: the position as a (1,) device tensor
        self.valid = None             # a padded batch: (B, max_len) bool, False at pad positions (pad())

    def pad(self, valid):
        """A padded batch's forward: valid (B, tokens so far) marks its tokens; pad keys are masked from here on."""
        if self.step_pos is not None:
            raise ValueError("a padded batch cannot use the graphed decode step: pass cuda_graph=False")
        if self.valid is None:
            self.valid = torch.ones(valid.size(0), self.max_len, dtype=torch.bool, device=valid.device)
        self.valid[:, :valid.size(1)] = valid
        return self

    def extend(self, k, v):
        """Append one layer's new (B, kv, T, hd) keys and values: all its keys and values so far, and the mask of
        the new queries (None when the plain causal mask, or no mask, is right)."""
        T, i = k.size(2), self.layer
        if self.step_pos is not None:   # fixed shapes, the position on the device: a CUDA graph can replay it
            self.layer += 1
            self.k[i].index_copy_(2, self.step_pos, k)
            self.v[i].index_copy_(2, self.step_pos, v)
            seen = (torch.arange(self.max_len, device=k.device) <= self.step_pos)[None]   # (1, max_len): up to here
            return self.k[i].to(k.dtype), self.v[i].to(v.dtype), seen
        if self.pos + T > self.max_len:
            raise ValueError(f"KVCache full: {self.pos} + {T} tokens > max_len={self.max_len}")
        self.k[i][:, :, self.pos:self.pos + T] = k
        self.v[i][:, :, self.pos:self.pos + T] = v
        self.layer += 1
        end = self.pos + T
        mask = None
        if T > 1 and self.pos > 0:   # a chunk after cached tokens: query t sees positions <= pos + t
            mask = torch.ones(T, end, dtype=torch.bool, device=k.device).tril(self.pos)
        if self.valid is not None:
            mask = padded_mask(self.valid[:, :end], self.pos, T)
        return self.k[i][:, :, :end].to(k.dtype), self.v[i][:, :, :end].to(v.dtype), mask

    def advance(self, T):
        """After a forward over T new tokens: they are cached."""
        self.pos, self.layer = self.pos + T, 0

    # What transformers' generate() asks of a cache, by the names of its Cache class (beam search reorders the rows,
    # and a generation past max_len grows it). Not a subclass: this file, which training imports, needs no transformers.
    def get_seq_length(self, layer_idx=0):
        return self.pos

    def reorder_cache(self, beam_idx):
        """Keep rows beam_idx (beam search: each surviving beam's history) in every layer, and in the padding mask."""
        for i in range(len(self.k)):
            self.k[i], self.v[i] = self.k[i].index_select(0, beam_idx), self.v[i].index_select(0, beam_idx)
        if self.valid is not None:
            self.valid = self.valid.index_select(0, beam_idx)

    def grow(self, max_len):
        """Room for max_len positions (the model's RoPE tables must reach that far): the cached ones kept."""
        extra = max_len - self.max_len
        if extra > 0:
            pad = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], extra, t.shape[3])], 2)  # noqa: E731
            self.k, self.v = [pad(t) for t in self.k], [pad(t) for t in self.v]
            if self.valid is not None:
                self.valid = torch.cat([self.valid, self.valid.new_ones(self.valid.size(0), extra)], 1)
            self.max_len = max_len


def padded_mask(valid, pos, T):
    """The attention mask (B, 1, T, end) of T queries at positions pos .. pos + T - 1 over keys 0 .. end - 1 of which
    valid (B, end) are tokens: causal, pad keys out; each query sees itself (a pad row's output is finite and unused)."""
    end = valid.size(1)
    q = torch.arange(pos, pos + T, device=valid.device)[:, None]
    key = torch.arange(end, device=valid.device)[None, :]
    return ((key <= q) & valid[:, None, :] | (key == q))[:, None]


class Padding:
    """A padded batch without a cache: KVCache's extend(), so attention masks the pad keys the same way."""

    def __init__(self, valid):
        self.valid, self.pos, self.layer, self.step_pos = valid, 0, 0, None

    def extend(self, k, v):
        return k, v, padded_mask(self.valid, 0, k.size(2))

    def advance(self, T):
        pass

