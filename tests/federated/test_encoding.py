"""Model differences on the wire: float32 exact, float16, int8 with a per-tensor scale; sizes, errors, files."""
import numpy as np
import pytest

from odt_ops.errors import ModelDiffError
from odt_ops.export import ModelDiff, load_diff
from odt_ops.federated import (
    EncodedDiff,
    check_update,
    clip_update,
    decode_diff,
    encode_diff,
    encoding_error,
    fingerprint,
    load_encoded,
    save_encoded,
)


def _diff(seed=0):
    rng = np.random.default_rng(seed)
    deltas = {"a.weight": (rng.standard_normal((32, 64)) * 0.01).astype(np.float32), "a.bias": (rng.standard_normal(32) * 0.003).astype(np.float32),
              "z": np.zeros(4, np.float32)}
    return ModelDiff(deltas, "ab" * 32, num_examples=17, num_steps=3)


def test_float32_is_exact():
    d = _diff()
    enc = encode_diff(d, "float32")
    back = decode_diff(enc)
    for k in d.deltas:
        np.testing.assert_array_equal(back.deltas[k], d.deltas[k])
    assert enc.nbytes == (32 * 64 + 32 + 4) * 4
    assert encoding_error(d, enc) == 0.0
    assert (back.base_hash, back.num_examples, back.num_steps) == (d.base_hash, 17, 3)


def test_float16_halves_the_bytes_within_half_precision():
    d = _diff()
    enc = encode_diff(d, "float16")
    assert enc.nbytes == (32 * 64 + 32 + 4) * 2
    back = decode_diff(enc)
    for k, v in d.deltas.items():
        np.testing.assert_allclose(back.deltas[k], v, rtol=2 ** -11, atol=2 ** -24)
    assert 0 < encoding_error(d, enc) < 1e-3
    with pytest.raises(ModelDiffError, match="float16"):
        encode_diff(ModelDiff({"w": np.array([1e6], np.float32)}, "h"), "float16")


def test_int8_quarters_the_bytes_error_at_most_half_a_step():
    d = _diff()
    enc = encode_diff(d, "int8")
    assert enc.nbytes == (32 * 64 + 32 + 4) + 3 * 4
    assert {k: t.dtype for k, t in enc.tensors.items()} == {k: np.dtype(np.int8) for k in d.deltas}
    for k, v in d.deltas.items():
        scale = np.float32(np.abs(v).max() / np.float32(127))
        assert enc.scales[k] == pytest.approx(float(scale))
        assert np.abs(enc.tensors[k]).max() <= 127
        np.testing.assert_array_less(np.abs(decode_diff(enc).deltas[k] - v), scale / 2 * (1 + 1e-5) + 1e-12)
    assert np.array_equal(enc.tensors["z"], np.zeros(4, np.int8))
    assert enc.scales["z"] == 0.0
    assert 0 < encoding_error(d, enc) < 0.01


@pytest.mark.parametrize("encoding", ["float32", "float16", "int8"])
def test_files_round_trip(tmp_path, encoding):
    d = _diff()
    enc = encode_diff(d, encoding)
    path = tmp_path / f"u.{encoding}.odtdiff"
    save_encoded(enc, path)
    back = load_encoded(path)
    assert back.encoding == encoding
    assert back.base_hash == d.base_hash
    assert back.num_examples == 17
    for k in d.deltas:
        np.testing.assert_array_equal(back.tensors[k], enc.tensors[k])
    assert back.scales == enc.scales
    if encoding == "float32":  # a plain model difference, for export.load_diff and apply_diff
        assert load_diff(path).num_examples == 17
    else:
        with pytest.raises(ModelDiffError, match="not an ODT model difference"):
            load_diff(path)


def test_decode_refuses_damage():
    enc = encode_diff(_diff(), "int8")
    with pytest.raises(ModelDiffError, match="no scale"):
        decode_diff(EncodedDiff("int8", enc.tensors, enc.base_hash, {}))
    with pytest.raises(ModelDiffError, match="holds"):
        decode_diff(EncodedDiff("float16", enc.tensors, enc.base_hash))
    with pytest.raises(ModelDiffError, match="NaN"):
        decode_diff(EncodedDiff("float32", {"w": np.array([np.inf], np.float32)}, "h"))
    with pytest.raises(ModelDiffError, match="unknown diff encoding"):
        encode_diff(_diff(), "bf16")


