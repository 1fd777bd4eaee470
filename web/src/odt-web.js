// odt-web: train ODT's training artifacts in a browser tab (or Node) on onnxruntime-web.
//
// The artifacts are plain standard ONNX, so onnxruntime-web's ordinary inference build runs
// them: a train step is the training model (loss and one gradient per trainable parameter),
// then the optimizer model (learning rate, step, parameters, gradients, moments -> new
// parameters and moments). Parameters, gradients and moments stay here as tensors between
// steps. Gradients add up across train steps until lazyResetGrad(), as odt_ops.api.Module's
// do. The bundle (python -m odt_ops export-web) is a JSON manifest and one binary; a bundle
// whose hashes or roles do not match its models is refused. modelDiff() writes the file
// odt_ops.export.load_diff reads: an uncompressed zip of .npy arrays and a JSON manifest.
import * as ort from "onnxruntime-web";

export const BUNDLE_FORMAT = "odt-web-bundle";
export const BUNDLE_VERSION = 1;
export const DIFF_FORMAT = "odt-model-diff"; // odt_ops.export.DIFF_FORMAT / DIFF_VERSION
export const DIFF_VERSION = 1;

/** A bundle that cannot be trusted or used: says which file, model or name is at fault. */
export class BundleError extends Error {
  constructor(message) {
    super(message);
    this.name = "BundleError";
  }
}

const ARRAYS = { float32: Float32Array, float64: Float64Array, int32: Int32Array, int64: BigInt64Array };
const NPY_DESCR = { float32: "<f4", float64: "<f8", int32: "<i4", int64: "<i8" };
const IS_LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

async function sha256(bytes) {
  const digest = await globalThis.crypto.subtle.digest("SHA-256", bytes);
  return Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, "0")).join("");
}

const count = (shape) => shape.reduce((a, b) => a * b, 1);

/** A value as an error message shows it: strings quoted, a missing value as "nothing". */
const shown = (value) => (value === undefined ? "nothing" : typeof value === "string" ? JSON.stringify(value) : String(value));

/** `rate` if it is a learning rate odt_ops' Optimizer.set_learning_rate takes (a finite number
 * >= 0; 0 is allowed), else a TypeError (not a number: a string, a boolean, nothing) or a
 * RangeError (negative, NaN, infinite) that names `what`. A negative rate would climb the loss,
 * a NaN or infinite one turn every parameter non-finite, in silence. */
export function checkLearningRate(rate, what = "learningRate") {
  const message = `${what} must be a finite number >= 0, such as 0.001; got ${shown(rate)}`;
  if (typeof rate !== "number") throw new TypeError(message);
  if (!Number.isFinite(rate) || rate < 0) throw new RangeError(message);
  return rate;
}

/** `value` if it is a whole number >= 1 (a step count, a batch size), else a TypeError or
 * RangeError that names `what`. */
export function checkCount(value, what) {
  const message = `${what} must be a whole number >= 1; got ${shown(value)}`;
  if (typeof value !== "number") throw new TypeError(message);
  if (!Number.isInteger(value) || value < 1) throw new RangeError(message);
  return value;
}

/** A typed array copied out of the binary (the binary's bytes are little-endian, as this machine's). */
function readTensor(binary, entry, what) {
  const Typed = ARRAYS[entry.dtype];
  if (!Typed) throw new BundleError(`${what}: dtype ${entry.dtype} is not one of ${Object.keys(ARRAYS)}`);
  if (entry.bytes !== count(entry.shape) * Typed.BYTES_PER_ELEMENT || entry.offset + entry.bytes > binary.byteLength) {
    throw new BundleError(`${what}: its offset and size do not fit the binary; the bundle is damaged`);
  }
  return new Typed(binary.buffer.slice(binary.byteOffset + entry.offset, binary.byteOffset + entry.offset + entry.bytes));
}

