// kiln's wasm box: the main thread of one Deno process. It speaks kiln's
// agent protocol (internal/agentproto: 4-byte big-endian length, then JSON)
// on stdin and stdout, and runs Python in Pyodide on a worker thread
// (kernel.mjs), so that it can still read requests, and interrupt a cell,
// while one runs.
//
// Deno grants this process nothing but reading the Pyodide files and these
// scripts: no network, environment, subprocesses, writes or FFI. That is
// the boundary; Pyodide itself is not one (Python reaches JavaScript
// through the js module). Everything this process sends is validated by
// the host as hostile input.
//
// Deno.args[0] is a JSON object: {pyodide, driver, preload, memory,
// maxWrite, reseed, workspace, home, cache, …}: wasm.go's config.

const cfg = JSON.parse(Deno.args[0]);
const MAX_FRAME = 64 << 20;
const LIVE_INTERVAL_MS = 1000;
const enc = new TextEncoder();
const dec = new TextDecoder();
const stdout = Deno.stdout;
const stdin = Deno.stdin;

function writeAll(b) {
  let o = 0;
  while (o < b.length) o += stdout.writeSync(b.subarray(o));
}

function send(obj) {
  let body = enc.encode(JSON.stringify(obj));
  if (body.length > MAX_FRAME && obj.id !== undefined) {
    body = enc.encode(JSON.stringify({ id: obj.id, error: "the result is larger than the protocol allows" }));
  }
  const b = new Uint8Array(4 + body.length);
  new DataView(b.buffer).setUint32(0, body.length);
  b.set(body, 4);
  writeAll(b);
}

// The interrupt flag Pyodide polls (2 is SIGINT).
const interruptBuffer = new Int32Array(new SharedArrayBuffer(4));
let running = 0; // id of the python request the worker runs, 0 if none
const lastLive = new Map(); // id -> time of the last Output frame

const worker = new Worker(new URL("./kernel.mjs", import.meta.url).href, { type: "module" });
let ready = false;
const queue = []; // requests that came before the kernel was ready

worker.onmessage = (e) => {
  const m = e.data;
  if (m.hello) {
    ready = true;
    send(m.hello);
    for (const req of queue.splice(0)) handle(req);
    return;
  }
  if (m.live !== undefined) {
    const now = Date.now();
    if (now - (lastLive.get(m.live) ?? 0) < LIVE_INTERVAL_MS) return;
    lastLive.set(m.live, now);
    send({ id: m.live, output: { tail: m.tail, total: m.total } });
    return;
  }
  if (m.fatal) {
    Deno.exit(70);
  }
  if (m.resp) {
    if (m.resp.id === running) running = 0;
    lastLive.delete(m.resp.id);
    send(m.resp);
  }
};
worker.onerror = (e) => {
  // The kernel's thread died (a V8 heap limit, a fault of Pyodide): the
  // box is no use any more. Exiting ends the stream, which the host reads
  // as a box that died.
  console.error("kiln wasm kernel:", e.message);
  e.preventDefault();
  Deno.exit(70);
};
worker.postMessage({ init: cfg, interruptBuffer });

function handle(req) {
  switch (req.op) {
    case "ping":
      send({ id: req.id });
      return;
    case "interrupt":
      if (running) Atomics.store(interruptBuffer, 0, 2);
      send({ id: req.id });
      return;
    case "shell":
      send({ id: req.id, error: "run_shell is not available on the wasm backend: Python runs in WebAssembly (Pyodide), with no operating system to start programs in" });
      return;
    case "python":
      running = req.id;
      Atomics.store(interruptBuffer, 0, 0);
      worker.postMessage({ req });
      return;
    case "write":
    case "read":
    case "list":
    case "changes":
      worker.postMessage({ req });
      return;
    default:
      send({ id: req.id, error: `unknown operation "${String(req.op).slice(0, 64)}"` });
  }
}

// Read frames until stdin closes, then exit: the host closed the box.
let buf = new Uint8Array(1 << 16);
let have = 0;
const chunk = new Uint8Array(1 << 16);
for (;;) {
  const n = await stdin.read(chunk);
  if (n === null) break;
  if (have + n > buf.length) {
    const nb = new Uint8Array(Math.max(buf.length * 2, have + n));
    nb.set(buf.subarray(0, have));
    buf = nb;
  }
  buf.set(chunk.subarray(0, n), have);
  have += n;
  let off = 0;
  while (have - off >= 4) {
    const len = new DataView(buf.buffer, off, 4).getUint32(0);
    if (len > MAX_FRAME) {
      console.error("kiln wasm host: request frame too large");
      Deno.exit(65);
    }
    if (have - off - 4 < len) break;
    let req;
    try {
      req = JSON.parse(dec.decode(buf.subarray(off + 4, off + 4 + len)));
    } catch {
      console.error("kiln wasm host: request is not JSON");
      Deno.exit(65);
    }
    off += 4 + len;
    if (ready) handle(req);
    else queue.push(req);
  }
  buf.copyWithin(0, off, have);
  have -= off;
}
Deno.exit(0);
