// Shared plumbing of the end-to-end tests: where kiln is, how to start it
// over stdio and over HTTP, and small assertions on tool results. The
// client is the official TypeScript SDK; nothing here speaks MCP by hand
// except the tests that must (raw stdout framing, the stateless revision).

import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import net from 'node:net';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import assert from 'node:assert/strict';

import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';

const here = path.dirname(fileURLToPath(import.meta.url));

export const KILN = process.env.KILN_BIN || path.join(here, '..', 'bin', 'kiln');

// skip is the reason the e2e tests cannot run here, or false. The jail
// backend needs root (user, mount and pid namespaces, cgroups).
export const skip = (() => {
  if (process.platform !== 'linux') return 'kiln e2e: needs Linux (the jail backend)';
  if (typeof process.getuid === 'function' && process.getuid() !== 0) {
    return 'kiln e2e: needs root (the jail backend creates namespaces and cgroups); run as root or in CI';
  }
  if (!existsSync(KILN)) return `kiln e2e: no kiln binary at ${KILN} (run make build, or set KILN_BIN)`;
  return false;
})();

// Flags every test server gets: one box kept ready, nothing preloaded
// unless a suite asks (matplotlib makes a box start about a second slower).
export const BASE_FLAGS = ['--pool', '1', '--timeout', '30s', '--max-output', '20000'];

export const PNG_MAGIC = Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]);

// A value the server's environment holds and no sandbox may see.
export const CANARY = `kiln-e2e-canary-${process.pid}-${Date.now()}`;

const clientInfo = { name: 'kiln-e2e', version: '0.0.0' };

// connectStdio starts `kiln mcp` through the SDK's stdio transport.
export async function connectStdio(flags = []) {
  const stderr = [];
  const transport = new StdioClientTransport({
    command: KILN,
    args: ['mcp', ...BASE_FLAGS, ...flags],
    env: { ...process.env, KILN_E2E_CANARY: CANARY },
    stderr: 'pipe',
  });
  transport.stderr?.on('data', (d) => stderr.push(d));
  const client = new Client(clientInfo);
  await client.connect(transport);
  return {
    client,
    stderr: () => Buffer.concat(stderr).toString(),
    async close() {
      await client.close();
    },
  };
}

// freePort asks the kernel for an unused loopback port.
export function freePort() {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.on('error', reject);
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address();
      srv.close(() => resolve(port));
    });
  });
}

