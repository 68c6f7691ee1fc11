# Registers and stack a thread of the gathers (_gather_bwd at each width's shipped tiles, leading and following) from
# this tree and from another routing_gather.py: Triton's sm_90 cubin, no GPU needed (results/forward_sharing/registers.py)
#   git show b5a619f:routing_gather.py > out/rg_rows.py    # a tile's row offsets kept apart (reverted)
#   python results/gather_backward/registers_rows.py out/rg_rows.py
# The logs (registers_rows_triton39.txt on the CPU, _triton36.txt on the H200's Triton) ran on b5a619f with 302809e's
# file as the other: there "this tree" is the variant.
import importlib.util, os, sys
sys.path.insert(0, "."); sys.path.insert(0, "results/forward_sharing")
from registers import usage, sig_of, triton, rg, config_for, _split, _block_m

spec = importlib.util.spec_from_file_location("rg_other", sys.argv[1])
other = importlib.util.module_from_spec(spec)
spec.loader.exec_module(other)
for name, module in (("this tree", rg), (sys.argv[1], other)):
    sig = sig_of(module._gather_bwd, {"S", "GIN", "GB", "DS"}, {"M", "j", "N"}, {"inv_dm"})
    for d, H in [(512, 4), (768, 4), (1024, 8), (1280, 8), (512, 1), (1024, 1)]:
        cfg, D = config_for(d, H), d // H
        bh, (d_a, bb, lanes) = triton.next_power_of_2(H), _split(D)
        out = []
        for lead, (tile, warps, stages) in ((False, cfg.gather_bwd), (True, cfg.gather_bwd_lead)):
            bm = _block_m(tile, bh * lanes, cfg)
            c = dict(DM=d, H=H, D=D, BH=bh, D_A=d_a, BLOCK_B=bb, BLOCK_M=bm, STAGES=stages, LEAD=lead, FOLLOW=not lead,
                     LOGITS_STORED=cfg.gather_logits)
            out.append(f"{'leading' if lead else 'following'} ({bm} token, {warps} warp): "
                       + usage(module._gather_bwd, sig, c, warps, stages))
        print(f"{name}  d {d} H {H}:  " + " | ".join(out), flush=True)
