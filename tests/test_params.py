"""qarray._params: kept plans (kept, _key) and the read-only parameters they rest on."""

import numpy as np
import pytest

import qarray as qa
from qarray._params import check_params, kept


def _counted():
    calls = []

    @kept
    def f(*args):
        calls.append(args)
        return len(calls)

    return f, calls


def test_kept_by_value_not_by_object():
    f, calls = _counted()
    a = np.arange(3, dtype=np.float32)
    assert f(a, 1, "x") == f(a.copy(), 1, "x") == 1  # an equal array: the kept result
    a[0] = 5  # a writable array changed in place: a new value, a new result
    assert f(a, 1, "x") == 2
    assert f(a, 1.0, "x") == 3  # 1 and 1.0 are different parameters (int and float keys)
    assert f(a.astype(np.float64), 1, "x") == 4  # dtype is part of the key
    assert f(a.reshape(1, 3), 1, "x") == 5  # and shape
    assert len(calls) == 5


def test_kept_read_only_arrays_by_identity_held_by_the_entry():
    f, calls = _counted()
    a = np.ones(4, np.float32)
    a.setflags(write=False)
    b = a.copy()  # equal, writable: keyed by value
    assert f(a) == 1 and f(a) == 1
    assert f(b) == 2  # not a's identity
    del a  # the entry holds a, so its id is not reused by a new array
    c = np.zeros(4, np.float32)
    c.setflags(write=False)
    assert f(c) == 3


def test_kept_numpy_scalars_keep_their_type():
    f, _ = _counted()
    assert f(np.int64(3)) == 1
    assert f(np.float64(3.0)) == 2  # equal values, but a float zero point is an error, an int one is not
    assert f(3) == 3 and f(True) == 4


def test_kept_runs_unkeyable_arguments_every_time():
    f, calls = _counted()

    class Mutable:  # hashable by identity, but could change underneath (a torch tensor, a CuPy array)
        pass

    m = Mutable()
    assert (f(m), f(m)) == (1, 2)


def test_kept_functions_by_code_and_closure():
    f, _ = _counted()

    def scaled(k):
        return lambda x: x * k

    assert f(scaled(2.0)) == f(scaled(2.0)) == 1  # a lambda made per call with one parameter: one key
    assert f(scaled(3.0)) == 2  # another closure value: another key


def test_check_params_returns_read_only_arrays_and_leaves_the_callers():
    s = np.array([0.5, 0.25], np.float32)
    z = np.array([1, 2], np.int32)
    cs, cz, _, _ = check_params(s, z, qa.qdtype("qint8"), (3, 2), 1, None)
    assert not cs.flags.writeable and not cz.flags.writeable
    assert s.flags.writeable and z.flags.writeable  # the caller's arrays stay writable
    s[0] = 2.0  # and changing them gives new parameters, not the kept ones
    assert check_params(s, z, qa.qdtype("qint8"), (3, 2), 1, None)[0][0] == 2.0
    q = qa.quantize(np.ones((3, 2), np.float32), s, z, "qint8", axis=1)
    with pytest.raises(ValueError, match="read-only"):
        q.scale[0] = 1.0  # a QArray's parameters are not changed in place: make a new QArray


def test_kept_scale_of_floating_format_is_a_copy():
    s = np.array([1.0, 2.0], np.float16)  # a floating format keeps float16 scales as they are
    q = qa.quantize(np.ones((2, 2), np.float32), s, 0, "float8_e4m3fn", axis=1)
    assert q.scale.dtype == np.float16 and s.flags.writeable and q.scale is not s
