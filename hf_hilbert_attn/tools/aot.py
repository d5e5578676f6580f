"""Compile the kernels' GPU code ahead of time, without a GPU: compile checks and resource reports.

The launchers run on CPU tensors with the kernels replaced by recorders (nothing is launched);
each distinct specialization they would launch is then compiled for a CUDA architecture with
Triton's NVIDIA backend, specialised exactly as Triton's JIT would (ints equal to 1 become
constants, pointers and ints divisible by 16 carry ``tt.divisibility``), and the ``ptxas -v`` log
of that compile (``ptxas`` ships in Linux x86-64 Triton wheels) gives registers, spills and the
stack frame.

Two uses: CI compiles every kernel variant through the real GPU compiler for the GPUs people
train on (``TARGETS``: A100 sm_80, RTX 3090 sm_86, RTX 4090 / L4 sm_89, H100 sm_90; the
interpreter runs the same Python but never lowers it, so a construct the compiler rejects would
pass the interpreter tests), and ``examples/benchmarks/kernel_resources.py`` prints what a tile
size or a kernel change does to the register budget, in seconds, on any machine.

Ampere and Ada (sm_80, sm_86, sm_89) share Triton's TritonGPU pipeline (the same MMA version
and software pipelining; the IR differs only in its target attribute), which is most of a
compile's time. :func:`compile_all` therefore lowers sm_86 and sm_89 from the sm_80 TritonGPU IR
(LLVM IR, PTX and ``ptxas`` per target: byte-identical cubins to a compile from source) once
:func:`ampere_ir_shared` has confirmed, on a probe kernel with a pipelined ``tl.dot``, that this
Triton builds that IR alike for the three.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import subprocess
import tempfile
import time
from typing import List, Optional

import torch
import triton
import triton.language as tl

KERNELS = ("_fwd_kernel", "_dq_kernel", "_dkdv_kernel")
# The GPUs the kernels must compile for: A100 (sm_80), RTX 3090 / A6000 (sm_86), RTX 4090 / L4 /
# L40 (sm_89), H100 / H200 (sm_90).
TARGETS = (80, 86, 89, 90)
# Shared memory one program may use (the opt-in maximum per block, bytes). Triton checks it only
# when a kernel is loaded on the GPU ("out of resource: shared memory"), so the compile check
# compares each kernel's ``shared`` with it.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
# PTX only Hopper executes: warp-group MMA, TMA bulk copies and tensor maps, register
# reallocation, stmatrix, clusters, mbarrier waits with try_wait, async-proxy fences. Code built
# for sm_8x must contain none (ptxas would reject it, or Triton took a Hopper-only path).
_HOPPER_ONLY = re.compile(r"\b(?:wgmma\.\w+|cp\.async\.bulk|cp\.reduce\.async\.bulk|tensormap"
                          r"|setmaxnreg|stmatrix|elect\.sync|barrier\.cluster|mbarrier\.try_wait"
                          r"|fence\.proxy\.async)|%cluster_\w+")
# constexpr arguments shown in a report's variant column (the others follow from the shape);
# a tuple of flags (the kernels' ``F``) shows each of its fields
SHOWN = ("BM", "BN", "D", "HAS_DLSE", "F")


@contextlib.contextmanager
def recorded_launches():
    """Within the block the launchers record instead of launching (the package's launch hook);
    yields the list of ``(jit_fn, grid, args, kwargs)``."""
    pkg = importlib.import_module("hf_hilbert_attn.kernels")
    calls = []
    saved = pkg.set_launch_hook(calls.extend)
    try:
        yield calls
    finally:
        pkg.set_launch_hook(saved)


def launches(q, k, v, pattern, *, causal: bool = True, backward: bool = True,
             arch: Optional[int] = None, dlse: bool = False, **positions):
    """Every kernel launch of one forward (and backward) on ``q, k, v`` (CPU tensors are fine),
    recorded, not run. ``arch``: with the tiles the launchers choose on that GPU (its shared
    memory, ``SHARED_LIMIT``), else the default ones. ``dlse``: the backward given the lse's
    gradient (ring attention, learned sinks). ``positions``: ``check_inputs`` keywords
    (positions, document ids)."""
    from hf_hilbert_attn.inputs import check_inputs
    from hf_hilbert_attn.kernels import dilated_bwd, dilated_fwd, plan_positions

    pkg = importlib.import_module("hf_hilbert_attn.kernels")
    a = check_inputs(q, k, v, pattern, **positions)
    plan, why = plan_positions(a, pattern)
    if plan is None:
        raise ValueError(f"the kernels do not take these positions: {why}")
    smem = SHARED_LIMIT[arch] if arch is not None else pkg.kernel_config().smem
    with pkg.configured(smem=smem), recorded_launches() as calls:
        out, lse = dilated_fwd(q, k, v, pattern, a.scale, causal, plan)
        if backward:
            dilated_bwd(out, q, k, v, out, lse, lse if dlse else None, pattern, a.scale, causal,
                        plan)
    return calls


_BINDERS: dict = {}


def specialize(jit_fn, args, kwargs, arch: int = 90):
    """``(signature, constexprs, attrs, options)`` of one launch, as Triton's JIT builds them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    hit = _BINDERS.get((jit_fn, arch))
    if hit is None:  # made once per kernel and target, as the JIT does (an exec each)
        backend = make_backend(GPUTarget("cuda", arch, 32))
        hit = _BINDERS[(jit_fn, arch)] = (backend, create_function_from_signature(
            jit_fn.signature, jit_fn.params, backend))
    backend, binder = hit
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
        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "ptxas")
    return path if path and os.path.exists(path) else None


