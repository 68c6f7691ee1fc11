# Registers and stack a thread of the gathers (leading, following) and the forwards (leading, other) at each width's shipped
# tiles under register caps (Triton's maxnreg): sm_90 cubins, no GPU needed; run it with the H200's Triton (3.6).
#   python results/gather_backward/registers_caps.py
import sys
sys.path.insert(0, "."); sys.path.insert(0, "results/forward_sharing")
from registers import triton, sig_of, rg, rk, config_for, _split, _block_m, usage
sig = sig_of(rg._gather_bwd, {"S", "GIN", "GB", "DS"}, {"M", "j", "N"}, {"inv_dm"})
for d, H, caps in [(512, 4, (None, 96, 80, 64)), (768, 4, (None, 168, 128)), (1024, 8, (None, 192, 168, 128)), (1280, 8, (None, 128))]:
    cfg, D = config_for(d, H), d // H
    bh, (d_a, bb, lanes) = triton.next_power_of_2(H), _split(D)
    for lead, (tile, warps, stages) in ((True, cfg.gather_bwd_lead), (False, cfg.gather_bwd)):
        bm = _block_m(tile, bh * lanes, cfg)
        c = dict(DM=d, H=H, D=D, BH=bh, D_A=d_a, BLOCK_B=bb, BLOCK_M=bm, STAGES=stages, LEAD=lead, FOLLOW=not lead,
                 LOGITS_STORED=cfg.gather_logits)
        print(f"gather d{d} H{H} {'lead' if lead else 'follow'}: " + " | ".join(
            f"cap {cap}: {usage(rg._gather_bwd, sig, c, warps, stages, cap)}" for cap in caps), flush=True)
sig = sig_of(rk._chain_fwd, {"S", "NEW", "OUT"}, {"M", "j", "back"}, {"eps"})
for d, H, caps in [(512, 4, (None, 168, 128)), (1024, 8, (None, 168, 128)), (768, 4, (None, 96)), (1280, 8, (None, 80))]:
    cfg = config_for(d, H)
    d_a, bb, lanes = _split(d // H, split=True)
    for kind, (tile, warps, stages), lead in (("lead", cfg.fwd_lead, cfg.fwd_lead_sites), ("follow", cfg.fwd, 0)):
        bm = _block_m(tile, lanes, cfg)
        c = dict(DM=d, H=H, D=d // H, D_A=d_a, BLOCK_B=bb, BLOCK_M=bm, BLOCK_C=min(1024, triton.next_power_of_2(d)),
                 STAGES=stages, STORE_LOGITS=cfg.stored_logits, LEAD=lead, FOLLOW=kind == "follow", STORE_MIX=True)
        print(f"fwd d{d} H{H} {kind} {lead} {(tile, warps, stages)}: " + " | ".join(
            f"cap {cap}: {usage(rk._chain_fwd, sig, c, warps, stages, cap)}" for cap in caps), flush=True)
