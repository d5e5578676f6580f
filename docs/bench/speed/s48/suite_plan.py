"""The GPU suite's plan without a GPU: its units (an ``xdist_group`` or a test, ``-m gpu``) as
collected here, their recorded seconds (``tests/conftest.py``), and the longest-processing-time
plan onto 16 workers — the most any worker holds, the total, and the units without a time.

    python docs/bench/speed/s48/suite_plan.py
"""
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tests"))
units = {}


class Collect:
    def pytest_collection_modifyitems(self, items):
        for it in (i for i in items if i.get_closest_marker("gpu")):
            m = it.get_closest_marker("xdist_group")
            units.setdefault(m.args[0] if m else it.nodeid, []).append(it.nodeid)


pytest.main(["--collect-only", "-q", "-m", "gpu", os.path.join(ROOT, "tests"),
             "-p", "no:cacheprovider"], plugins=[Collect()])
import conftest  # noqa: E402

rows = [(s, conftest._unit_seconds(s, ids, True)) for s, ids in units.items()]
sec = dict(rows)
loads = sorted((sum(sec[s] for s in plan), plan) for plan in conftest._lpt(rows, 16))
print(f"{len(rows)} units, {sum(sec.values()):.0f} s of work; the longest worker holds "
      f"{loads[-1][0]:.0f} s: {[s.split('::')[-1] for s in loads[-1][1]]}")
print("untimed:", [s for s in units if s.split("::")[-1] not in conftest._UNIT_SECONDS])
