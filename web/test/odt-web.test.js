// odt-web's unit tests, under Node's test runner (`npm test` or `node --test test/` in web/),
// on onnxruntime-web's WebAssembly build as the browser runs it.
//
// The bundle comes from ODT_WEB_BUNDLE (a folder written by `python -m odt_ops export-web`,
// as tests/web/test_node.py passes it), else it is made here by tests/web/bundle_fixture.py
// with the repository's virtualenv (ODT_PYTHON overrides which python).
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { BundleError, checkCount, checkLearningRate, crc32, npy, openBundle, shuffled, verifyBundle, zipStored } from "../src/odt-web.js";

const REPO = resolve(fileURLToPath(import.meta.url), "../../..");

function bundleDir() {
  if (process.env.ODT_WEB_BUNDLE) return process.env.ODT_WEB_BUNDLE;
  const python = process.env.ODT_PYTHON ?? join(REPO, ".venv/bin/python");
  const out = mkdtempSync(join(tmpdir(), "odt-web-"));
  const made = execFileSync(existsSync(python) ? python : "python3", ["-m", "tests.web.bundle_fixture", out], { cwd: REPO, encoding: "utf8" });
  return made.trim().split("\n").at(-1);
}

const DIR = bundleDir();
const load = () => ({ manifest: JSON.parse(readFileSync(join(DIR, "bundle.json"), "utf8")), binary: new Uint8Array(readFileSync(join(DIR, "bundle.bin"))) });

test("crc32 gives the standard check value of '123456789'", () => {
  assert.equal(crc32(new TextEncoder().encode("123456789")), 0xcbf43926); // the CRC-32/ISO-HDLC check value
});

test("npy headers are padded to 64 bytes and describe dtype and shape as numpy writes them", () => {
  const file = npy("float32", [3], Float32Array.of(1, 2, 3));
  const headerLength = file[8] | (file[9] << 8);
  assert.equal((10 + headerLength) % 64, 0);
  const header = new TextDecoder().decode(file.subarray(10, 10 + headerLength));
  assert.match(header, /^\{'descr': '<f4', 'fortran_order': False, 'shape': \(3,\), \} *\n$/);
  assert.deepEqual([...new Float32Array(file.slice(10 + headerLength).buffer)], [1, 2, 3]);
});

test("zipStored writes the end record where the zip format puts it, naming every member", () => {
  const zip = zipStored([{ name: "a.txt", data: new TextEncoder().encode("hello") }, { name: "b", data: new Uint8Array(0) }]);
  const view = new DataView(zip.buffer);
  const end = zip.length - 22;
  assert.equal(view.getUint32(end, true), 0x06054b50);
  assert.equal(view.getUint16(end + 10, true), 2);
  const centralOffset = view.getUint32(end + 16, true);
  assert.equal(view.getUint32(centralOffset, true), 0x02014b50);
  assert.equal(view.getUint32(centralOffset + 16, true), crc32(new TextEncoder().encode("hello")));
});

test("shuffled is a seeded permutation", () => {
  const a = shuffled(50, 7);
  assert.deepEqual([...a].sort((x, y) => x - y), Array.from({ length: 50 }, (_, i) => i));
  assert.deepEqual(shuffled(50, 7), a);
  assert.notDeepEqual(shuffled(50, 8), a);
});

test("a bundle whose binary changed by one byte is refused", async () => {
  const { manifest, binary } = load();
  binary[manifest.models.eval.offset + 100] ^= 1;
  await assert.rejects(openBundle(manifest, binary), (e) => e instanceof BundleError && /bundle\.bin: sha256 .* refusing it/.test(e.message));
});

test("a manifest whose model hash does not match its model is refused, naming the model", async () => {
  const { manifest, binary } = load();
  manifest.models.training = { ...manifest.models.training, offset: manifest.models.eval.offset, bytes: manifest.models.eval.bytes };
  await assert.rejects(verifyBundle(manifest, binary), (e) => e instanceof BundleError && /training_model\.onnx: sha256/.test(e.message));
});

test("a manifest whose roles name inputs the model lacks is refused", async () => {
  const { manifest, binary } = load();
  manifest.training.trainable = [...manifest.training.trainable, "no.such.weight"];
  await assert.rejects(openBundle(manifest, binary), (e) => e instanceof BundleError && /no\.such\.weight/.test(e.message));
});

