#!/usr/bin/env node
// Node.js gRPC client for inference-service (and TorchServe 0.12's gRPC API).
//
// Loads protos/inference.proto (and the google/rpc/status.proto it imports) from
// the repository at run time with @grpc/proto-loader: no generated code. The
// grpc.health.v1 protocol comes from protos/grpc/health/v1/health.proto beside
// this file.
//
//   node clients/node/client.js [options] ping
//   node clients/node/client.js [options] health [SERVICE]
//   node clients/node/client.js [options] predict MODEL INPUT
//   node clients/node/client.js [options] stream MODEL INPUT
//
// INPUT is the text to send, or @PATH to send a file's bytes (as curl's -d @file).
//
// Options:
//   --host HOST            server host (127.0.0.1)
//   --port PORT            inference API port (default: the run directory's status.json, else 7070)
//   --token KEY            send "authorization: Bearer KEY" with each call
//   --key-file PATH        read the inference key from the server's key_file.json
//                          (default: the key file the run directory's status.json names)
//   --run-dir DIR          the server's run directory (.inference_service): its status.json
//                          gives the port and key file left unset
//   --model-version V      model version (default: the model's default version)
//   --input-name NAME      input map key the request body goes under ("data")
//   --timeout SECONDS      deadline of the call (for stream: of the whole stream)
//   --jsonl                stream: one JSON line per message, {"index", "elapsed_ms", "prediction"}
//   --protos DIR           directory holding inference.proto (default: <repo>/protos)
//
// Exit status: 0 on success; 1 when the call fails ("error: CODE: details" on
// stderr) or health is not SERVING; 2 on a usage error; 130 on Ctrl-C (the call
// in flight is cancelled first).
"use strict";

const fs = require("node:fs");
const path = require("node:path");
const { parseArgs } = require("node:util");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const DEFAULT_PROTOS = path.resolve(__dirname, "..", "..", "protos");
const HEALTH_PROTOS = path.join(__dirname, "protos");
const LOADER_OPTIONS = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true };
const CHANNEL_OPTIONS = {
  // the server enforces its own size limits; do not add gRPC's 4 MiB default on top
  "grpc.max_receive_message_length": -1,
  "grpc.max_send_message_length": -1,
};

const DEFAULT_RUN_DIR = ".inference_service";
const DEFAULT_PORT = "7070";

const USAGE = `usage: client.js [--host HOST] [--port PORT] [--token KEY | --key-file PATH] [--run-dir DIR]
                 [--model-version V] [--input-name NAME] [--timeout S] [--jsonl] [--protos DIR]
                 {ping | health [SERVICE] | predict MODEL INPUT | stream MODEL INPUT}
INPUT: text, or @PATH for a file's bytes`;

class UsageError extends Error {}

/** Load the inference API and health service definitions; returns their client constructors. */
function loadServices(protosDir = DEFAULT_PROTOS) {
  const inferenceDef = protoLoader.loadSync("inference.proto", { ...LOADER_OPTIONS, includeDirs: [protosDir] });
  const healthDef = protoLoader.loadSync("grpc/health/v1/health.proto",
    { ...LOADER_OPTIONS, includeDirs: [HEALTH_PROTOS] });
  const inference = grpc.loadPackageDefinition(inferenceDef).org.pytorch.serve.grpc.inference;
  const health = grpc.loadPackageDefinition(healthDef).grpc.health.v1;
  return { InferenceAPIsService: inference.InferenceAPIsService, Health: health.Health };
}

/** The bearer token: --token, else the "inference" key of --key-file, else none (authorization off). */
function readToken(options) {
  if (options.token) return options.token;
  if (!options["key-file"]) return null;
  const keys = JSON.parse(fs.readFileSync(options["key-file"], "utf8"));
  if (!keys.inference || !keys.inference.key) {
    throw new UsageError(`${options["key-file"]} has no "inference" key`);
  }
  return keys.inference.key;
}

/**
 * Fill --port and --key-file, when not given, from the run directory's status.json (the one
 * the server writes in <working dir>/.inference_service, or --run-dir's); else port 7070 and
 * no key. A --run-dir without a readable status.json is a usage error.
 */
function findServer(options) {
  const statusPath = path.join(options["run-dir"] || DEFAULT_RUN_DIR, "status.json");
  let status = {};
  try {
    status = JSON.parse(fs.readFileSync(statusPath, "utf8")) || {};
  } catch (err) {
    if (options["run-dir"]) {
      throw new UsageError(`no server status in ${statusPath} (${err.message}): is a server running with that --run-dir?`);
    }
  }
  if (options.port === undefined) options.port = String(status.inference_port || DEFAULT_PORT);
  if (options["key-file"] === undefined && !options.token && status.key_file) options["key-file"] = status.key_file;
  return options;
}

/** Call metadata carrying "authorization: Bearer <token>" when a token is given. */
function authMetadata(token) {
  const metadata = new grpc.Metadata();
  if (token) metadata.set("authorization", `Bearer ${token}`);
  return metadata;
}

/** INPUT as bytes: "@PATH" reads the file, anything else is sent as UTF-8 text. */
function readInput(input) {
  return input.startsWith("@") ? fs.readFileSync(input.slice(1)) : Buffer.from(input, "utf8");
}

