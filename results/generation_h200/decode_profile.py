"""Where an eager one-token decode step spends its time, against the same step replayed as a CUDA graph.

    python results/generation_h200/decode_profile.py > decode_profile.txt     (from the repo root, on a CUDA GPU)

100M shape of bench.py, random weights, a 512-token prompt cached, then one-token steps. Per variant (baseline and
MHAR; reference and fused routing; fp32 weights under bf16 autocast, or bf16 weights): the eager step (unsynced and
synced per step), the 512-token prefill, the graphed step (graphs.DecodeGraph) and an eager step at batch 16. Then a
Python profile and a torch.profiler table of eager steps (launch counts, host time against GPU time)."""
import cProfile, io, os, pstats, statistics, subprocess, sys, time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch
from torch.profiler import ProfilerActivity, profile

import bench
from graphs import DecodeGraph
from generation import KVCache
from model import GPT, GPTConfig


def smi(fields):
    return subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv"], capture_output=True, text=True).stdout


def build(residual, impl, dtype=torch.float32):
    kw, _ = bench.scale_config("100m", 50304)
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**kw, "residual": residual, "routing_impl": impl})).cuda().to(dtype).eval()


def steps(m, n, B=1, graph=False, autocast=True, per_step=False):
    """ms per one-token step over n steps after a 512-token prefill; per_step: (median, min, max, prefill ms)."""
    prompt = torch.randint(0, m.cfg.vocab_size, (B, 512), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        cache = KVCache(m, B, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t = time.perf_counter()
        m(prompt, cache=cache)
        torch.cuda.synchronize()
        prefill = (time.perf_counter() - t) * 1e3
        tok = prompt[:, -1:]
        step = DecodeGraph.capture(m, cache, tok) if graph else None
        times = []
        torch.cuda.synchronize()
        t = t0 = time.perf_counter()
        for _ in range(n):
            step(tok) if step else m(tok, cache=cache)
            if per_step:
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t) * 1e3)
                t = time.perf_counter()
        torch.cuda.synchronize()
        if per_step:
            return statistics.median(times), min(times), max(times), prefill
        return (time.perf_counter() - t0) / n * 1e3


def main():
    print(torch.__version__, torch.cuda.get_device_name())
    print(smi("clocks.sm,clocks.max.sm,persistence_mode,pstate,utilization.gpu"), flush=True)
    variants = [("baseline", "reference", torch.float32, True), ("baseline", "reference", torch.bfloat16, False),
                ("mhar", "reference", torch.float32, True), ("mhar", "auto", torch.float32, True),
                ("mhar", "auto", torch.bfloat16, False)]
    for residual, impl, dtype, ac in variants:
        m = build(residual, impl, dtype)
        steps(m, 5, autocast=ac)
        med, lo, hi, pre = steps(m, 30, autocast=ac, per_step=True)
        print(f"{residual:8s} {impl:9s} {str(dtype):15s} autocast={ac}: eager step {steps(m, 50, autocast=ac):7.2f} ms "
              f"(synced: median {med:.2f} min {lo:.2f} max {hi:.2f}; prefill 512 {pre:.1f} ms) | graphed "
              f"{steps(m, 50, graph=True, autocast=ac):7.2f} ms | B16 eager {steps(m, 20, B=16, autocast=ac):7.2f} ms",
              flush=True)
        del m
    print(smi("clocks.sm,utilization.gpu"))
    for residual, impl in [("baseline", "reference"), ("mhar", "auto")]:
        m = build(residual, impl)
        steps(m, 5)
        print("=" * 30, residual, impl, "cProfile of 20 eager steps")
        pr = cProfile.Profile()
        pr.enable()
        steps(m, 20)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue()[:6000])
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:   # a prefill + 5 steps
            steps(m, 5)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
        del m


if __name__ == "__main__":
    main()