/** Fetch bundle.json and the binary it names from a folder's URL (the browser's way in). */
export async function fetchBundle(base = "./") {
  const url = new URL("bundle.json", new URL(base, globalThis.location?.href));
  const get = async (u) => {
    const response = await fetch(u);
    if (!response.ok) throw new BundleError(`${u}: ${response.status} ${response.statusText}`);
    return response;
  };
  const manifest = await (await get(url)).json().catch((e) => { throw new BundleError(`${url}: not JSON (${e.message}); the bundle is damaged`); });
  const binary = new Uint8Array(await (await get(new URL(manifest?.binary?.file ?? "bundle.bin", url))).arrayBuffer());
  return { manifest, binary };
}

/** Check the manifest against the binary and the models; a mismatch throws a BundleError. */
export async function verifyBundle(manifest, binary) {
  if (manifest?.format !== BUNDLE_FORMAT) throw new BundleError(`not an ODT web bundle (format ${JSON.stringify(manifest?.format)})`);
  if (!Number.isInteger(manifest.format_version) || manifest.format_version > BUNDLE_VERSION) {
    throw new BundleError(`bundle format version ${manifest.format_version} is newer than odt-web reads (${BUNDLE_VERSION})`);
  }
  if (!IS_LITTLE_ENDIAN) throw new BundleError("this machine is big-endian; the bundle's tensors are little-endian");
  for (const key of ["binary", "models", "training", "eval", "optimizer"]) {
    if (typeof manifest[key] !== "object" || manifest[key] === null) throw new BundleError(`the manifest has no ${key} section; the bundle is damaged`);
  }
  if (!Array.isArray(manifest.tensors)) throw new BundleError("the manifest lists no tensors; the bundle is damaged");
  const file = manifest.binary.file;
  if (binary.byteLength !== manifest.binary.bytes) {
    throw new BundleError(`${file}: ${binary.byteLength} bytes, the manifest says ${manifest.binary.bytes}; the bundle is truncated or damaged`);
  }
  const found = await sha256(binary);
  if (found !== manifest.binary.sha256) {
    throw new BundleError(`${file}: sha256 ${found} does not match the manifest's ${manifest.binary.sha256}; the bundle was changed or damaged, refusing it`);
  }
  const models = {};
  for (const role of ["training", "eval", "optimizer"]) {
    const m = manifest.models?.[role];
    if (!m || m.offset + m.bytes > binary.byteLength) throw new BundleError(`the manifest lists no usable ${role} model`);
    models[role] = binary.subarray(m.offset, m.offset + m.bytes);
    const digest = await sha256(models[role]);
    if (digest !== m.sha256) {
      throw new BundleError(`${m.file}: sha256 ${digest} does not match the manifest's ${m.sha256}; the manifest does not describe this model, refusing the bundle`);
    }
  }
  return models;
}

function checkNames(what, expected, actual) {
  const missing = expected.filter((n) => !actual.includes(n));
  if (missing.length) {
    throw new BundleError(`${what}: the manifest names ${JSON.stringify(missing)}, which the model does not have (it has ${JSON.stringify(actual)}); the manifest does not match its models`);
  }
}

/** Open a bundle: verify it, create the three sessions, and return a Trainer. */
export async function openBundle(manifest, binary, { numThreads = 1, sessionOptions = {} } = {}) {
  binary = binary instanceof Uint8Array ? binary : new Uint8Array(binary);
  const models = await verifyBundle(manifest, binary);
  if (numThreads) ort.env.wasm.numThreads = numThreads;
  const options = { executionProviders: ["wasm"], graphOptimizationLevel: "all", ...sessionOptions };
  const sessions = {};
  for (const [role, bytes] of Object.entries(models)) sessions[role] = await ort.InferenceSession.create(bytes, options);

  try {
    checkRoles(manifest, sessions);
    return new Trainer(manifest, binary, sessions);
  } catch (error) {
    await Promise.all(Object.values(sessions).map((s) => s.release())); // the sessions hold WebAssembly memory
    throw error;
  }
}

