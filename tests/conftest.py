import os
import random
import time

import pytest

# Whether this process has a CUDA GPU: set in pytest_configure by every process that collects
# tests. The xdist controller collects none and never imports torch (seconds before the
# workers start).
HAS_CUDA = False

# HF_HILBERT_TEST_TIMELINE=DIR: each process (xdist controller and workers) appends when it
# started, collected, and began and ended each test to DIR/timeline_<worker>.txt (epoch
# seconds): where the wall time of the GPU suite goes besides the tests themselves.
_TIMELINE = os.environ.get("HF_HILBERT_TEST_TIMELINE")


def _mark(event: str) -> None:
    if _TIMELINE:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        os.makedirs(_TIMELINE, exist_ok=True)
        with open(os.path.join(_TIMELINE, f"timeline_{worker}.txt"), "a") as f:
            f.write(f"{time.time():.3f} {event}\n")


_mark("conftest imported")


def _worker_threads():
    """Intra-op threads of an xdist worker: its share of the cores, None outside xdist. Torch's
    pool (and that of every process a test starts: they inherit the environment) defaults to
    every core, so CI's 2 workers on 2 cores ran 4 busy threads, and tiny ops waited in OpenMP
    barriers for a descheduled one (tests/test_tool_smoke.py's ``_one_thread``: 1.4 s instead of
    15 ms; a 4-step fine-tune of the tiny model in a worker: 4.7 s instead of 0.3 s). An
    OMP_NUM_THREADS of the caller's is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if not workers:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // workers)


_THREADS = _worker_threads()
if _THREADS is not None:  # before torch is imported (pytest_configure)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))


def pytest_sessionstart(session):
    _mark("session start")


def pytest_collection_finish(session):
    _mark(f"collected {len(session.items)}")


def pytest_runtest_logstart(nodeid, location):
    _mark(f"start {nodeid}")


def pytest_runtest_logfinish(nodeid, location):
    _mark(f"end {nodeid}")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    _mark("session finish")  # before every other plugin's (xdist's controller: its workers
    yield                    # are then shut down)
    _mark("session finished")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    _mark("unconfigure")
    # The GPU suite's xdist workers stop here, once their results are sent (pytest-xdist's
    # "workerfinished", from pytest_sessionfinish): each then exits as it finishes instead of
    # all of them tearing down torch and CUDA together after the last test (6-8 s of the
    # suite's wall on the device; docs/decisions.md "GPU tests: planned units").
    if (hasattr(config, "workerinput") and config.getoption("markexpr") == "gpu"
            and not config.pluginmanager.hasplugin("_cov")):
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if _TIMELINE:
    import atexit

    atexit.register(_mark, "exit")  # at import: after the exit handlers registered later (torch)


def pytest_addoption(parser):
    parser.addoption("--aot", action="store_true",
                     help="also run the ahead-of-time compile check for sm_80/86/89/90 "
                     "(tests/test_kernels_compile.py; ~25 CPU-minutes from a cold Triton cache, "
                     "about one with a warm one): CI's second stage")


def _collects(config) -> bool:
    """False in the xdist controller (its workers collect and run the tests)."""
    return hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    global HAS_CUDA
    if _collects(config):
        import torch

        if _THREADS is not None and os.environ["OMP_NUM_THREADS"].isdigit():
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # if imported before
        HAS_CUDA = torch.cuda.is_available()
        # CPU machines run the real Triton kernels through the interpreter. This must be set
        # before any @triton.jit function is defined, i.e. before hf_hilbert_attn.kernels is
        # imported (collection, after this hook).
        if not HAS_CUDA:
            os.environ.setdefault("TRITON_INTERPRET", "1")
    # Under -n (pytest-xdist) without an explicit --dist: "loadgroup" instead of "load". Each
    # test is its own unit of work, handed out as workers free up, and tests marked with one
    # xdist_group run on one worker (below: those sharing a module-scoped fixture). The workers
    # learn it from the controller (pytest_configure_node) to tag their tests' ids.
    explicit = any(a == "-d" or a.startswith("--dist") for a in config.invocation_params.args)
    if getattr(config.option, "dist", "no") == "load" and not explicit:
        config.option.dist = "loadgroup"
    if getattr(config, "workerinput", {}).get("loadgroup"):
        config.option.loadgroup = True


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["loadgroup"] = node.config.getoption("dist") == "loadgroup"


# Seconds a work unit (an ``xdist_group``, or a test) took with a cold Triton cache on the device
# machine (H100, 16 CPU cores, `-m gpu -n 16 --durations=40`, sums per unit, session 49, call 1:
# docs/bench/speed/s49/call1_gpu_suite_cold_H100.txt; units under 12 s there keep earlier sessions'
# numbers). Compiling kernels dominates (the CPU is busy throughout); a unit whose kernels another
# worker compiled before reads them from Triton's disk cache. Only the plan below uses them: a stale
# number costs time, never a result. The suite's wall time is its longest unit or its work over the
# workers, whichever is larger, plus ~20 s of start: in session 47, 155 s, bound by `gpu_natural`
# (127 s) and `gpu_layer_types` (117 s). Session 48 split them (the three tests of `gpu_natural`
# that compile mostly their own kernels, and the static caches' generate tests, whose time is
# Inductor's, are units of their own; their numbers below are the session-47 tests' own plus a few
# seconds for the kernels they no longer share): planned, the longest worker holds 112 s of the
# 1,712 s of work (16 workers); session 49's cold suite with that plan: 136 s, its longest unit
# `gpu_layer_types_static` (89 s; 63 s in session 50's, one Inductor compile instead of three:
# D100).
_UNIT_SECONDS = {
    "gpu_sliding_sinks": 72, "test_head_dim_256": 60, "test_soft_capped_scores": 64,
    "test_ring_local_pieces": 62, "gpu_layer_types_static": 63, "gpu_transformers": 64,
    "gpu_segment_sinks": 42, "gpu_natural": 50, "test_sinks_and_sliding[sliding-4-float16]": 48,
    "test_sliding_modes_with_sinks[per_head-False-128]": 41, "test_modes[all-False]": 40,
    "test_modes[all-True]": 45, "test_position_map": 44,
    "test_sliding_modes_with_sinks[all-False-64]": 40, "gpu_float16": 34,
    "test_gpu_head_sizes_the_kernels_lack_run_on_them[deepseek_v3]": 38, "gpu_layer_types": 38,
    "gpu_transformers_static": 47, "test_longnet_like[float16-4096]": 34,
    "test_modes[per_head-False]": 31, "test_first_call_compiles_its_kernels_together": 28,
    "test_longnet_like[bfloat16-4096]": 14, "test_hopper_dkdv_kernel[per_head_noncausal]": 34,
    "test_an_lse_gradient_after_a_call_without_one_on_the_same_layout": 31,
    "test_gpu_head_sizes_the_kernels_lack_run_on_them[phi3]": 28,
    "test_hopper_dkdv_kernel[d64_sinks]": 26, "test_offset_runs_and_head_chunked_backward": 28,
    "test_torch_compile_fullgraph_with_backward": 34, "test_hopper_dkdv_kernel[batch_float16]": 20,
    "test_head_dim_64_and_mqa": 18, "test_relaunch_without_binding_follows_alignment": 25,
    "test_sinks_and_sliding[sliding-0-bfloat16]": 13, "test_dense_heads_bf16[positions]": 17,
    "test_hopper_dkdv_kernel[earlier_all_noncausal]": 17, "test_hopper_dkdv_kernel[earlier]": 16,
    "test_hopper_dkdv_kernel[unaligned_rows]": 15,
    "test_sliding_sinks_decode_positions_and_documents[position_map]": 12,
    "test_packed_documents": 15, "test_decode_matches_reference": 13,
    "test_gpu_pattern_cache_decode_matches_dynamic_cache[concatenated]": 9,
    "test_dense_heads_bf16[documents]": 9, "test_dense_heads_bf16[natural]": 6,
    "test_reduce_overhead_compile_replays_cuda_graphs": 5,
    "test_sliding_modes_with_sinks[all-True-64]": 4,
    "test_gpu_pattern_cache_decode_matches_dynamic_cache[kept-room]": 1,
    "test_gpu_a_long_cache_splits_its_keys_by_head[kernel-segment]": 1,
    "test_gpu_a_long_cache_splits_its_keys_by_head[kernel-sliding]": 1, "test_16k_tokens": 1,
    # under 14 s in session 47 (not among its 40 longest)
    **{f"test_hopper_dkdv_kernel[{case}]": 12 for case in (
        "sliding_sinks", "all_dense_head", "d64_unaligned_rows", "d64_earlier", "mixed")},
    "test_hopper_dkdv_kernel[mixed_loop]": 16,
    "test_gpu_a_long_cache_splits_its_keys_by_head[torch-sliding]": 12,
    "test_gpu_a_long_cache_splits_its_keys_by_head[torch-segment]": 12,
}
_NEW_GPU_UNIT = 20  # a GPU unit not timed yet (a mid-sized one above)


def _unit_seconds(scope: str, nodeids, gpu_run: bool) -> float:
    """The planned seconds of a unit: recorded, else (GPU suite) a new GPU unit's estimate, else
    (other runs) its test count / 100 (more tests first, as xdist's own reordering)."""
    key = scope.split("::")[-1]
    if key in _UNIT_SECONDS:
        return _UNIT_SECONDS[key]
    return _NEW_GPU_UNIT if gpu_run else len(nodeids) / 100


def _gpu_run(config) -> bool:
    """The GPU suite (``-m gpu``): its units are planned up front. (Once, only units of one file
    counted as GPU units; a GPU test in another file turned the plan off unnoticed.)"""
    return config.getoption("markexpr") == "gpu"


def _lpt(units, n):
    """Longest-processing-time plan: units (scope, seconds) onto ``n`` workers, each unit to the
    least loaded worker, longest first. Returns one list of scopes per worker."""
    plans, loads = [[] for _ in range(n)], [0.0] * n
    for scope, sec in sorted(units, key=lambda u: -u[1]):
        i = loads.index(min(loads))
        plans[i].append(scope)
        loads[i] += sec
    return plans


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``, planned from the recorded unit times where there are some.

    The GPU tests (every unit timed on the device: ~20 units for 8 workers, 8-70 s each) are
    planned up front: longest-processing-time first onto the least loaded worker (``_lpt``),
    each worker then runs its own list. xdist hands units out as workers ask, one unit ahead
    (a worker needs its next test before it finishes the current one), which put two long units
    back to back on one worker while others idled (118 s against a planned 72 s of work).
    Other runs (the CPU suite: units without recorded times) keep xdist's order, largest units
    first, as workers free up.
    """
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class Planned(LoadGroupScheduling):
        _plans = None

        def _assign_work_unit(self, node):
            if self._plans is None:
                self._plans = {}
                gpu = _gpu_run(self.config)
                units = [(scope, _unit_seconds(scope, ids, gpu))
                         for scope, ids in self.workqueue.items()]
                if gpu:
                    for nd, plan in zip(self.nodes, _lpt(units, len(self.nodes))):
                        self._plans[nd] = plan
                else:
                    order = sorted(self.workqueue.items(),
                                   key=lambda kv: -_unit_seconds(*kv, False))
                    self.workqueue.clear()
                    self.workqueue.update(order)
            plan = self._plans.get(node)
            if plan:  # this worker's next planned unit goes to the front of the queue
                self.workqueue.move_to_end(plan.pop(0), last=False)
            super()._assign_work_unit(node)

        def _reschedule(self, node):
            if self._plans and node in self._plans and not self._plans[node]:
                if not node.shutting_down:
                    node.shutdown()  # its plan is done: it runs its last test and stops
                return
            super()._reschedule(node)

    return Planned(config, log)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_aot = pytest.mark.skip(reason="compile check for every GPU target: run with --aot "
                                "(.ci/run does, as its second stage)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "aot" in item.keywords and not config.getoption("--aot"):
            item.add_marker(skip_aot)
        # Tests sharing a module-scoped fixture of their file (a training run, a model) run on
        # one xdist worker (--dist loadgroup, pyproject.toml), so the fixture is built once.
        if item.get_closest_marker("xdist_group") is None and _uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def _uses_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(d.scope in ("module", "package", "session") and d.baseid
               for name in item.fixturenames for d in info.name2fixturedefs.get(name, ()))


def pytest_ignore_collect(collection_path, config):
    # `-m gpu` (the GPU suite): test files without a GPU test are not imported (their imports
    # took seconds of the suite's start in every worker)
    if (config.getoption("markexpr") == "gpu" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")
            and "mark.gpu" not in collection_path.read_text()):
        return True
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # The processes a `multiprocess` test starts (setup with its module fixtures, call, teardown)
    # run gloo on the CPU, as on CI: on a machine with CUDA, the tools they run (torchrun jobs,
    # Trainer, accelerate) would pick CUDA and NCCL per rank, and ranks on one GPU fail
    # ("invalid device ordinal", NCCL "invalid usage"). They inherit CUDA_VISIBLE_DEVICES="".
    # This process keeps its GPU: pytest_configure's torch.cuda.is_available() initialised the
    # CUDA runtime, which read the variable then; torch.cuda.init() here also fixes torch's
    # device count, which (through NVML) reads the variable until torch initialises CUDA.
    if not (HAS_CUDA and "multiprocess" in item.keywords):
        yield
        return
    import torch

    torch.cuda.init()
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    import torch

    # Fresh random data per test, reproducible from the seed a failure prints
    # (HF_HILBERT_TEST_SEED=<seed> reruns with it).
    env = os.environ.get("HF_HILBERT_TEST_SEED")
    seed = int(env) if env else random.randrange(2**31)
    torch.manual_seed(seed)
    random.seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield


# What the dispatch says to CPU tensors sent to the kernels without Triton's interpreter
# (backends.use_triton), which this file turns on only on machines without a GPU, and what
# Triton's launcher says to them where a test reaches the kernels past the dispatch (the backend
# seam, the kernels' own launchers) or sets TRITON_INTERPRET=1 after the kernels were compiled.
_NEEDS_INTERPRETER = ("TRITON_INTERPRET=1 in the environment before hf_hilbert_attn is imported",
                      "cannot be accessed from Triton (cpu tensor?)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (report.failed and report.when in ("setup", "call") and HAS_CUDA
            and "gpu" not in item.keywords
            and any(m in str(report.longrepr) for m in _NEEDS_INTERPRETER)):
        # On a GPU machine, a test of the kernels on CPU tensors (in this process or in the
        # processes it starts) is refused: one process runs the kernels compiled or through
        # the interpreter, never both. The machines without a GPU (CI) run it.
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, "Skipped: runs the kernels "
                           "on CPU tensors through Triton's interpreter, which is on only "
                           "where there is no GPU")
    elif report.failed:
        for key, value in item.user_properties:
            if key == "seed":
                report.sections.append(("seed", f"rerun with HF_HILBERT_TEST_SEED={value}"))


# ------------------------------------------------------------ tolerances from the arithmetic
# Every tolerance in tests/ comes from the arithmetic the check compares, never from what one
# machine printed (issue 27: a bound read off one machine failed on another CPU). Two rules:
#
# 1. Another order of the same sum (`reorder_tol`). Blocking, threads, ring shards, an LSE
#    merge or a reduction over ranks add the same float terms in another order. Each order is
#    within (n-1)·u·Σ|x_i| of the exact sum (u = eps/2; Higham, "Accuracy and Stability of
#    Numerical Algorithms", (4.4)), so two orders differ by at most (n-1)·eps·Σ|x_i|: relative
#    to the value itself where the terms have one sign (a mean of losses, a softmax
#    denominator, a convex combination of bounded values), else relative to Σ|x_i|. Typical
#    differences are ~sqrt(n)·eps; a test that must never fail at random uses the worst case.
# 2. Same error size as the baseline (`assert_error_within`): where a float32 result chains many
#    sums (a model's gradients), its error against a float64 run of the same computation
#    ("exact") is at most FACTOR times the error of the float32 baseline it should equal (the
#    one-process model, the plain op), plus a floor of rule 1 for entries the baseline happens
#    to get exact — flash-attention's test rule. The float32 baseline measures the arithmetic's
#    error on this machine, so the bound moves with the CPU instead of being read off one.
EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23,
       "float64": 2.0 ** -52, "tf32": 2.0 ** -10}  # tf32: a GPU's float32 dots, 10-bit mantissa
FACTOR = 2.0


def eps(dtype="float32") -> float:
    """Machine epsilon of ``dtype`` (a torch dtype or its name)."""
    return EPS[str(dtype).replace("torch.", "")]


def reorder_tol(n: int, dtype="float32") -> float:
    """Rule 1: the most two sums of the same ``n`` terms in ``dtype``, added in different orders,
    can differ, relative to ``Σ|x_i|`` (the sum itself for terms of one sign)."""
    return max(int(n) - 1, 1) * eps(dtype)


# |x| of the suite's torch.randn inputs: P(|x| > 6) = 2e-9 per entry
RANDN_MAX = 6.0


def attention_tol(n_keys: int, head_dim: int, dtype="float32") -> float:
    """Rule 1 for attention (output, lse and gradients) in ``dtype`` against its float64
    reference on randn inputs, relative to ``max(1, max|want|)`` (``helpers.assert_close``).

    Every entry is a sum over at most ``n_keys`` keys (for dK/dV: queries) of terms built from
    ``head_dim``-term dot products (scores; dP = dO·V; delta = rowsum(dO∘O)); blocking, chunks,
    an online softmax or an LSE merge add them in another order, which moves the entry by at
    most about ``(n_keys + 2·head_dim)·eps`` times the size of its terms (first order), and the
    terms carry randn entries (at most ``RANDN_MAX``) where the scale is at least 1.
    """
    return (n_keys + 2 * head_dim) * eps(dtype) * RANDN_MAX


# |lse| of the suite's attention on randn inputs: log(keys) <= 9 (4096 keys) plus the largest
# score, scale·|q|·|k| <= (sqrt(d) + 4)**2 / sqrt(d) <= 22 for head_dim <= 128 (|q| of a randn
# row is within 4 of sqrt(d), 6 sigma)
LSE_MAX = 31.0


def lse_float32_tol(lse_max: float = 0.0) -> float:
    """An lse returned in float32 for float64 inputs (the op's contract) is the float64 value
    rounded once: relative error <= eps/2, and what flows through it (a backward that reads it,
    ``P = exp(s - lse)``) picks up ``|lse|·eps/2`` relative; relative to ``max(1, |want|)`` with
    ``|lse| <= lse_max``."""
    return eps("float32") / 2 * max(1.0, lse_max)


def model_tol(*sums: int, dtype="float32") -> float:
    """Rule 1 for two runs of one small model's function (another attention order, chunked
    prefill, shards, a cache) compared in a value relative to its size (a loss, perplexity or
    NLL: a mean of per-token terms of one sign; logits relative to their largest): each run is
    within ``reorder_tol`` of the exact value for its sums of ``sum(sums)`` terms (the tokens
    averaged, the keys of an attention row, the features of a layer; the suite's tiny random
    models do not amplify a relative error through their 2 layers), so twice that apart."""
    return 2 * reorder_tol(sum(sums), dtype)


# A value read back from a results CSV, written with "%.6g": within half a unit of its 6th digit
CSV_6G = 5e-6


def assert_error_within(name, got, baseline, exact, floor=0.0, factor=FACTOR, what=""):
    """Rule 2: ``max|got - exact| <= factor * max|baseline - exact| + floor`` (max over the
    tensor; ``exact`` is the float64 run of the same computation). Compared in float64; the
    message gives both errors and where ``got``'s is worst."""
    import torch

    got, baseline, exact = (torch.as_tensor(t).detach().double() for t in (got, baseline, exact))
    err = (got - exact).abs()
    err_base = float((baseline - exact).abs().max()) if exact.numel() else 0.0
    bound = factor * err_base + floor
    worst = float(err.max()) if err.numel() else 0.0
    if not worst <= bound:  # also fails on NaN
        at = [int(i) for i in torch.unravel_index(err.argmax(), err.shape)] if err.dim() else []
        raise AssertionError(
            f"{what} {name}: error vs float64 {worst:.3g} at {at} > {factor:g} x baseline's "
            f"{err_base:.3g} + floor {floor:.3g} (got {float(got.flatten()[err.argmax()]):.9g}, "
            f"exact {float(exact.flatten()[err.argmax()]):.9g})".strip())
