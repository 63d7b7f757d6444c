// kiln's wasm box: the worker thread that runs Python in Pyodide. host.mjs
// sends it requests; it answers each with one message. The display logic
// is kiln's own kernel driver (internal/kernel/driver.py), loaded as a
// library: cells run through its _run_cell, so results, displays and
// tracebacks at <cell N> are the same as on every other backend.

let WORKSPACE, HOME, CACHE; // the box's paths, from the host (boxpolicy)
const MAX_LIST = 1000; // agentproto.MaxListEntries
const MAX_READ = 16 << 20; // agentproto.MaxRead
const MAX_LIVE_TAIL = 2 << 10; // agentproto.MaxLiveTail
const PAGE = 65536;
const dec = new TextDecoder(); // invalid UTF-8 becomes U+FFFD, as the agent does
const enc = new TextEncoder();

let cfg;
let py;
let cell; // the Python glue that runs one cell
let out = null, err = null; // capture buffers of the running cell
let live = null; // {id, tail: Uint8Array, total}

// capBuf keeps the head and the tail of a stream, max bytes in all, as
// kiln-agent's capBuf does.
class CapBuf {
  constructor(max) {
    this.headMax = max - (max >> 1);
    this.tailMax = max >> 1;
    this.head = new Uint8Array(0);
    this.tail = new Uint8Array(0);
    this.total = 0;
  }
  write(b) {
    this.total += b.length;
    const room = this.headMax - this.head.length;
    if (room > 0) {
      const k = Math.min(room, b.length);
      const h = new Uint8Array(this.head.length + k);
      h.set(this.head);
      h.set(b.subarray(0, k), this.head.length);
      this.head = h;
      b = b.subarray(k);
    }
    if (b.length > 0) {
      const t = new Uint8Array(Math.min(this.tail.length + b.length, this.tailMax));
      const fromB = Math.min(b.length, t.length);
      const fromTail = t.length - fromB;
      t.set(this.tail.subarray(this.tail.length - fromTail));
      t.set(b.subarray(b.length - fromB), fromTail);
      this.tail = t;
    }
  }
  stream() {
    const head = dec.decode(this.head);
    const tail = dec.decode(this.tail);
    return { text: head + tail, total: this.total, cut: enc.encode(head).length };
  }
}

function capture(which) {
  return {
    write(b) {
      const buf = which === 1 ? out : err;
      if (buf) buf.write(b);
      if (live) {
        live.total += b.length;
        const keep = b.subarray(Math.max(0, b.length - MAX_LIVE_TAIL));
        const t = new Uint8Array(Math.min(live.tail.length + keep.length, MAX_LIVE_TAIL));
        const fromNew = Math.min(keep.length, t.length);
        t.set(live.tail.subarray(live.tail.length - (t.length - fromNew)));
        t.set(keep.subarray(keep.length - fromNew), t.length - fromNew);
        live.tail = t;
        const now = Date.now();
        if (now - live.sent >= 1000) {
          live.sent = now;
          self.postMessage({ live: live.id, tail: dec.decode(live.tail).replaceAll("\uFFFD", ""), total: live.total });
        }
      }
      return b.length;
    },
    isatty: false,
  };
}

// capMemory bounds the growth of every WebAssembly memory of this thread
// (Pyodide's heap, where Python's objects and the workspace live): a grow
// past the cap fails, which Python sees as a MemoryError.
function capMemory(cap) {
  const grow = WebAssembly.Memory.prototype.grow;
  Object.defineProperty(WebAssembly.Memory.prototype, "grow", {
    value: function (delta) {
      if (this.buffer.byteLength + Number(delta) * PAGE > cap) {
        throw new RangeError("kiln: the box's memory limit");
      }
      return grow.call(this, delta);
    },
    writable: false,
    configurable: false,
  });
  Object.freeze(WebAssembly.Memory.prototype);
}

// capFiles bounds the in-memory filesystem (the workspace, /tmp, home):
// file contents live in JavaScript buffers outside both V8's heap cap and
// Pyodide's, so they get caps of their own, as a tmpfs would: bytes over
// maxBytes or files over maxNodes fail with ENOSPC. Counting starts now:
// Pyodide's own files are not charged.
function capFiles(maxBytes, maxNodes) {
  const FS = py.FS;
  const MEMFS = FS.filesystems.MEMFS;
  const ENOSPC = 51;
  let bytes = 0, nodes = 0;
  const size = (node) => (node && node.contents && node.contents.length) || 0;
  for (const name of ["expandFileStorage", "resizeFileStorage"]) {
    const orig = MEMFS[name];
    MEMFS[name] = function (node, n) {
      const before = size(node);
      if (n > before && bytes - before + n > maxBytes) throw new FS.ErrnoError(ENOSPC);
      orig.call(this, node, n);
      bytes += size(node) - before;
    };
  }
  const createNode = FS.createNode;
  FS.createNode = function (...args) {
    if (nodes >= maxNodes) throw new FS.ErrnoError(ENOSPC);
    const node = createNode.apply(this, args);
    nodes++;
    return node;
  };
  const destroyNode = FS.destroyNode;
  FS.destroyNode = function (node) {
    // A file still open keeps its contents: they stay charged (for
    // good, which errs on the safe side).
    if (!FS.streams.some((st) => st && st.node === node)) bytes -= size(node);
    nodes = Math.max(0, nodes - 1);
    return destroyNode.call(this, node);
  };
}

