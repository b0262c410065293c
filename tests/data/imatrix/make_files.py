"""Writes tests/data/imatrix/lm.imatrix.{gguf,dat}: llama.cpp's own importance-matrix files, the
reference of tests/test_io_imatrix.py (qarray/io/imatrix.py).

They come from llama.cpp's ``llama-imatrix`` (llama-cpp-python 0.3.36 from PyPI, vendored llama.cpp
at commit 0c1e57098bba, built as benchmarks/check_lm_gguf.py and check_lm_imatrix.py describe:
``cmake --build /tmp/ggml-perf --target llama-imatrix``), run on the lm example's float32 GGUF
(``qarray.examples.lm``: the cached 600-step model, ``lm.write_gguf``) and the first 5120 bytes of
its training text, 4 chunks of 128 tokens, the output head included:

    python tests/data/imatrix/make_files.py [/tmp/ggml-perf/bin]

A rerun gives the same bytes (checked: both files identical to the committed ones).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
from qarray.examples import lm  # noqa: E402


def main(bin_dir="/tmp/ggml-perf/bin"):
    tool = Path(bin_dir) / "llama-imatrix"
    params, _ = lm.model()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, text = tmp / "lm-F32.gguf", tmp / "train.txt"
        lm.write_gguf(model, params, lm.CONFIG)
        text.write_bytes(lm.text()[0][:5120].tobytes())
        for fmt in ("gguf", "dat"):  # names relative to tmp: the file records the text's path as given
            subprocess.run([str(tool), "-m", model.name, "-f", text.name, "-o", str(HERE / f"lm.imatrix.{fmt}"),
                            "--output-format", fmt, "-c", "128", "-b", "128", "--chunks", "4", "-t", "1",
                            "--process-output", "--no-ppl"], check=True, capture_output=True, cwd=tmp)


if __name__ == "__main__":
    main(*sys.argv[1:])
