# The reduced-budget reproduction on one H200 (results/repro_100m): the 100M architecture of paper Table 1 on the offline
# books+Wikipedia corpus, 2,000 steps of 32 x 1024 tokens (65.5M tokens, ~2.1 epochs of its 30.5M train tokens).
#   python prepare_data.py --input=BOOKS_WIKI/books_wiki_en_train.jsonl.xz \
#       --val_input=BOOKS_WIKI/books_wiki_en_val.jsonl.xz --out_dir=data/books_wiki      (any local jsonl works)
#   python train.py config/repro_100m.py --residual=mhar --seed=0 --out_dir=out/repro/mhar_s0
# Modes: baseline | hyper | attnres | mhar (add --route_heads=H for the head sweep). The seed fixes the
# initialisation and the data order; both are the same across modes for a seed (the residual mechanism's
# parameters draw no random numbers), so runs of one seed are a paired comparison.
data_dir = "data/books_wiki"
n_layer = 12
n_head = 8
n_kv_head = 4          # mhar's default route_heads = 4
n_embd = 512
ffn_hidden = 1536
block_size = 1024
batch_tokens = 32 * 1024
micro_batch = 32       # one microbatch per step on an H200 (~20 GB)
lr = 1e-3
warmup_steps = 200
max_steps = 2000
lr_decay_steps = 2000
eval_interval = 100
eval_tokens = 1048576  # the whole val split (~0.4M tokens) is the fixed validation set