const GLUE = `
import json as _json, os as _os, sys as _sys

def _kiln_cell(code):
    d = globals()
    d["_displays"].clear()
    d["_rich_used"] = 0
    result, error, interrupted = None, None, False
    try:
        result, error, interrupted = _run_cell(code, _sys.modules["__main__"].__dict__)
    except KeyboardInterrupt:
        interrupted = True
    displays = list(d["_displays"])
    d["_displays"].clear()
    for s in (_sys.stdout, _sys.stderr):
        try:
            s.flush()
        except Exception:
            pass
    return _json.dumps({"result": result, "displays": displays, "error": error, "interrupted": interrupted})
`;

async function init(msg) {
  cfg = msg.init;
  ({ workspace: WORKSPACE, home: HOME, cache: CACHE } = cfg);
  capMemory(cfg.memory);
  const { loadPyodide } = await import(new URL("file://" + cfg.pyodide + "/pyodide.mjs").href);
  const opts = { indexURL: cfg.pyodide + "/", env: { HOME, XDG_CACHE_HOME: CACHE } };
  py = null;
  if (cfg.snapshot) {
    try {
      py = await loadPyodide({ ...opts, _loadSnapshot: Deno.readFileSync(cfg.snapshot) });
    } catch (e) {
      console.error("kiln wasm kernel: restoring the snapshot failed, starting cold:", String(e).slice(0, 1000));
    }
  }
  if (!py) py = await loadPyodide(opts);
  if (cfg.wheels && cfg.wheels.length) {
    // The configured local wheels, read from the one directory Deno may
    // read them from: no network.
    await py.loadPackage(cfg.wheels.map((w) => new URL("file://" + w).href), {
      messageCallback: () => {},
      errorCallback: (m) => console.error("kiln wasm kernel:", m),
    });
  }
  py.setStdout(capture(1));
  py.setStderr(capture(2));
  py.setInterruptBuffer(msg.interruptBuffer);
  const FS = py.FS;
  FS.mkdirTree(WORKSPACE);
  FS.mkdirTree(CACHE);
  const driver = Deno.readTextFileSync(cfg.driver);
  // The driver runs its own main() unless a jail zygote hands it one; a
  // zygote_main that does nothing leaves it a library.
  const ns = py.globals.get("dict")();
  ns.set("__name__", "kiln_driver");
  ns.set("_src", driver);
  ns.set("_glue", GLUE);
  ns.set("_preload", (cfg.preload || []).join(","));
  ns.set("_reseed", cfg.reseed || "");
  ns.set("_workspace", WORKSPACE);
  ns.set("_home", HOME);
  ns.set("_cache", CACHE);
  py.runPython(`
import os, sys
os.environ["HOME"] = _home
os.environ["XDG_CACHE_HOME"] = _cache
os.chdir(_workspace)
# A box restored from a snapshot starts with its maker's generator state:
# redraw what the host's one list says (sandbox.ReseedCode).
exec(_reseed, {})
os.environ["KILN_ZYGOTE"] = "def zygote_main():\\n    pass\\n"
os.environ["KILN_PRELOAD"] = _preload
exec(compile(_src, "<kiln-driver>", "exec"), globals())
exec(compile(_glue, "<kiln-driver>", "exec"), globals())
_kiln_preloaded = prepare()
def _kiln_no_system(command):
    raise OSError(38, "there are no programs to run in a wasm sandbox (no shell, no subprocesses)")
import posix
os.system = posix.system = _kiln_no_system
del posix
# Emscripten answers name lookups with made-up addresses; a wasm box has
# no network, so a lookup fails as it would on a host without one.
import socket, _socket
def _kiln_no_dns(*args, _err=socket.gaierror, _code=socket.EAI_NONAME, **kwargs):
    raise _err(_code, "Name or service not known (a wasm sandbox has no network)")
for _m in (socket, _socket):
    for _n in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
        if hasattr(_m, _n):
            setattr(_m, _n, _kiln_no_dns)
del _m, _n, socket, _socket
del _src, _glue, _preload, _reseed, _workspace, _home, _cache
`, { globals: ns });
  capFiles(cfg.fsBytes, cfg.inodes);
  cell = ns.get("_kiln_cell");
  const preloaded = ns.get("_kiln_preloaded").toJs();
  const version = py.runPython("import sys; sys.version.split()[0]");
  // Python code gets no handle on Pyodide's own API.
  py.unregisterJsModule("pyodide_js");
  py.runPython("import sys; sys.modules.pop('pyodide_js', None)");
  out = err = null; // what loading printed is no cell's
  return { version: 1, python: version, preloaded };
}

