"""CPU tests of the benchmark baselines (hf_hilbert_attn.tools.benchmarks) and a smoke run of the
attention benchmark.

The gather → SDPA → LSE-merge baseline must equal the pattern's reference wherever no pair is
allowed by two configs (a single config), and must differ — by exactly the double counting that
its label announces — where configs overlap.
"""

import csv
import json
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from conftest import attention_tol, eps
from hf_hilbert_attn import DilatedPattern, reference_attention
from hf_hilbert_attn.tools.benchmarks import baselines as B
from hf_hilbert_attn.tools.benchmarks import common as C

BENCH_DIR = Path(__file__).resolve().parents[1] / "examples" / "benchmarks"


def _inputs(S, hq, hkv, D, dtype=torch.float32, batch=2):
    q = torch.randn(batch, hq, S, D, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, hkv, S, D, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, hkv, S, D, dtype=dtype, requires_grad=True)
    do = torch.randn(batch, hq, S, D, dtype=dtype)
    return q, k, v, do


# Two float32 computations of the same sums (at most 128 keys, head_dim 16), each within the
# sums' bound of the exact result (conftest.attention_tol): twice that between them
TOL = 2 * attention_tol(128, 16)
# bf16 inputs against float32 references: rounding q and k (into every score), v and the result,
# each half an eps(bf16) relative, with scores of size ~1: about 3 eps(bf16) in all
BF16_TOL = 3 * eps("bfloat16")


def _rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def _assert_close(name, got, want, tol):
    # Relative Frobenius error; a reference that is (near) zero, e.g. dq when every query sees
    # one key, is compared absolutely against the unit-scale inputs instead.
    err = _rel(got, want)
    diff = (got.detach().float() - want.detach().float()).abs()
    if not (err <= tol or float(diff.max()) <= tol):
        idx = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
        raise AssertionError(f"{name}: rel err {err:.3e} > {tol:.1e}; worst at {idx}: "
                             f"{float(got.detach().float()[idx])} vs {float(want.detach().float()[idx])}")


def _single(w, r, mode):
    # A lone config with r > 1 is not a valid per_head pattern (queries outside class h % r
    # would see nothing), so single configs with r > 1 use "all" query dilation.
    return DilatedPattern([w], [r], query_dilation=mode if r == 1 else "all")