test("gradients add up across train steps until lazyResetGrad, as odt_ops' Module does", async () => {
  const { manifest, binary } = load();
  const trainer = await openBundle(manifest, binary);
  const { x, y } = trainer.samples.train;
  const per = x.length / y.length;
  const batch = (i) => [x.slice(i * 8 * per, (i + 1) * 8 * per), Array.from(y.subarray(i * 8, (i + 1) * 8), Number), 8];
  const gradsOf = () => Object.fromEntries([...trainer.grads].map(([k, v]) => [k, Float32Array.from(v.data)]));
  await trainer.trainStep(...batch(0));
  const first = gradsOf();
  trainer.lazyResetGrad();
  await trainer.trainStep(...batch(1));
  const second = gradsOf();
  await trainer.trainStep(...batch(0)); // no reset: adds
  for (const [name, summed] of Object.entries(gradsOf())) {
    summed.forEach((v, i) => assert.ok(Math.abs(v - (first[name][i] + second[name][i])) <= 1e-6 * (1 + Math.abs(v)), `${name}[${i}]`));
  }
  trainer.lazyResetGrad();
  await trainer.trainStep(...batch(0)); // reset: overwrites
  for (const [name, g] of Object.entries(gradsOf())) assert.deepEqual(g, first[name]);
});

test("training lowers the loss, moves only the trainable parameters, and reports progress", async () => {
  const { manifest, binary } = load();
  const trainer = await openBundle(manifest, binary);
  const { x, y } = trainer.samples.train;
  const frozenBefore = Float32Array.from(trainer.values.get(manifest.training.frozen[0]).data);
  trainer.learningRate = 0.01;
  const seen = [];
  const { losses, batches, msPerStep } = await trainer.train(x, y, { steps: 30, batchSize: 16, onProgress: (p) => seen.push(p.step) });
  assert.equal(losses.length, 30);
  assert.deepEqual(seen, Array.from({ length: 30 }, (_, i) => i + 1));
  assert.equal(batches[0].length, 16);
  assert.ok(msPerStep > 0);
  const mean = (a) => a.reduce((s, v) => s + v, 0) / a.length;
  assert.ok(mean(losses.slice(-5)) < mean(losses.slice(0, 5)), `${losses}`);
  assert.deepEqual(trainer.values.get(manifest.training.frozen[0]).data, frozenBefore);
  assert.equal(trainer.step, 30);
  const holdout = trainer.samples.holdout;
  const result = await trainer.evaluate(holdout.x, holdout.y);
  assert.equal(result.samples, holdout.y.length);
  assert.ok(result.accuracy >= 0 && result.accuracy <= 1);
});

test("train refuses an order naming samples that do not exist", async () => {
  const { manifest, binary } = load();
  const trainer = await openBundle(manifest, binary);
  const { x, y } = trainer.samples.train;
  await assert.rejects(trainer.train(x, y, { steps: 1, batchSize: 2, order: [0, y.length] }), RangeError);
  assert.equal(trainer.step, manifest.optimizer.step);
});

// ---- argument checks: what odt_ops' Optimizer.set_learning_rate refuses, and batch sizes and
// step counts that are not whole numbers >= 1, are refused before any model runs ----------------

/** A trainer whose training and optimizer sessions count their runs. */
async function countingTrainer() {
  const { manifest, binary } = load();
  const trainer = await openBundle(manifest, binary);
  const runs = { training: 0, optimizer: 0 };
  for (const role of Object.keys(runs)) {
    const session = trainer.sessions[role], run = session.run.bind(session);
    session.run = (...args) => { runs[role] += 1; return run(...args); };
  }
  return { manifest, trainer, runs };
}

const BAD_RATES = [[-1, RangeError], [-1e-9, RangeError], [NaN, RangeError], [Infinity, RangeError], [-Infinity, RangeError],
  ["0.01", TypeError], ["", TypeError], [true, TypeError], [null, TypeError], [undefined, TypeError], [10n, TypeError]];