function runPython(req) {
  const max = req.max_output > 0 ? req.max_output : 20000;
  out = new CapBuf(max);
  err = new CapBuf(max);
  live = req.live ? { id: req.id, tail: new Uint8Array(0), total: 0, sent: Date.now() } : null;
  let res;
  try {
    res = JSON.parse(cell(req.code));
  } catch (e) {
    // A fault of Pyodide itself (a wasm trap, a host call that threw):
    // Pyodide is unusable after one. The box dies, the host sees its
    // stream end, and the session starts a new one.
    console.error("kiln wasm kernel: Pyodide failed:", String(e).slice(0, 4096));
    self.postMessage({ fatal: true });
    return null;
  }
  const exec = {
    stdout: out.stream(),
    stderr: err.stream(),
    result: res.result ?? undefined,
    displays: res.displays && res.displays.length ? res.displays : undefined,
    error: res.error ?? undefined,
    exit_code: 0,
    interrupted: res.interrupted || undefined,
  };
  out = err = live = null;
  return { exec };
}

// splitPath mirrors kiln-agent's: absolute paths only under the
// workspace, no ".." above it, no NUL.
function splitPath(p) {
  if (p.includes("\0")) throw new Error("path contains a NUL byte");
  if (enc.encode(p).length > 4096) throw new Error("path is longer than 4096 bytes");
  let rel = p;
  if (p.startsWith("/")) {
    const c = normalize(p);
    if (c === WORKSPACE) return [];
    if (!c.startsWith(WORKSPACE + "/")) {
      throw new Error(`path is outside the workspace: "${p}" (paths are relative to the workspace ${WORKSPACE})`);
    }
    rel = c.slice(WORKSPACE.length + 1);
  }
  const parts = [];
  for (const c of rel.split("/")) {
    if (c === "" || c === ".") continue;
    if (c === "..") {
      if (parts.length === 0) throw new Error(`path is outside the workspace: "${p}"`);
      parts.pop();
      continue;
    }
    if (enc.encode(c).length > 255) throw new Error("a path component is longer than 255 bytes");
    parts.push(c);
  }
  return parts;
}

function normalize(p) {
  const out = [];
  for (const c of p.split("/")) {
    if (c === "" || c === ".") continue;
    if (c === "..") out.pop();
    else out.push(c);
  }
  return "/" + out.join("/");
}

// resolve follows relative symlinks inside the workspace, as kiln-agent
// does, and refuses absolute ones and those that climb out of it.
function resolve(p) {
  const FS = py.FS;
  let parts = splitPath(p);
  const done = [];
  let links = 0;
  while (parts.length > 0) {
    const c = parts.shift();
    if (c === "" || c === ".") continue;
    if (c === "..") {
      if (done.length === 0) throw new Error(`path is outside the workspace: ${p} (a symlink or .. leads out of it)`);
      done.pop();
      continue;
    }
    const full = WORKSPACE + "/" + [...done, c].join("/");
    let st;
    try {
      st = FS.lstat(full);
    } catch {
      return [...done, c, ...parts];
    }
    if (!FS.isLink(st.mode)) {
      done.push(c);
      continue;
    }
    if (++links > 8) throw new Error(`path is outside the workspace: ${p} (a symlink or .. leads out of it)`);
    const target = FS.readlink(full);
    if (target.startsWith("/")) throw new Error(`path is outside the workspace: ${p} (a symlink or .. leads out of it)`);
    parts = [...target.split("/"), ...parts];
  }
  return done;
}

function fsErr(p, e) {
  const code = e && e.code;
  switch (code) {
    case "ENOENT":
      return new Error(`${p}: no such file or directory`);
    case "ENOTDIR":
      return new Error(`${p}: a parent is not a directory`);
    case "EISDIR":
      return new Error(`${p}: is a directory; use list_files`);
    case "ENOMEM":
    case "ENOSPC":
      return new Error(`${p}: the workspace is full`);
  }
  return e instanceof Error && !(e.errno !== undefined) ? e : new Error(`${p}: ${code || e}`);
}

