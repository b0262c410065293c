"""``qarray examples`` and ``qarray run NAME``: the examples of
:mod:`qarray.examples`, listed and run."""

from __future__ import annotations

import importlib

from ..examples import NAMES, _common
from ._shared import CliError, _table


def examples(args) -> int:
    rows = [(name, importlib.import_module(f"qarray.examples.{name}").__doc__.strip().splitlines()[0])
            for name in NAMES]
    _table("qarray examples", ["name", "description"], rows,
           caption="run one: qarray run NAME [--quick] [--backend numpy|cupy]", left=2)
    return 0


def run(args) -> int:
    if args.name not in NAMES:
        which = f"unknown example {args.name!r}" if args.name else "run needs the NAME of an example"
        raise CliError(f"{which}; the examples are {', '.join(NAMES)}", 2)
    argv = ["--backend", args.backend] + ["--quick"] * args.quick
    token = _common.FROM_CLI.set(True)  # what the example lacks comes back as this command's error
    try:
        return importlib.import_module(f"qarray.examples.{args.name}").main(argv)
    except _common.Unavailable as e:
        raise CliError(str(e)) from None
    finally:
        _common.FROM_CLI.reset(token)
