// The demo page: draw digits (or load the bundle's slanted ones), train the head here, compare
// holdout accuracy before and after, download the model difference for odt_ops.export.apply_diff.
// window.odt exposes the trainer and the last run, for tests and the curious.
import * as ort from "onnxruntime-web";
import { checkCount, checkLearningRate, fetchBundle, openBundle } from "./odt-web.js";

const $ = (id) => document.getElementById(id);
const SIDE = 8, BITMAP = 32; // optdigits: 32x32 bitmaps counted into 4x4 blocks -> 8x8 values in [0, 1]
const user = { x: [], y: [] }; // the samples to train on, each x SIDE*SIDE floats
const odt = (window.odt = { lastRun: null, samples: user });

function fail(error) {
  $("error").textContent = String(error?.message ?? error);
  $("status").textContent = "The bundle cannot be used.";
  console.error(error);
}

function showSample(values) {
  const c = document.createElement("canvas");
  c.width = c.height = SIDE;
  const img = c.getContext("2d").createImageData(SIDE, SIDE);
  values.forEach((v, i) => { img.data.set([v * 255, v * 255, v * 255, 255], i * 4); });
  c.getContext("2d").putImageData(img, 0, 0);
  $("samples").append(c);
  $("count").textContent = user.y.length;
}

function addSample(values, label) {
  user.x.push(values);
  user.y.push(label);
  showSample(values);
  $("train").disabled = !odt.trainer;
}

// ---- the drawing pad -------------------------------------------------------------------
const pad = $("pad"), pen = pad.getContext("2d");
pen.lineWidth = 20; // a stroke of 4-5 pixels in the 32x32 bitmap, as optdigits' pens made
pen.lineCap = pen.lineJoin = "round";
pen.strokeStyle = "#fff";
let drawing = false;
pad.addEventListener("pointerdown", (e) => { drawing = true; pen.beginPath(); pen.moveTo(e.offsetX, e.offsetY); });
pad.addEventListener("pointermove", (e) => { if (drawing) { pen.lineTo(e.offsetX, e.offsetY); pen.stroke(); } });
addEventListener("pointerup", () => { drawing = false; });
const clearPad = () => { pen.fillStyle = "#000"; pen.fillRect(0, 0, pad.width, pad.height); };
clearPad();
for (let d = 0; d < 10; d++) $("label").add(new Option(String(d), String(d)));

/** The drawing as optdigits made its digits: the ink's bounding box scaled into a 32x32 bitmap,
 * each 4x4 block's count of ink pixels / 16. */
function padSample() {
  const { data, width, height } = pen.getImageData(0, 0, pad.width, pad.height);
  let top = height, left = width, bottom = -1, right = -1;
  for (let r = 0; r < height; r++) for (let c = 0; c < width; c++) {
    if (data[(r * width + c) * 4] > 127) { top = Math.min(top, r); bottom = Math.max(bottom, r); left = Math.min(left, c); right = Math.max(right, c); }
  }
  if (bottom < 0) return null;
  const side = Math.max(bottom - top, right - left) + 1;
  const small = new OffscreenCanvas(BITMAP, BITMAP).getContext("2d");
  small.fillStyle = "#000"; small.fillRect(0, 0, BITMAP, BITMAP);
  small.drawImage(pad, left - (side - (right - left + 1)) / 2, top - (side - (bottom - top + 1)) / 2, side, side, 0, 0, BITMAP, BITMAP);
  const bits = small.getImageData(0, 0, BITMAP, BITMAP).data, up = BITMAP / SIDE;
  const values = new Array(SIDE * SIDE).fill(0);
  for (let r = 0; r < BITMAP; r++) for (let c = 0; c < BITMAP; c++) {
    if (bits[(r * BITMAP + c) * 4] > 127) values[Math.floor(r / up) * SIDE + Math.floor(c / up)] += 1 / (up * up);
  }
  return values;
}

$("add").onclick = () => { const v = padSample(); if (v) addSample(v, Number($("label").value)); clearPad(); };
$("clear").onclick = clearPad;
$("load-bundled").onclick = () => {
  const { x, y } = odt.trainer.samples.train, per = x.length / y.length;
  for (let i = 0; i < y.length; i++) addSample(Array.from(x.subarray(i * per, (i + 1) * per)), Number(y[i]));
  $("load-bundled").disabled = true;
};

