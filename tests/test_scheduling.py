"""tests/scheduling.py: the work units `make test` hands its workers, the longest first."""
from dataclasses import dataclass
from types import SimpleNamespace

from scheduling import scope_of, sort_longest_first


@dataclass(frozen=True)
class Item:
    nodeid: str


def test_units_are_files_but_docs_pages_and_compiled_models():
    assert scope_of("test_readers", "test_a_bad_row[csv]") == "test_readers"
    assert scope_of("test_docs", "test_command_runs[docs/serving.md:288: deeprec train --model dlrm]") == \
        "test_docs::docs/serving.md"
    assert scope_of("test_docs", "test_command_runs[README.md:12: deeprec data synth]") == "test_docs::README.md"
    assert scope_of("test_docs", "test_the_docs_have_commands") == "test_docs"
    assert scope_of("test_serving_compiled", "test_the_package_scores_as_the_exported_program[dlrm-table]") == \
        "test_serving_compiled::dlrm-table"
    assert scope_of("test_serving_compiled", "test_a_tampered_package_is_refused_naming_the_file") == \
        "test_serving_compiled"


def test_the_longest_unit_goes_first_and_a_units_tests_stay_together_in_order():
    items = [Item("tests/test_a.py::t1"), Item("tests/test_docs.py::test_command_runs[README.md:3: x]"),
             Item("tests/test_a.py::t2"), Item("tests/test_docs.py::test_command_runs[docs/ps.md:9: y]"),
             Item("tests/test_docs.py::test_command_runs[README.md:7: z]"), Item("tests/test_new.py::t")]
    sort_longest_first(items, {"test_a": 5.0, "test_docs::README.md": 50.0, "test_docs::docs/ps.md": 20.0})
    assert [i.nodeid.split("::", 1)[1] for i in items] == [
        "test_command_runs[README.md:3: x]", "test_command_runs[README.md:7: z]",  # 50 s, in page order
        "test_command_runs[docs/ps.md:9: y]",  # 20 s
        "t",  # not measured yet: 10 s
        "t1", "t2"]  # 5 s


class Node:
    """A worker as xdist's scheduler sees it: the test indices it was sent."""

    def __init__(self, name: str):
        self.sent, self.shutting_down = [], False
        self.gateway = SimpleNamespace(id=name)

    def send_runtest_some(self, indices):
        self.sent.append(list(indices))

    def shutdown(self):
        self.shutting_down = True


def test_the_scheduler_hands_out_units_in_collection_order_one_at_a_time():
    from scheduling import UnitScheduling

    config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=True),
                             getvalue=lambda name: {"tx": ["2*popen"], "dist": "loadfile"}[name])
    scheduler = UnitScheduling(config)
    collection = ["tests/test_docs.py::test_command_runs[docs/ps.md:3: deeprec serve x --host ::]",  # longest
                  "tests/test_many.py::t1", "tests/test_many.py::t2", "tests/test_many.py::t3",
                  "tests/test_docs.py::test_command_runs[docs/ps.md:9: deeprec export]",
                  "tests/test_last.py::t"]
    a, b = Node("gw0"), Node("gw1")
    for node in (a, b):
        scheduler.add_node(node)
        scheduler.add_node_collection(node, collection)
    scheduler.schedule()
    # the page's two commands (one holding "::") are one unit, first although test_many has more tests
    assert a.sent[0] == [0, 4] and b.sent == [[1, 2, 3]]
    scheduler.mark_test_complete(a, 0)  # one test left: a worker holds its last test until it gets more
    assert a.sent[1:] == [[5]]
    assert not b.shutting_down