/** The manifest's roles name only inputs and outputs the models have. */
function checkRoles(manifest, sessions) {
  const t = manifest.training, e = manifest.eval, o = manifest.optimizer;
  const params = [...t.trainable, ...t.frozen];
  checkNames(manifest.models.training.file, [...t.user_inputs, ...t.labels, ...params, ...t.buffers], sessions.training.inputNames);
  checkNames(manifest.models.training.file, [t.loss, ...t.extra_outputs, ...Object.values(t.gradients), ...Object.values(t.buffer_updates)],
    sessions.training.outputNames);
  checkNames(manifest.models.eval.file, [...e.user_inputs, ...e.labels, ...e.parameters, ...e.buffers], sessions.eval.inputNames);
  checkNames(manifest.models.eval.file, [e.loss, ...e.extra_outputs], sessions.eval.outputNames);
  checkNames(manifest.models.optimizer.file, [o.scalar_inputs.learning_rate, o.scalar_inputs.step, ...o.parameters.flatMap((p) => [p.value, p.grad, ...Object.values(p.states)])],
    sessions.optimizer.inputNames);
  checkNames(manifest.models.optimizer.file, o.parameters.flatMap((p) => p.outputs), sessions.optimizer.outputNames);
}

/** Train and eval steps over one opened bundle, and the model difference they made. */
export class Trainer {
  #learningRate;

  constructor(manifest, binary, sessions) {
    this.manifest = manifest;
    this.sessions = sessions;
    this.roles = manifest.training;
    try {
      this.learningRate = manifest.optimizer.learning_rate;
    } catch (error) {
      throw new BundleError(`the manifest's ${error.message}; the bundle is damaged`);
    }
    this.step = manifest.optimizer.step;
    const tensor = (entry) => new ort.Tensor(entry.dtype, readTensor(binary, entry, `tensor ${entry.name}`), entry.shape);
    this.base = new Map(); // the trainable parameters as bundled: what modelDiff subtracts
    this.values = new Map(); // parameters and buffers, fed to both models
    const states = new Map();
    for (const entry of manifest.tensors) {
      if (entry.kind === "state") {
        if (!states.has(entry.name)) states.set(entry.name, {});
        states.get(entry.name)[entry.state] = tensor(entry);
      } else {
        this.values.set(entry.name, tensor(entry));
        if (entry.kind === "parameter" && entry.trainable) this.base.set(entry.name, readTensor(binary, entry, entry.name));
      }
    }
    for (const name of [...this.roles.trainable, ...this.roles.frozen, ...this.roles.buffers]) {
      if (!this.values.has(name)) throw new BundleError(`the bundle holds no values for ${name}, which the training model takes`);
    }
    // moments start as the checkpoint's, or zeros (a fresh optimizer)
    this.states = new Map(manifest.optimizer.parameters.map((p) => {
      const value = this.values.get(p.name);
      const own = states.get(p.name) ?? {};
      return [p.name, Object.fromEntries(Object.keys(p.states).map((s) =>
        [s, own[s] ?? new ort.Tensor(value.type, new ARRAYS[value.type](value.size), value.dims)]))];
    }));
    this.grads = new Map();
    this.resetGrad = true;
    this.samples = Object.fromEntries(Object.entries(manifest.samples ?? {}).map(([name, s]) =>
      [name, { x: readTensor(binary, s.x, `${name}.x`), xShape: s.x.shape, y: readTensor(binary, s.y, `${name}.y`) }]));
  }

  /** The learning rate the next optimizerStep uses. Setting it checks it as odt_ops'
   * Optimizer.set_learning_rate does: anything but a finite number >= 0 throws and leaves it as it was. */
  get learningRate() {
    return this.#learningRate;
  }

  set learningRate(rate) {
    this.#learningRate = checkLearningRate(rate, "learningRate");
  }

