"""Runnable examples on real data: ``python -m qarray.examples.NAME [--quick] [--backend numpy|cupy]``
(or ``qarray run NAME``).

Each module's docstring starts with a one-line description and each has
``main(argv) -> int`` and ``run(quick=False, xp=numpy) -> dict`` (the numbers
``main`` prints). ``import qarray`` does not import this package, and importing
it (or an example module) imports nothing beyond NumPy and qarray: scikit-learn
and rich (the ``examples`` extra) are imported when an example runs.
"""

NAMES = ("digits", "train", "lstm", "lm", "concat", "cuda", "quickstart")
