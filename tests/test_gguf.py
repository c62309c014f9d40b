"""GGUF loading: metadata, tensors, mmap/copy/repack paths, progress, and bad files.

Good files are written with ``gguf.GGUFWriter``; bad ones are derived from them (truncations,
seeded byte corruptions) or built byte by byte (``raw_gguf``) to claim impossible things. A bad file
must raise ``GGUFError`` (``FileNotFoundError`` when missing) and never crash the interpreter.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from pyggml import Backend, BackendParams, DType, GGUFError

ONE_THREAD = BackendParams(n_threads=1)

SCALARS = {
    "test.u8": (V.UINT8, 200), "test.i8": (V.INT8, -100), "test.u16": (V.UINT16, 60000),
    "test.i16": (V.INT16, -30000), "test.u32": (V.UINT32, 4_000_000_000), "test.i32": (V.INT32, -2_000_000_000),
    "test.u64": (V.UINT64, 2**63 + 5), "test.i64": (V.INT64, -(2**62)), "test.f32": (V.FLOAT32, 1.5),
    "test.f64": (V.FLOAT64, math.pi), "test.bool": (V.BOOL, True), "test.bool_false": (V.BOOL, False),
    "test.string": (V.STRING, "héllo ✓"), "llama.block_count": (V.UINT32, 2),
    "llama.rope.freq_base": (V.FLOAT32, 10000.0),
}
ARRAYS = {
    "test.strings": (V.STRING, ["a", "", "ünï"]), "test.u32s": (V.UINT32, [1, 2, 3]),
    "test.i32s": (V.INT32, [-1, 2]), "test.f32s": (V.FLOAT32, [0.5, -1.25]), "test.bools": (V.BOOL, [True, False]),
    "test.u8s": (V.UINT8, [0, 255, 7]), "test.i64s": (V.INT64, [-(2**40), 3]), "test.f64s": (V.FLOAT64, [0.1, 2.0]),
}


def make_tensors() -> dict[str, tuple[np.ndarray, Q | None, np.ndarray]]:
    """name -> (array written, raw dtype or None, expected float values in numpy order)."""
    r = np.random.default_rng(7)
    f32 = r.standard_normal((6, 16)).astype(np.float32)
    f16 = r.standard_normal((4, 8)).astype(np.float16)
    cube = r.standard_normal((2, 4, 8)).astype(np.float32)
    norm = r.standard_normal(16).astype(np.float32)
    w8 = r.standard_normal((8, 64)).astype(np.float32)
    w4 = r.standard_normal((16, 64)).astype(np.float32)  # 2-d, 16 rows: repackable
    q8, q4 = gguf.quants.quantize(w8, Q.Q8_0), gguf.quants.quantize(w4, Q.Q4_0)
    return {
        "token_embd.weight": (f32, None, f32),
        "w.f16": (f16, None, f16),
        "blk.0.cube": (cube, None, cube),
        "output_norm.weight": (norm, None, norm),
        "w.q8_0": (q8, Q.Q8_0, gguf.quants.dequantize(q8, Q.Q8_0)),
        "w.q4_0": (q4, Q.Q4_0, gguf.quants.dequantize(q4, Q.Q4_0)),
    }


def write_gguf(path: Path, tensors=None, arch: str = "llama") -> Path:
    writer = gguf.GGUFWriter(path, arch=arch)
    for key, (vtype, value) in SCALARS.items():
        writer.add_key_value(key, value, vtype)
    for key, (sub, value) in ARRAYS.items():
        writer.add_key_value(key, value, V.ARRAY, sub_type=sub)
    for name, (array, raw, _) in (make_tensors() if tensors is None else tensors).items():
        writer.add_tensor(name, array, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "good.gguf")


@pytest.fixture(scope="module")
def good_bytes(good) -> bytes:
    return good.read_bytes()


# ---- metadata ---------------------------------------------------------------------------------
def test_metadata(good):
    with Backend.load(good, ONE_THREAD) as backend:
        c = backend.config
        assert c.architecture == "llama" and c.string("general.architecture") == "llama"
        for key, (vtype, value) in SCALARS.items():
            if vtype == V.FLOAT32:
                assert c[key] == pytest.approx(value, rel=1e-7)
            else:
                assert c[key] == value and type(c[key]) is type(value), key
        for key, (_, value) in ARRAYS.items():
            got = c[key]
            assert got == pytest.approx(value) if isinstance(value[0], float) else got == value, key
        assert c.uint("test.u64") == 2**63 + 5 and c.uint("test.u8") == 200
        assert c.int("test.i64") == -(2**62) and c.int("test.u16") == 60000
        assert c.float("test.f64") == math.pi and c.float("test.u8") == 200.0
        assert c.bool("test.bool") is True and c.bool("test.bool_false") is False
        assert c.string("test.string") == "héllo ✓"
        assert c.strings("test.strings") == ["a", "", "ünï"]
        assert c.uints("test.u32s") == [1, 2, 3]
        assert c.floats("test.f32s") == [0.5, -1.25]
        # keys may omit the architecture prefix
        assert c.uint("block_count") == 2 and c.float("rope.freq_base") == 10000.0
        # defaults for missing keys
        assert c.uint("missing") == 0 and c.uint("missing", None) is None and c.float("missing", 2.5) == 2.5
        assert c.string("missing") == "" and c.strings("missing") is None and c.bool("missing") is False
        # wrong types are refused, naming the key
        for getter, key in [("uint", "test.i8"), ("uint", "test.string"), ("float", "test.bool"),
                            ("bool", "test.u8"), ("string", "test.u32"), ("strings", "test.u32s"),
                            ("uints", "test.strings"), ("int", "test.f32"), ("floats", "test.u8")]:
            with pytest.raises(GGUFError, match=key.replace(".", r"\.")):
                getattr(c, getter)(key)
        assert "test.u8" in c and len(c) >= len(SCALARS) + len(ARRAYS)


# ---- tensors ----------------------------------------------------------------------------------
EXPECTED_DTYPES = {"token_embd.weight": DType.F32, "w.f16": DType.F16, "blk.0.cube": DType.F32,
                   "output_norm.weight": DType.F32, "w.q8_0": DType.Q8_0, "w.q4_0": DType.Q4_0}


@pytest.mark.parametrize("use_mmap", [True, False])
def test_tensors(good, use_mmap):
    expected = make_tensors()
    with Backend.load(good, BackendParams(n_threads=1, use_mmap=use_mmap, repack=False)) as backend:
        assert set(backend.tensors()) == set(expected)
        assert not backend._repacked
        for name, (_, _, values) in expected.items():
            t = backend.get(name)
            assert t.name == name and t.ctx is None
            assert t.dtype == EXPECTED_DTYPES[name]
            assert t.shape == tuple(reversed(values.shape)), name
            data = t.numpy()
            assert data.shape == values.shape
            np.testing.assert_array_equal(data, values.astype(data.dtype), err_msg=name)
        mem = backend.memory()
        assert sum(m["weights"] for m in mem.values()) >= sum(t.nbytes for t in backend.tensors().values())


def test_mmap_and_copy_give_identical_data(good):
    loaded = {}
    for use_mmap in (True, False):
        with Backend.load(good, BackendParams(n_threads=1, use_mmap=use_mmap, repack=False)) as backend:
            loaded[use_mmap] = {name: t.numpy() for name, t in backend.tensors().items()}
    for name in loaded[True]:
        np.testing.assert_array_equal(loaded[True][name], loaded[False][name], err_msg=name)


def test_repack_gives_identical_products(good):
    x = np.random.default_rng(8).standard_normal((5, 64)).astype(np.float32)
    results = {}
    for repack in (False, True):
        with Backend.load(good, BackendParams(n_threads=2, repack=repack)) as backend:
            w = backend.get("w.q4_0")
            if repack:
                assert "w.q4_0" in backend._repacked  # 2-d Q4_0 with rows % 8 == 0
                assert "token_embd.weight" not in backend._repacked  # get_rows needs plain data
                with pytest.raises(ValueError, match="repacked"):
                    w.numpy()
                with backend.new_context() as ctx:  # only w.mulmat(x) has a kernel for repacked data
                    with pytest.raises(ValueError, match="rows.*repacked"):
                        w.rows(ctx.from_numpy(np.zeros(1, np.int32)))
                    with pytest.raises(ValueError, match="reshape.*repacked"):
                        w.reshape(32, 32, ctx=ctx)
                np.testing.assert_array_equal(backend.get("w.q8_0").numpy(), make_tensors()["w.q8_0"][2])
            else:
                assert not backend._repacked
            with backend.new_context() as ctx:
                y = w.mulmat(ctx.from_numpy(x))
                ctx.compute(y)
                results[repack] = y.numpy()
    ref = x @ make_tensors()["w.q4_0"][2].T
    np.testing.assert_allclose(results[True], results[False], rtol=1e-5, atol=1e-5)
    assert np.abs(results[False] - ref).max() <= 2e-2 * np.abs(ref).max()  # activations go through Q8_0


def test_progress(good):
    calls = []
    with Backend.load(good, ONE_THREAD, progress=lambda done, total: calls.append((done, total))) as backend:
        total = sum(t.nbytes for t in backend.tensors().values())
    assert calls, "progress was never called"
    assert all(t == calls[0][1] for _, t in calls) and calls[0][1] >= total
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert calls[-1][0] == calls[-1][1]
    calls.clear()
    with Backend.load(good, BackendParams(n_threads=1, use_mmap=False),
                      progress=lambda done, total: calls.append((done, total))):
        pass
    assert len(calls) >= 2 and calls[-1][0] == calls[-1][1]


def test_metadata_only_file(tmp_path):
    path = write_gguf(tmp_path / "vocab.gguf", tensors={})
    calls = []
    with Backend.load(path, ONE_THREAD, progress=lambda d, t: calls.append((d, t))) as backend:
        assert backend.tensors() == {} and backend.config.uint("block_count") == 2
    assert calls == [(0, 0)]


# ---- bad files --------------------------------------------------------------------------------
def expect_gguf_error(path: Path, match: str | None = None) -> None:
    with pytest.raises(GGUFError, match=match):
        Backend.load(path, ONE_THREAD)


def test_missing_and_not_gguf(tmp_path):
    with pytest.raises(FileNotFoundError):
        Backend.load(tmp_path / "nope.gguf")
    expect_gguf_error(tmp_path, "not a file")
    (tmp_path / "text.gguf").write_text("hello, this is not a model\n" * 10)
    expect_gguf_error(tmp_path / "text.gguf", "not a GGUF")
    (tmp_path / "empty.gguf").write_bytes(b"")
    expect_gguf_error(tmp_path / "empty.gguf")
    (tmp_path / "magic.gguf").write_bytes(b"GGUF")
    expect_gguf_error(tmp_path / "magic.gguf")


def data_end(path: Path) -> int:
    """The offset just past the last tensor's data (the writer may pad after it)."""
    reader = gguf.GGUFReader(path)
    return max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)


