# The forward's bytes a chain moves with a leading forward that runs the next k - 1 sites (k = 1: none leads), in units
# of M x d bytes (one bf16 pass is 2), leaders from site lead_min up: what fwd_lead_sites was predicted to save before
# it was built (python results/forward_sharing/fwd_bytes.py; N = 25 / 49 / 73: the 100M / 350M / 1B chains).
# Per site: its older sources read (2 each), its newest source read and stored (2 + 2), its output (2, bf16) and the
# unrounded fp32 output (4); a leader writes 4 per led site, a led site reads its state (4) and the sources since.
def cost(N, k, lead_min=2):
    # units: bytes per token-channel (x M*d); site j reads s_0..s_{j-2} from S, NEW (s_{j-1}) from its input
    tot, j = 0, 1
    while j <= N:
        group = min(k, N - j + 1) if j >= lead_min else 1
        # leader
        tot += 2 * (j - 1) + 2 + 2 + 2 + 4 + 4 * (group - 1)
        for dist in range(1, group):
            jj = j + dist
            tot += 4 + 2 * (dist - 1) + 2 + 2 + 2 + 4   # state, sources j..jj-2 from S, NEW, S write, OUT, MIX
        j += group
    return tot
for N in (25, 49, 73):
    base = cost(N, 2)
    print(N, "k=1", cost(N, 1), "k=2", base, " ".join(f"k={k} {cost(N,k)} ({cost(N,k)/base:.3f})" for k in (3, 4, 5, 6)))