def test_clip_update_bounds_the_norm():
    d = _diff().deltas
    norm = float(np.sqrt(sum((v.astype(np.float64) ** 2).sum() for v in d.values())))
    clipped, before = clip_update(d, norm / 4)
    assert before == pytest.approx(norm)
    after = float(np.sqrt(sum((v.astype(np.float64) ** 2).sum() for v in clipped.values())))
    assert after == pytest.approx(norm / 4, rel=1e-6)
    same, _ = clip_update(d, norm * 2)
    assert all(np.array_equal(same[k], d[k]) for k in d)


def test_check_update_names_each_problem():
    specs = {"w": ((2, 2), np.dtype(np.float32)), "b": ((2,), np.dtype(np.float32))}
    good = {"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)}
    h = fingerprint(good)
    assert check_update(good, specs, base_hash=h, expected_hash=h) == []
    assert "another base" in check_update(good, specs, base_hash="x" * 64, expected_hash=h)[0]
    assert "non-finite" in check_update({**good, "b": np.array([0, np.nan], np.float32)}, specs)[0]
    assert "missing" in check_update({"w": good["w"]}, specs)[0]
    assert "expected float32[2]" in check_update({**good, "b": np.zeros(3, np.float32)}, specs)[0]


FORGED = [10**400, 2**53 + 1, -1, 2.0, 1e308, "3", True, None]


@pytest.mark.parametrize("value", FORGED, ids=lambda v: repr(v)[:24])
@pytest.mark.parametrize("key", ["num_examples", "num_steps"])
def test_encode_decode_and_save_refuse_a_forged_count(tmp_path, key, value):
    d = _diff()
    setattr(d, key, value)
    with pytest.raises(ModelDiffError, match=f"encode_diff: the model difference: {key}"):
        encode_diff(d, "int8")
    enc = encode_diff(_diff(), "int8")
    setattr(enc, key, value)
    with pytest.raises(ModelDiffError, match=f"decode_diff: the encoded difference: {key}"):
        decode_diff(enc)
    with pytest.raises(ModelDiffError, match=key):
        save_encoded(enc, tmp_path / "u.odtdiff")
    assert not (tmp_path / "u.odtdiff").exists()


def _forge_encoded(path, entry=None, **header):
    from odt_ops.federated.encoding import ENCODED_FORMAT, ENCODED_VERSION
    from odt_ops.tensorfile import write_tensor_file

    header = {"encoding": "int8", "base_hash": "ab" * 32, "num_examples": 3, "num_steps": 1, "metadata": {}, **header}
    write_tensor_file(path, ENCODED_FORMAT, ENCODED_VERSION, header, [({"name": "w", "scale": 0.5, **(entry or {})},
                                                                       np.array([1, -2, 3], np.int8))], ModelDiffError)


@pytest.mark.parametrize("value", FORGED, ids=lambda v: repr(v)[:24])
@pytest.mark.parametrize("key", ["num_examples", "num_steps"])
def test_load_encoded_refuses_a_forged_count_naming_the_file(tmp_path, key, value):
    path = tmp_path / "forged.odtdiff"
    _forge_encoded(path, **{key: value})
    with pytest.raises(ModelDiffError) as info:
        load_encoded(path)
    assert str(path) in str(info.value) and key in str(info.value), info.value


@pytest.mark.parametrize("header, entry, match", [
    ({"metadata": [1, 2]}, None, r"\['metadata'\] of the wrong kind"),  # before: TypeError from dict()
    ({"base_hash": 7}, None, r"\['base_hash'\] of the wrong kind"),
    ({}, {"scale": "x"}, r"scales of \['w'\] are not finite"),  # before: ValueError from float()
    ({}, {"scale": 10**400}, r"scales of \['w'\] are not finite"),  # before: OverflowError from float()
    ({}, {"scale": [1]}, r"scales of \['w'\] are not finite"),
    ({}, {"scale": -1.0}, "int8 scale -1.0 is not a finite number >= 0"),
])
def test_load_encoded_refuses_a_damaged_header_naming_the_file(tmp_path, header, entry, match):
    path = tmp_path / "damaged.odtdiff"
    _forge_encoded(path, entry, **header)
    with pytest.raises(ModelDiffError, match=match) as info:
        load_encoded(path)
    assert str(path) in str(info.value)


def test_load_encoded_keeps_counts_up_to_2_53(tmp_path):
    path = tmp_path / "big.odtdiff"
    _forge_encoded(path, num_examples=2**53)
    back = load_encoded(path)
    assert back.num_examples == 2**53
    assert decode_diff(back).num_examples == 2**53
    np.testing.assert_array_equal(decode_diff(back).deltas["w"], np.array([0.5, -1.0, 1.5], np.float32))
