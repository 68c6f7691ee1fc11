# A two-minute CPU run (2 cores: ~1.3 s/step, 100 steps) on any prepare_data.py output: proves the pipeline and shows a falling loss.
# python prepare_data.py --input=docs.jsonl.xz --out_dir=data/tiny   (any local jsonl / txt / parquet)
# python train.py config/tiny.py --data_dir=data/tiny --residual=mhar
data_dir = "data/tiny"
out_dir = "out/tiny"
# a 4-layer model: narrow enough for a laptop CPU, deep enough that routing has 9 sites to learn
n_layer = 4
n_head = 4
n_kv_head = 2      # MHAR default: route_heads = n_kv_head = 2
n_embd = 128
ffn_hidden = 384
block_size = 128
batch_tokens = 2048   # 16 sequences of 128 tokens per step: the 50k-vocab LM head dominates CPU time
micro_batch = 8       # 2 micro-steps: accumulation is exercised too
# a small model takes a high learning rate; short warmup, cosine over the whole run
lr = 3e-3
warmup_steps = 20
max_steps = 100
lr_decay_steps = 100  # fixed horizon: --max_steps=40 then resume to 80 follows the 100-step schedule exactly
eval_interval = 25
eval_tokens = 16384
compile = False       # compiling costs more than it saves on a 2-minute CPU run