  /** The feeds of one batch: x [n, ...] float32 values, y class ids, encoded as the label input takes them. */
  batchFeeds(x, y, n) {
    checkCount(n, "the batch size n");
    if (y.length !== n) throw new RangeError(`the batch has ${y.length} labels for a batch size n of ${n}`);
    const [input] = this.roles.user_inputs, [label] = this.roles.labels;
    const specs = this.roles.inputs;
    const inShape = [n, ...specs[input].shape.slice(1)];
    if (inShape.some((d) => d === null)) throw new BundleError(`input ${input} has a symbolic non-batch dimension; odt-web feeds fixed sample shapes`);
    if (x.length !== count(inShape)) throw new BundleError(`input ${input}: ${x.length} values do not make a batch of shape ${JSON.stringify(inShape)}`);
    const labelSpec = specs[label];
    let labels;
    if (labelSpec.dtype === "int64") {
      labels = new ort.Tensor("int64", BigInt64Array.from(y, (v) => BigInt(v)), [n]);
    } else { // one-hot rows (mse, l1, bce_with_logits), as pipeline.training.target_encoder makes them
      const width = labelSpec.shape.at(-1);
      const data = new ARRAYS[labelSpec.dtype](n * width);
      y.forEach((v, i) => { data[i * width + Number(v)] = 1; });
      labels = new ort.Tensor(labelSpec.dtype, data, [n, width]);
    }
    return { [input]: new ort.Tensor(specs[input].dtype, x, inShape), [label]: labels };
  }

  paramFeeds(names) {
    return Object.fromEntries(names.map((n) => [n, this.values.get(n)]));
  }

  /** Forward + backward on one batch; gradients overwrite (after lazyResetGrad) or add up. Returns the loss. */
  async trainStep(x, y, n = y.length) {
    const r = this.roles;
    const feeds = { ...this.batchFeeds(x, y, n), ...this.paramFeeds([...r.trainable, ...r.frozen, ...r.buffers]) };
    const gradNames = r.trainable.filter((p) => p in r.gradients);
    const out = await this.sessions.training.run(feeds, [r.loss, ...gradNames.map((p) => r.gradients[p]), ...Object.values(r.buffer_updates)]);
    const loss = Number(out[r.loss].data[0]);
    if (!Number.isFinite(loss)) {
      throw new Error(`the loss is ${loss}; parameters and gradients were left as they were. Lower the learning rate or check the data`);
    }
    for (const p of gradNames) {
      const g = out[r.gradients[p]];
      if (this.resetGrad || !this.grads.has(p)) this.grads.set(p, g);
      else {
        const acc = this.grads.get(p).data, add = g.data;
        for (let i = 0; i < acc.length; i++) acc[i] += add[i];
      }
    }
    this.resetGrad = false;
    for (const [buffer, updated] of Object.entries(r.buffer_updates)) this.values.set(buffer, out[updated]);
    return loss;
  }

  /** The next train step overwrites the gradients instead of adding to them. */
  lazyResetGrad() {
    this.resetGrad = true;
  }

  /** One optimizer update of every trainable parameter from its accumulated gradient. */
  async optimizerStep() {
    const o = this.manifest.optimizer;
    this.step += 1;
    const feeds = {
      [o.scalar_inputs.learning_rate]: new ort.Tensor("float32", Float32Array.of(this.learningRate), []),
      [o.scalar_inputs.step]: new ort.Tensor("int64", BigInt64Array.of(BigInt(this.step)), []),
    };
    for (const p of o.parameters) {
      if (!this.grads.has(p.name)) throw new Error(`no gradient for ${p.name}: run trainStep before optimizerStep`);
      feeds[p.value] = this.values.get(p.name);
      feeds[p.grad] = this.grads.get(p.name);
      for (const [s, input] of Object.entries(p.states)) feeds[input] = this.states.get(p.name)[s];
    }
    const out = await this.sessions.optimizer.run(feeds);
    for (const p of o.parameters) { // outputs: the new value, then the states in the manifest's order
      this.values.set(p.name, out[p.outputs[0]]);
      Object.keys(p.states).forEach((s, k) => { this.states.get(p.name)[s] = out[p.outputs[1 + k]]; });
    }
  }

