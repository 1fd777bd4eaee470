"""Data for the prepare stage: the bundled demo, the simulated user's handwriting, and
the user's own data in the documented formats (see data/user/README.md).

Every sample is float32 of ``data.input_shape`` with values in [0, 1], ink bright on a
dark background (0 = paper), as scikit-learn's digits are; labels are int64 class ids.
"""
from __future__ import annotations

import contextlib
import csv
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pipeline.errors import ConfigError, DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".pgm", ".ppm", ".tif", ".tiff", ".webp")
# a sample is a few dozen pixels; anything this large is a mistake or a decompression bomb,
# refused before decoding (Pillow's own limit, ~89M pixels, is for photos)
MAX_IMAGE_PIXELS = 4096 * 4096
UP = 4  # optdigits' 8x8 values count the ink pixels of 4x4 blocks of a 32x32 bitmap


def load_digits_demo() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1797 handwritten digits, shipped in its wheel (no download):
    x float32 [N, 1, 8, 8] in [0, 1], y int64 [N].

    Read straight from the wheel's ``datasets/data/digits.csv.gz`` (what
    ``sklearn.datasets.load_digits`` reads) without importing scikit-learn, whose
    import costs seconds.
    """
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the digits demo ships with scikit-learn, which is not installed: pip install -e '.[pipeline]'")
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    try:
        with gzip.open(path) as f:
            table = np.loadtxt(f, delimiter=",")
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: the digits demo is unreadable ({exc}); reinstall scikit-learn") from None
    x = (table[:, :-1].astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    return x, table[:, -1].astype(np.int64)


def render_style(x: np.ndarray, *, slant_deg: float, stroke: int, jitter_deg: float, shift, rng: np.random.Generator) -> np.ndarray:
    """Re-write digits in one user's hand, the way optdigits made its 8x8 images.

    Each 8x8 image is blown up to the 32x32 bitmap it was counted from (block
    replication, a light blur, threshold), slanted by ``slant_deg`` (+ a per-sample
    ``jitter_deg``, normal), shifted by ``shift`` (down, right in 8x8 pixels), its
    strokes thickened by ``stroke`` pixels, and counted back into 4x4 blocks, so the
    result has the originals' value grid (multiples of 1/16).
    """
    from scipy import ndimage

    n, c, h, w = x.shape
    out = np.empty_like(x)
    center = np.array([(h * UP - 1) / 2, (w * UP - 1) / 2])
    slants = np.tan(np.deg2rad(slant_deg + jitter_deg * rng.standard_normal(n)))
    offset_shift = np.asarray(shift, dtype=np.float64) * UP
    for i in range(n):
        for ch in range(c):
            big = np.kron(x[i, ch], np.ones((UP, UP), np.float32))
            big = (ndimage.gaussian_filter(big, 1.0) > 0.35).astype(np.float32)
            # output (r, c) samples input (r, c - t * (center_r - r)) - shift: rows above
            # the centre lean right, as in italic handwriting
            matrix = np.array([[1.0, 0.0], [slants[i], 1.0]])
            offset = np.array([0.0, -slants[i] * center[0]]) - offset_shift
            big = ndimage.affine_transform(big, matrix, offset=offset, order=1)
            if stroke:
                big = ndimage.grey_dilation(big, size=(stroke + 1, stroke + 1))
            bitmap = (big > 0.5).astype(np.float32)
            out[i, ch] = bitmap.reshape(h, UP, w, UP).sum(axis=(1, 3)) / (UP * UP)
    return out


# --------------------------------------------------------------------------- user data


README = "README"  # a folder's notes (data/user/README.md) are not data


def user_files(folder: Path) -> list[Path]:
    """The data files under ``folder``, sorted: dotfiles, dot-folders and READMEs aside
    (the retraining job hashes the same list, so what it sees is what prepare reads)."""
    if folder.is_file():
        return [folder]
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.rglob("*") if p.is_file() and not _ignored(p.relative_to(folder)))


def _ignored(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts) or rel.name.upper().startswith(README)


@contextlib.contextmanager
def written_as(path: Path, shown: str | None) -> Iterator[None]:
    """A DataError raised inside names the files under ``path`` as the user wrote ``path``
    (``shown``, relative to the repository): the scheduled job runs prepare in DVC's temporary
    copy (``dvc exp run --temp``), whose absolute paths name a folder the user never saw."""
    try:
        yield
    except DataError as exc:
        if not shown or str(path) == shown:
            raise
        raise DataError(str(exc).replace(str(path), shown)) from None


def folder_format(folder: Path, fmt: str, *, key: str = "data.user_format", shown: str | None = None) -> str | None:
    """What a folder of user data holds: ``npz`` or ``csv`` files at its top, or ``images``
    in class subfolders; None when it holds no data. A folder that mixes them, or holds a
    file of none of these kinds, is a DataError naming the file (under ``shown``, the folder
    as the user wrote it) and ``key``."""
    with written_as(folder, shown):
        return _folder_format(folder, fmt, key)


def _folder_format(folder: Path, fmt: str, key: str) -> str | None:
    kinds: dict[str, Path] = {}
    for f in user_files(folder):
        rel = f.relative_to(folder)
        kind = ("images" if f.suffix.lower() in IMAGE_SUFFIXES else None) if len(rel.parts) == 2 else \
            {".npz": "npz", ".csv": "csv"}.get(f.suffix.lower()) if len(rel.parts) == 1 else None
        if kind is None:
            raise DataError(f"{f}: not user data (an .npz or .csv in {folder}, or an image in a class folder {folder}/<class>/); "
                            "move it out, or point data.user_data at the data itself")
        kinds.setdefault(kind, f)
    if fmt != "auto":
        return fmt if fmt in kinds else None
    if len(kinds) > 1:
        found = ", ".join(f"{k} ({v})" for k, v in sorted(kinds.items()))
        raise DataError(f"{folder}: holds more than one kind of data: {found}; set {key} to the one to use (npz | csv | images)")
    return next(iter(kinds), None)


def load_user_data(path: Path, data_cfg, *, shown: str) -> tuple[np.ndarray, np.ndarray]:
    """The user's own samples from an .npz, a .csv, a folder of either, or an image folder
    (``data.user_format``), checked against ``data.input_shape`` and ``data.num_classes``.
    ``shown`` is the path as the user wrote it, for messages."""
    with written_as(path, shown):
        return _load_user_data(path, data_cfg, shown)


def _load_user_data(path: Path, data_cfg, shown: str) -> tuple[np.ndarray, np.ndarray]:
    fmt = data_cfg.user_format.value
    if not path.exists():
        raise DataError(
            f"data.user_data={shown}: {path} not found; put your data there or set data.user_data=null "
            "for the simulated user (formats: data/user/README.md)"
        )
    if path.is_dir():
        fmt = _folder_format(path, fmt, "data.user_format")
        if fmt is None:
            kind = "" if data_cfg.user_format.value == "auto" else f" {data_cfg.user_format.value}"
            raise DataError(f"data.user_data={shown}: {path} holds no{kind} data (formats: data/user/README.md)")
    elif fmt == "auto":
        fmt = {".npz": "npz", ".csv": "csv"}.get(path.suffix.lower(), "")
        if not fmt:
            raise DataError(f"{path}: unknown data format {path.suffix!r}; use an .npz, a .csv or a folder of images, or set data.user_format")
    if fmt == "images":
        if not path.is_dir():
            raise DataError(f"{path}: data.user_format=images needs a folder with one subfolder per class")
        return _check_samples(path, *_load_images(path, data_cfg), data_cfg, scaled=True)  # images are scaled as read
    loader = {"npz": _load_npz, "csv": _load_csv}[fmt]
    files = [f for f in user_files(path) if f.suffix.lower() == f".{fmt}" and f.parent == path] if path.is_dir() else [path]
    parts = [_check_samples(f, *loader(f, data_cfg), data_cfg, scaled=False) for f in files]
    return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])


def _load_npz(path: Path, data_cfg) -> tuple[np.ndarray, np.ndarray]:
    from pipeline.io import load_npz

    arrays = load_npz(path, ("x", "y"), what="user data file")
    return arrays["x"], arrays["y"]


def _load_csv(path: Path, data_cfg) -> tuple[np.ndarray, np.ndarray]:
    label_column = data_cfg.label_column
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: Excel's byte-order mark
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"{path}: not a readable CSV file ({exc})") from None
    rows = [r for r in rows if any(cell.strip() for cell in r)]
    if len(rows) < 2:
        raise DataError(f"{path}: needs a header row and at least one sample row")
    header = [h.strip() for h in rows[0]]
    if label_column not in header:
        raise DataError(
            f"{path}: no column named {label_column!r} in the header ({', '.join(header[:5])}{', ...' if len(header) > 5 else ''}); "
            "add a header with a label column, or set data.label_column"
        )
    li = header.index(label_column)
    # every row's width before the array: a header of 200,000 columns over 200,000 one-field rows
    # (a 2 MB file) would otherwise ask numpy for 298 GiB
    for r, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise DataError(f"{path}: line {r} has {len(row)} fields, the header has {len(header)}")
    values = np.empty((len(rows) - 1, len(header)), dtype=np.float64)
    for r, row in enumerate(rows[1:], start=2):
        for c, cell in enumerate(row):
            try:
                values[r - 2, c] = float(cell)
            except ValueError:
                raise DataError(f"{path}: line {r}, column {header[c]!r}: {cell!r} is not a number") from None
    y = values[:, li]
    x = np.delete(values, li, axis=1)
    return x, y


def _load_images(path: Path, data_cfg) -> tuple[np.ndarray, np.ndarray]:
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise DataError(f"{path}: reading image folders needs Pillow (pip install pillow); or save your data as .npz or .csv") from None
    c, h, w = _image_shape(data_cfg)
    class_dirs = sorted(d for d in path.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not class_dirs:
        raise DataError(f"{path}: no class folders; put each image in a subfolder named by its class (0, 1, ...)")
    xs, ys = [], []
    for d in class_dirs:
        try:
            label = int(d.name)
        except ValueError:
            raise DataError(f"{d}: class folders must be named by class id (0 .. {data_cfg.num_classes - 1}), not {d.name!r}") from None
        for f in sorted(p for p in d.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
            try:
                with Image.open(f) as im:  # reads the header only: the size is checked before any pixel is decoded
                    if im.width * im.height > MAX_IMAGE_PIXELS:
                        raise DataError(f"{f}: {im.width}x{im.height} pixels, more than a sample may have ({MAX_IMAGE_PIXELS}; "
                                        f"refused as a possible decompression bomb); scale it down to about {w}x{h}")
                    im = im.convert("L" if c == 1 else "RGB").resize((w, h), Image.Resampling.BOX)
                    a = np.asarray(im, dtype=np.float32)
            except Image.DecompressionBombError as exc:  # Pillow's own limit, hit while opening
                raise DataError(f"{f}: refused as a decompression bomb ({exc}); scale it down to about {w}x{h}") from None
            except (OSError, UnidentifiedImageError, ValueError) as exc:
                raise DataError(f"{f}: not a readable image ({exc})") from None
            xs.append(a[None] if c == 1 else a.transpose(2, 0, 1))
            ys.append(label)
    if not xs:
        raise DataError(f"{path}: no images ({', '.join(IMAGE_SUFFIXES)}) in its class folders")
    x = np.stack(xs)
    scale = data_cfg.pixel_max or 255.0
    x = x / scale
    ink = data_cfg.ink.value
    invert = np.full(len(x), ink == "dark_on_light") if ink != "auto" else x.reshape(len(x), -1).mean(axis=1) > 0.5
    x[invert] = 1.0 - x[invert]
    return x, np.asarray(ys)


def _image_shape(data_cfg) -> tuple[int, int, int]:
    shape = list(data_cfg.input_shape)
    if len(shape) != 3 or shape[0] not in (1, 3):
        raise ConfigError(f"data.input_shape={shape}: image folders need [channels, height, width] with 1 or 3 channels")
    return shape[0], shape[1], shape[2]


def _check_samples(path: Path, x: np.ndarray, y: np.ndarray, data_cfg, *, scaled: bool) -> tuple[np.ndarray, np.ndarray]:
    shape = tuple(data_cfg.input_shape)
    size = math.prod(shape)
    if x.ndim < 2 or len(x) != len(y) or y.ndim != 1:
        raise DataError(f"{path}: expected x with one row per sample and y of the same length, got x {x.shape} and y {y.shape}")
    if x.dtype.kind not in "fiub" or y.dtype.kind not in "fiub":
        raise DataError(f"{path}: x and y must be numeric, got {x.dtype} and {y.dtype}")
    sample = x.shape[1:]
    squeezed = tuple(d for d in shape if d != 1)
    if sample != shape and sample != (size,) and sample != squeezed:
        raise DataError(
            f"{path}: samples have shape {sample} but the model input takes data.input_shape={list(shape)} ({size} values); "
            "reshape the data or set data.input_shape"
        )
    x = x.reshape(len(x), *shape).astype(np.float32)
    if not scaled and data_cfg.pixel_max:
        x = x / np.float32(data_cfg.pixel_max)
    if not np.all(np.isfinite(x)):
        raise DataError(f"{path}: x has NaN or infinite values")
    if x.min() < -1e-6 or x.max() > 1 + 1e-6:
        raise DataError(
            f"{path}: pixel values span [{x.min():g}, {x.max():g}] but the model expects [0, 1]; "
            "set data.pixel_max (e.g. 16 for optdigits counts, 255 for 8-bit images)"
        )
    if not np.all(y == np.round(y)) or y.min() < 0 or y.max() >= data_cfg.num_classes:
        bad = sorted({float(v) for v in y if v != round(v) or not 0 <= v < data_cfg.num_classes})[:5]
        raise DataError(f"{path}: labels must be class ids 0 .. {data_cfg.num_classes - 1} (data.num_classes), found {bad}")
    return x, y.astype(np.int64)
