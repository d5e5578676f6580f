"""The kernels compile for a Hopper GPU (sm_90) through Triton's real GPU compiler, on a CPU.

The interpreter tests run the kernels' Python but never lower it; a construct the GPU compiler
rejects (a loop-carried value changing type, a layout it cannot convert) would pass them. Here
every specialization one forward + backward would launch is compiled ahead of time for sm_90
(``hf_hilbert_attn.kernels.aot``), in a subprocess without ``TRITON_INTERPRET`` (conftest sets it
for this process before the kernels are defined). Cases cover both query-dilation modes,
bf16/fp16/fp32, head sizes 128/64/32, causal and not, the three position kinds (natural, a
permutation, a map with gaps), document ids, sink
tokens (the sink launch, the dq kernel's atomic dk/dv) and sliding windows.
Each tile load must stay vectorised (no 1-2 byte global loads: that is what a lost alignment
specialization costs, 8x the load instructions).
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
}


def _compile_case(name):
    """Runs in the subprocess: compile the case, print its rows as JSON."""
    import torch

    from hf_hilbert_attn import DilatedPattern
    from hf_hilbert_attn.kernels import aot

    mode, dtype, d, causal, positions, env, *options = CASES[name]
    os.environ.update(env)
    why = aot.available()
    if why:
        print(json.dumps({"skip": why}))
        return
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
    rows = aot.compile_all(aot.launches(q, k, k, pattern, causal=causal, **kw), 90)
    print(json.dumps({"rows": rows}))


@pytest.fixture(scope="module")
def compiled():
    """Every case compiled in its own subprocess, all at once (the machine's cores in use)."""
    # no interpreter, and none of the tuning switches a developer may have exported (each case
    # sets its own)
    env = {k: v for k, v in os.environ.items()
           if k != "TRITON_INTERPRET" and not k.startswith("HF_HILBERT_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    procs = {name: subprocess.Popen([sys.executable, __file__, name], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in CASES}
    results = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=900)
            results[name] = (proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return results


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernels_compile_for_sm90(compiled, name):
    rc, out, err = compiled[name]
    assert rc == 0, f"compiling {name} for sm_90 failed:\n{err[-6000:]}"
    res = json.loads(out.strip().splitlines()[-1])
    if "skip" in res:
        pytest.skip(res["skip"])
    rows = res["rows"]
    kinds = {r["kernel"] for r in rows}
    assert kinds == {"_fwd_kernel", "_dq_kernel", "_dkdv_kernel", "_delta_kernel"}, kinds
    # the first config in priority order compiles without the union code, the others with it
    for kern in ("_fwd_kernel", "_dq_kernel", "_dkdv_kernel"):
        variants = {r["variant"].split("EARLIER=")[1].split()[0] for r in rows
                    if r["kernel"] == kern}
        assert variants == {"0", "1"}, (kern, variants)
    for r in rows:
        assert r["narrow_loads"] == 0, f"element-by-element loads in {r}"
        if r["registers"] is not None:
            assert 0 < r["registers"] <= 255, r
    print("\n".join(json.dumps(r) for r in rows))  # resource numbers in the -rA log


def test_narrow_load_count_on_ptx():
    from hf_hilbert_attn.kernels.aot import narrow_loads

    wide = ("ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [ %rd1 + 0 ];\n"
            "cp.async.cg.shared.global [ %r5 + 0 ], [ %rd2 + 0 ], 0x10, %r6;\n"
            "ld.global.b32 %r7, [ %rd3 + 0 ];\n")
    narrow = "ld.global.b16 %rs1, [ %rd4 + 0 ];\nld.global.nc.u16 %rs2, [ %rd5 + 0 ];\n"
    assert narrow_loads(wide) == 0
    assert narrow_loads(wide + narrow) == 2


if __name__ == "__main__":
    _compile_case(sys.argv[1])
