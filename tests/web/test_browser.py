"""The demo page in real Chromium (Debian's, headless, driven by playwright): 20 train steps
in the page give the losses odt's Python Module gives on the same batches, the downloaded
model difference applies with odt_ops.export and reproduces the browser's parameters, and a
tampered bundle is refused. Skips, saying why, without Chromium, playwright or npm ci."""
from __future__ import annotations

import functools
import http.server
import importlib.util
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from odt_ops.checkpoint import Checkpoint, load_checkpoint
from odt_ops.export import aggregate, apply_diff, load_diff, model_diff
from tests.web.conftest import missing_node_packages
from tests.web.oracle import PythonTrainer, samples

CHROMIUM = Path("/usr/bin/chromium")
# no network beyond loopback, no first-run or background work, a fresh profile per run (playwright's user_data_dir)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
STEPS, BATCH, LR = 20, 16, 0.01


def _missing() -> str | None:
    if not CHROMIUM.is_file():
        return f"{CHROMIUM} not found: apt-get install -y chromium (.ci/run does)"
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed: pip install -e '.[dev]'"
    return missing_node_packages()


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # the test's output is the assertions', not every request's
        pass


@pytest.fixture(scope="module")
def site(bundle_root):
    """The bundle's folder served on loopback as `python -m http.server` serves it, with a tampered
    copy (one byte of the eval model flipped) under tampered/."""
    bundle = bundle_root / "bundle"
    tampered = bundle / "tampered"
    tampered.mkdir()
    for name in ("bundle.json", "bundle.bin"):
        shutil.copyfile(bundle / name, tampered / name)
    blob = bytearray((tampered / "bundle.bin").read_bytes())
    blob[200] ^= 0xFF
    (tampered / "bundle.bin").write_bytes(bytes(blob))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(bundle)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def page(site, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(str(tmp_path_factory.mktemp("profile")), executable_path=str(CHROMIUM),
                                                        headless=True, args=FLAGS, accept_downloads=True)
        page = context.new_page()
        page.on("pageerror", lambda e: print(f"page error: {e}"))  # shown with a failing test's output
        yield page
        context.close()


def _open(page, url: str) -> bool:
    page.goto(url)
    return page.evaluate("() => window.odt.ready")


def _percent(text: str) -> float:
    """'87.5 % of 64' -> 87.5"""
    return float(re.match(r"([\d.]+) %", text).group(1))


def test_page_trains_as_odt_python_does_and_its_difference_applies(page, site, bundle_root, tmp_path):
    assert _open(page, site), page.inner_text("#error")
    before = page.inner_text("#before")
    page.click("#load-bundled")
    page.fill("#steps", str(STEPS))
    page.fill("#batch", str(BATCH))
    page.fill("#lr", str(LR))
    page.click("#train")
    page.wait_for_function("() => window.odt.lastRun !== null || document.getElementById('error').textContent", timeout=60_000)
    assert page.inner_text("#error") == ""
    run = page.evaluate("() => window.odt.lastRun")

    x, y = samples(bundle_root, "train")
    batches = run["batches"]
    assert len(batches) == STEPS
    assert all(len(b) == BATCH for b in batches)
    python = PythonTrainer(bundle_root / "artifacts", LR)
    losses = python.train(x, y, batches)
    params = python.parameters
    # the same float32 arithmetic in another order (onnxruntime's kernels vs numpy's): rounding only
    np.testing.assert_allclose(run["losses"], losses, rtol=2e-5, atol=1e-6)
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    browser_params = {n: np.asarray(v, np.float32).reshape(params[n].shape) for n, v in run["parameters"].items()}
    for name, value in browser_params.items():
        np.testing.assert_allclose(value, params[name], rtol=1e-4, atol=1e-6, err_msg=name)

    hx, hy = samples(bundle_root, "holdout")
    assert _percent(page.inner_text("#after")) == pytest.approx(100 * python.accuracy(hx, hy), abs=0.05)
    assert _percent(before) == pytest.approx(100 * PythonTrainer(bundle_root / "artifacts").accuracy(hx, hy), abs=0.05)

    with page.expect_download() as download:
        page.click("#download")
    path = tmp_path / "model.odtdiff"
    download.value.save_as(path)
    diff = load_diff(path)
    assert diff.num_steps == STEPS
    assert diff.num_examples == len(y)
    restored = apply_diff(load_checkpoint(bundle_root / "artifacts" / "checkpoint"), path)
    for name, value in browser_params.items():
        # base + (trained - base) in float32: at most a rounding of the parameter's size away
        np.testing.assert_allclose(restored.parameters[name], value, rtol=0, atol=2e-7 * max(1.0, float(np.abs(value).max())), err_msg=name)
    # the federated server's averaging takes the browser's update beside a Python client's
    python_diff = model_diff(load_checkpoint(bundle_root / "artifacts" / "checkpoint"), Checkpoint(
        parameters={**restored.parameters, **params}, requires_grad=restored.requires_grad), num_examples=len(y))
    averaged = aggregate([diff, python_diff])
    for name in diff.deltas:
        np.testing.assert_allclose(averaged.deltas[name], (diff.deltas[name] + python_diff.deltas[name]) / 2, rtol=1e-6, atol=1e-8)
    print(f"\nbrowser {run['msPerStep']:.2f} ms/step, odt Python {python.ms_per_step:.2f} ms/step (batch {BATCH}, {STEPS} steps)")


def test_tampered_bundle_is_refused_with_a_message(page, site):
    assert _open(page, site + "?bundle=tampered/") is False
    message = page.inner_text("#error")
    assert "sha256" in message, message
    assert "refusing" in message, message
    assert page.is_disabled("#train")


def test_a_drawn_digit_becomes_an_8x8_sample_as_optdigits_counts_them(page, site):
    """A vertical stroke: its bounding box scaled into 32x32 and counted in 4x4 blocks is ink in
    the middle two columns of every row, values in sixteenths."""
    assert _open(page, site)
    box = page.locator("#pad").bounding_box()
    page.mouse.move(box["x"] + 80, box["y"] + 20)
    page.mouse.down()
    page.mouse.move(box["x"] + 80, box["y"] + 140, steps=12)
    page.mouse.up()
    page.select_option("#label", "1")
    page.click("#add")
    drawn = page.evaluate("() => window.odt.samples")
    assert drawn["y"] == [1]
    assert page.inner_text("#count") == "1"
    image = np.asarray(drawn["x"][0]).reshape(8, 8)
    assert np.all(image * 16 == np.round(image * 16))
    assert image.min() >= 0
    assert image.max() <= 1
    assert np.all(image[:, 3:5].sum(axis=1) > 0)
    assert not image[:, :2].any()
    assert not image[:, 6:].any()
    assert not page.is_disabled("#train")
