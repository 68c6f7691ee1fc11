# The width control of paper Table 9 at the reduced budget of config/repro_100m.py (results/temperature_study): the
# 124M shape d768 / L12 / KV4 (route_heads 4), 12 query heads of 64 and a SwiGLU of 3d like our 100M, ~122M
# parameters with the GPT-2 vocabulary; the same data, steps, batch, schedule and evaluation as repro_100m.
#   python train.py config/repro_124m.py --residual=attnres --seed=0 --route_scale=0.5 --out_dir=out/study/...
data_dir = "data/books_wiki"
n_layer = 12
n_head = 12
n_kv_head = 4          # mhar's default route_heads = 4
n_embd = 768
ffn_hidden = 2304
block_size = 1024
batch_tokens = 32 * 1024
micro_batch = 32       # one microbatch per step on an H200
lr = 1e-3
warmup_steps = 200
max_steps = 2000
lr_decay_steps = 2000
eval_interval = 100
eval_tokens = 1048576  # the whole val split (~0.4M tokens) is the fixed validation set
