#!/usr/bin/env node
// Runs the NeMo RL golden cases (tests/golden/nemo-rl/*.json in the repository, or
// $ADVANTAGE_GOLDEN_DIR/nemo-rl) through a running advantage server from Node.js and checks every value with
// the golden tolerance, |got - want| <= 1e-5 + 1e-4 |want| against `expected` or `expected_f64`.
//
//   node golden.js --target localhost:50051 [--golden-dir DIR] [--cases ID,ID,...] [--token-file F] [--tls-ca F]
//
// Like the Python RemoteAdvantageEstimator it takes NeMo RL's config keys and keyword names, sends only the
// inputs ListEstimators declares for the estimator, and sends an x-request-id it expects echoed back.
// Prints one line per case and ends with "N passed, M failed"; exits 1 when a case failed.
"use strict";

const fs = require("node:fs");
const path = require("node:path");
const { connect, tensor, decodeTensor, REPO_ROOT } = require("./advantage");

const RENAMES = { logprobs_policy: "logprobs", logprobs_reference: "reference_logprobs" };

function parseArgs(argv) {
  const args = { target: "localhost:50051", goldenDir: null, cases: null, tokenFile: null, tlsCa: null };
  for (let i = 0; i < argv.length; i++) {
    const [flag, inline] = argv[i].split(/=(.*)/s);
    const value = () => (inline !== undefined ? inline : argv[++i]);
    switch (flag) {
      case "--target": args.target = value(); break;
      case "--golden-dir": args.goldenDir = value(); break;
      case "--cases": args.cases = value().split(",").filter(Boolean); break;
      case "--token-file": args.tokenFile = value(); break;
      case "--tls-ca": args.tlsCa = value(); break;
      default: throw new Error(`unknown argument ${argv[i]}`);
    }
  }
  return args;
}

function goldenDir(args) {
  return args.goldenDir || process.env.ADVANTAGE_GOLDEN_DIR || path.resolve(REPO_ROOT, "tests", "golden");
}

// The golden files write non-finite floats as strings.
function decodeNumbers(value) {
  if (value === "NaN") return NaN;
  if (value === "Infinity") return Infinity;
  if (value === "-Infinity") return -Infinity;
  if (Array.isArray(value)) return value.map(decodeNumbers);
  if (value && typeof value === "object") {
    return Object.fromEntries(Object.entries(value).map(([k, v]) => [k, decodeNumbers(v)]));
  }
  return value;
}

// Nested lists -> [shape, flat values].
function flatten(nested) {
  const shape = [];
  for (let level = nested; Array.isArray(level); level = level[0]) shape.push(level.length);
  return [shape, shape.length ? nested.flat(shape.length) : [nested]];
}

// A message or enum type of the schema by the (possibly package-relative) name a field refers to it with.
function schemaType(definition, typeName) {
  const name = typeName.replace(/^\./, "");
  const found = definition[name] || definition[`advantage.v1.${name}`];
  if (!found) throw new Error(`the schema has no type ${typeName}`);
  return found.type;
}

// A NeMo config dict -> the estimator's config message, keeping the keys it has a field for (as NeMo does).
function configMessage(definition, estimator, config) {
  const request = definition["advantage.v1.ComputeAdvantageRequest"].type;
  const field = request.field.find((f) => f.name === estimator);
  if (!field) throw new Error(`the schema has no estimator ${estimator}`);
  const type = schemaType(definition, field.typeName);
  const message = {};
  for (const f of type.field) {
    const value = config[f.name];
    if (value === undefined || value === null) continue;
    if (f.type === "TYPE_ENUM") {
      const values = schemaType(definition, f.typeName).value.map((v) => v.name);
      const prefix = values[0].replace(/UNSPECIFIED$/, "");
      message[f.name] = `${prefix}${String(value).toUpperCase()}`;
      if (!values.includes(message[f.name])) throw new Error(`${estimator}.${f.name}: unknown value ${value}`);
    } else {
      message[f.name] = value;
    }
  }
  return { [estimator]: message };
}

// NeMo keyword arguments -> the declared service inputs, as Tensors.
function inputsFor(caseInputs, declared) {
  const hints = caseInputs.dtype;
  const offered = {};
  for (const [name, value] of Object.entries(caseInputs)) {
    if (name === "dtype") continue;
    if (name === "repeated_batch") {
      for (const [key, component] of Object.entries(value)) offered[key] = [component, hints[name]];
    } else {
      offered[RENAMES[name] || name] = [value, hints[name]];
    }
  }
  const inputs = {};
  for (const spec of declared) {
    const names = spec.name.endsWith("<name>")
      ? Object.keys(offered).filter((k) => k.startsWith(spec.name.slice(0, -"<name>".length)))
      : [spec.name].filter((k) => k in offered);
    for (const name of names) {
      const [value, hint] = offered[name];
      const [shape, flat] = flatten(value);
      inputs[name] = tensor(hint === "int64" ? "int64" : "float32", shape, flat);
    }
  }
  return inputs;
}

