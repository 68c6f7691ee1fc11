"""
A Multi-Head Attention Residuals model (arXiv 2607.27230) exported by the mhar repository's export.py: model.py and
the modules beside this file are that repository's, copied with their imports made package-relative. This file only
wraps model.GPT for transformers: config, weights, loss and logits, and generate() through model.py's KV cache.
(In the repository, export.py copies this file as it is into every non-baseline export; its relative imports resolve
there, in the package transformers makes of the folder, not here.)
"""
import inspect

import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .generation import KVCache
from .model import GPT, GPTConfig

# the name under which generate() hands a model its cache: "cache" in recent transformers, "past_key_values" before
CACHE = "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters else \
    "past_key_values"


class MHARConfig(PretrainedConfig):
    model_type = "mhar"

    def __init__(self, gpt_config=None, **kwargs):
        self.gpt_config = dict(gpt_config or {})   # model.GPTConfig's fields
        super().__init__(**kwargs)


class MHARForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MHARConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    supports_gradient_checkpointing = True   # model.py's own: every sublayer recomputed, never the routing
    _tied_weights_keys = {"model.lm_head.weight": "model.wte.weight"}   # tied where config.tie_word_embeddings says

    def __init__(self, config):
        super().__init__(config)
        self.model = GPT(GPTConfig.from_dict(config.gpt_config))
        self.rope_ready = False   # RoPE tables: not in the weights, so made on the first forward where the model is
        self.post_init()

    def _init_weights(self, module):   # the weights come from the checkpoint; model.py initialised the rest
        pass

    def get_input_embeddings(self):
        return self.model.wte

    def get_output_embeddings(self):
        return self.model.lm_head

    @classmethod
    def _supports_default_dynamic_cache(cls):   # generation keeps model.py's own KV cache
        return False

    def _set_gradient_checkpointing(self, enable=True, gradient_checkpointing_func=None, **kwargs):
        """gradient_checkpointing_enable(): model.py recomputes each sublayer in the backward (torch.utils.checkpoint,
        use_reentrant=False), as train.py --activation_checkpointing does; the gradients are those without it."""
        self.model.checkpoint_sublayers = self.gradient_checkpointing = enable

    def _positions(self, n, cache):
        """Room for n positions. Past the training length (max_position_embeddings) the RoPE tables and the cache grow,
        as a stock model's rotary embedding does (generate() says once that the length is exceeded; nothing was
        trained there)."""
        if n > self.model.cfg.block_size:
            self.model.cfg.block_size = max(n, 2 * self.model.cfg.block_size)
            self.model.reset_buffers(self.model.wte.weight.device)
        if cache is not None and n > cache.max_len:
            cache.grow(self.model.cfg.block_size)

    def forward(self, input_ids=None, attention_mask=None, labels=None, use_cache=None, cache=None,
                past_key_values=None, **kwargs):
        """Logits (B, T, vocab) of input_ids; with labels (input_ids' shape, -100 ignored) the next-token loss; with
        use_cache the KV cache (model.py's KVCache) to pass back for the next tokens. attention_mask (B, tokens so far):
        0 at padding, on either side; a padded row computes what it would alone."""
        if not self.rope_ready:   # (transformers builds the model on the meta device: its buffers hold no values)
            self.model.reset_buffers(self.model.wte.weight.device)
            self.rope_ready = True
        cache = cache if isinstance(cache, KVCache) else past_key_values if isinstance(past_key_values, KVCache) else None
        if cache is None and use_cache and not self.training:
            cache = KVCache(self.model, input_ids.size(0), dtype=self.model.wte.weight.dtype)
        self._positions((cache.pos if cache is not None else 0) + input_ids.size(1), cache)
        logits, _ = self.model(input_ids, cache=cache, attention_mask=attention_mask)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        out = CausalLMOutputWithPast(loss=loss, logits=logits)
        if cache is not None:   # handed back to the next step by generate()
            out[CACHE] = cache
        return out

    def prepare_inputs_for_generation(self, input_ids, cache=None, past_key_values=None, attention_mask=None,
                                      use_cache=True, **kwargs):
        cache = cache if isinstance(cache, KVCache) else past_key_values if isinstance(past_key_values, KVCache) else None
        if cache is not None:
            input_ids = input_ids[:, cache.pos:]   # only the tokens the cache has not seen
        return {"input_ids": input_ids, CACHE: cache, "use_cache": use_cache, "attention_mask": attention_mask}