// startHTTP runs `kiln serve` on a free loopback port and waits for it to
// answer /healthz. env adds to the server's environment (KILN_TOKEN).
export async function startHTTP({ flags = [], env = {}, port: wantPort } = {}) {
  const port = wantPort ?? (await freePort());
  const url = `http://127.0.0.1:${port}/mcp`;
  const proc = spawn(KILN, ['serve', '--addr', `127.0.0.1:${port}`, ...BASE_FLAGS, ...flags], {
    env: { ...process.env, KILN_E2E_CANARY: CANARY, ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  const out = [];
  proc.stdout.on('data', (d) => out.push(d));
  proc.stderr.on('data', (d) => out.push(d));
  const exited = new Promise((resolve) => proc.on('exit', (code, signal) => resolve({ code, signal })));
  const deadline = Date.now() + 15_000;
  for (;;) {
    if (proc.exitCode !== null) {
      throw new Error(`kiln serve exited with ${proc.exitCode}:\n${Buffer.concat(out)}`);
    }
    try {
      const r = await fetch(`http://127.0.0.1:${port}/healthz`);
      if (r.ok) break;
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline) {
      proc.kill('SIGKILL');
      throw new Error(`kiln serve did not answer /healthz in 15s:\n${Buffer.concat(out)}`);
    }
    await sleep(50);
  }
  return {
    url,
    port,
    proc,
    log: () => Buffer.concat(out).toString(),
    async stop() {
      if (proc.exitCode === null && proc.signalCode === null) {
        proc.kill('SIGTERM');
        const t = setTimeout(() => proc.kill('SIGKILL'), 10_000);
        await exited;
        clearTimeout(t);
      }
    },
  };
}

// connectHTTP connects an SDK client to a running kiln serve.
export async function connectHTTP(url, token) {
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  const transport = new StreamableHTTPClientTransport(new URL(url), { requestInit: { headers } });
  const client = new Client(clientInfo);
  await client.connect(transport);
  return {
    client,
    async close() {
      await transport.terminateSession().catch(() => {});
      await client.close();
    },
  };
}

export function sleep(ms) {
  return new Promise((r) => setTimeout(r, ms));
}

// call runs a tool with a generous request timeout (the SDK's default is 60s).
export function call(client, name, args) {
  return client.callTool({ name, arguments: args }, undefined, { timeout: 120_000 });
}

// text is the first content block's text; every kiln result starts with one.
export function text(res) {
  assert.ok(Array.isArray(res.content) && res.content.length > 0, `result has no content: ${JSON.stringify(res)}`);
  assert.equal(res.content[0].type, 'text', `first block is not text: ${JSON.stringify(res.content[0])}`);
  return res.content[0].text;
}

// sessionOf is the session a result names in its first line.
export function sessionOf(res) {
  const m = /^\[session: ([^\],]+)/.exec(text(res));
  assert.ok(m, `result does not name its session: ${JSON.stringify(text(res).slice(0, 200))}`);
  return m[1];
}

// ok asserts a successful result and returns its text.
export function ok(res) {
  const t = text(res);
  assert.notEqual(res.isError, true, `unexpected isError result:\n${t}`);
  sessionOf(res);
  return t;
}

export function images(res) {
  return res.content.filter((b) => b.type === 'image');
}

export function assertPNG(block) {
  assert.equal(block.mimeType, 'image/png');
  const data = Buffer.from(block.data, 'base64');
  assert.ok(data.length > 100, `PNG is only ${data.length} bytes`);
  assert.deepEqual(data.subarray(0, 8), PNG_MAGIC, 'image block does not start with the PNG signature');
  return data;
}

// The 2026-07-28 revision carries what initialize used to in every
// request: the MCP-Protocol-Version header, the Mcp-Method (and for
// tools/call Mcp-Name) headers, and the _meta triple in the params.
export const STATELESS = '2026-07-28';
export async function stateless(url, token, id, method, params = {}) {
  const headers = {
    'Content-Type': 'application/json',
    Accept: 'application/json, text/event-stream',
    'MCP-Protocol-Version': STATELESS,
    'Mcp-Method': method,
  };
  if (token) headers.Authorization = `Bearer ${token}`;
  if (method === 'tools/call') headers['Mcp-Name'] = params.name;
  const body = {
    jsonrpc: '2.0',
    id,
    method,
    params: {
      ...params,
      _meta: {
        'io.modelcontextprotocol/protocolVersion': STATELESS,
        'io.modelcontextprotocol/clientCapabilities': {},
        'io.modelcontextprotocol/clientInfo': { name: 'kiln-e2e-stateless', version: '0.0.0' },
      },
    },
  };
  const res = await fetch(url, { method: 'POST', headers, body: JSON.stringify(body) });
  const raw = await res.text();
  assert.equal(res.status, 200, `stateless ${method}: HTTP ${res.status}: ${raw.slice(0, 300)}`);
  assert.equal(res.headers.get('mcp-session-id'), null, 'a stateless answer created a transport session');
  let msg;
  if ((res.headers.get('content-type') || '').includes('text/event-stream')) {
    const data = raw.split('\n').filter((l) => l.startsWith('data:')).map((l) => l.slice(5).trim());
    msg = data.map((d) => JSON.parse(d)).find((m) => m.id === id);
  } else {
    msg = JSON.parse(raw);
  }
  assert.equal(msg?.id, id, `no answer to id ${id}: ${raw.slice(0, 300)}`);
  assert.equal(msg.error, undefined, `stateless ${method}: ${JSON.stringify(msg.error)}`);
  return msg.result;
}
