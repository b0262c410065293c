"""What several commands share: one-line errors, optional packages, rich
tables, shapes, and the GPUs CuPy sees."""

from __future__ import annotations

import importlib

import qarray
from ..examples._common import print_table


class CliError(Exception):
    """An error to report in one line, with the exit status to return."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _need(module: str, install: str):
    """``module`` imported, or CliError naming what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise CliError(f"this needs {module.split('.')[0]}: {install}") from None


def _table(title, columns, rows, caption=None, left=1):
    """A rich table (``left`` text columns, then numbers); no text is read as rich markup."""
    _need("rich", "pip install 'qarray[cli]'")
    from rich.markup import escape

    print_table(escape(title), [escape(c) for c in columns], [[escape(str(v)) for v in r] for r in rows],
                caption and escape(caption), left)


def _shape(a) -> str:
    return "x".join(map(str, a.shape)) or "scalar"


def _gpus() -> list:
    """``[(label, text, compute capability as "90" or None)]``: each GPU CuPy sees,
    or one row saying why there is none."""
    try:
        cupy = qarray.backends.get("cupy").check()
        rows = []
        for i in range(cupy.cuda.runtime.getDeviceCount()):
            p = cupy.cuda.runtime.getDeviceProperties(i)
            name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
            rows.append((f"GPU {i}", f"{name}, compute capability {p['major']}.{p['minor']}",
                         f"{p['major']}{p['minor']}"))
        return rows
    except (ImportError, RuntimeError) as e:  # CupyBackend.check says what is missing
        return [("GPU", f"none: {e}", None)]
    except Exception as e:
        return [("GPU", f"none: {_one_line(e)}", None)]