function callOptions(options) {
  return options.timeout ? { deadline: Date.now() + Number(options.timeout) * 1000 } : {};
}

function unary(client, method, request, metadata, opts) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata, opts, (err, response) => (err ? reject(err) : resolve(response)));
  });
}

function endLine(out, last) {
  if (last.length === 0 || last[last.length - 1] !== 0x0a) out.write("\n");
}

/** Run one command; resolves to the exit status. Writes results to `out`. */
async function run(argv, out = process.stdout) {
  let parsed;
  try {
    parsed = parseArgs({
      args: argv,
      allowPositionals: true,
      options: {
        host: { type: "string", default: "127.0.0.1" },
        port: { type: "string" },
        "run-dir": { type: "string" },
        token: { type: "string" },
        "key-file": { type: "string" },
        "model-version": { type: "string", default: "" },
        "input-name": { type: "string", default: "data" },
        timeout: { type: "string" },
        jsonl: { type: "boolean", default: false },
        protos: { type: "string" },
        help: { type: "boolean", short: "h", default: false },
      },
    });
  } catch (err) {
    throw new UsageError(err.message);
  }
  const { values: options, positionals } = parsed;
  if (options.help) {
    out.write(`${USAGE}\n`);
    return 0;
  }
  const [command, ...rest] = positionals;
  const arity = { ping: [0, 0], health: [0, 1], predict: [2, 2], stream: [2, 2] }[command];
  if (!arity) throw new UsageError(command ? `unknown command ${JSON.stringify(command)}` : "no command given");
  if (rest.length < arity[0] || rest.length > arity[1]) throw new UsageError(`wrong arguments for ${command}`);
  if (options.timeout !== undefined && !(Number(options.timeout) > 0)) {
    throw new UsageError("--timeout must be a positive number of seconds");
  }

  findServer(options);
  const services = loadServices(options.protos || DEFAULT_PROTOS);
  const target = `${options.host}:${options.port}`;
  const credentials = grpc.credentials.createInsecure();
  const metadata = authMetadata(readToken(options));
  const opts = callOptions(options);

  if (command === "health") {
    const client = new services.Health(target, credentials, CHANNEL_OPTIONS);
    try {
      const response = await unary(client, "Check", { service: rest[0] || "" }, metadata, opts);
      out.write(`${response.status}\n`);
      return response.status === "SERVING" ? 0 : 1;
    } finally {
      client.close();
    }
  }

  const client = new services.InferenceAPIsService(target, credentials, CHANNEL_OPTIONS);
  try {
    if (command === "ping") {
      const response = await unary(client, "Ping", {}, metadata, opts);
      out.write(`${response.health}\n`);
      return 0;
    }
    const request = {
      model_name: rest[0],
      model_version: options["model-version"],
      input: { [options["input-name"]]: readInput(rest[1]) },
    };
    if (command === "predict") {
      const response = await unary(client, "Predictions", request, metadata, opts);
      out.write(response.prediction);
      endLine(out, response.prediction);
      return 0;
    }
    return await streamPredictions(client, request, metadata, opts, options.jsonl, out);
  } finally {
    client.close();
  }
}

/** StreamPredictions: write each message the moment it arrives (raw, or one JSON line each with --jsonl). */
function streamPredictions(client, request, metadata, opts, jsonl, out) {
  return new Promise((resolve, reject) => {
    const started = process.hrtime.bigint();
    const call = client.StreamPredictions(request, metadata, opts);
    const onSigint = () => {
      call.cancel();
      process.exit(130);
    };
    process.once("SIGINT", onSigint);
    let index = 0;
    let last = Buffer.alloc(0);
    call.on("data", (response) => {
      if (jsonl) {
        const elapsedMs = Number(process.hrtime.bigint() - started) / 1e6;
        out.write(`${JSON.stringify({ index, elapsed_ms: elapsedMs, prediction: response.prediction.toString("utf8") })}\n`);
      } else if (response.prediction.length > 0) {
        out.write(response.prediction);
        last = response.prediction;
      }
      index += 1;
    });
    call.on("error", (err) => {
      process.removeListener("SIGINT", onSigint);
      reject(err);
    });
    call.on("end", () => {
      process.removeListener("SIGINT", onSigint);
      if (!jsonl) endLine(out, last);
      resolve(0);
    });
  });
}

async function main() {
  try {
    process.exitCode = await run(process.argv.slice(2));
  } catch (err) {
    if (err instanceof UsageError) {
      process.stderr.write(`${USAGE}\nerror: ${err.message}\n`);
      process.exitCode = 2;
    } else if (err && typeof err.code === "number" && grpc.status[err.code] !== undefined) {
      process.stderr.write(`error: ${grpc.status[err.code]}${err.details ? `: ${err.details}` : ""}\n`);
      process.exitCode = 1;
    } else {
      process.stderr.write(`error: ${err && err.message ? err.message : err}\n`);
      process.exitCode = 1;
    }
  }
}

module.exports = { loadServices, readToken, authMetadata, readInput, run, findServer };

if (require.main === module) {
  main();
}
