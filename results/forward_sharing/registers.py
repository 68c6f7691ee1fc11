# Registers and stack a thread (cuobjdump of Triton's sm_90 cubin, no GPU needed) of the leading forward at each
# width's shipped leading tile with 0-3 led sites, of dw's product per tokens a step and precision, and of the gathers
# per tokens a program and warps.   python results/forward_sharing/registers.py [fwd] [dw] [gather] [gather_warps]
import os, sys, subprocess, tempfile
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, ".")
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
import routing_kernel as rk, routing_gather as rg
from routing_config import config_for, _split, _block_m
target = GPUTarget("cuda", 90, 32)
CUOBJ = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
def usage(fn, sig, consts, warps, stages=3, cap=None):
    """Registers, stack and shared memory of `fn` compiled as the GPU launch compiles it for 16-byte aligned tensors
    (each pointer argument specialised as divisible by 16: without it Triton loads a bf16 column at a time and the
    counts differ from the H200's, e.g. the leading gather at d 1024 254 against 243); `cap`: Triton's maxnreg."""
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    opts = dict(num_warps=warps, num_stages=stages, **({"maxnreg": cap} if cap else {}))
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=target, options=opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        out = subprocess.run([CUOBJ, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = [l for l in out.splitlines() if "REG" in l][0]
    return " ".join(x for x in line.split() if x.startswith(("REG", "STACK", "SHARED")))
def sig_of(fn, bf16, ints, floats=()):
    return {p.name: "constexpr" if p.is_constexpr else "*bf16" if p.name in bf16 else "i32" if p.name in ints
            else "fp32" if p.name in floats else "*fp32" for p in fn.params}
if __name__ == "__main__":
    which = sys.argv[1:] or ["fwd", "dw", "gather"]
    if "fwd" in which:
        sig = sig_of(rk._chain_fwd, {"S", "NEW", "OUT"}, {"M", "j", "back"}, {"eps"})
        for d, H in [(512, 4), (768, 4), (1024, 8), (1280, 8), (512, 1), (1024, 1)]:
            cfg = config_for(d, H)
            tile, warps, stages = cfg.fwd_lead
            d_a, bb, lanes = _split(d // H, split=True)
            bm = _block_m(tile, lanes, cfg)
            out = []
            for lead in (0, 1, 2, 3):
                c = dict(DM=d, H=H, D=d // H, D_A=d_a, BLOCK_B=bb, BLOCK_M=bm, BLOCK_C=min(1024, triton.next_power_of_2(d)),
                         STAGES=stages, STORE_LOGITS=cfg.stored_logits, LEAD=lead, FOLLOW=False, STORE_MIX=True)
                out.append(f"{lead}: " + usage(rk._chain_fwd, sig, c, warps, stages))
            print(f"fwd_lead d{d} H{H} {cfg.fwd_lead} BM{bm}: " + " | ".join(out), flush=True)
    if "dw" in which:
        sig = sig_of(rg._dw_terms, {"S"}, {"N", "M", "tokens_per_split", "P1"})
        for d, H in [(512, 4), (1024, 8), (1280, 8)]:
            D = d // H
            for bt in (16, 32, 64):
                for prec in ("tf32x3", "ieee"):
                    c = dict(DM=d, H=H, D=D, BLOCK_J=32, BLOCK_T=bt, BLOCK_C=min(64, triton.next_power_of_2(D)), PRECISION=prec)
                    print(f"dw d{d} H{H} BLOCK_T {bt} {prec}: {usage(rg._dw_terms, sig, c, 4)}", flush=True)
    # the gathers per tokens a program and warps; gather_warps: one token a program on 1, 2 or 4 warps (tile 512 on 2
    # or 4 warps at d 512 / 768)
    for section, widths, blocks in (("gather", [(512, 4), (1024, 8), (512, 1)], [(1, 1), (2, 1), (2, 2), (4, 2)]),
                                    ("gather_warps", [(512, 4), (512, 1), (768, 4)], [(1, 1), (1, 2), (1, 4), (2, 4)])):
        if section not in which:
            continue
        sig = sig_of(rg._gather_bwd, {"S", "GIN", "GB", "DS"}, {"M", "j", "N"}, {"inv_dm"})
        for d, H in widths:
            D = d // H
            bh, (d_a, bb, lanes) = triton.next_power_of_2(H), _split(D)
            for bm, w in blocks:
                out = []
                for lead in (False, True):
                    c = dict(DM=d, H=H, D=D, BH=bh, D_A=d_a, BLOCK_B=bb, BLOCK_M=bm, STAGES=3, LEAD=lead, FOLLOW=False,
                             LOGITS_STORED=config_for(d, H).gather_logits)
                    out.append(usage(rg._gather_bwd, sig, c, w))
                print(f"gather d{d} H{H} BM{bm} w{w}: alone {out[0]} | lead {out[1]}", flush=True)