def constexpr_values(jit_fn, constexprs) -> dict:
    """Name -> value of the constexpr arguments of a launch; the fields of a named tuple of
    flags (the kernels' ``F``) by their own names."""
    out = {}
    for i, p in enumerate(jit_fn.params):
        if p.is_constexpr and (i,) in constexprs:
            value = constexprs[(i,)]
            if hasattr(value, "_asdict"):
                out.update({k: int(x) for k, x in value._asdict().items()})
            else:
                out[p.name] = value
    return out


def variant_of(jit_fn, constexprs) -> str:
    shown = {p.name for p in jit_fn.params if p.name in SHOWN}
    values = constexpr_values(jit_fn, constexprs)
    flags = {k for i, p in enumerate(jit_fn.params) if p.name in shown and (i,) in constexprs
             and hasattr(constexprs[(i,)], "_asdict") for k in constexprs[(i,)]._fields}
    return " ".join(f"{k}={int(v)}" for k, v in values.items() if k in shown or k in flags)


@contextlib.contextmanager
def _ptxas_log():
    """Within the block Triton prints the ``ptxas -v`` log of each cubin it builds; yields the
    buffer it goes to (the log of the very ptxas run the JIT makes, with its flags: no second
    ``ptxas`` run)."""
    nv = getattr(getattr(triton, "knobs", None), "nvidia", None)
    buf = io.StringIO()
    if nv is None or not hasattr(nv, "dump_ptxas_log"):  # older Triton: no such knob
        yield None
        return
    old = nv.dump_ptxas_log
    nv.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(buf):
            yield buf
    finally:
        nv.dump_ptxas_log = old


