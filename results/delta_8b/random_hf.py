"""Write a randomly initialised Llama-3.1-8B-shaped checkpoint in Hugging Face layout (config.json, 4 safetensors
shards, index), bf16, N(0, 0.02) weights, norms 1: the input of the 8B conversion and training run (no download
is possible on that machine). Usage: python results/delta_8b/random_hf.py OUT_DIR"""
import json
import os
import sys

import torch
from safetensors.torch import save_file

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
              intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
              max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
              rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              hidden_act="silu", attention_bias=False, mlp_bias=False, torch_dtype="bfloat16")


def shapes(c):
    d, f, hd = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (c["vocab_size"], d), "model.norm.weight": (d,), "lm_head.weight": (c["vocab_size"], d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                    p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                    p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
                    p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d), p + "mlp.down_proj.weight": (d, f)})
    return out


def main(out_dir, n_shards=4):
    os.makedirs(out_dir, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    names = list(shapes(CONFIG).items())
    weight_map, per = {}, -(-len(names) // n_shards)
    for s in range(n_shards):
        fname = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {}
        for name, shape in names[s * per:(s + 1) * per]:
            t = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, device=dev, generator=gen) * 0.02
            part[name] = t.to(torch.bfloat16).cpu()
        save_file(part, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
        print(f"wrote {fname}: {sum(t.numel() for t in part.values()) / 1e9:.2f}B parameters", flush=True)
    json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(out_dir, "model.safetensors.index.json"), "w"))
    json.dump(CONFIG, open(os.path.join(out_dir, "config.json"), "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