  /** Mean loss and accuracy (argmax of the first extra output against y) over a sample set, in batches. */
  async evaluate(x, y, { batchSize = 256 } = {}) {
    const e = this.manifest.eval;
    const n = y.length, per = x.length / n;
    let lossSum = 0, correct = 0;
    for (let start = 0; start < n; start += batchSize) {
      const m = Math.min(batchSize, n - start);
      const feeds = { ...this.batchFeeds(x.subarray(start * per, (start + m) * per), y.subarray(start, start + m), m),
        ...this.paramFeeds([...e.parameters, ...e.buffers]) };
      const out = await this.sessions.eval.run(feeds);
      lossSum += Number(out[e.loss].data[0]) * m;
      const logits = e.extra_outputs.length ? out[e.extra_outputs[0]] : null;
      if (logits) {
        const k = logits.dims.at(-1), d = logits.data;
        for (let i = 0; i < m; i++) {
          let best = 0;
          for (let c = 1; c < k; c++) if (d[i * k + c] > d[i * k + best]) best = c;
          if (best === Number(y[start + i])) correct += 1;
        }
      }
    }
    return { loss: lossSum / n, accuracy: e.extra_outputs.length ? correct / n : null, samples: n };
  }

  /** `steps` train steps (train, optimizer, reset) over batches of x, y drawn in `order`
   * (default: a seeded shuffle, epoch after epoch). Reports progress; returns the losses,
   * each batch's sample indices and the milliseconds per step. */
  async train(x, y, { steps, batchSize = 16, seed = 0, order, onProgress } = {}) {
    checkCount(steps, "steps");
    checkCount(batchSize, "batchSize");
    const n = y.length, per = x.length / n;
    const indices = order ?? shuffled(n, seed);
    if (!indices.length || indices.some((i) => !Number.isInteger(i) || i < 0 || i >= n)) {
      throw new RangeError(`order must list sample indices in [0, ${n}); it has ${indices.length} entries, some outside`);
    }
    const losses = [], batches = [];
    const xb = new Float32Array(batchSize * per), yb = new Array(batchSize);
    const started = performance.now();
    for (let s = 0, next = 0; s < steps; s++) {
      const batch = [];
      for (let i = 0; i < batchSize; i++, next++) batch.push(indices[next % indices.length]);
      batch.forEach((j, i) => { xb.set(x.subarray(j * per, (j + 1) * per), i * per); yb[i] = Number(y[j]); });
      const loss = await this.trainStep(xb, yb, batchSize); // the run copies xb into WebAssembly memory before it resolves
      await this.optimizerStep();
      this.lazyResetGrad();
      losses.push(loss);
      batches.push(batch);
      onProgress?.({ step: s + 1, steps, loss });
    }
    return { losses, batches, msPerStep: (performance.now() - started) / steps };
  }

  /** The trainable parameters' current values, by name. */
  parameters() {
    return Object.fromEntries(this.roles.trainable.map((p) => [p, this.values.get(p).data]));
  }

  /** The model difference (trained minus bundled, per trainable parameter) as the bytes of an
   * odt model-difference file, which odt_ops.export.load_diff and apply_diff take. */
  modelDiff({ numExamples = 0, numSteps = this.step - this.manifest.optimizer.step, metadata = {} } = {}) {
    const entries = this.roles.trainable.map((name, i) => {
      const base = this.base.get(name), now = this.values.get(name).data;
      const delta = new base.constructor(base.length);
      for (let j = 0; j < base.length; j++) delta[j] = now[j] - base[j];
      const entry = this.manifest.tensors.find((t) => t.name === name && t.kind === "parameter");
      return { key: `t${i}`, name, shape: entry.shape, dtype: entry.dtype, data: delta };
    });
    const manifest = {
      format: DIFF_FORMAT, format_version: DIFF_VERSION, base_hash: this.manifest.base_hash,
      num_examples: numExamples, num_steps: numSteps, metadata: { producer: "odt-web", ...metadata },
      tensors: entries.map(({ key, name, shape, dtype }) => ({ key, shape, dtype: NPY_DESCR[dtype], name })),
    };
    const files = entries.map((e) => ({ name: `${e.key}.npy`, data: npy(e.dtype, e.shape, e.data) }));
    files.push({ name: "manifest.json", data: new TextEncoder().encode(JSON.stringify(manifest, null, 1)) });
    return zipStored(files);
  }
}

