"""cProfile of the kernels' host code on a GPU host (4K, SmolLM2-135M heads, default pattern):
dilated_fwd / dilated_bwd with launches, and with the run step stubbed (planning and buffers only).
python hostprof.py"""
import cProfile, pstats, time, torch
import hf_hilbert_attn.kernels as K
from hf_hilbert_attn.kernels import dilated_bwd, dilated_fwd
from hf_hilbert_attn.kernels._plan import plan_positions
from hf_hilbert_attn.inputs import check_inputs
from hf_hilbert_attn.patterns import as_pattern
pat = as_pattern("default")
mk = lambda h: torch.randn(1, h, 4096, 64, device="cuda", dtype=torch.bfloat16)
q, k, v = mk(9), mk(3), mk(3)
a = check_inputs(q, k, v, pat); plan, _ = plan_positions(a, pat)
out, lse = dilated_fwd(q, k, v, pat, a.scale, True, plan)
f = lambda: dilated_fwd(q, k, v, pat, a.scale, True, plan)
b = lambda: dilated_bwd(q, q, k, v, out, lse, None, pat, a.scale, True, plan)
for _ in range(5): f(); b()
torch.cuda.synchronize()
real = K._run
for label, run in (("with launches", real), ("run step stubbed", lambda l, fr, c: None)):
    K._run = run
    for name, fn in (("dilated_fwd", f), ("dilated_bwd", b)):
        best = 1e9
        for _ in range(10):
            torch.cuda.synchronize(); t = time.perf_counter()
            for _ in range(20): fn()
            best = min(best, (time.perf_counter() - t) / 20 * 1e6)
        print(f"{label}: {name} {best:.1f} us per call", flush=True)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(200): f(); b()
    pr.disable(); torch.cuda.synchronize()
    print(f"== {label}: 200 x (fwd + bwd), by own time")
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)
K._run = real