def test_truncated(tmp_path, good, good_bytes):
    end = data_end(good)
    reader = gguf.GGUFReader(good)
    data_start = min(int(t.data_offset) for t in reader.tensors)
    cuts = sorted({*range(0, 64), *range(64, data_start, 37), data_start - 1, data_start,
                   *(int(t.data_offset) + k for t in reader.tensors for k in (1, int(t.n_bytes) - 1)), end - 1})
    assert len(cuts) > 100
    path = tmp_path / "cut.gguf"
    for cut in cuts:
        path.write_bytes(good_bytes[:cut])
        with pytest.raises(GGUFError):
            Backend.load(path, ONE_THREAD)
    path.write_bytes(good_bytes[:end])  # only trailing padding missing: still a complete file
    with Backend.load(path, ONE_THREAD) as backend:
        assert len(backend.tensors()) == len(EXPECTED_DTYPES)


def exercise(backend: Backend) -> None:
    """Touch everything a loaded (maybe corrupted) file offers."""
    dict(backend.config)
    for getter in ("uint", "int", "float", "bool", "string", "strings", "uints", "floats"):
        try:
            getattr(backend.config, getter)("block_count")
        except GGUFError:
            pass
    for name, t in backend.tensors().items():
        if name not in backend._repacked:
            t.numpy()
    w = backend.get("w.q4_0")
    if w is not None and w.dtype == DType.Q4_0 and w.shape == (64, 16):
        with backend.new_context() as ctx:
            y = w.mulmat(ctx.from_numpy(np.ones((2, 64), np.float32)))
            ctx.compute(y)
            y.numpy()


