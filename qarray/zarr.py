"""``qarray.zarr``, as README.md names it: QArrays in chunked Zarr stores
(``to_zarr``, ``from_zarr``, ``load_store``), which :mod:`qarray.io.zarr` holds."""

from .io.zarr import from_zarr, load_store, to_zarr

__all__ = ["to_zarr", "from_zarr", "load_store"]
