# Paper Table 1, 1B scale: d1280 / L36 / 16 heads / 8 KV heads / FFN 5120, seq 1024, global batch 32.
#   torchrun --standalone --nproc_per_node=8 train.py config/train_1b.py --residual=mhar --out_dir=out/1b_mhar
# 20k steps x 32k tokens = 655M tokens:  python prepare_data.py --max_tokens=7e8 --out_dir=data/fineweb_edu
# head_dim = 1280 / 16 = 80; 73 routing sites, the last one reads all 73 sources.
data_dir = "data/fineweb_edu"
n_layer = 36
n_head = 16
n_kv_head = 8          # MHAR default route_heads = 8
n_embd = 1280
ffn_hidden = 5120
block_size = 1024
batch_tokens = 32 * 1024
micro_batch = 2        # the paper's per-GPU microbatch (2 x 1024)
lr = 1e-3
warmup_steps = 1000
max_steps = 20000
lr_decay_steps = 20000
eval_interval = 500
