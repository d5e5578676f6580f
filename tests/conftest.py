import os
import random

import pytest
import torch

# CPU machines run the real Triton kernels through the interpreter. This must be set before
# any @triton.jit function is defined, i.e. before hf_hilbert_attn.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption("--aot", action="store_true",
                     help="also run the ahead-of-time compile check for sm_80/86/89/90 "
                     "(tests/test_kernels_compile.py; ~25 CPU-minutes from a cold Triton cache, "
                     "about one with a warm one): CI's second stage")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
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


# Seconds a work unit (an ``xdist_group``, or a test) took with a cold Triton cache on the
# device machine (H100, 8 workers, `-m gpu -n 8 --durations=0`;
# docs/bench/gpu_tests_workers/gputests_n8.log). Compiling kernels dominates. Only the order in
# which work is handed out uses them: a stale number costs time, never a result.
_UNIT_SECONDS = {
    "gpu_natural": 71, "test_local_attention_and_autocast": 54, "gpu_segment_sinks": 45,
    "gpu_float16": 44, "test_position_map": 34, "test_modes[all-True]": 32,
    "test_sliding_modes_with_sinks[per_head-False-128]": 32, "gpu_aligned": 30,
    "test_modes[per_head-False]": 30, "test_modes[all-False]": 26, "gpu_sliding_sinks": 24,
    "test_sliding_modes_with_sinks[all-False-64]": 24,
    "test_gpu_pattern_cache_decode_matches_dynamic_cache": 16, "gpu_transformers": 16,
    "test_head_dim_64_and_mqa": 15,
    "test_sliding_sinks_decode_positions_and_documents[position_map]": 14,
    "test_sinks_and_sliding[sliding-4-float16]": 12, "test_16k_tokens": 11,
    "test_sliding_modes_with_sinks[all-True-64]": 8,
}


def _unit_seconds(scope: str, nodeids) -> float:
    key = scope.split("::")[-1]
    if key in _UNIT_SECONDS:
        return _UNIT_SECONDS[key]
    if scope.startswith("tests/test_kernels_gpu.py"):
        return 20
    return len(nodeids) / 100  # CPU units: more tests first, as xdist's own reordering


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the longest work first, paired with the shortest.

    xdist gives every worker one unit ahead of the one it runs (a worker needs its next test
    before it finishes the current one), so with about as many units as workers (the GPU
    tests: ~20 units, 8-16 workers) whichever units land second on a worker run back to back.
    Handing out the longest units first, the shortest of them to the workers that also get a
    second unit, bounds the wall time by the longest pair instead of any two long units.
    """
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class LongestFirst(LoadGroupScheduling):
        _ordered = False

        def _assign_work_unit(self, node):
            if not self._ordered:
                self._ordered = True
                units = sorted(self.workqueue.items(),
                               key=lambda kv: -_unit_seconds(kv[0], kv[1]))
                n = len(self.nodes)
                # the first n go one per worker, shortest of them first: the workers that
                # get a second unit (the next ones, longest first) start with the shortest
                order = units[:n][::-1] + units[n:]
                self.workqueue.clear()
                self.workqueue.update(order)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)


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


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random data per test, reproducible from the seed a failure prints
    # (HF_HILBERT_TEST_SEED=<seed> reruns with it).
    env = os.environ.get("HF_HILBERT_TEST_SEED")
    seed = int(env) if env else random.randrange(2**31)
    torch.manual_seed(seed)
    random.seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for key, value in item.user_properties:
            if key == "seed":
                report.sections.append(("seed", f"rerun with HF_HILBERT_TEST_SEED={value}"))
