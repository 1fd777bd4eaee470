"""The demo page in real Chromium (Debian's, headless, driven by playwright): 20 train steps
in the page give the losses odt's Python Module gives on the same batches, the downloaded
model difference applies with odt_ops.export and reproduces the browser's parameters, a
tampered bundle is refused, and a bad Steps, Batch or Learning rate is refused on the page,
naming the field and what it takes, with no model run. Skips, saying why, without Chromium,
playwright or npm ci."""
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


# ---- the training fields: a bad value is refused on the page, naming the field and what it takes,
# and nothing trains (the learning rate's rule is odt_ops.api.optimizer.checked_learning_rate's) ----
GOOD_INPUTS = {"steps": "2", "batch": "4", "lr": "0.01"}
EMPTY = " (the field is empty or not a number)"
BAD_INPUTS = [
    ("lr", "-1", "Learning rate must be a finite number >= 0, such as 0.001; got -1"),  # gradient ascent before
    ("lr", "", f"Learning rate must be a finite number >= 0, such as 0.001; got nothing{EMPTY}"),  # Number("") is 0
    ("batch", "0", "Batch must be a whole number >= 1; got 0"),  # onnxruntime's reshape error before
    ("batch", "1.5", "Batch must be a whole number >= 1; got 1.5"),
    ("batch", "", f"Batch must be a whole number >= 1; got nothing{EMPTY}"),
    ("steps", "", f"Steps must be a whole number >= 1; got nothing{EMPTY}"),  # "Trained 0 steps" before
    ("steps", "0", "Steps must be a whole number >= 1; got 0"),
    ("steps", "2.5", "Steps must be a whole number >= 1; got 2.5"),  # 3 steps before
]
RUN_STATE = "() => [window.odt.trainer.step, window.odt.trainer.learningRate, window.odt.runs, window.odt.lastRun]"


def _ready_with_samples(page, site):
    """The page opened afresh with the bundled samples loaded, its training and optimizer sessions counting their runs."""
    assert _open(page, site), page.inner_text("#error")
    page.click("#load-bundled")
    page.evaluate("""() => {
      window.odt.runs = 0;
      for (const session of [window.odt.trainer.sessions.training, window.odt.trainer.sessions.optimizer]) {
        const run = session.run.bind(session);
        session.run = (...args) => { window.odt.runs += 1; return run(...args); };
      }
    }""")


def test_the_training_fields_attributes_state_the_rules(page, site):
    assert _open(page, site)
    attributes = page.evaluate("""() => Object.fromEntries(["steps", "batch", "lr"].map((id) => {
      const e = document.getElementById(id);
      return [id, { min: e.min, step: e.step, required: e.required }];
    }))""")
    assert attributes == {"steps": {"min": "1", "step": "1", "required": True}, "batch": {"min": "1", "step": "1", "required": True},
                          "lr": {"min": "0", "step": "any", "required": True}}


@pytest.mark.parametrize(("field", "value", "message"), BAD_INPUTS, ids=[f"{f}={v or 'empty'}" for f, v, _ in BAD_INPUTS])
def test_a_bad_training_field_is_refused_naming_it_and_nothing_trains(page, site, field, value, message):
    _ready_with_samples(page, site)
    step, rate = page.evaluate("() => [window.odt.trainer.step, window.odt.trainer.learningRate]")
    for name, good in GOOD_INPUTS.items():
        page.fill(f"#{name}", value if name == field else good)
    page.click("#train")  # the fields are checked before the handler's first await: refused by the time the click returns
    assert page.inner_text("#error") == f"{message}\nNothing was trained."
    assert page.evaluate(RUN_STATE) == [step, rate, 0, None]
    assert page.get_attribute(f"#{field}", "aria-invalid") == "true"
    assert page.eval_on_selector(f"#{field}", "e => e.checkValidity()") is False  # the browser's own check of min/step/required agrees
    assert "Trained" not in page.inner_text("#status")
    assert not page.is_disabled("#train")


def test_every_bad_field_is_named_at_once(page, site):
    _ready_with_samples(page, site)
    for name, value in (("steps", "0"), ("batch", "0"), ("lr", "-1")):
        page.fill(f"#{name}", value)
    page.click("#train")
    assert page.inner_text("#error").split("\n") == [
        "Steps must be a whole number >= 1; got 0", "Batch must be a whole number >= 1; got 0",
        "Learning rate must be a finite number >= 0, such as 0.001; got -1", "Nothing was trained."]
    assert page.evaluate("() => window.odt.runs") == 0


def test_the_smallest_valid_fields_train_after_a_refusal_is_fixed(page, site):
    """Steps 1, batch 1 and learning rate 0 (which odt_ops' Optimizer allows too) train one step."""
    _ready_with_samples(page, site)
    step = page.evaluate("() => window.odt.trainer.step")
    page.fill("#steps", "0")
    page.click("#train")
    assert page.inner_text("#error").startswith("Steps must be")
    for name, value in (("steps", "1"), ("batch", "1"), ("lr", "0")):
        page.fill(f"#{name}", value)
        assert page.eval_on_selector(f"#{name}", "e => e.checkValidity()") is True
    page.click("#train")
    page.wait_for_function("() => window.odt.lastRun !== null || document.getElementById('error').textContent", timeout=60_000)
    assert page.inner_text("#error") == ""
    step_after, rate, runs, run = page.evaluate(RUN_STATE)
    assert [step_after, rate, runs] == [step + 1, 0, 2]  # one training and one optimizer run
    assert run["batches"] == [[0]]
    assert len(run["losses"]) == 1
    assert page.inner_text("#status").startswith("Trained 1 steps on ")
    assert page.get_attribute("#steps", "aria-invalid") is None
