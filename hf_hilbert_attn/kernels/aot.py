"""Compile the kernels' GPU code ahead of time, without a GPU: compile checks and resource reports.

The launchers run on CPU tensors with the kernels replaced by recorders (nothing is launched);
each distinct specialization they would launch is then compiled for a CUDA architecture with
Triton's NVIDIA backend, specialised exactly as Triton's JIT would (ints equal to 1 become
constants, pointers and ints divisible by 16 carry ``tt.divisibility``), and ``ptxas -v`` (shipped
in Linux x86-64 Triton wheels) reports registers, spills and the stack frame.

Two uses: CI compiles every kernel variant through the real GPU compiler (the interpreter runs
the same Python but never lowers it, so a construct the compiler rejects would pass the
interpreter tests), and ``examples/benchmarks/kernel_resources.py`` prints what a tile size or a
kernel change does to the register budget, in seconds, on any machine.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import subprocess
import tempfile
import time
from typing import List, Optional

import torch

KERNELS = ("_fwd_kernel", "_dq_kernel", "_dkdv_kernel", "_delta_kernel")
# constexpr arguments shown in a report's variant column (the others follow from the shape)
SHOWN = ("BM", "BN", "D", "CAUSAL", "PER_HEAD", "MAPPED", "HAS_DOC", "IEEE", "UMAX", "UTAB",
         "EARLIER", "SLIDING", "SINKT", "SINKADD")


class _Recorder:
    def __init__(self, jit_fn, calls):
        self.fn, self.calls = jit_fn, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((self.fn, grid, args, kwargs))
        return launch


@contextlib.contextmanager
def recorded_launches():
    """Within the block the launchers record instead of launching; yields the list of
    ``(jit_fn, grid, args, kwargs)``."""
    pkg = importlib.import_module(__package__)
    calls, saved = [], {n: getattr(pkg, n) for n in KERNELS}
    try:
        for n, fn in saved.items():
            setattr(pkg, n, _Recorder(fn, calls))
        yield calls
    finally:
        for n, fn in saved.items():
            setattr(pkg, n, fn)


def launches(q, k, v, pattern, *, causal: bool = True, backward: bool = True, **positions):
    """Every kernel launch of one forward (and backward) on ``q, k, v`` (CPU tensors are fine),
    recorded, not run. ``positions``: ``check_inputs`` keywords (positions, document ids)."""
    from ..inputs import check_inputs
    from . import dilated_bwd, dilated_fwd, plan_positions

    a = check_inputs(q, k, v, pattern, **positions)
    plan, why = plan_positions(a, pattern)
    if plan is None:
        raise ValueError(f"the kernels do not take these positions: {why}")
    with recorded_launches() as calls:
        out, lse = dilated_fwd(q, k, v, pattern, a.scale, causal, plan)
        if backward:
            dilated_bwd(out, q, k, v, out, lse, None, pattern, a.scale, causal, plan)
    return calls


def specialize(jit_fn, args, kwargs, arch: int = 90):
    """``(signature, constexprs, attrs, options)`` of one launch, as Triton's JIT builds them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(jit_fn.signature, jit_fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, sig, constexprs, attrs = jit_fn._pack_args(backend, kwargs, bound, specialization,
                                                         options)
    return sig, constexprs, attrs, options.__dict__


