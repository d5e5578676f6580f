"""The kernels compile for the GPUs people train on, through Triton's real GPU compiler, on a CPU.

The interpreter tests run the kernels' Python but never lower it; a construct the GPU compiler
rejects (a loop-carried value changing type, a layout it cannot convert) would pass them. Here
the specializations one forward + backward launches are compiled ahead of time
(``hf_hilbert_attn.tools.aot``), each case in a subprocess without ``TRITON_INTERPRET``
(conftest sets it for this process before the kernels are defined), one test and one process per
target group (importing the package is most of a run once Triton's cache holds the kernels), so
pytest-xdist runs the two side by side:

* sm_90 (H100 / H200): every case below; Hopper-only instructions (warp-group MMA) are used.
* sm_80 (A100), sm_86 (RTX 3090) and sm_89 (RTX 4090, L4): ``AMPERE_CASES``, three cases that
  together give every kernel function every value of every constexpr flag the five cases give
  (checked by the group's test); sm_86 / sm_89 are lowered from the sm_80 TritonGPU
  IR (the expensive part of a compile, the same for the three: ``aot.ampere_ir_shared``), with
  their own tiles where their 99 KiB of shared memory asks for it. No Hopper-only instruction
  may appear in their code.

Cases cover both query-dilation modes, bf16/fp16/fp32, head sizes 128/64/32, causal and not,
the three position kinds (natural, a permutation, a map with gaps), document ids, sink tokens
(the sink launch, the dq kernel's atomic dk/dv) and sliding windows. Every kernel must fit the
target's shared memory and 255 registers, and each tile load must stay vectorised (no 1-2 byte
global loads: that is what a lost alignment specialization costs, 8x the load instructions).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    # name: (query_dilation, dtype, head_dim, causal, positions, env[, pattern options])
    "bf16_d128_natural": ("per_head", "bf16", 128, True, "natural", {}),
    "fp16_d64_perm_all_noncausal": ("all", "fp16", 64, False, "perm", {}),
    "fp32_d32_gaps_docs": ("per_head", "fp32", 32, True, "gaps_docs", {}),
    "bf16_d64_sliding_sinks": ("per_head", "bf16", 64, True, "natural", {},
                               dict(window="sliding", sink_tokens=4)),
    "fp16_d128_segment_sinks_perm_noncausal": ("all", "fp16", 128, False, "perm", {},
                                               dict(sink_tokens=1)),
    "bf16_d256_sliding_sinks": ("per_head", "bf16", 256, True, "natural", {},
                                dict(window="sliding", sink_tokens=4)),  # Gemma's head size
}
# Natural / permutation / gapped positions with documents; causal and not; per_head and all;
# segments and sliding windows; sinks and none; fp32 and 16-bit; the largest 16-bit tiles
# (head size 128: the most shared memory).
AMPERE_CASES = ("fp32_d32_gaps_docs", "bf16_d64_sliding_sinks",
                "fp16_d128_segment_sinks_perm_noncausal")
GROUPS = {"sm_90": ((90,), tuple(CASES)), "sm_80_86_89": ((80, 86, 89), AMPERE_CASES)}
FLAGS = ("CAUSAL", "PER_HEAD", "MAPPED", "HAS_DOC", "IEEE", "UTAB", "EARLIER", "SLIDING",
         "SINK", "HAS_DLSE")


def _calls(name, arch=None):
    import torch

    from hf_hilbert_attn import DilatedPattern
    from hf_hilbert_attn.tools import aot

    mode, dtype, d, causal, positions, env, *options = CASES[name]
    os.environ.update(env)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    s = 4096
    # rate 4 does not divide 6: that config's programs need the per-pair union mask
    pattern = DilatedPattern([64, 128, 256, 512], [1, 2, 4, 6], query_dilation=mode,
                             **(options[0] if options else {}))
    q = torch.empty(1, 4, s, d, dtype=dtype)
    k = torch.empty(1, 2, s, d, dtype=dtype)
    kw = {}
    if positions == "perm":
        perm = torch.randperm(s)
        kw = dict(q_positions=perm, k_positions=perm)
    elif positions == "gaps_docs":
        pos = torch.cat([torch.arange(s // 2), torch.arange(s // 2 + 100, s + 100)])
        doc = torch.arange(s) // 1000
        kw = dict(q_positions=pos, k_positions=pos, q_doc_ids=doc, k_doc_ids=doc)
    # (the gaps-and-documents case: a backward given the lse's gradient, as ring attention's)
    return aot.launches(q, k, k, pattern, causal=causal, arch=arch,
                        dlse=name == "fp32_d32_gaps_docs", **kw)


def _compile_group(group):
    """Runs in the subprocess (one per group: importing the package is most of a warm run):
    compile the group's cases for its targets, print the rows (and, for the Ampere group, the
    constexpr values its cases and all cases give) as JSON."""
    from hf_hilbert_attn.tools import aot

    why = aot.available()
    if why:
        print(json.dumps({"skip": why}))
        return
    archs, names = GROUPS[group]
    rows = [dict(r, case=name) for name in names
            for r in aot.compile_all({a: _calls(name, a) for a in archs}, archs)]
    flags = {"subset": _flag_values(AMPERE_CASES), "all": _flag_values(CASES)} \
        if group != "sm_90" else None
    print(json.dumps({"rows": rows, "flags": flags}))


def _flag_values(names):
    """Runs in the subprocess: {kernel: {flag: sorted values}} over the cases' launches."""
    from hf_hilbert_attn.tools.aot import constexpr_values, specialize

    seen = {}
    for name in names:
        for fn, _grid, args, kwargs in _calls(name):
            _sig, constexprs, _attrs, _opt = specialize(fn, args, kwargs)
            flags = seen.setdefault(fn.__name__, {})
            for flag, value in constexpr_values(fn, constexprs).items():
                if flag in FLAGS:
                    flags.setdefault(flag, set()).add(int(value))
    return {k: {f: sorted(v) for f, v in fl.items()} for k, fl in seen.items()}


