"""The seconds each test file took (tests/durations.json), read from a JUnit XML report:
    .venv/bin/python -m pytest -n auto --dist loadfile --junitxml=run.xml && python tests/durations.py run.xml

conftest.py hands xdist the files longest first (a long file started last would run alone at the end
while the other workers idle).
"""
from __future__ import annotations

import collections
import json
import os
import sys
import xml.etree.ElementTree as ElementTree

HERE = os.path.dirname(os.path.abspath(__file__))
DURATIONS = os.path.join(HERE, "durations.json")


def main(report: str) -> None:
    seconds: collections.Counter = collections.Counter()
    for case in ElementTree.parse(report).iter("testcase"):
        seconds[case.get("classname", "").rpartition(".")[2]] += float(case.get("time", 0))
    with open(DURATIONS, "w") as f:
        json.dump({k: round(v, 1) for k, v in seconds.most_common()}, f, indent=0)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
