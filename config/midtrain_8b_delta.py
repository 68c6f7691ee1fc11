# The paper's 8B mid-training (section 3.3, Appendix I): Marin-8B (Llama-3.1 architecture) grafted with MHAR delta
# routing (H = 8 heads, 8 blocks of 4 layers), then trained on. Steps:
#   python convert.py --hf_dir=path/to/marin-8b --out_dir=out/marin8b_delta
#   python prepare_data.py --tokenizer=out/marin8b_delta/tokenizer.json --max_tokens=1e10 --out_dir=data/fineweb_edu_llama3
#   torchrun --standalone --nproc_per_node=8 train.py config/midtrain_8b_delta.py
init_from = "out/marin8b_delta"
data_dir = "data/fineweb_edu_llama3"
out_dir = "out/marin8b_midtrain"
block_size = 4096
batch_tokens = 256 * 4096      # ~1.05M tokens per step
micro_batch = 1
lr = 4e-4
min_lr_ratio = 0.01            # 4e-4 -> 4e-6
lr_schedule = "linear"
warmup_steps = 100             # a short re-warmup: our choice, the paper does not give its length
max_steps = 9500
lr_decay_steps = 9500
weight_decay = 0.05
decay_all = False              # no decay on norms and embeddings; the new routing parameters get their own group
z_loss = 1e-4
ema_decay = 0.999
fsdp = True                    # bf16 compute, fp32 master weights, sharded over the GPUs
activation_checkpointing = True
eval_interval = 250
