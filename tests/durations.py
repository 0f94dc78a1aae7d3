"""The seconds each work unit of the suite took (tests/durations.json), read from a JUnit XML report:
    .venv/bin/python -m pytest -n auto --dist loadfile --junitxml=run.xml && python tests/durations.py run.xml

tests/scheduling.py hands the workers the units longest first (a long unit started last would run
alone at the end while the other workers idle).
"""
from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ElementTree

from scheduling import DURATIONS, scope_of


def main(report: str) -> None:
    seconds: collections.Counter = collections.Counter()
    for case in ElementTree.parse(report).iter("testcase"):
        # tests.test_x[.Class]; a module skipped whole (importorskip) has no class name, its name is tests.test_x
        parts = (case.get("classname") or case.get("name", "")).split(".")
        module = next((p for p in parts if p.startswith("test_")), None)
        if module is None:
            continue
        seconds[scope_of(module, case.get("name", ""))] += float(case.get("time", 0))
    with open(DURATIONS, "w") as f:
        json.dump({k: round(v, 1) for k, v in seconds.most_common()}, f, indent=0)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