LARGE_COUNTS = [0, 1, 255, 4096, 2**31, 2**32 - 1, 2**63, 2**64 - 1]


def test_random_corruptions(tmp_path, good, good_bytes):
    """300 seeded corruptions, mostly in the header, metadata and tensor table: each file either
    loads (and every tensor reads back) or raises GGUFError."""
    rng = np.random.default_rng(1234)
    data_start = min(int(t.data_offset) for t in gguf.GGUFReader(good).tensors)
    path = tmp_path / "bad.gguf"
    outcomes = {"loaded": 0, "refused": 0}
    for _ in range(300):
        data = bytearray(good_bytes)
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(0, data_start if rng.random() < 0.9 else len(data)))
            kind = rng.integers(0, 3)
            if kind == 0:
                data[pos] = int(rng.integers(0, 256))
            elif kind == 1:
                data[pos] ^= 1 << int(rng.integers(0, 8))
            else:  # a plausible-looking large little-endian count
                value = LARGE_COUNTS[int(rng.integers(0, len(LARGE_COUNTS)))]
                data[pos: pos + 8] = value.to_bytes(8, "little")[: len(data[pos: pos + 8])]
        path.write_bytes(bytes(data))
        try:
            with Backend.load(path, ONE_THREAD) as backend:
                exercise(backend)
            outcomes["loaded"] += 1
        except GGUFError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100 and sum(outcomes.values()) == 300


