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


# Seconds a work unit (an ``xdist_group``, or a test) took with a cold Triton cache on the
# device machine (H100, 16 CPU cores, `-m gpu -n 8 --durations=0`, sums per unit;
# docs/bench/gpu_tests_workers/gputests_n8_final.log). Compiling kernels dominates; a unit
# whose kernels another worker compiled before reads them from Triton's disk cache (the short
# ones below). Only the plan below uses them: a stale number costs time, never a result.
_UNIT_SECONDS = {
    "gpu_natural": 53, "test_local_attention_and_autocast": 44, "gpu_segment_sinks": 38,
    "gpu_float16": 38, "gpu_sliding_sinks": 35,
    "test_sliding_modes_with_sinks[per_head-False-128]": 31, "test_position_map": 30,
    "test_modes[all-True]": 28, "gpu_transformers": 25, "test_modes[per_head-False]": 22,
    "test_sliding_modes_with_sinks[all-False-64]": 18, "test_modes[all-False]": 18,
    "test_gpu_pattern_cache_decode_matches_dynamic_cache": 17,
    "test_sliding_sinks_decode_positions_and_documents[position_map]": 14,
    "test_head_dim_64_and_mqa": 14, "test_sinks_and_sliding[sliding-4-float16]": 11,
    "test_sliding_modes_with_sinks[all-True-64]": 11,
    "test_first_call_compiles_its_kernels_together": 9,
    "test_torch_compile_fullgraph_with_backward": 8, "test_16k_tokens": 3,
    "test_sinks_and_sliding[sliding-0-bfloat16]": 1,
}
_GPU_FILE = "tests/test_kernels_gpu.py"


def _unit_seconds(scope: str, nodeids) -> float:
    key = scope.split("::")[-1]
    if key in _UNIT_SECONDS:
        return _UNIT_SECONDS[key]
    if scope.startswith(_GPU_FILE):
        return 20
    return len(nodeids) / 100  # CPU units: more tests first, as xdist's own reordering


def _recorded(scope: str) -> bool:
    return scope.split("::")[-1] in _UNIT_SECONDS or scope.startswith(_GPU_FILE)


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
                units = [(scope, _unit_seconds(scope, ids))
                         for scope, ids in self.workqueue.items()]
                if all(_recorded(scope) for scope, _ in units):
                    for nd, plan in zip(self.nodes, _lpt(units, len(self.nodes))):
                        self._plans[nd] = plan
                else:
                    order = sorted(self.workqueue.items(), key=lambda kv: -_unit_seconds(*kv))
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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for key, value in item.user_properties:
            if key == "seed":
                report.sections.append(("seed", f"rerun with HF_HILBERT_TEST_SEED={value}"))
