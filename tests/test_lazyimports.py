"""A deferred module loads on its first use and then behaves as itself (`distlab.engine.lazyimports`)."""
import sys

import pytest

from distlab.engine.lazyimports import _Deferred, defer

GRAMMAR = '''
import pathlib
LOADS = pathlib.Path(__file__).with_name("loads")
LOADS.write_text(str(int(LOADS.read_text() or 0) + 1) if LOADS.exists() else "1")
def is_valid_syntax(term, value):
    return term == "iri" and ":" in value
TERMS = ("iri",)
'''


@pytest.fixture
def grammar(tmp_path, monkeypatch):
    (tmp_path / "slow_grammar.py").write_text(GRAMMAR)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "loads"
    sys.modules.pop("slow_grammar", None)
    sys.modules.pop("slow_user", None)


def test_a_bound_function_loads_the_module_on_its_first_call(grammar):
    assert defer("slow_grammar", ("is_valid_syntax",), importers=("slow_user",))
    from slow_grammar import is_valid_syntax       # what jsonschema does as it is imported
    assert not grammar.exists()                      # bound, not loaded
    assert is_valid_syntax("iri", "a:b") is True and is_valid_syntax("iri", "ab") is False
    assert grammar.read_text() == "1"                # loaded once, on the first call
    real = sys.modules["slow_grammar"]
    assert not isinstance(real, _Deferred) and real.TERMS == ("iri",)
    assert defer("slow_grammar", ("is_valid_syntax",)) is False     # imported: nothing stands in again


def test_any_other_attribute_loads_it_at_once(grammar):
    assert defer("slow_grammar", ("is_valid_syntax",))
    import slow_grammar
    assert slow_grammar.TERMS == ("iri",) and grammar.read_text() == "1"


def test_nothing_stands_in_once_an_importer_has_bound_the_real_module(grammar):
    sys.modules["slow_user"] = type(sys)("slow_user")
    assert defer("slow_grammar", ("is_valid_syntax",), importers=("slow_user",)) is False
    assert "slow_grammar" not in sys.modules
    assert defer("no_such_module_here", ("f",)) is False


def test_jsonschema_still_checks_iris_here():
    """In this process (the suite loads distlab's plugin first), jsonschema registered its "iri" check."""
    import jsonschema
    assert {"iri", "iri-reference"} <= set(jsonschema.Draft7Validator.FORMAT_CHECKER.checkers)
