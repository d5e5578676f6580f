"""The GPU suite's plan of work units onto xdist workers (tests/conftest.py)."""

import random

from conftest import _NEW_GPU_UNIT, _UNIT_SECONDS, _gpu_run, _lpt, _unit_seconds


def test_lpt_places_every_unit_once_and_balances():
    rng = random.Random(0)
    for _ in range(50):
        units = [(f"u{i}", rng.uniform(1, 60)) for i in range(rng.randint(1, 30))]
        n = rng.randint(1, 10)
        plans = _lpt(units, n)
        assert len(plans) == n
        assert sorted(u for p in plans for u in p) == sorted(u for u, _ in units)
        sec = dict(units)
        loads = [sum(sec[u] for u in p) for p in plans]
        # longest-processing-time: the busiest worker ends within the longest unit of the others
        assert max(loads) <= sum(sec.values()) / n + max(sec.values())
        for p in plans:  # each worker runs its longest unit first
            assert [sec[u] for u in p] == sorted((sec[u] for u in p), reverse=True)


class _Config:
    def __init__(self, markexpr):
        self._m = markexpr

    def getoption(self, name):
        return self._m if name == "markexpr" else None


def test_every_gpu_unit_is_planned_recorded_or_not():
    # a GPU test in a new file (or a new test) gets an estimate: it must not turn the plan off
    assert _gpu_run(_Config("gpu")) and not _gpu_run(_Config(""))
    key, sec = next(iter(_UNIT_SECONDS.items()))
    assert _unit_seconds(f"tests/test_kernels_gpu.py::{key}", ["a"], True) == sec
    for scope in ("tests/test_new_gpu_file.py::test_x", "tests/test_kernels_gpu.py::test_new"):
        assert _unit_seconds(scope, ["a", "b"], True) == _NEW_GPU_UNIT
    # the CPU suite: larger units first
    assert _unit_seconds("tests/test_ops.py", ["a"] * 300, False) > _unit_seconds(
        "tests/test_cache.py", ["a"] * 20, False)
