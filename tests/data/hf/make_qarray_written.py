"""Make tests/data/hf/qarray_gptq_*: GPTQ checkpoints that *qarray* wrote
(``qarray.save(dir, tensors, format="gptq")``), with GPTQModel's own dequantization of
them as ``expected.safetensors``: the check that what qarray writes, the reference
library reads to qarray's values (tests/test_io_hf.py also checks that qarray writes
these bytes again from what it loads).

Run in the venv of make_vectors.py (GPTQModel 7.7.0; its docstring says how), with
qarray importable (``PYTHONPATH=.`` from the repository root):

    PYTHONPATH=. python tests/data/hf/make_qarray_written.py
    python tests/data/hf/make_vectors.py verify qarray_gptq_v1_b4_g32 ...

Cases: 4-bit symmetric groups of 32 (v1, as GGUF's Q4_0 carries over), 3-bit asymmetric
groups of 32 with act-order (v1 or v2, as its zero points have it), and 8-bit asymmetric with
a zero point of 0 (qarray then writes gptq_v2).
"""

import json
import sys

import numpy as np
from safetensors.torch import save_file

import qarray as qa
from qarray.io.hf import Tensors

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
import make_vectors as mv  # noqa: E402  (GPTQModel's module path, GPTQ_LAYERS)

CASES = {"qarray_gptq_v1_b4_sym_g32": ("int4_g32_f16", False, False),
         "qarray_gptq_b3_asym_g32_descact": ("uint3_g32_f16_zp", True, False),
         "qarray_gptq_v2_b8_asym_g32_zero0": ("uint8_g32_f16_zp", False, True)}


def main():
    rng = np.random.default_rng(40)
    for case, (dtype, act, zero0) in CASES.items():
        tensors = {}
        for p, n, k in mv.GPTQ_LAYERS:
            x = rng.normal(size=(n, k)).astype(np.float32) * np.exp(rng.uniform(-5, 0, (n, 1))).astype(np.float32)
            x[0], x[1] = 0, np.linspace(-1, 1, k)
            x[2] = -np.abs(x[2])  # the top zero point
            if zero0:
                x[3] = np.abs(x[3])  # zero point 0
            q = qa.quantize(x, dtype=dtype)
            if act:
                q = qa.QArray._blocks(q.data, q.dtype, None, rng.permutation(k))
            tensors[f"{p}.weight"] = q
        path = mv.HERE / case
        qa.save(path, tensors, format="gptq")
        config = json.loads((path / "config.json").read_text())
        config["model_type"] = "qarray-test"
        (path / "config.json").write_text(json.dumps(config, indent=2))
        qc = config["quantization_config"]
        st = {name: mv.torch.from_numpy(np.asarray(Tensors(path)[name])) for name in Tensors(path).names()}
        expected = {f"{p}.weight": mv.gptqmodel_dequant(qc, st, p, k, n) for p, n, k in mv.GPTQ_LAYERS}
        save_file(expected, str(path / "expected.safetensors"))
        print(case, qc["checkpoint_format"])


if __name__ == "__main__":
    main()
