"""Writes OUT: a routing_gather.py (one accumulator) whose gathers also store each site's c and lse token-major,
[N, M, 2H] (c in [0, H), lse in [H, 2H)), so a later gather loads a token's 2H values from one row instead of from 2H
rows of [N, H, M] (one token a program: 2H memory sectors a pair -> 1-2). Timed, not shipped (token_major_ab_h200.txt).
    python results/gather_backward/token_major_variant.py routing_gather.py out/rg_token_major.py"""
import sys
src = open(sys.argv[1]).read()
def sub(a, b):
    global src
    assert src.count(a) == 1, a[:70]
    src = src.replace(a, b)
sub("""    tl.store(C + n * H * M64 + hoff, c, mask=hmask)
""", """    toff = rows64[:, None] * (2 * H) + heads[None, :]   # token-major: a token's c and lse in one row
    tl.store(C + n * M64 * (2 * H) + toff, c, mask=hmask)
""")
sub("""    w_a, w_b, lse = _site(W, LSE, j, woff_a, wmask_a, woff_b, wmask_b, hoff, hmask, M64, DM, H, SPLIT)
""", """    w_a, w_b, lse = _site(W, LSE, j, woff_a, wmask_a, woff_b, wmask_b, hoff, hmask, M64, DM, H, SPLIT)
    tl.store(C + n * M64 * (2 * H) + toff + H, lse, mask=hmask)
""")
sub("""        c = tl.load(C + (jp - 1) * H * M64 + hoff, mask=hmask, other=0.0)
        w_a, w_b, lse = _site(W, LSE, jp, woff_a, wmask_a, woff_b, wmask_b, hoff, hmask, M64, DM, H, SPLIT)
""", """        c = tl.load(C + (jp - 1) * M64 * (2 * H) + toff, mask=hmask, other=0.0)
        lse = tl.load(C + (jp - 1) * M64 * (2 * H) + toff + H, mask=hmask, other=0.0)
        w_a, w_b = _load(W, (jp - 1) * DM, woff_a, wmask_a, woff_b, wmask_b, SPLIT)
        w_a, w_b = w_a[None, :, :], w_b[None, :, :]
""")
sub("""torch.empty(N, H, M, **f32)
        self.DLR""", """torch.empty(N, M, 2 * H, **f32)
        self.DLR""")
open(sys.argv[2], "w").write(src)