// Element-wise check against `expected` or `expected_f64`; returns null when close, else a description.
function compare(got, testCase, key) {
  for (let i = 0; i < got.values.length; i++) {
    if (!Number.isFinite(got.values[i])) return `${key}: non-finite output at ${i}`;
  }
  const failures = [];
  for (const variant of ["expected", "expected_f64"]) {
    const want = testCase[variant] && testCase[variant][key];
    if (want === undefined || want === null) continue;
    const [shape, flat] = flatten(want);
    if (shape.join() !== got.shape.join()) {
      failures.push(`${variant}: shape [${got.shape}] != [${shape}]`);
      continue;
    }
    const bad = flat.findIndex((w, i) => Number.isFinite(w) && !(Math.abs(got.values[i] - w) <= 1e-5 + 1e-4 * Math.abs(w)));
    if (bad < 0) return null;
    failures.push(`${variant}: position ${bad} got ${got.values[bad]} want ${flat[bad]}`);
  }
  return `${key}: ${failures.join(" | ") || "nothing to compare"}`;
}

async function runCase(client, declaredByName, testCase) {
  const requestId = `node-golden-${testCase.id}`;
  const { result, requestId: echoed } = await client.compute(
    configMessage(client.definition, testCase.estimator, testCase.config),
    inputsFor(testCase.inputs, declaredByName[testCase.estimator]),
    { requestId });
  const problems = [];
  if (echoed !== requestId) problems.push(`x-request-id echoed ${echoed}, sent ${requestId}`);
  problems.push(compare(decodeTensor(result.advantages), testCase, "advantages"));
  const wantReturns = testCase.expected.returns;
  if (wantReturns === null) {
    if (result.returns) problems.push("returns: present, the reference has none");
  } else if (!result.returns) {
    problems.push("returns: missing");
  } else {
    problems.push(compare(decodeTensor(result.returns), testCase, "returns"));
  }
  const metrics = result.metrics || {};
  const wantMetrics = testCase.expected.metrics || {};
  if (Object.keys(metrics).sort().join() !== Object.keys(wantMetrics).sort().join()) {
    problems.push(`metrics: keys ${Object.keys(metrics)} != ${Object.keys(wantMetrics)}`);
  } else {
    for (const [key, want] of Object.entries(wantMetrics)) {
      if (!(Math.abs(metrics[key] - want) <= 1e-5 + 1e-4 * Math.abs(want))) {
        problems.push(`metrics[${key}]: got ${metrics[key]} want ${want}`);
      }
    }
  }
  return problems.filter(Boolean);
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const dir = path.join(goldenDir(args), "nemo-rl");
  if (!fs.existsSync(dir)) throw new Error(`no golden cases at ${dir}: pass --golden-dir or set ADVANTAGE_GOLDEN_DIR`);
  let files = fs.readdirSync(dir).filter((f) => f.endsWith(".json")).sort();
  if (args.cases) {
    const missing = args.cases.filter((id) => !files.includes(`${id}.json`));
    if (missing.length) throw new Error(`no such golden cases: ${missing.join(", ")}`);
    files = args.cases.map((id) => `${id}.json`);
  }
  const client = connect(args.target, {
    token: args.tokenFile ? fs.readFileSync(args.tokenFile, "utf8").trim() : undefined,
    tlsCa: args.tlsCa ? fs.readFileSync(args.tlsCa) : undefined,
  });
  let passed = 0;
  let failed = 0;
  try {
    const declaredByName = Object.fromEntries((await client.listEstimators()).map((e) => [e.name, e.inputs]));
    for (const file of files) {
      const testCase = decodeNumbers(JSON.parse(fs.readFileSync(path.join(dir, file), "utf8")));
      let problems;
      try {
        problems = await runCase(client, declaredByName, testCase);
      } catch (err) {
        problems = [`${err.code !== undefined ? `gRPC status ${err.code}: ` : ""}${err.details || err.message}`];
      }
      if (problems.length) {
        failed++;
        console.log(`FAIL ${testCase.id}: ${problems.join("; ")}`);
      } else {
        passed++;
        console.log(`ok   ${testCase.id}`);
      }
    }
  } finally {
    client.close();
  }
  console.log(`node golden: ${passed} passed, ${failed} failed`);
  return failed === 0 && passed > 0 ? 0 : 1;
}

if (require.main === module) {
  main().then((code) => process.exit(code), (err) => {
    console.error(`golden.js: ${err.message}`);
    process.exit(2);
  });
}

module.exports = { configMessage, inputsFor, compare, flatten };
