"""odt-web under Node (onnxruntime-web's WebAssembly build, as in the browser): its unit tests
(web/test/*.test.js) under Node's test runner, and training resumed from a checkpoint that
carries optimizer state, held to odt's Python Module and Optimizer resuming from the same."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from odt_ops.web_bundle import write_web_bundle
from tests.web.conftest import WEB, missing_node_packages
from tests.web.oracle import PythonTrainer, samples

pytestmark = pytest.mark.skipif(missing_node_packages() is not None, reason=str(missing_node_packages()))

# open a bundle, train the given batches, print the losses, step and parameters
RESUME = """
import { readFileSync } from "node:fs";
import { openBundle } from "./src/odt-web.js";
const [dir, batchesJson] = process.argv.slice(1);
const trainer = await openBundle(JSON.parse(readFileSync(dir + "/bundle.json", "utf8")), readFileSync(dir + "/bundle.bin"));
const batches = JSON.parse(batchesJson), { x, y } = trainer.samples.train;
const run = await trainer.train(x, y, { steps: batches.length, batchSize: batches[0].length, order: batches.flat() });
const parameters = Object.fromEntries(Object.entries(trainer.parameters()).map(([k, v]) => [k, Array.from(v)]));
console.log(JSON.stringify({ losses: run.losses, step: trainer.step, learningRate: trainer.learningRate, parameters }));
"""


def test_node_unit_tests_pass(bundle_root):
    env = {**os.environ, "ODT_WEB_BUNDLE": str(bundle_root / "bundle")}
    run = subprocess.run(["node", "--test", "test/"], cwd=WEB, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "# fail 0" in run.stdout


def test_training_resumes_from_optimizer_state_as_python_does(bundle_root, tmp_path):
    x, y = samples(bundle_root, "train")
    batches = [[(16 * i + k) % len(y) for k in range(16)] for i in range(10)]
    artifacts = tmp_path / "artifacts"
    shutil.copytree(bundle_root / "artifacts", artifacts)
    python = PythonTrainer(artifacts, learning_rate=0.02)
    python.train(x, y, batches[:5])
    python.save(artifacts / "checkpoint")  # step 5, its learning rate and both AdamW moments
    write_web_bundle(artifacts, tmp_path / "bundle", samples={"train": bundle_root / "samples" / "train.npz"})

    run = subprocess.run(["node", "--input-type=module", "-e", RESUME, str(tmp_path / "bundle"), json.dumps(batches[5:])],
                         cwd=WEB, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    node = json.loads(run.stdout)
    losses = python.train(x, y, batches[5:])
    assert node["step"] == 10
    assert node["learningRate"] == pytest.approx(0.02)
    np.testing.assert_allclose(node["losses"], losses, rtol=2e-5, atol=1e-6)
    for name, value in node["parameters"].items():
        np.testing.assert_allclose(np.asarray(value, np.float32).reshape(python.parameters[name].shape), python.parameters[name],
                                   rtol=1e-4, atol=1e-6, err_msg=name)
