"""The GPU suite's plan of work units onto xdist workers (tests/conftest.py)."""

import random

from conftest import _UNIT_SECONDS, _lpt, _recorded


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


def test_only_recorded_units_are_planned():
    assert all(_recorded(k) for k in _UNIT_SECONDS)
    assert _recorded("tests/test_kernels_gpu.py::test_new_gpu_test")
    assert not _recorded("tests/test_ops.py::test_something")
