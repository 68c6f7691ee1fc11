"""Is the shipped gather the kernel that was measured? The stored-logits gathers were timed on the H200 as a variant
file (logits_variant.py applied to routing_gather.py at c833a09; logits_ab.py ran it); the tree then took them as a
switch (RoutingConfig.gather_logits). This compiles _gather_bwd for sm_90 (no GPU needed: Triton's CUDA backend to PTX)
at every tuned single-head width, leading / following / neither, from both files, and compares the PTX (kernel name
aside); and MHAR's, switch off, against c833a09's own kernel.
    git show c833a09:routing_gather.py > out/routing_gather_c833a09.py
    python results/gather_backward/logits_variant.py out/routing_gather_c833a09.py out/rg_logits.py
    python results/gather_backward/logits_ptx.py out/routing_gather_c833a09.py out/rg_logits.py"""
import importlib.util
import re
import sys
sys.path.insert(0, ".")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import routing_gather
from routing_config import TUNED_H200, _block_m, _split, config_for


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._gather_bwd


BF16 = {"S", "GIN", "GB", "DS"}   # the bf16 tensors of a training pass; every other pointer is fp32


def ptx(kernel, d, H, lead, follow, stored):
    cfg = config_for(d, H)
    tile, warps, stages = cfg.gather_bwd_lead if lead else cfg.gather_bwd
    bh, (d_a, block_b, lanes) = triton.next_power_of_2(H), _split(d // H)
    const = dict(DM=d, H=H, D=d // H, BH=bh, D_A=d_a, BLOCK_B=block_b, BLOCK_M=_block_m(tile, bh * lanes, cfg),
                 STAGES=stages, LEAD=lead, FOLLOW=follow, LOGITS_STORED=stored)
    names = kernel.arg_names
    sig = {n: "constexpr" if n in const else "i32" if n in ("M", "j", "N") else "fp32" if n == "inv_dm" else
           "*bf16" if n in BF16 else "*fp32" for n in names}
    const = {(names.index(n),): v for n, v in const.items() if n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    src = ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs)
    code = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)).asm["ptx"]
    code = code.split("\t.section\t.debug")[0]   # the instructions, without line information
    return "\n".join(line for line in code.splitlines() if not line.lstrip().startswith((".loc", ".file", "//")))


def instructions(code):
    """The instructions, sorted, registers and parameters unnumbered: what stays when an unused parameter is added."""
    return sorted(re.sub(r"%\w+?\d+|param_\d+", "#", line.strip()) for line in code.splitlines()
                  if line.strip() and not line.lstrip().startswith(".param"))


old, variant = load(sys.argv[1], "rg_old"), load(sys.argv[2], "rg_variant")
same = True
for (d, H), entry in TUNED_H200.items():
    if entry.get("backward") != "gather":
        continue
    for lead, follow in ((False, False), (True, False), (False, True)):
        stored = config_for(d, H).gather_logits
        a = ptx(routing_gather._gather_bwd, d, H, lead, follow, stored)
        b = ptx(variant if stored else old, d, H, lead, follow, stored)
        verdict = "same PTX" if a == b else "same instructions, an unused parameter more" if (
            instructions(a) == instructions(b)) else "DIFFERENT"
        same &= verdict != "DIFFERENT"
        print(f"d {d:4d} H {H}  lead {lead:d} follow {follow:d}  stored logits {stored:d}  "
              f"against {'the variant' if stored else 'c833a09'}: {verdict} ({a.count(chr(10))} lines)", flush=True)
print("every kernel the same" if same else "some differ")
