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