def ptxas_path(arch: int = 90) -> Optional[str]:
    """The ``ptxas`` Triton itself uses for ``sm_<arch>``, or None (no NVIDIA binaries)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(arch).path
    except Exception:  # older Triton: the one binary shipped with it
        import triton

        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "ptxas")
    return path if path and os.path.exists(path) else None


def variant_of(jit_fn, constexprs) -> str:
    return " ".join(f"{p.name}={int(constexprs[(i,)])}" for i, p in enumerate(jit_fn.params)
                    if p.is_constexpr and p.name in SHOWN)


def compile_launch(jit_fn, args, kwargs, arch: int = 90, resources: bool = True) -> dict:
    """Compile one recorded launch for ``sm_<arch>``; with ``resources``, run ``ptxas -v`` on
    its PTX. Returns a dict: kernel, variant, warps, stages, registers, spill_stores,
    spill_loads, stack (bytes per thread), shared (bytes per program), narrow_loads (global
    loads or async copies of fewer than 4 bytes: an element-by-element tile load, which a lost
    alignment specialization would cause), compile_s."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, constexprs, attrs, options = specialize(jit_fn, args, kwargs, arch)
    t0 = time.perf_counter()
    kernel = triton.compile(ASTSource(jit_fn, sig, constexprs, attrs),
                            target=GPUTarget("cuda", arch, 32), options=options)
    row = dict(kernel=jit_fn.__name__, variant=variant_of(jit_fn, constexprs),
               warps=options["num_warps"], stages=options["num_stages"], registers=None,
               spill_stores=None, spill_loads=None, stack=None, shared=kernel.metadata.shared,
               narrow_loads=narrow_loads(kernel.asm["ptx"]),
               compile_s=round(time.perf_counter() - t0, 1))
    ptxas = ptxas_path(arch) if resources else None
    if ptxas is None:
        return row
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        res = subprocess.run([ptxas, f"-arch=sm_{arch}{'a' if arch >= 90 else ''}", "-v", ptx,
                              "-o", os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    info = res.stdout + res.stderr
    if res.returncode != 0:
        raise RuntimeError(f"ptxas failed for {jit_fn.__name__}:\n{info[-2000:]}")

    def grab(pattern):
        m = re.search(pattern, info)
        return int(m.group(1)) if m else 0

    row.update(registers=grab(r"Used (\d+) registers"),
               spill_stores=grab(r"(\d+) bytes spill stores"),
               spill_loads=grab(r"(\d+) bytes spill loads"),
               stack=grab(r"(\d+) bytes stack frame"))
    return row


def narrow_loads(ptx: str) -> int:
    """Global loads of 1 or 2 bytes in ``ptx`` (asynchronous copies are 4, 8 or 16 bytes: a tile
    of 2-byte elements whose alignment is unknown is loaded with these instead)."""
    return len(re.findall(r"ld\.global(?:\.\w+)*\.[bu](?:8|16)\b", ptx))


def compile_all(calls, arch: int = 90, resources: bool = True, progress=None) -> List[dict]:
    """Compile each distinct specialization among recorded ``calls`` once; rows carry how many
    launches share it (``launches``). ``progress``: optional callable(row) after each compile."""
    rows, seen = [], {}
    for jit_fn, _grid, args, kwargs in calls:
        sig, constexprs, attrs, options = specialize(jit_fn, args, kwargs, arch)
        key = (jit_fn.__name__, repr(sig), repr(sorted(constexprs.items())),
               repr(sorted(attrs.items())), repr(sorted((k, repr(v)) for k, v in options.items())))
        if key in seen:
            seen[key]["launches"] += 1
            continue
        row = compile_launch(jit_fn, args, kwargs, arch, resources)
        row["launches"] = 1
        seen[key] = row
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows


def _probe(X, n, BLOCK: "tl.constexpr"):  # noqa: F821 - annotation read by triton.jit
    pass


def available() -> Optional[str]:
    """None when ahead-of-time compilation works here, else why not (no NVIDIA backend, the
    interpreter, or a Triton whose JIT internals this module does not know)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 is set (the interpreter does not compile)"
    try:
        import triton
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource, make_backend  # noqa: F401
        from triton.runtime.jit import create_function_from_signature  # noqa: F401
    except ImportError as e:
        return f"this Triton has no ahead-of-time compile API ({e})"
    if "nvidia" not in backends:
        return "this Triton install has no NVIDIA backend"
    try:  # the JIT's specialization and the compiler, on a trivial kernel
        compile_launch(triton.jit(_probe), (torch.empty(4), 16), {"BLOCK": 4}, resources=False)
    except Exception as e:  # internals moved in this Triton version
        return f"Triton {triton.__version__}: its JIT internals differ ({type(e).__name__}: {e})"
    return None
