"""``qarray examples`` and ``qarray run`` (qarray/cli/examples.py), in process
through ``main([...])``."""

import importlib

import pytest

from _reference import fails, rows, run

pytest.importorskip("rich")
pytestmark = pytest.mark.usefixtures("wide_tables")


def test_examples(capsys):
    from qarray.examples import NAMES

    rc, text, err = run(capsys, "examples")
    assert (rc, err) == (0, "")
    got = rows(text)
    assert [r[0] for r in got if r[0]] == list(NAMES)
    first = importlib.import_module(f"qarray.examples.{NAMES[0]}").__doc__.strip().splitlines()[0]
    assert got[0][1] == first


def test_run(capsys):
    rc, text, err = run(capsys, "run", "quickstart", "--quick")
    assert (rc, err) == (0, "")
    assert "saved and loaded" in text


def test_run_reports_what_an_example_lacks_as_its_own_error(capsys, monkeypatch):
    """`qarray run NAME` says what the example lacks as every command says its
    errors, `qarray: error: ...` (it printed `qarray.examples.NAME: ...`)."""
    from qarray.examples import _common

    monkeypatch.setattr(_common, "gpu_problem", lambda: "the cupy backend found no CUDA device")
    fails(capsys, 1, "--backend cupy: the cupy backend found no CUDA device", "run", "digits", "--backend", "cupy")
    monkeypatch.setattr(_common, "_PACKAGES", {**_common._PACKAGES, "rich": "rich"})
    monkeypatch.setattr(_common.importlib.util, "find_spec", lambda m: None if m == "sklearn" else object())
    fails(capsys, 1, "the digits example needs scikit-learn: pip install 'qarray[examples]'", "run", "digits")
    assert not _common.FROM_CLI.get()


def test_run_passes_the_options_and_the_exit_status(capsys, monkeypatch):
    import qarray.examples.quickstart as example

    seen = []
    monkeypatch.setattr(example, "main", lambda argv: seen.append(argv) or 3)
    assert run(capsys, "run", "--quick", "quickstart", "--backend", "cupy")[0] == 3
    assert run(capsys, "run", "quickstart")[0] == 3
    assert seen == [["--backend", "cupy", "--quick"], ["--backend", "numpy"]]

    def boom(argv):
        raise RuntimeError("device fell over\nsecond line")
    monkeypatch.setattr(example, "main", boom)
    fails(capsys, 1, "RuntimeError: device fell over", "run", "quickstart")
