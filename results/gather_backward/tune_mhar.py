"""MHAR's gather backward tuned at its training microbatches (and the 1B single head's), the result applied in memory,
then in the same process the training step and the authors' kernel side by side. Run from the repository root on a GPU:
    python results/gather_backward/tune_mhar.py OUT_DIR [PATH/mhar_triton.py]
(tune_mhar_h200.txt is its output on tree d062e6f; the settings it found ship in routing_config.TUNED_H200.)"""
import os
import sys

sys.path.insert(0, os.getcwd())
import bench  # noqa: E402
import routing_config as rc  # noqa: E402

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
shapes = [s for s in bench.CHAIN_SHAPES if s[0].endswith("train")] + [("1B-train", 36, 1280, 1, 2, 1024)]
configs = bench.tune_configs(["gather_bwd", "gather_bwd_lead", "backward"], shapes, True, "cuda")
for (_, _, d, H, _, _), cfg in zip(shapes, configs):
    rc.TUNED_H200.setdefault((d, H), {}).update(gather_bwd=cfg.gather_bwd, gather_bwd_lead=cfg.gather_bwd_lead,
                                                backward=cfg.backward)
    print("APPLY", (d, H), rc.TUNED_H200[(d, H)], flush=True)
bench.main(["--scales=100m,350m,1b", "--variants=baseline,mhar_fused,attnres_fused", f"--output={out}/bench.json"])
if len(sys.argv) > 2:
    bench.main(["routing", f"--authors={sys.argv[2]}", f"--output={out}/authors.json"])
