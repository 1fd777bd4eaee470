"""Structure-aware damage: each mutator takes a real file's bytes and a seeded generator and returns
the damaged file (bytes) plus any files to place beside it (symlinks, directories, FIFOs), so a
case reaches the checks behind the container's (CRC, protobuf, JSON) instead of stopping there.

Mutators know the formats: the tensor file's zip members and JSON manifest (tensors, optimizer
scalars, the engine's generator state, properties), the npy header of each tensor, the ONNX
protobuf (initializers, external-data entries, metadata JSON, nodes, graph inputs), and the raw
bytes (flips, truncation) for the formats parsed by hand (ONNX Runtime's FlatBuffer).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx

from tests.odt_ops.fuzz import zipcraft

# values of every JSON kind, and the edges of numbers
JUNK = [None, 0, -1, 1.5, float("nan"), "x", "", [], {}, [1, "a"], {"a": 1}, True, 2**63, 2**70, -(2**63), 1e308, "\u2603"]


@dataclass
class Damage:
    data: bytes
    what: str  # the mutation, for the report
    # extra entries placed in the case folder: name -> ("file", bytes) | ("symlink", target) | ("dir",) | ("fifo",)
    extras: dict[str, tuple] = field(default_factory=dict)
    outside: dict[str, bytes] = field(default_factory=dict)  # files placed OUTSIDE the case folder (symlink targets)


def pick(rng: np.random.Generator, items):
    return items[int(rng.integers(len(items)))]


# ---- JSON ----------------------------------------------------------------------------------
def damage_json(value, rng: np.random.Generator, depth: int = 0):
    """One structural change somewhere: a key dropped, added or retyped, a list element changed,
    a deep nesting, or a value of another kind."""
    if isinstance(value, dict) and value and rng.random() < 0.75:
        key = pick(rng, list(value))
        out = dict(value)
        action = int(rng.integers(5))
        if action == 0:
            del out[key]
        elif action == 1:
            out[key] = pick(rng, JUNK)
        elif action == 2:
            out[f"unexpected_{int(rng.integers(100))}"] = pick(rng, JUNK)
        elif action == 3:
            out[key] = nest(int(rng.integers(20, 3000)))
        else:
            out[key] = damage_json(value[key], rng, depth + 1)
        return out
    if isinstance(value, list) and value and rng.random() < 0.75:
        i = int(rng.integers(len(value)))
        action = int(rng.integers(3))
        if action == 0:
            return value[:i] + value[i + 1:]
        if action == 1:
            return value + [value[i]]  # a duplicate
        return value[:i] + [damage_json(value[i], rng, depth + 1)] + value[i + 1:]
    if isinstance(value, str) and value[:1] in "{[" and rng.random() < 0.8:  # JSON inside a string (the generator state)
        try:
            return dumps(damage_json(json.loads(value), rng, depth + 1)).decode()
        except ValueError:
            pass
    if isinstance(value, int) and not isinstance(value, bool) and rng.random() < 0.5:
        return pick(rng, [value + 1, -value - 1, value * 2**33, 2**64, 0])
    return pick(rng, JUNK)


def nest(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def dumps(value) -> bytes:
    try:
        return json.dumps(value).encode()
    except (ValueError, RecursionError):
        return b"[" * 5000


# ---- tensor files (checkpoints, nominal checkpoints, model differences) ----------------------
def _npy(header: str, body: bytes, version: bytes = b"\x01\x00") -> bytes:
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    return b"\x93NUMPY" + version + len(header).to_bytes(2, "little") + header.encode("latin1") + body


def _npy_header(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[8:10], "little")
    import ast

    return ast.literal_eval(data[10:10 + n].decode("latin1")), data[10 + n:]


def tensorfile(data: bytes, rng: np.random.Generator, outside: str = "") -> Damage:
    members = zipcraft.read_members(data)
    manifest_at = next(i for i, m in enumerate(members) if m.name == "manifest.json")
    tensors = [i for i, m in enumerate(members) if m.name.endswith(".npy")]
    kind = pick(rng, ["manifest", "manifest", "entry", "engine", "retensor", "retensor", "npy", "npy", "zip", "bomb", "bytes"])
    manifest = json.loads(members[manifest_at].data)
    if kind == "engine" and isinstance(manifest.get("engine"), dict):
        manifest["engine"]["rng_state"] = engine_state(manifest["engine"].get("rng_state", "{}"), rng)
        members[manifest_at] = zipcraft.Member("manifest.json", dumps(manifest))
        return Damage(zipcraft.build(members), "engine rng_state")
    if kind == "retensor" and manifest.get("tensors"):
        return retensor(members, manifest_at, manifest, rng)
    if kind == "manifest":
        members[manifest_at] = zipcraft.Member("manifest.json", dumps(damage_json(manifest, rng)))
        return Damage(zipcraft.build(members), "manifest json")
    if kind == "entry" and manifest.get("tensors"):
        entries = manifest["tensors"]
        i = int(rng.integers(len(entries)))
        key = pick(rng, sorted(entries[i]))
        entry = dict(entries[i])
        entry[key] = damage_json(entry[key], rng) if rng.random() < 0.7 else pick(rng, JUNK)
        entries[i] = entry
        members[manifest_at] = zipcraft.Member("manifest.json", dumps(manifest))
        return Damage(zipcraft.build(members), f"manifest entry {key}")
    if kind == "npy" and tensors:
        i = pick(rng, tensors)
        header, body = _npy_header(members[i].data)
        action = pick(rng, ["shape", "shape_both", "huge", "dtype", "fortran", "garbage", "body", "version"])
        if action in ("shape", "shape_both"):
            shape = list(header["shape"]) or [1]
            j = int(rng.integers(len(shape)))
            shape[j] = int(pick(rng, [0, shape[j] + 1, max(shape[j] - 1, 0), shape[j] * 7]))
            header["shape"] = tuple(shape)
            if action == "shape_both":  # the manifest agrees: only the data's size can tell
                entry = next(e for e in manifest["tensors"] if e["key"] + ".npy" == members[i].name)
                entry["shape"] = list(shape)
                members[manifest_at] = zipcraft.Member("manifest.json", dumps(manifest))
        elif action == "huge":  # 2**40 elements, the manifest agreeing
            header["shape"] = (2**40,)
            entry = next(e for e in manifest["tensors"] if e["key"] + ".npy" == members[i].name)
            entry["shape"], entry["dtype"] = [2**40], header["descr"]
            members[manifest_at] = zipcraft.Member("manifest.json", dumps(manifest))
        elif action == "dtype":
            header["descr"] = pick(rng, ["<f8", "<i4", "|u1", "O", "|V8", "<U4", "(2,)<f4", "<M8[s]", ">f4"])
            if rng.random() < 0.5:
                entry = next(e for e in manifest["tensors"] if e["key"] + ".npy" == members[i].name)
                entry["dtype"] = header["descr"]
                members[manifest_at] = zipcraft.Member("manifest.json", dumps(manifest))
        elif action == "fortran":
            header["fortran_order"] = pick(rng, [True, 1, "yes"])
        elif action == "body":
            body = body[: int(rng.integers(len(body) + 1))] if rng.random() < 0.5 else body + b"\0" * int(rng.integers(1, 64))
        if action == "garbage":
            text = pick(rng, ["{'descr': '<f4', 'shape': ((((", "[" * 3000, "{'descr': '<f4', 'fortran_order': False}",
                              "__import__('os')", "{'descr': '<f4', 'fortran_order': False, 'shape': (-3,), }", "\xff\xfe"])
            members[i] = zipcraft.Member(members[i].name, _npy(text, body))
        else:
            members[i] = zipcraft.Member(members[i].name, _npy(repr(header), body,
                                                               pick(rng, [b"\x01\x00", b"\x02\x00", b"\x03\x00", b"\x09\x09"])
                                                               if action == "version" else b"\x01\x00"))
        return Damage(zipcraft.build(members), f"npy {action}")
    if kind == "zip":
        i = int(rng.integers(len(members)))
        action = pick(rng, ["deflate", "size_lie", "drop", "duplicate", "rename", "extra", "crc_ok_truncate"])
        m = members[i]
        if action == "deflate":
            import zlib

            c = zlib.compressobj(6, zlib.DEFLATED, -15)
            members[i] = zipcraft.Member(m.name, c.compress(m.data) + c.flush(), zipcraft.DEFLATED, zlib.crc32(m.data), len(m.data))
        elif action == "size_lie":
            members[i] = zipcraft.Member(m.name, m.data, file_size=int(pick(rng, [len(m.data) + 1, 2**31, 0])))
        elif action == "drop":
            del members[i]
        elif action == "duplicate":
            members.append(zipcraft.Member(m.name, m.data[::-1]))
        elif action == "rename":
            members[i] = zipcraft.Member(pick(rng, ["t99.npy", "../manifest.json", "manifest.json", "/abs.npy"]), m.data)
        elif action == "extra":
            members.append(zipcraft.Member(pick(rng, ["junk.bin", "t0.npy.bak", "__init__.py"]), b"\0" * 100))
        else:
            members[i] = zipcraft.Member(m.name, m.data[: int(rng.integers(len(m.data) + 1))])
        return Damage(zipcraft.build(members), f"zip {action}")
    if kind == "bomb":  # small bombs: enough to show inflating (64 MiB), cheap on code that inflates them
        i = pick(rng, [manifest_at, *tensors])
        size = 64 << 20
        members[i] = zipcraft.Member(members[i].name, zipcraft.deflate_bomb(size, members[i].data[:1]), zipcraft.DEFLATED,
                                     crc=0, file_size=size)
        return Damage(zipcraft.build(members), "zip bomb " + ("manifest" if i == manifest_at else "tensor"))
    return Damage(raw_bytes(data, rng), "bytes")


def engine_state(text: str, rng: np.random.Generator) -> str:
    """The saved Dropout generator state (numpy's PCG64 state as JSON), damaged in its fields."""
    try:
        state = json.loads(text)
    except ValueError:
        state = {}
    if rng.random() < 0.3 or not isinstance(state, dict):
        return pick(rng, ["", "nope", "[]", "{}", "null", '{"bit_generator": "MT19937", "state": {"key": [1], "pos": 0}}'])
    inner = state.get("state") if isinstance(state.get("state"), dict) else {}
    field_ = pick(rng, ["bit_generator", "state", "has_uint32", "uinteger", "state.state", "state.inc"])
    value = pick(rng, JUNK + [-1, 2**128, "PCG64"])
    if field_.startswith("state."):
        inner = dict(inner)
        inner[field_[6:]] = value
        state["state"] = inner
    else:
        state[field_] = value
    return dumps(state).decode()


def retensor(members: list, manifest_at: int, manifest: dict, rng: np.random.Generator) -> Damage:
    """Replace one tensor by a well-formed one of another shape, dtype or value (NaN, huge),
    manifest and npy header agreeing, so the damage reaches the checks of what the file means."""
    import io

    entries = manifest["tensors"]
    entry = entries[int(rng.integers(len(entries)))]
    shape = list(entry["shape"])
    action = pick(rng, ["shape", "dtype", "nan", "huge", "scalar", "kind", "name"])
    dtype = np.dtype(entry["dtype"])
    if action == "shape":
        shape = shape[:-1] if shape and rng.random() < 0.3 else (shape or [1])[:-1] + [int(rng.integers(0, 9))]
    elif action == "dtype":
        dtype = np.dtype(pick(rng, ["<f8", "<f2", "<i8", "<i4", "|u1", "|b1", "<c8"]))
    elif action == "scalar":
        shape = []
    array = np.zeros(shape, dtype)
    if action == "nan" and array.size and dtype.kind == "f":
        array.flat[int(rng.integers(array.size))] = np.nan
    elif action == "huge" and array.size and dtype.kind == "f":
        array[...] = np.finfo(dtype).max
    if action == "kind":
        entry["kind"] = pick(rng, ["parameter", "buffer", "optimizer", "other"])
    elif action == "name":
        entry["name"] = pick(rng, ["fc0.weight", "fc1.bias", "fc9.weight", "", entries[0]["name"]])
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, allow_pickle=False)
    entry["shape"], entry["dtype"] = list(array.shape), array.dtype.str
    members = [zipcraft.Member(m.name, buf.getvalue()) if m.name == entry["key"] + ".npy" else m for m in members]
    members[manifest_at] = zipcraft.Member("manifest.json", dumps(manifest))
    return Damage(zipcraft.build(members), f"retensor {action}")