# --------------------------------------------------------------------------- gather == reference
@pytest.mark.parametrize("kernel", ["math", "auto"])
@pytest.mark.parametrize("w,r,S,hq,hkv,causal", [
    (16, 1, 97, 4, 2, True),      # partial last segment, GQA
    (32, 3, 97, 4, 4, True),      # rate not dividing the segment: padded classes
    (128, 4, 97, 6, 2, True),     # segment longer than the sequence
    (16, 2, 128, 4, 1, False),    # non-causal (no padding), MQA
    (1, 1, 33, 2, 1, True),       # every query alone in its segment
])
def test_gather_single_config_equals_reference(kernel, w, r, S, hq, hkv, causal):
    pattern = _single(w, r, "per_head")
    q, k, v, do = _inputs(S, hq, hkv, 16)
    out, lse = B.gather_sdpa_attention(q, k, v, pattern, causal=causal, kernel=kernel,
                                       return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref, ref_lse = reference_attention(q, k, v, pattern, causal=causal, return_lse=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    _assert_close("out", out, ref, TOL)
    _assert_close("lse", lse, ref_lse, TOL)
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        _assert_close(name, g, rg, TOL)


def test_gather_disjoint_heads_equal_reference():
    # per_head, one config: (segment, class) sub-sequences of different heads never overlap.
    pattern = DilatedPattern([24], [1])
    q, k, v, do = _inputs(75, 8, 2, 16)
    out = B.gather_sdpa_attention(q, k, v, pattern, kernel="math")
    _assert_close("out", out, reference_attention(q, k, v, pattern), TOL)


# --------------------------------------------------------------------------- overlaps double-count
@pytest.mark.parametrize("mode", ["per_head", "all"])
def test_gather_overlapping_configs_double_count(mode):
    pattern = DilatedPattern([16, 32, 64], [1, 2, 4], query_dilation=mode)
    q, k, v, do = _inputs(97, 8, 2, 16)
    out, lse = B.gather_sdpa_attention(q, k, v, pattern, kernel="math", return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), do)
    # It is not the pattern's function ...
    ref = reference_attention(q, k, v, pattern)
    assert _rel(out, ref) > 1e-2, "overlapping configs should be double-counted"
    # ... but exactly the one where each key weighs as many times as configs allow it.
    dc, dc_lse = B.double_counted_reference(q, k, v, pattern, return_lse=True)
    dc_grads = torch.autograd.grad(dc, (q, k, v), do)
    _assert_close("out", out, dc, TOL)
    _assert_close("lse", lse, dc_lse, TOL)
    for name, g, rg in zip(("dq", "dk", "dv"), grads, dc_grads):
        _assert_close(name, g, rg, TOL)
    assert B.gather_pairs(pattern, 97, 8) > pattern.count_pairs_total(97, 8)


def test_gather_fused_cpu_kernel_matches_math_with_gqa():
    # The fused CPU flash op with the merged-(out, lse) backward, against the float32 math path.
    pattern = DilatedPattern([16, 48], [1, 3])
    q, k, v, do = _inputs(101, 6, 2, 16)
    outs, grads = [], []
    for kernel in ("math", "flash"):
        out = B.gather_sdpa_attention(q, k, v, pattern, kernel=kernel)
        outs.append(out)
        grads.append(torch.autograd.grad(out, (q, k, v), do))
    _assert_close("out", outs[1], outs[0], TOL)
    for name, g, rg in zip(("dq", "dk", "dv"), grads[1], grads[0]):
        _assert_close(name, g, rg, TOL)


def test_gather_pairs_single_config_matches_count_pairs():
    pattern = DilatedPattern([32], [1])
    assert B.gather_pairs(pattern, 100, 4) == pattern.count_pairs_total(100, 4)


def test_gather_rejects_noncausal_padding():
    pattern = DilatedPattern([16], [1])
    q, k, v, _ = _inputs(20, 2, 2, 8)
    with pytest.raises(ValueError, match="non-causal gather_sdpa_attention needs S"):
        B.gather_sdpa_attention(q, k, v, pattern, causal=False)


def test_gather_rejects_wrong_plan():
    pattern = DilatedPattern([16], [1])
    plan = B.build_gather_plan(pattern, 32, 2, 2)
    q, k, v, _ = _inputs(20, 2, 2, 8)
    with pytest.raises(ValueError, match=r"plan is for \(S, Hq, Hkv\)"):
        B.gather_sdpa_attention(q, k, v, pattern, plan=plan)


def test_gather_plan_rejects_bad_heads():
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        B.build_gather_plan(DilatedPattern([16], [1]), 32, 6, 4)


# --------------------------------------------------------------------------- FlexAttention
@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
def test_flex_mask_matches_reference_forward_eager_cpu():
    # Eager flex (no compile, forward only on CPU) checks the block mask and the GQA wiring.
    pattern = DilatedPattern([16, 32, 64], [1, 2, 4])
    q, k, v, _ = (t.detach() for t in _inputs(97, 4, 2, 16, batch=1))
    fx = B.FlexDilated(pattern, 97, 4, "cpu", compile=False)
    assert fx.build_s >= 0
    _assert_close("out", fx(q, k, v), reference_attention(q, k, v, pattern), TOL)


# --------------------------------------------------------------------------- common helpers
def test_common_sizes_and_names():
    assert C.parse_size("16K") == 16384 and C.parse_size("1m") == 1 << 20
    assert C.parse_size("3000") == 3000
    assert C.fmt_size(131072) == "128K" and C.fmt_size(3000) == "3000"
    with pytest.raises(ValueError, match="expected a length like 4096, 4K or 1M, got '16Q'"):
        C.parse_size("16Q")
    assert C.sanitize("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    assert C.tflops(2e12, 1000.0) == pytest.approx(2.0) and C.tflops(1.0, None) is None


def test_common_csv_and_table(tmp_path):
    rows = [{"a": 1, "b": 2.5}, {"a": 3, "c": "x|y", "b": float("nan")}]
    path = C.write_csv(rows, tmp_path / "t.csv")
    with open(path) as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == ["a", "b", "c"] and got[1]["b"] == "" and got[1]["c"] == "x|y"
    table = C.markdown_table(rows, [("A", "a", "{:d}"), ("B", "b", "{:.1f}"), ("C", "c", None)])
    assert table.splitlines()[2] == "| 1 | 2.5 | – |" and "x/y" in table


# --------------------------------------------------------------------------- the script
def _load_script():
    spec = importlib.util.spec_from_file_location("bench_attention", BENCH_DIR / "bench_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_attention_cpu_smoke(tmp_path, capsys):
    bench = _load_script()
    rc = bench.main(["--device", "cpu", "--ours-backend", "torch", "--seq-lens", "256",
                     "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--quick",
                     "--patterns", "longnet_lm", "--out-dir", str(tmp_path)])
    assert rc == 0
    csv_path = tmp_path / "bench_attention_cpu.csv"
    assert csv_path.exists() and (tmp_path / "bench_attention_cpu.png").stat().st_size > 0
    with open(csv_path) as f:
        rows = {r["impl_key"]: r for r in csv.DictReader(f)}
    assert set(rows) == set(bench.LABELS)
    for key in ("sdpa-cudnn", "sdpa-flash", "flex"):
        assert rows[key]["status"] == "unavailable", rows[key]
    for key in ("ours-natural", "ours-hilbert", "gather-sdpa"):
        r = rows[key]
        assert r["status"] == "ok", r
        assert all(math.isfinite(float(r[c])) and float(r[c]) > 0
                   for c in ("fwd_ms", "bwd_ms", "fwd_bwd_ms", "tflops_fwd_bwd")), r
        # bf16 inputs against float32 references: bf16 rounding, not a different function.
        assert float(r["err_vs_own"]) < BF16_TOL, r
    assert rows["gather-sdpa"]["impl"] == "gather-sdpa (double-counts overlaps)"
    assert float(rows["ours-natural"]["err_vs_pattern"]) < BF16_TOL
    # At S=256 every longnet_lm config covers the whole sequence, so the gather baseline
    # counts most keys several times: far from the pattern's function.
    assert float(rows["gather-sdpa"]["err_vs_pattern"]) > 5e-2
    out = capsys.readouterr().out
    assert "gather-sdpa (double-counts overlaps)" in out and "speed-up" in out


def test_bench_attention_max_len_cpu_smoke(tmp_path):
    bench = _load_script()
    rc = bench.main(["--device", "cpu", "--ours-backend", "torch", "--max-len", "--quick",
                     "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
                     "--max-len-start", "32", "--max-len-cap", "128",
                     "--max-len-granularity", "16", "--out-dir", str(tmp_path)])
    assert rc == 0
    with open(tmp_path / "bench_attention_maxlen_cpu.csv") as f:
        rows = list(csv.DictReader(f))
    ours = [r for r in rows if r["impl"] == "ours natural"]
    assert len(ours) == 2
    for r in ours:
        assert r["max_ok_len"] == "128" and "max-len-cap" in r["stopped"], r
    assert all(r["max_ok_str"] == "unavailable" for r in rows if r["impl"] != "ours natural")


def test_plot_panels_keeps_title_and_legend_inside(tmp_path):
    # One panel and six long series names: the title and the legend used to run off the image.
    import matplotlib.image

    rows = [dict(panel="longnet_lm Hkv=8 D=128", impl=f"implementation number {i} (a long label)",
                 S=S, y=float(i + S / 1e4)) for i in range(6) for S in (16384, 32768, 65536)]
    path = C.plot_panels(rows, tmp_path / "p.png", panel_key="panel", series_key="impl",
                         x_key="S", y_key="y", xlabel="sequence length", ylabel="TFLOP/s",
                         title="Dilated attention fwd+bwd, useful (pattern-pair) TFLOP/s — "
                               "NVIDIA H100 80GB HBM3, Hq=32, bf16")
    img = matplotlib.image.imread(str(path))[..., :3]
    for edge in (img[:3], img[-3:], img[:, :3], img[:, -3:]):
        assert float(edge.min()) > 0.99  # nothing drawn up to the border


def test_bench_attention_script_is_the_package_benchmark():
    from hf_hilbert_attn.tools.benchmarks import attention

    script = _load_script()
    assert script.main is attention.main and script.LABELS is attention.LABELS


@pytest.mark.parametrize("pattern", [
    DilatedPattern([64, 128, 256, 512, 1024], [1, 2, 4, 6, 12]),
    DilatedPattern([48, 100, 300], [1, 3, 5], sink_tokens=3),
    DilatedPattern([32, 64, 128], [1, 2, 4], window="sliding", sink_tokens=1),
    DilatedPattern([40, 96], [1, 2], query_dilation="all")])
def test_kernel_timing_pairs_per_launch(pattern):
    """kernel_timing.py's per-launch table: each launch's pairs under the union rule (as the
    kernels split them: a config keeps the pairs no config before it in priority allows, the
    last launch also the sink-key pairs no config allows); together the pattern's count, and
    each equal to a brute-force count over the mask."""
    spec = importlib.util.spec_from_file_location("kernel_timing", BENCH_DIR / "kernel_timing.py")
    kt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kt)
    from hf_hilbert_attn.kernels._plan import config_order

    s, hq = 700, 6
    got = kt.launch_pairs(pattern, s, hq)
    prio, launch = config_order(pattern)
    assert [c for c, _ in got] == launch
    assert sum(n for _, n in got) == pattern.count_pairs_total(s, hq)
    h = torch.arange(hq).view(-1, 1, 1)
    qp, kp = torch.arange(s).view(1, -1, 1), torch.arange(s).view(1, 1, -1)
    free = (kp <= qp).expand(hq, s, s).clone()
    want = {}
    for w, r in prio:
        allowed = pattern.config_allowed(pattern.configs.index((w, r)), h, qp, kp)
        want[(w, r)] = int((free & allowed).sum())
        free &= ~allowed
    want[launch[-1]] += int((free & (kp < pattern.sink_tokens)).sum())
    assert dict(got) == want
    rows = kt.launch_table(pattern, s, hq, 64, [(n, 1.0) for n in ("_fwd_kernel", "_dq_kernel",
                                                                  "_dkdv_kernel")
                                                for _ in launch])
    assert rows is not None and rows.count("\n") == len(launch) + 1
    assert kt.launch_table(pattern, s, hq, 64, [("_fwd_kernel", 1.0)]) is None


def test_ring_trace_summary_counts_overlapping_kernels_once(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("ring_trace_summary",
                                                  BENCH_DIR / "ring_trace_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    k = lambda name, ts, dur: dict(ph="X", cat="kernel", name=name, ts=ts, dur=dur)  # noqa: E731
    trace = {"traceEvents": [k("_fwd_kernel", 0, 1000), k("_fwd_kernel", 500, 1000),
                             k("ncclDevKernel_SendRecv", 1500, 3000), k("_dq_kernel", 4000, 1000),
                             dict(ph="X", cat="cpu_op", name="aten::add", ts=0, dur=9000)]}
    s = mod.summarize(trace)
    assert (s["span_ms"], s["busy_ms"], s["idle_ms"], s["nccl_ms"]) == (5.0, 2.5, 2.5, 3.0)
    assert s["kernels"] == {"_fwd_kernel": (2.0, 2), "_dq_kernel": (1.0, 1)}
    (tmp_path / "trace_T1K_W2_contiguous_rank0.json").write_text(json.dumps(trace))
    assert mod.main([str(tmp_path)]) == 0
    assert "compute 2.5, idle 2.5" in capsys.readouterr().out
