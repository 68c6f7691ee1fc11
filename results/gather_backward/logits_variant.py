"""Writes OUT: a copy of routing_gather.py (as of c833a09: the text it replaces must match) whose gathers load the
forward's stored logits instead of recomputing r <w, s> per pair, for logits_ab.py to time against the tree. The tree
then took the same change as RoutingConfig.gather_logits (logits_ptx.py checks the two compile alike).
    python results/gather_backward/logits_variant.py ROUTING_GATHER_PY OUT"""
import re, sys
src = open(sys.argv[1]).read()
def sub(a, b, count=1):
    global src
    assert src.count(a) >= 1, a[:60]
    src = src.replace(a, b) if count == 0 else src.replace(a, b, count)
sub("""def _pair(acc_a, u_a, acc_b, u_b, k, s_a, s_b, r, g_a, g_b, c, w_a, w_b, lse, DLR, row, hoff, hmask, M64,
          H: tl.constexpr, SPLIT: tl.constexpr):""", """def _pair(acc_a, u_a, acc_b, u_b, k, s_a, s_b, r, g_a, g_b, c, w_a, w_b, lse, DLR, row, hoff, hmask, M64,
          H: tl.constexpr, SPLIT: tl.constexpr, LG, lrow):""")
sub("""    logit = r[:, None] * _dot2(s_a, w_a, s_b, w_b, SPLIT)
    alpha = tl.exp(logit - lse)""", """    logit = tl.load(LG + lrow * H * M64 + hoff, mask=hmask, other=0.0)
    alpha = tl.exp(logit - lse)""")
# call sites: own pair (site j), lead pair, loop pairs
sub("""_pair(acc_a, u_a, acc_b, u_b, k, s_a, s_b, r, g_a, g_b, c, w_a, w_b, lse, DLR, row0 + j,
                                      hoff, hmask, M64, H, SPLIT)""", """_pair(acc_a, u_a, acc_b, u_b, k, s_a, s_b, r, g_a, g_b, c, w_a, w_b, lse, DLR, row0 + j,
                                      hoff, hmask, M64, H, SPLIT, LG, j * (j - 1) // 2 + n)""")
sub("""_pair(acc2_a, u2_a, acc2_b, u2_b, k2, s2_a, s2_b, r2, g_a, g_b, c, w_a, w_b, lse,
                                               DLR, row2 + j, hoff, hmask, M64, H, SPLIT)""", """_pair(acc2_a, u2_a, acc2_b, u2_b, k2, s2_a, s2_b, r2, g_a, g_b, c, w_a, w_b, lse,
                                               DLR, row2 + j, hoff, hmask, M64, H, SPLIT, LG, j * (j - 1) // 2 + n - 1)""")
sub("""_pair(acc_a, u_a, acc_b, u_b, k, s_a, s_b, r, g_a, g_b, c, w_a, w_b, lse, DLR,
                                          row0 + jp, hoff, hmask, M64, H, SPLIT)""", """_pair(acc_a, u_a, acc_b, u_b, k, s_a, s_b, r, g_a, g_b, c, w_a, w_b, lse, DLR,
                                          row0 + jp, hoff, hmask, M64, H, SPLIT, LG, jp * (jp - 1) // 2 + n)""")
sub("""_pair(acc2_a, u2_a, acc2_b, u2_b, k2, s2_a, s2_b, r2, g_a, g_b, c, w_a, w_b,
                                                   lse, DLR, row2 + jp, hoff, hmask, M64, H, SPLIT)""", """_pair(acc2_a, u2_a, acc2_b, u2_b, k2, s2_a, s2_b, r2, g_a, g_b, c, w_a, w_b,
                                                   lse, DLR, row2 + jp, hoff, hmask, M64, H, SPLIT, LG, jp * (jp - 1) // 2 + n - 1)""")
# kernel signature and launch
sub("""    S, R, W, LSE, MIX,  # the forward's""", """    S, R, W, LSE, MIX, LG,  # the forward's (LG: its stored logits)""")
sub("""            S=self.S, R=self.R, W=self.W, LSE=self.LSE, MIX=self.MIX, GB=self.GB,""",
    """            S=self.S, R=self.R, W=self.W, LSE=self.LSE, MIX=self.MIX, LG=self.LG, GB=self.GB,""")
sub("""        self.LG = self.LSE   # (a placeholder: the forward stores no logits)""",
    """        self.LG = torch.empty(P, H, M, **f32)   # the forward's logits, loaded by the gathers""")
sub("""        self.stored_logits = False   # (the gather recomputes each pair's logit)""",
    """        self.stored_logits = True""")
open(sys.argv[2], "w").write(src)