/** A permutation of 0..n-1 from a seeded generator (mulberry32), epoch after epoch the same for a seed. */
export function shuffled(n, seed = 0) {
  let a = seed >>> 0;
  const random = () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const out = Array.from({ length: n }, (_, i) => i);
  for (let i = n - 1; i > 0; i--) {
    const j = Math.floor(random() * (i + 1));
    [out[i], out[j]] = [out[j], out[i]];
  }
  return out;
}

/** An .npy file (format 1.0): magic, a header padded to a multiple of 64 bytes, the raw little-endian data. */
export function npy(dtype, shape, data) {
  const dims = shape.length === 1 ? `(${shape[0]},)` : `(${shape.join(", ")})`;
  let header = `{'descr': '${NPY_DESCR[dtype]}', 'fortran_order': False, 'shape': ${dims}, }`;
  header += " ".repeat(63 - ((10 + header.length) % 64)) + "\n";
  const out = new Uint8Array(10 + header.length + data.byteLength);
  out.set([0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 1, 0, header.length & 0xff, header.length >> 8]);
  out.set(new TextEncoder().encode(header), 10);
  out.set(new Uint8Array(data.buffer, data.byteOffset, data.byteLength), 10 + header.length);
  return out;
}

const CRC_TABLE = Uint32Array.from({ length: 256 }, (_, n) => {
  let c = n;
  for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
  return c >>> 0;
});

/** CRC-32 (zip's, IEEE 802.3). */
export function crc32(bytes) {
  let c = 0xffffffff;
  for (let i = 0; i < bytes.length; i++) c = CRC_TABLE[(c ^ bytes[i]) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

/** A zip of uncompressed (stored) members, as odt's tensor files are: local headers, data, the
 * central directory, the end record. Dates are 1980-01-01 as odt writes them. No zip64: members
 * and the whole file stay under 4 GiB. */
export function zipStored(files) {
  const encoder = new TextEncoder();
  const DOS_DATE = (0 << 9) | (1 << 5) | 1; // 1980-01-01
  const locals = [], central = [];
  let offset = 0;
  for (const { name, data } of files) {
    const nameBytes = encoder.encode(name), crc = crc32(data);
    const local = new DataView(new ArrayBuffer(30));
    local.setUint32(0, 0x04034b50, true);
    local.setUint16(4, 20, true); // version needed: 2.0
    local.setUint16(10, 0, true); // time
    local.setUint16(12, DOS_DATE, true);
    local.setUint32(14, crc, true);
    local.setUint32(18, data.length, true);
    local.setUint32(22, data.length, true);
    local.setUint16(26, nameBytes.length, true);
    locals.push(new Uint8Array(local.buffer), nameBytes, data);
    const entry = new DataView(new ArrayBuffer(46));
    entry.setUint32(0, 0x02014b50, true);
    entry.setUint16(4, 20, true);
    entry.setUint16(6, 20, true);
    entry.setUint16(14, DOS_DATE, true);
    entry.setUint32(16, crc, true);
    entry.setUint32(20, data.length, true);
    entry.setUint32(24, data.length, true);
    entry.setUint16(28, nameBytes.length, true);
    entry.setUint32(42, offset, true);
    central.push(new Uint8Array(entry.buffer), nameBytes);
    offset += 30 + nameBytes.length + data.length;
  }
  const centralSize = central.reduce((a, b) => a + b.length, 0);
  const end = new DataView(new ArrayBuffer(22));
  end.setUint32(0, 0x06054b50, true);
  end.setUint16(8, files.length, true);
  end.setUint16(10, files.length, true);
  end.setUint32(12, centralSize, true);
  end.setUint32(16, offset, true);
  const parts = [...locals, ...central, new Uint8Array(end.buffer)];
  const out = new Uint8Array(parts.reduce((a, b) => a + b.length, 0));
  let at = 0;
  for (const part of parts) { out.set(part, at); at += part.length; }
  return out;
}