function b64decode(s) {
  if (!s) return new Uint8Array(0);
  const bin = atob(s);
  const b = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) b[i] = bin.charCodeAt(i);
  return b;
}

function b64encode(b) {
  let s = "";
  for (let i = 0; i < b.length; i += 0x8000) s += String.fromCharCode.apply(null, b.subarray(i, i + 0x8000));
  return btoa(s);
}

function writeFile(req) {
  const FS = py.FS;
  const data = b64decode(req.data);
  if (data.length > cfg.maxWrite) throw new Error(`file is larger than ${cfg.maxWrite} bytes`);
  const parts = resolve(req.path);
  if (parts.length === 0) throw new Error("path names the workspace itself, not a file");
  const full = WORKSPACE + "/" + parts.join("/");
  try {
    if (parts.length > 1) FS.mkdirTree(WORKSPACE + "/" + parts.slice(0, -1).join("/"));
    let st = null;
    try {
      st = FS.stat(full);
    } catch { /* a new file */ }
    if (st && !FS.isFile(st.mode)) throw new Error(`${req.path}: not a regular file`);
    FS.writeFile(full, data);
  } catch (e) {
    throw fsErr(req.path, e);
  }
  return {};
}

function readFile(req) {
  const FS = py.FS;
  const parts = resolve(req.path);
  const full = WORKSPACE + (parts.length ? "/" + parts.join("/") : "");
  let st;
  try {
    st = FS.stat(full);
  } catch (e) {
    throw fsErr(req.path, e);
  }
  if (FS.isDir(st.mode)) throw new Error(`${req.path}: is a directory; use list_files`);
  if (!FS.isFile(st.mode)) throw new Error(`${req.path}: not a regular file`);
  let max = req.max_bytes > 0 && req.max_bytes < st.size ? req.max_bytes : st.size;
  max = Math.min(max, MAX_READ);
  const data = FS.readFile(full).subarray(0, max);
  return { data: b64encode(data), size: st.size };
}

function info(FS, rel, st) {
  const link = FS.isLink(st.mode);
  const dir = FS.isDir(st.mode);
  const file = FS.isFile(st.mode);
  const ms = st.mtime instanceof Date ? st.mtime.getTime() : Number(st.mtime);
  const fi = { path: rel, size: dir ? 0 : st.size, mtime_ns: ms * 1e6 + 999999 };
  if (dir) fi.dir = true;
  if (link) fi.symlink = true;
  if (!link && !dir && !file) fi.special = FS.isFIFO(st.mode) ? "fifo" : FS.isChrdev(st.mode) ? "char-device" : "other";
  return fi;
}

function listFiles(req) {
  const FS = py.FS;
  const parts = resolve(req.path || "");
  const rel = parts.join("/") || ".";
  const full = WORKSPACE + (parts.length ? "/" + rel : "");
  let st;
  try {
    st = FS.lstat(full);
  } catch (e) {
    throw fsErr(req.path, e);
  }
  if (!FS.isDir(st.mode)) return { files: [info(FS, rel, st)] };
  const files = [];
  const walk = (dir, prefix) => {
    const names = FS.readdir(dir).filter((n) => n !== "." && n !== "..").sort();
    for (const n of names) {
      if (files.length >= MAX_LIST) return;
      const p = dir + "/" + n;
      const r = prefix ? prefix + "/" + n : n;
      let s;
      try {
        s = FS.lstat(p);
      } catch {
        continue;
      }
      files.push(info(FS, r, s));
      if (FS.isDir(s.mode)) walk(p, r);
    }
  };
  walk(full, parts.length ? rel : "");
  return { files };
}

function changes(req) {
  const since = Number(req.since || 0);
  const { files } = listFiles({ path: "" });
  return { files: files.filter((f) => !f.dir && !f.symlink && f.mtime_ns >= since) };
}

self.onmessage = async (e) => {
  const m = e.data;
  if (m.init) {
    let hello;
    try {
      hello = await init(m);
    } catch (x) {
      hello = { version: 1, error: "starting Pyodide: " + String(x && x.message || x).slice(0, 4096) };
    }
    self.postMessage({ hello });
    return;
  }
  const req = m.req;
  let resp;
  try {
    switch (req.op) {
      case "python":
        resp = runPython(req);
        if (resp === null) return;
        break;
      case "write":
        resp = writeFile(req);
        break;
      case "read":
        resp = readFile(req);
        break;
      case "list":
        resp = listFiles(req);
        break;
      case "changes":
        resp = changes(req);
        break;
      default:
        resp = { error: "unknown operation" };
    }
  } catch (x) {
    resp = { error: String(x && x.message || x).slice(0, 4096) };
  }
  resp.id = req.id;
  self.postMessage({ resp });
};
