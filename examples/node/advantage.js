// A small Node.js client for the advantage service: @grpc/grpc-js with @grpc/proto-loader, loading
// proto/advantage/v1/advantage.proto exactly as published (no generated code).
//
//   const { connect, tensor, decodeTensor } = require("./advantage");
//   const client = connect("localhost:50051");
//   const result = await client.compute(
//     { grpo: { normalize_rewards: true } },
//     { prompt_ids: tensor("int64", [4], [0, 0, 1, 1]),
//       rewards: tensor("float32", [4], [1, 0, 0.5, 0.5]),
//       mask: tensor("float32", [4, 3], new Array(12).fill(1)) });
//   decodeTensor(result.advantages)   // { shape: [4, 3], values: Float64Array(12) }
//
// Tensors travel as raw little-endian, C-contiguous bytes (see the Tensor message in the .proto).
"use strict";

const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const REPO_ROOT = path.resolve(__dirname, "..", "..");
const PROTO_DIR = path.join(REPO_ROOT, "proto");
const PROTO_FILE = "advantage/v1/advantage.proto";

// keepCase: the .proto's own snake_case field names; enums as their names ("DTYPE_FLOAT32"); int64 as strings.
const LOADER_OPTIONS = { keepCase: true, longs: String, enums: String, defaults: false, oneofs: true,
                         includeDirs: [PROTO_DIR] };

function loadSchema() {
  const definition = protoLoader.loadSync(PROTO_FILE, LOADER_OPTIONS);
  return { definition, proto: grpc.loadPackageDefinition(definition) };
}

// dtype name -> [DType enum name, bytes per element, writer(buffer, value, offset), reader(buffer, offset)]
const DTYPES = {
  float32: ["DTYPE_FLOAT32", 4, (b, v, o) => b.writeFloatLE(v, o), (b, o) => b.readFloatLE(o)],
  float64: ["DTYPE_FLOAT64", 8, (b, v, o) => b.writeDoubleLE(v, o), (b, o) => b.readDoubleLE(o)],
  int64: ["DTYPE_INT64", 8, (b, v, o) => b.writeBigInt64LE(BigInt(v), o), (b, o) => Number(b.readBigInt64LE(o))],
  int32: ["DTYPE_INT32", 4, (b, v, o) => b.writeInt32LE(v, o), (b, o) => b.readInt32LE(o)],
};
const BY_ENUM = Object.fromEntries(Object.entries(DTYPES).map(([name, spec]) => [spec[0], name]));

// An advantage.v1.Tensor from a flat array of values in row-major order.
function tensor(dtype, shape, values) {
  const [code, size, write] = DTYPES[dtype];
  const count = shape.reduce((a, b) => a * b, 1);
  if (values.length !== count) throw new Error(`tensor: ${values.length} values for shape [${shape}]`);
  const data = Buffer.alloc(count * size);
  values.forEach((v, i) => write(data, v, i * size));
  return { dtype: code, shape, data };
}

// advantage.v1.Tensor -> { shape: number[], values: Float64Array }
function decodeTensor(t) {
  const name = BY_ENUM[t.dtype || "DTYPE_FLOAT32"];
  if (!name) throw new Error(`decodeTensor: unsupported dtype ${t.dtype}`);
  const [, size, , read] = DTYPES[name];
  const shape = (t.shape || []).map(Number);
  const count = shape.reduce((a, b) => a * b, 1);
  if (t.data.length !== count * size) throw new Error(`decodeTensor: ${t.data.length} bytes for shape [${shape}]`);
  const values = new Float64Array(count);
  for (let i = 0; i < count; i++) values[i] = read(t.data, i * size);
  return { shape, values };
}

// A connected client. options: { tlsCa: PEM Buffer (TLS; else plaintext), token: string (sent as
// `authorization: Bearer <token>`), timeoutMs: number (deadline of each call, default 30 s) }.
// compute(estimatorConfig, inputs, { requestId }) resolves to { result, requestId } where requestId is the
// x-request-id the server echoed in its trailing metadata.
function connect(target, options = {}) {
  const { definition, proto } = loadSchema();
  const credentials = options.tlsCa ? grpc.credentials.createSsl(options.tlsCa) : grpc.credentials.createInsecure();
  const stub = new proto.advantage.v1.AdvantageService(target, credentials, {
    "grpc.max_receive_message_length": -1, "grpc.max_send_message_length": -1 });
  const deadline = () => new Date(Date.now() + (options.timeoutMs || 30000));

  function unary(method, request, requestId) {
    return new Promise((resolve, reject) => {
      const metadata = new grpc.Metadata();
      // Per-call metadata (grpc-js refuses call credentials on a plaintext channel, which a test server may use).
      if (options.token) metadata.set("authorization", `Bearer ${options.token}`);
      if (requestId) metadata.set("x-request-id", requestId);
      let echoed = null;
      const call = stub[method](request, metadata, { deadline: deadline() }, (err, reply) => {
        if (err) {
          err.requestId = err.metadata && err.metadata.get("x-request-id")[0];
          reject(err);
        } else {
          resolve({ result: reply, get requestId() { return echoed; } });
        }
      });
      call.on("status", (status) => { echoed = status.metadata.get("x-request-id")[0] || null; });
    });
  }

  return {
    definition,
    close: () => stub.close(),
    listEstimators: () => unary("ListEstimators", {}).then((r) => r.result.estimators),
    compute: (estimator, inputs, { requestId, outputDtype } = {}) =>
      unary("ComputeAdvantage", { ...estimator, inputs, output_dtype: outputDtype }, requestId),
  };
}

module.exports = { connect, tensor, decodeTensor, loadSchema, PROTO_DIR, PROTO_FILE, REPO_ROOT };
