"""``python -m qarray``: the ``qarray`` command (see :mod:`qarray.cli`)."""

from .cli import main

raise SystemExit(main())