test("checkLearningRate takes a finite number >= 0, 0 included, as set_learning_rate does, and names what it checks", () => {
  for (const rate of [0, 1e-3, 0.5, 10]) assert.equal(checkLearningRate(rate), rate);
  for (const [rate, Error] of BAD_RATES) {
    assert.throws(() => checkLearningRate(rate, "Learning rate"), (e) => e instanceof Error
      && /^Learning rate must be a finite number >= 0, such as 0\.001; got /.test(e.message), String(rate));
  }
  assert.throws(() => checkLearningRate(-1), { message: "learningRate must be a finite number >= 0, such as 0.001; got -1" });
  assert.throws(() => checkLearningRate(undefined), { message: /got nothing$/ });
  assert.throws(() => checkLearningRate("0.01"), { message: /got "0\.01"$/ });
});

test("checkCount takes whole numbers >= 1 only", () => {
  for (const n of [1, 2, 16, 1e3]) assert.equal(checkCount(n, "steps"), n);
  for (const [n, Error] of [[0, RangeError], [-1, RangeError], [2.5, RangeError], [NaN, RangeError], [Infinity, RangeError],
    ["3", TypeError], [undefined, TypeError], [null, TypeError], [true, TypeError]]) {
    assert.throws(() => checkCount(n, "steps"), (e) => e instanceof Error && /^steps must be a whole number >= 1; got /.test(e.message), String(n));
  }
});

test("a refused learning rate throws and leaves the trainer's rate as it was, running no model", async () => {
  const { trainer, runs } = await countingTrainer();
  trainer.learningRate = 0.02;
  for (const [rate, Error] of BAD_RATES) {
    assert.throws(() => { trainer.learningRate = rate; }, Error, String(rate));
    assert.equal(trainer.learningRate, 0.02);
  }
  trainer.learningRate = 0; // allowed, as odt_ops' Optimizer allows it
  assert.equal(trainer.learningRate, 0);
  assert.deepEqual(runs, { training: 0, optimizer: 0 });
});

test("a bundle whose manifest holds a bad learning rate is refused as damaged", async () => {
  const { manifest, binary } = load();
  manifest.optimizer.learning_rate = -0.5;
  await assert.rejects(openBundle(manifest, binary), (e) => e instanceof BundleError
    && /learningRate must be a finite number >= 0.*got -0\.5; the bundle is damaged/.test(e.message));
});

test("train refuses steps and batch sizes that are not whole numbers >= 1, before any step runs", async () => {
  const { manifest, trainer, runs } = await countingTrainer();
  const { x, y } = trainer.samples.train;
  const before = Object.fromEntries(Object.entries(trainer.parameters()).map(([k, v]) => [k, Float32Array.from(v)]));
  const cases = [[{ steps: 0 }, /^steps must be a whole number >= 1; got 0$/], [{ steps: 2.5 }, /got 2\.5$/], [{ steps: -3 }, /got -3$/],
    [{}, /^steps .* got nothing$/], [{ steps: "5" }, /got "5"$/],
    [{ steps: 1, batchSize: 0 }, /^batchSize must be a whole number >= 1; got 0$/], [{ steps: 1, batchSize: 1.5 }, /got 1\.5$/]];
  for (const [options, message] of cases) {
    await assert.rejects(trainer.train(x, y, options), (e) => (e instanceof RangeError || e instanceof TypeError) && message.test(e.message),
      JSON.stringify(options));
  }
  assert.deepEqual(runs, { training: 0, optimizer: 0 });
  assert.equal(trainer.step, manifest.optimizer.step);
  assert.deepEqual(trainer.parameters(), before);
  const { losses } = await trainer.train(x, y, { steps: 1, batchSize: 1 }); // the smallest valid run still trains
  assert.equal(losses.length, 1);
  assert.deepEqual(runs, { training: 1, optimizer: 1 });
});

test("trainStep refuses an empty batch or one whose labels do not match n, naming the batch size, not onnxruntime's reshape", async () => {
  const { trainer, runs } = await countingTrainer();
  const { x, y } = trainer.samples.train;
  const per = x.length / y.length;
  await assert.rejects(trainer.trainStep(new Float32Array(0), [], 0), { name: "RangeError", message: "the batch size n must be a whole number >= 1; got 0" });
  await assert.rejects(trainer.trainStep(x.slice(0, 2 * per), [1, 2, 3], 2), { name: "RangeError", message: "the batch has 3 labels for a batch size n of 2" });
  assert.deepEqual(runs, { training: 0, optimizer: 0 });
  assert.equal(trainer.grads.size, 0);
});
