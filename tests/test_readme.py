import doctest
from pathlib import Path

import pytest

import qarray

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run_as_shown():
    """The >>> examples in README.md print exactly what the README says (they show
    the floating formats and Dask too: skipped without those extras)."""
    pytest.importorskip("ml_dtypes")
    pytest.importorskip("dask.array")
    result = doctest.testfile(str(README), module_relative=False, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 5
    assert result.failed == 0


def test_docstring_examples():
    import qarray._api
    import qarray._dtypes
    import qarray._fixed_point

    for module in (qarray._dtypes, qarray._fixed_point):
        result = doctest.testmod(module, extraglobs={"np": __import__("numpy"), "qarray": qarray})
        assert result.failed == 0, module.__name__