def _run(*argv, timeout=3600):
    # no interpreter, and none of the tuning switches a developer may have exported (each case
    # sets its own)
    env = {k: v for k, v in os.environ.items()
           if k != "TRITON_INTERPRET" and not k.startswith("HF_HILBERT_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, __file__, *argv], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{' '.join(argv)} failed:\n{res.stderr[-6000:]}"
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    return out


@pytest.mark.aot
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_kernels_compile(group):
    out = _run(group)
    archs, names = GROUPS[group]
    for name in names:
        for arch in archs:
            mine = [r for r in out["rows"] if r["arch"] == arch and r["case"] == name]
            kinds = {r["kernel"] for r in mine}
            assert kinds == {"_fwd_kernel", "_dq_kernel", "_dkdv_kernel"}, \
                (name, arch, kinds)
            # the first config in priority order compiles without the union code, the others
            # with it
            for kern in ("_fwd_kernel", "_dq_kernel", "_dkdv_kernel"):
                variants = {r["variant"].split("EARLIER=")[1].split()[0] for r in mine
                            if r["kernel"] == kern}
                assert variants == {"0", "1"}, (name, arch, kern, variants)
            # one compile per constexpr variant: the launches' integers (the launch table's
            # rows, 16-byte aligned) must not split a variant into specializations
            seen = [(r["kernel"], r["variant"], r["warps"], r["stages"]) for r in mine]
            assert len(seen) == len(set(seen)), (name, arch, sorted(seen))
            for r in mine:
                assert r["narrow_loads"] == 0, f"element-by-element loads in {r}"
                assert r["shared"] <= r["shared_limit"], \
                    f"more shared memory than sm_{arch} has: {r}"
                if r["registers"] is not None:
                    assert 0 < r["registers"] <= 255, r
                if arch < 90:
                    assert r["hopper_only"] == 0, f"Hopper-only instructions for sm_{arch}: {r}"
            if arch == 90 and CASES[name][1] != "fp32":  # the check sees Hopper code there
                assert all(r["hopper_only"] > 0 for r in mine), mine
            if arch in (86, 89):  # lowered from the sm_80 IR wherever the tiles are the same
                assert any(r["from_ir"] for r in mine), mine
    if out["flags"] is not None:
        # the cases compiled for sm_80 / sm_86 / sm_89 give every kernel every value of every
        # constexpr flag that all the cases (compiled for sm_90) give
        assert out["flags"]["subset"] == out["flags"]["all"], out["flags"]
    print("\n".join(json.dumps(r) for r in out["rows"]))  # resource numbers in the -rA log


def test_narrow_load_count_on_ptx():
    from hf_hilbert_attn.tools.aot import hopper_only, narrow_loads

    wide = ("ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [ %rd1 + 0 ];\n"
            "cp.async.cg.shared.global [ %r5 + 0 ], [ %rd2 + 0 ], 0x10, %r6;\n"
            "ld.global.b32 %r7, [ %rd3 + 0 ];\n")
    narrow = "ld.global.b16 %rs1, [ %rd4 + 0 ];\nld.global.nc.u16 %rs2, [ %rd5 + 0 ];\n"
    assert narrow_loads(wide) == 0
    assert narrow_loads(wide + narrow) == 2
    hopper = ("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd1, %rd2;\n"
              "mov.u32 %r1, %cluster_ctarank;\n")
    assert hopper_only(wide + narrow) == 0
    assert hopper_only(hopper) == 2


if __name__ == "__main__":
    _compile_group(sys.argv[1])
