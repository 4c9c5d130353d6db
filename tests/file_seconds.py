"""How long each test file takes, and the order pytest-xdist is handed the files in.

`scripts/test.sh` runs the suite in two worker processes, one test file at a time each
(`--dist loadfile`), taking the next file from a queue whenever a worker runs low. The queue's
order decides how the run ends: pytest-xdist's default puts the files with the most tests first,
so the files with a few long tests (a train.py run killed and resumed, a vLLM server, the README
snippet) came last, and one worker could run such a file alone for minutes while the other core
idled. `tests/conftest.py` orders the files longest first by the seconds measured here (and
`scripts/test.sh` passes `--no-loadscope-reorder` so pytest-xdist keeps that order): the long
files start early, and the short ones fill both workers at the end.

The seconds come from one run of the whole command (its JUnit XML: each test's setup, call and
teardown), so they are relative weights, not a budget; a file missing from the table (a new
one) counts as the median file. To refresh them after a run:

    python tests/file_seconds.py /tmp/junit.xml > tests/file_seconds.json
"""

import collections
import json
import os
import statistics
import sys
import xml.etree.ElementTree as ET

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_seconds.json")


def load(path: str = TABLE) -> dict[str, float]:
    """The table: test file name (``test_paged.py``) -> seconds; empty if there is none."""
    try:
        with open(path) as f:
            return {str(k): float(v) for k, v in json.load(f)["seconds"].items()}
    except FileNotFoundError:
        return {}


def longest_first(seconds: dict[str, float]):
    """A sort key over file names that puts the longest first; a name the table lacks weighs the
    median of the table. Python's sort is stable: equal weights keep collection order, and a
    file's tests (contiguous when collected) stay together and in order."""
    default = statistics.median(seconds.values()) if seconds else 0.0
    return lambda name: -seconds.get(name, default)


def from_junit(path: str) -> dict[str, float]:
    """Seconds per test file from a JUnit XML report (pytest's ``--junitxml``)."""
    totals = collections.Counter()
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "").split(".")
        files = [part for part in module if part.startswith("test_")]
        if files:
            totals[files[0] + ".py"] += float(case.get("time", 0.0))
    return dict(totals)


if __name__ == "__main__":
    seconds = from_junit(sys.argv[1])
    table = {
        "measured": "the whole command's JUnit report (tests/file_seconds.py)",
        "seconds": {name: round(s, 1) for name, s in sorted(seconds.items())},
    }
    json.dump(table, sys.stdout, indent=1)
    sys.stdout.write("\n")
