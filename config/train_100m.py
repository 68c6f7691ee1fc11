# Paper Table 1, 100M scale: d512 / L12 / 8 heads / 4 KV heads / FFN 1536, seq 2048, global batch 64.
# Pick the residual mode on the command line, everything else is shared by all four modes:
#   torchrun --standalone --nproc_per_node=8 train.py config/train_100m.py --residual=mhar --out_dir=out/100m_mhar
# 20k steps x 131k tokens = 2.6B tokens: prepare at least that many to avoid repeating data:
#   python prepare_data.py --max_tokens=2.7e9 --out_dir=data/fineweb_edu
data_dir = "data/fineweb_edu"
n_layer = 12
n_head = 8
n_kv_head = 4          # MHAR default route_heads = n_kv_head = 4
n_embd = 512
ffn_hidden = 1536
block_size = 2048
batch_tokens = 64 * 2048
micro_batch = 8        # the paper's per-GPU microbatch (8 x 2048); accumulation covers fewer GPUs
lr = 1e-3              # single-head (attnres) was also run at 5e-4 in the paper
warmup_steps = 1000
max_steps = 20000
lr_decay_steps = 20000
eval_interval = 500
