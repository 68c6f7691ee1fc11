# The width control of paper Table 9 (results/temperature_study): the 124M shape d768 / L12 / KV4 (route_heads 4), 12
# query heads of 64 and a SwiGLU of 3d like our 100M, ~122M parameters with the GPT-2 vocabulary. Only the shape is
# here: give it after a 100M config, whose data, steps, batch, schedule and evaluation it keeps (config files apply in
# order), so the two shapes cannot drift apart in recipe. config/repro_100m.py is the reduced budget, train_100m.py the
# paper's (Table 9 itself trained at lr 5e-4: add --lr=5e-4).
#   python train.py config/repro_100m.py config/repro_124m.py --residual=attnres --seed=0 --route_scale=0.5 --out_dir=...
n_layer = 12
n_head = 12
n_kv_head = 4          # mhar's default route_heads = 4
n_embd = 768
ffn_hidden = 2304
