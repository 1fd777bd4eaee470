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

import { BundleError, crc32, npy, openBundle, shuffled, verifyBundle, zipStored } from "../src/odt-web.js";

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
