"""tools/mutate.py's list stays usable: each mutation's text is found exactly once under
apex_lite/, and the tests it names exist.

The mutations are run by hand (each costs a pytest start); this check is what CI can afford. Code
moved by a refactor left eight of them pointing at text that no longer existed, and nothing said
so until the list was run again: this test says so at once.
"""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def _mutate_module():
    spec = importlib.util.spec_from_file_location("apex_lite_mutate", ROOT / "tools" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclass looks its module up by name
    spec.loader.exec_module(module)   # defines the list and functions; main() runs under __main__
    return module


MUTATE = _mutate_module()


@pytest.mark.parametrize("mutation", MUTATE.MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_finds_its_text_once(mutation):
    path, content = MUTATE.locate(ROOT, mutation.find)
    assert mutation.find != mutation.replace
    assert content.replace(mutation.find, mutation.replace, 1) != content, path


@pytest.mark.parametrize("mutation", MUTATE.MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_names_tests_that_exist(mutation):
    assert mutation.tests, f"{mutation.name} names no test"
    for test in mutation.tests:
        file, _, function = test.partition("::")
        source = TESTS / file
        assert source.is_file(), f"{mutation.name}: {file} is not in tests/"
        if function:
            name = function.split("[")[0]
            assert re.search(rf"^def {re.escape(name)}\(", source.read_text(), re.M), \
                f"{mutation.name}: {file} has no test {name}"


def test_the_list_is_not_empty_and_names_are_unique():
    names = [m.name for m in MUTATE.MUTATIONS]
    assert len(names) > 40
    assert len(set(names)) == len(names)