def gguf_string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def raw_gguf(tensors, *, version: int = 3, kv: bytes = b"", n_kv: int = 0, data: bytes = b"",
             n_tensors: int | None = None, alignment: int = 32) -> bytes:
    """A GGUF file from parts: tensors are (name, dims, ggml type, offset)."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors, n_kv) + kv
    for name, dims, kind, offset in tensors:
        out += gguf_string(name.encode()) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", kind, offset)
    out += b"\0" * (-len(out) % alignment)
    return out + data


@pytest.mark.parametrize("case", [
    "huge_tensor", "offset_past_end", "misaligned", "bad_type", "removed_type", "partial_block",
    "five_dims", "overflowing_dims", "duplicate_names", "many_tensors", "version_1", "version_4",
    "bad_kv_type", "huge_string", "huge_array",
])
def test_crafted_bad_files(tmp_path, case):
    data = bytes(256)
    kv = b""
    n_kv = 0
    tensors = [("a", (16, 4), 0, 0)]  # F32 16x4 = 256 bytes, fits
    kw = {}
    if case == "huge_tensor":
        tensors = [("a", (1 << 20, 1 << 18), 0, 0)]  # claims 1 TiB in a tiny file
    elif case == "offset_past_end":
        tensors = [("a", (16, 4), 0, 4096)]
    elif case == "misaligned":
        tensors = [("a", (8,), 0, 0), ("b", (8,), 0, 33)]
    elif case == "bad_type":
        tensors = [("a", (16, 4), 99, 0)]
    elif case == "removed_type":
        tensors = [("a", (32, 4), 4, 0)]  # Q4_2, long gone
    elif case == "partial_block":
        tensors = [("a", (16, 1), int(DType.Q4_0), 0)]  # 16 columns of a 32-wide block type
    elif case == "five_dims":
        tensors = [("a", (2, 2, 2, 2, 2), 0, 0)]
    elif case == "overflowing_dims":
        tensors = [("a", (2**62, 2**62), 0, 0)]
    elif case == "duplicate_names":
        tensors = [("a", (8,), 0, 0), ("a", (8,), 0, 32)]
    elif case == "many_tensors":
        kw["n_tensors"] = 2**40
    elif case in ("version_1", "version_4"):
        kw["version"] = int(case[-1])
    elif case == "bad_kv_type":
        kv, n_kv = gguf_string(b"k") + struct.pack("<I", 77) + struct.pack("<I", 1), 1
    elif case == "huge_string":
        kv, n_kv = gguf_string(b"k") + struct.pack("<I", int(V.STRING)) + struct.pack("<Q", 2**40) + b"abc", 1
    elif case == "huge_array":
        kv = gguf_string(b"k") + struct.pack("<II", int(V.ARRAY), int(V.UINT32)) + struct.pack("<Q", 2**61)
        n_kv = 1
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(raw_gguf(tensors, kv=kv, n_kv=n_kv, data=data, **kw))
    expect_gguf_error(path, CRAFTED_REASONS[case])


# why each crafted file is refused: our own checks' messages, or the line of ggml's log we pass on (ggml
# 0.3.36's gguf reader refuses a misaligned offset or a partial block before our checks could run)
CRAFTED_REASONS = {
    "huge_tensor": "is truncated: tensor 'a' needs bytes up to 1099511627872, the file has 352",
    "offset_past_end": "tensor 'a' has offset 4096, expected 0",
    "misaligned": "tensor 'b' has offset 33, expected 32",
    "bad_type": "tensor 'a' has invalid ggml type 99",
    "removed_type": r"tensor 'a' of type 4 \(DEPRECATED\) .* not a multiple of block size",
    "partial_block": r"tensor 'a' of type 2 \(q4_0\) has 16 elements per row, not a multiple of block size \(32\)",
    "five_dims": "tensor 'a' has invalid number of dimensions: 5 > 4",
    "overflowing_dims": "incorrect shape for a tensor 'a' may cause overflow",
    "duplicate_names": "duplicate tensor name 'a' for tensor 1",
    "many_tensors": "failed to read tensor info",
    "version_1": "GGUF version 1, which is no longer supported",
    "version_4": "unsupported GGUF version 4",
    "bad_kv_type": "key 'k' has invalid GGUF type 77",
    "huge_string": "string length 1099511627776 exceeds maximum",
    "huge_array": "failed to read key-value pairs",
}


def test_crafted_good_file_loads(tmp_path):
    """The byte-level builder itself makes valid files (so the failures above are the claims)."""
    values = np.arange(64, dtype=np.float32)
    path = tmp_path / "ok.gguf"
    path.write_bytes(raw_gguf([("a", (16, 4), 0, 0)], data=values.tobytes()))
    with Backend.load(path, ONE_THREAD) as backend:
        np.testing.assert_array_equal(backend.get("a").numpy(), values.reshape(4, 16))


def test_gguf_v1_real_file(shared_models):
    path = shared_models / "legacy" / "tinyllamas-stories-260k-f32.gguf"
    if not path.exists():
        pytest.skip("legacy GGUF v1 file absent")
    expect_gguf_error(path, "version 1")


# ---- real files -------------------------------------------------------------------------------
def reader_value(field):
    value = field.contents()
    if isinstance(value, str):
        return value
    if field.types[0] == V.ARRAY and field.types[-1] == V.BOOL:
        return [bool(v) for v in value]
    if field.types[0] == V.BOOL:
        return bool(value)
    return value


@pytest.mark.parametrize("name", ["stories260K.gguf", "llama-2-tiny-random.gguf"])
def test_real_files_match_gguf_reader(shared_models, name):
    path = shared_models / name
    if not path.exists():
        pytest.skip(f"{name} absent")
    reader = gguf.GGUFReader(path)
    with Backend.load(path, BackendParams(n_threads=1, repack=False)) as backend:
        config = backend.config
        fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        assert set(config) == set(fields)
        for key, field in fields.items():
            want = reader_value(field)
            if isinstance(want, float) or (isinstance(want, list) and want and isinstance(want[0], float)):
                assert config[key] == pytest.approx(want, rel=1e-7), key
            else:
                assert config[key] == want, key
        assert config.architecture == "llama"
        assert len(backend.tensors()) == len(reader.tensors)
        for rt in reader.tensors:
            t = backend.get(rt.name)
            assert t is not None, rt.name
            shape = tuple(int(d) for d in rt.shape)
            while len(shape) > 1 and shape[-1] == 1:
                shape = shape[:-1]
            assert t.shape == shape, rt.name
            assert int(t.dtype) == int(rt.tensor_type), rt.name
            np.testing.assert_array_equal(t.numpy(), np.asarray(rt.data).reshape(t.numpy().shape), err_msg=rt.name)