def _ptxas_info(kernel, arch: int, options: dict) -> str:
    """The ``ptxas -v`` log of a kernel Triton took from its cache: its cubin stage again (same
    command, same flags), or plain ``ptxas -v`` where this Triton has no log knob."""
    with _ptxas_log() as buf:
        if buf is not None:
            from triton.backends.compiler import GPUTarget
            from triton.compiler import make_backend

            backend = make_backend(GPUTarget("cuda", arch, 32))
            backend.make_cubin(kernel.asm["ptx"], {}, backend.parse_options(dict(options)), arch)
    if buf is not None and "Used" in buf.getvalue():
        return buf.getvalue()
    ptxas = ptxas_path(arch)
    if ptxas is None:
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        res = subprocess.run([ptxas, f"-arch=sm_{arch}{'a' if arch >= 90 else ''}", "-v", ptx,
                              "-o", os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"ptxas failed for sm_{arch}:\n{(res.stdout + res.stderr)[-2000:]}")
    return res.stdout + res.stderr


def _cached_log(kernel, info: str) -> str:
    """The ``ptxas -v`` log of ``kernel``: ``info`` when it holds one (then kept in Triton's
    cache beside the kernel), else the kept one ("" if none): a kernel Triton takes from its
    cache needs no ``ptxas`` run for its report."""
    try:
        from triton.runtime.cache import get_cache_manager

        cache = get_cache_manager(kernel.hash)
    except Exception:  # no usable cache API: nothing kept
        return info if "Used" in info else ""
    if "Used" in info:
        cache.put(info, "ptxas-v.log", binary=False)
        return info
    path = cache.get_file("ptxas-v.log")
    if path is None:
        return ""
    with open(path) as f:
        return f.read()


def _compile(jit_fn, args, kwargs, arch: int, resources: bool, ttgir: Optional[str] = None):
    """``(row, kernel)``: one launch compiled for ``sm_<arch>``, from the Python source, or with
    ``ttgir`` (the TritonGPU IR text of another Ampere/Ada target) from that IR."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, constexprs, attrs, options = specialize(jit_fn, args, kwargs, arch)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack, _ptxas_log() as buf:
        if ttgir is None:  # (a Gluon kernel: its own source kind)
            src = (_gluon_source() if getattr(jit_fn, "is_gluon", lambda: False)() else
                   ASTSource)(jit_fn, sig, constexprs, attrs)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            src = os.path.join(tmp, f"{jit_fn.__name__}.ttgir")
            with open(src, "w") as f:
                f.write(re.sub(r'ttg\.target = "cuda:\d+"', f'ttg.target = "cuda:{arch}"', ttgir))
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    ptx = kernel.asm["ptx"]
    row = dict(kernel=jit_fn.__name__, arch=arch, variant=variant_of(jit_fn, constexprs),
               warps=options["num_warps"], stages=options["num_stages"], registers=None,
               spill_stores=None, spill_loads=None, stack=None, shared=kernel.metadata.shared,
               shared_limit=SHARED_LIMIT.get(arch), narrow_loads=narrow_loads(ptx),
               hopper_only=hopper_only(ptx), from_ir=ttgir is not None,
               compile_s=round(time.perf_counter() - t0, 1))
    if not resources:
        return row, kernel
    info = buf.getvalue() if buf is not None else ""
    info = _cached_log(kernel, info) or _cached_log(kernel, _ptxas_info(kernel, arch, options))

    def grab(pattern):
        m = re.search(pattern, info)
        return int(m.group(1)) if m else 0

    if info:
        row.update(registers=grab(r"Used (\d+) registers"),
                   spill_stores=grab(r"(\d+) bytes spill stores"),
                   spill_loads=grab(r"(\d+) bytes spill loads"),
                   stack=grab(r"(\d+) bytes stack frame"))
    return row, kernel


def _gluon_source():
    from triton.experimental.gluon._runtime import GluonASTSource

    return GluonASTSource


def compile_launch(jit_fn, args, kwargs, arch: int = 90, resources: bool = True) -> dict:
    """Compile one recorded launch for ``sm_<arch>``; with ``resources``, read the ``ptxas -v``
    log of its cubin. Returns a dict: kernel, arch, variant, warps, stages, registers,
    spill_stores, spill_loads, stack (bytes per thread), shared (bytes per program),
    shared_limit (the target's maximum), narrow_loads (global loads of fewer than 4 bytes: an
    element-by-element tile load, which a lost alignment specialization would cause),
    hopper_only (Hopper-only PTX instructions), from_ir, compile_s."""
    return _compile(jit_fn, args, kwargs, arch, resources)[0]


def narrow_loads(ptx: str) -> int:
    """Global loads of 1 or 2 bytes in ``ptx`` (asynchronous copies are 4, 8 or 16 bytes: a tile
    of 2-byte elements whose alignment is unknown is loaded with these instead)."""
    return len(re.findall(r"ld\.global(?:\.\w+)*\.[bu](?:8|16)\b", ptx))


def hopper_only(ptx: str) -> int:
    """Instructions in ``ptx`` that only sm_90 has (warp-group MMA, TMA, clusters, ...)."""
    return len(_HOPPER_ONLY.findall(ptx))


def spec_key(jit_fn, args, kwargs, arch: int = 90) -> tuple:
    """What makes two launches one compiled kernel (equal keys: one compile serves both)."""
    sig, constexprs, attrs, options = specialize(jit_fn, args, kwargs, arch)
    return (jit_fn.__name__, repr(sig), repr(sorted(constexprs.items())),
            repr(sorted(attrs.items())), repr(sorted((k, repr(v)) for k, v in options.items()
                                                     if k != "arch")))


def compile_all(calls, arch=90, resources: bool = True, progress=None) -> List[dict]:
    """Compile each distinct specialization among recorded ``calls`` once per target; rows carry
    ``arch`` and how many launches share the kernel (``launches``). ``arch``: one compute
    capability or several (e.g. ``TARGETS``); ``calls``: one list for every target, or a dict
    ``{arch: calls}`` (each recorded with ``launches(..., arch=arch)``). Among sm_80, sm_86 and
    sm_89, a kernel already compiled for one of them is lowered for the next from its
    TritonGPU IR when :func:`ampere_ir_shared` (else compiled from source). ``progress``:
    optional callable(row) after each compile."""
    archs = sorted({arch} if isinstance(arch, int) else set(arch))
    per_arch = calls if isinstance(calls, dict) else {a: calls for a in archs}
    ampere = [a for a in archs if a in (80, 86, 89)]
    reuse = len(ampere) > 1 and ampere_ir_shared()
    irs = {}  # spec_key -> TritonGPU IR of an Ampere/Ada compile
    rows = []
    for a in archs:
        specs = {}
        for jit_fn, _grid, args, kwargs in per_arch[a]:
            key = spec_key(jit_fn, args, kwargs)
            if key in specs:
                specs[key][1] += 1
            else:
                specs[key] = [(jit_fn, args, kwargs), 1]
        for key, ((jit_fn, args, kwargs), count) in specs.items():
            via = irs.get(key) if reuse and a in ampere else None
            row, kernel = _compile(jit_fn, args, kwargs, a, resources, via)
            if a in ampere:
                irs.setdefault(key, kernel.asm["ttgir"])
            row["launches"] = count
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def _probe_dot(A, B, C, n, BLOCK: tl.constexpr):
    # a pipelined loop of bf16 dots: the MMA and software-pipelining passes of the TritonGPU
    # pipeline run on it, as on the attention kernels
    r = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for i in range(0, n, BLOCK):
        a = tl.load(A + r[:, None] * n + (i + r)[None, :])
        b = tl.load(B + (i + r)[:, None] * BLOCK + r[None, :])
        acc += tl.dot(a, b)
    tl.store(C + r[:, None] * BLOCK + r[None, :], acc)


_AMPERE_IR_SHARED: Optional[bool] = None


def ampere_ir_shared() -> bool:
    """Whether this Triton builds the same TritonGPU IR for sm_80, sm_86 and sm_89 (up to the
    target attribute) on a probe kernel with a pipelined ``tl.dot``: then lowering one target's
    IR for the others is the compile from source (checked once per process)."""
    global _AMPERE_IR_SHARED
    if _AMPERE_IR_SHARED is None:
        fn = triton.jit(_probe_dot)
        x = torch.empty(64 * 64, dtype=torch.bfloat16)
        args, kwargs = (x, x, torch.empty(64 * 64), 256), dict(BLOCK=64, num_stages=3)
        irs = {re.sub(r'ttg\.target = "cuda:\d+"', "", _compile(fn, args, kwargs, a, False)[1]
                      .asm["ttgir"]) for a in (80, 86, 89)}
        _AMPERE_IR_SHARED = len(irs) == 1
    return _AMPERE_IR_SHARED


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