def raw_bytes(data: bytes, rng: np.random.Generator) -> bytes:
    kind = int(rng.integers(3))
    if kind == 0:
        b = bytearray(data)
        for pos in rng.integers(0, len(b), int(rng.integers(1, 9))):
            b[pos] ^= int(rng.integers(1, 256))
        return bytes(b)
    if kind == 1:
        return data[: int(rng.integers(0, len(data)))]
    return data + bytes(rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8))


# ---- ONNX models ----------------------------------------------------------------------------
OPS = ["Relu", "Sigmoid", "Gemm", "MatMul", "Add", "Softmax", "Identity", "NotAnOp", "Dropout", "Reshape", "Concat",
       "Transpose", "Cast", "Where"]


def onnx_model(data: bytes, rng: np.random.Generator, outside: str = "") -> Damage:
    model = onnx.load_from_string(data)
    graph = model.graph
    kinds = ["initializer", "metadata", "metadata", "node", "node", "io", "protobuf"]
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer):
        kinds += ["external"] * 4
    kind = pick(rng, kinds)
    if kind == "external":
        return external_entry(model, rng, outside)
    if kind == "initializer" and graph.initializer:
        t = pick(rng, list(graph.initializer))
        action = pick(rng, ["dims", "dtype", "raw", "typed_field"])
        if action == "dims":
            if t.dims:
                t.dims[int(rng.integers(len(t.dims)))] = int(pick(rng, [0, 1, 7, 2**40, -1]))
            else:
                t.dims.append(3)
        elif action == "dtype":
            t.data_type = int(pick(rng, [0, 7, 8, 11, 16, 17, 23, 999, -1]))
        elif action == "raw":
            if t.HasField("raw_data"):
                t.raw_data = t.raw_data[: int(rng.integers(len(t.raw_data) + 1))]
            else:
                t.raw_data = b"\x01\x02\x03"
        else:
            t.ClearField("raw_data")
            t.float_data.extend([1.0] * int(rng.integers(1, 5)))
        return Damage(model.SerializeToString(), f"onnx initializer {action}")
    if kind == "metadata" and model.metadata_props:
        prop = pick(rng, list(model.metadata_props))
        action = pick(rng, ["json", "json", "names", "names", "deep", "truncate", "utf8"])
        if action == "names":  # a name added to or dropped from one of the metadata's lists
            try:
                data = json.loads(prop.value)
            except ValueError:
                data = {}
            lists = [k for k, v in data.items() if isinstance(v, list)] if isinstance(data, dict) else []
            if lists:
                key = pick(rng, lists)
                if data[key] and rng.random() < 0.4:
                    data[key] = data[key][1:]
                else:
                    data[key] = data[key] + [pick(rng, ["fc9.weight", "input", "labels", "loss", "fc0.weight"])]
                prop.value = json.dumps(data)
        elif action == "json":
            try:
                prop.value = dumps(damage_json(json.loads(prop.value), rng)).decode()
            except ValueError:
                prop.value = "{"
        elif action == "deep":
            prop.value = "[" * int(rng.integers(20, 100_000)) + "]" * int(rng.integers(0, 20))
        elif action == "truncate":
            prop.value = prop.value[: int(rng.integers(len(prop.value) + 1))]
        else:  # bytes that are not UTF-8 in a protobuf string: written by patching the serialized model
            marker = "\u0394MARK\u0394"
            prop.value = prop.value[:5] + marker + prop.value[5:]
            out = model.SerializeToString().replace(marker.encode(), b"\xff\xfe\xfd\xfc\xfb\xfa\xf9")
            return Damage(out, "onnx metadata utf8")
        return Damage(model.SerializeToString(), f"onnx metadata {action}")
    if kind == "node" and graph.node:
        node = pick(rng, list(graph.node))
        action = pick(rng, ["op", "op", "input", "output", "attribute", "domain"])
        if action == "op":
            node.op_type = pick(rng, OPS)
        elif action == "input":
            if node.input and rng.random() < 0.5:
                node.input[int(rng.integers(len(node.input)))] = pick(rng, ["", "nowhere", node.output[0] if node.output else "x"])
            else:
                node.input.append("extra_input")
        elif action == "output":
            if node.output:
                node.output[0] = pick(rng, ["", graph.node[0].output[0] if graph.node[0].output else "y", "renamed"])
        elif action == "attribute":
            if node.attribute:
                a = pick(rng, list(node.attribute))
                a.type = int(pick(rng, [1, 2, 3, 7, 0]))
            else:
                node.attribute.append(onnx.helper.make_attribute("axis", int(pick(rng, [-9, 99, 0]))))
        else:
            node.domain = pick(rng, ["com.microsoft", "x", "ai.onnx.ml"])
        return Damage(model.SerializeToString(), f"onnx node {action}")
    if kind == "io":
        field_ = pick(rng, [graph.input, graph.output])
        if len(field_):
            action = pick(rng, ["drop", "rename", "type", "shape"])
            i = int(rng.integers(len(field_)))
            if action == "drop":
                del field_[i]
            elif action == "rename":
                field_[i].name = pick(rng, ["", "renamed", field_[0].name])
            elif action == "type":
                field_[i].type.tensor_type.elem_type = int(pick(rng, [0, 7, 10, 999]))
            else:
                dims = field_[i].type.tensor_type.shape.dim
                if len(dims):
                    dims[int(rng.integers(len(dims)))].dim_value = int(pick(rng, [0, 1, 99, 2**40]))
            return Damage(model.SerializeToString(), f"onnx io {action}")
    return Damage(raw_bytes(data, rng), "onnx bytes")