// ---- training --------------------------------------------------------------------------
async function holdoutAccuracy() {
  const h = odt.trainer.samples.holdout;
  if (!h) return "no holdout in the bundle";
  const { accuracy, loss, samples } = await odt.trainer.evaluate(h.x, h.y);
  if (accuracy === null) return `loss ${loss.toFixed(4)} on ${samples} (the eval model outputs no class scores)`;
  return `${(100 * accuracy).toFixed(1)} % of ${samples}`;
}

/** The training fields, each checked by odt-web's own rule (the learning rate as odt_ops'
 * Optimizer.set_learning_rate checks it); the inputs' min, step and required say the same. */
const FIELDS = [["steps", "Steps", checkCount], ["batch", "Batch", checkCount], ["lr", "Learning rate", checkLearningRate]];

/** The fields' values by id, or null after showing, for each bad field, its name and what it takes.
 * An empty field is refused, not read as 0 (Number("") is 0); so is text that is not a number,
 * which the browser gives as "". */
function trainingInputs() {
  const values = {}, problems = [];
  for (const [id, label, check] of FIELDS) {
    const input = $(id), text = input.value.trim();
    try {
      values[id] = check(text === "" ? undefined : Number(text), label);
      input.removeAttribute("aria-invalid");
    } catch (error) {
      input.setAttribute("aria-invalid", "true");
      problems.push(text === "" ? `${error.message} (the field is empty or not a number)` : error.message);
    }
  }
  if (!problems.length) return values;
  $("error").textContent = `${problems.join("\n")}\nNothing was trained.`;
  return null;
}

$("train").onclick = async () => {
  const trainer = odt.trainer;
  $("error").textContent = "";
  const inputs = trainingInputs(); // before anything changes: a refused field leaves the trainer as it was
  if (!inputs) return;
  $("train").disabled = true;
  try {
    trainer.learningRate = inputs.lr;
    const x = Float32Array.from(user.x.flat()), y = Int32Array.from(user.y);
    const steps = inputs.steps, batchSize = Math.min(inputs.batch, y.length);
    const order = Array.from({ length: y.length }, (_, i) => i); // in the order the samples were added
    const run = await trainer.train(x, y, { steps, batchSize, order, onProgress: ({ step, loss }) => {
      $("progress").value = step / steps;
      $("loss").textContent = loss.toFixed(4);
    } });
    $("speed").textContent = `${run.msPerStep.toFixed(2)} ms (train + optimizer model, batch ${batchSize})`;
    $("after").textContent = await holdoutAccuracy();
    odt.lastRun = { ...run, parameters: Object.fromEntries(Object.entries(trainer.parameters()).map(([k, v]) => [k, Array.from(v)])) };
    $("download").disabled = false;
    $("status").textContent = `Trained ${trainer.step - trainer.manifest.optimizer.step} steps on ${y.length} samples.`;
  } catch (error) {
    $("error").textContent = String(error?.message ?? error);
  } finally {
    $("train").disabled = false;
  }
};

$("download").onclick = () => {
  const trainer = odt.trainer;
  const bytes = trainer.modelDiff({ numExamples: user.y.length, metadata: { producer: "odt-web demo" } });
  const link = Object.assign(document.createElement("a"), { href: URL.createObjectURL(new Blob([bytes])), download: "model.odtdiff" });
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 10000);
};

// ---- start: ?bundle=FOLDER/ loads another bundle than the page's own folder ---------------
odt.ready = (async () => {
  ort.env.wasm.wasmPaths = new URL("./ort/", import.meta.url).href;
  const { manifest, binary } = await fetchBundle(new URLSearchParams(location.search).get("bundle") ?? "./");
  odt.trainer = await openBundle(manifest, binary);
  $("lr").value = odt.trainer.learningRate;
  $("load-bundled").disabled = !odt.trainer.samples.train;
  $("before").textContent = await holdoutAccuracy();
  $("status").textContent = `Ready: ${(binary.byteLength / 1e6).toFixed(2)} MB bundle, ${manifest.training.trainable.length} trainable tensors, onnxruntime-web ${ort.env.versions?.web ?? ""} (WebAssembly, 1 thread).`;
  return true;
})().catch((error) => { fail(error); return false; });