def external_entry(model: onnx.ModelProto, rng: np.random.Generator, outside_dir: str) -> Damage:
    """Damage an external-data entry, with whatever must exist for it: a symlink out of the folder,
    a path through a symlinked sub-folder, a directory, a device, a FIFO, a bad offset or length."""
    tensors = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    t = pick(rng, tensors)
    entries = {e.key: e for e in t.external_data}
    action = pick(rng, ["symlink_out", "symlinked_dir", "dotdot", "absolute", "directory", "device", "fifo", "offset",
                        "length", "missing", "duplicate_key", "no_location", "not_external"])
    extras: dict[str, tuple] = {}
    outside: dict[str, bytes] = {}
    secret = b"\x7f" * 4096
    if action == "symlink_out":
        entries["location"].value = "linked.data"
        extras["linked.data"] = ("symlink", "OUTSIDE/secret.data")
        outside["secret.data"] = secret
    elif action == "symlinked_dir":
        entries["location"].value = "sub/secret.data"
        extras["sub"] = ("symlink", "OUTSIDE")
        outside["secret.data"] = secret
    elif action == "dotdot":
        entries["location"].value = pick(rng, ["../outside/secret.data", "./../outside/secret.data", "a/../../outside/secret.data"])
        outside["secret.data"] = secret
    elif action == "absolute":
        entries["location"].value = f"{outside_dir}/secret.data"
        outside["secret.data"] = secret
    elif action == "directory":
        entries["location"].value = "adir"
        extras["adir"] = ("dir",)
    elif action == "device":
        entries["location"].value = "dev.data"
        extras["dev.data"] = ("symlink", "/dev/zero")
    elif action == "fifo":
        entries["location"].value = "pipe.data"
        extras["pipe.data"] = ("fifo",)
    elif action == "offset":
        value = pick(rng, ["-8", "abc", "1e3", "99999999999999999999999", " 4", "4096"])
        if "offset" in entries:
            entries["offset"].value = value
        else:
            t.external_data.add(key="offset", value=value)
    elif action == "length":
        value = pick(rng, ["-1", "x", "3", "2", "99999999999999"])
        if "length" in entries:
            entries["length"].value = value
        else:
            t.external_data.add(key="length", value=value)
    elif action == "missing":
        entries["location"].value = "nothere.data"
    elif action == "duplicate_key":
        t.external_data.add(key="location", value="forward.onnx")
    elif action == "no_location":
        del t.external_data[:]
    else:
        t.data_location = onnx.TensorProto.DEFAULT
    return Damage(model.SerializeToString(), f"external {action}", extras, outside)


def ort_checkpoint(data: bytes, rng: np.random.Generator, outside_dir: str = "") -> Damage:
    if rng.random() < 0.25:
        action = pick(rng, ["symlink_out", "directory", "truncate", "device"])
        extras: dict[str, tuple] = {}
        outside: dict[str, bytes] = {}
        if action == "symlink_out":
            extras["ort_checkpoint.data"] = ("symlink", "OUTSIDE/secret.data")
            outside["secret.data"] = b"\0" * 65536
        elif action == "directory":
            extras["ort_checkpoint.data"] = ("dir",)
        elif action == "device":
            extras["ort_checkpoint.data"] = ("symlink", "/dev/zero")
        else:
            extras["ort_checkpoint.data"] = ("truncate",)
        return Damage(data, f"ort data {action}", extras, outside)
    return Damage(raw_bytes(data, rng), "ort bytes")


MUTATORS: dict[str, Callable[[bytes, np.random.Generator, str], Damage]] = {
    "tensorfile": tensorfile, "onnx": onnx_model, "ort": ort_checkpoint,
}
