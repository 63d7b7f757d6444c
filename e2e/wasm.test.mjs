// The wasm backend through a real MCP client: `kiln mcp --backend wasm`
// (Python in Pyodide, in Deno with no permissions but reading its own
// files). It runs when `kiln wasm install` has put Deno and Pyodide in
// kiln's cache; with KILN_TEST_WASM=1 (CI) it installs them first and never
// skips.

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { existsSync, readdirSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';

import { KILN, CANARY, call, ok, text, connectStdio } from './helpers.mjs';

function wasmSkip() {
  if (!existsSync(KILN)) return `kiln e2e: no kiln binary at ${KILN} (run make build, or set KILN_BIN)`;
  if (process.env.KILN_TEST_WASM === '1') return false;
  const cache = path.join(process.env.XDG_CACHE_HOME || path.join(os.homedir(), '.cache'), 'kiln', 'wasm');
  const installed = existsSync(cache) && readdirSync(cache).some((d) => d.startsWith('deno-'));
  return installed ? false : 'kiln e2e: the wasm runtime is not installed (kiln wasm install, or KILN_TEST_WASM=1)';
}

describe('wasm backend over stdio', { skip: wasmSkip() }, () => {
  let kiln;
  before(async () => {
    if (process.env.KILN_TEST_WASM === '1') {
      execFileSync(KILN, ['wasm', 'install'], { stdio: ['ignore', 'ignore', 'inherit'] });
    }
    kiln = await connectStdio(['--backend', 'wasm', '--preload', '']);
  });
  after(async () => {
    await kiln?.close();
  });

  it('offers no run_shell, and says why', async () => {
    const { tools } = await kiln.client.listTools();
    const names = tools.map((t) => t.name).sort();
    assert.deepEqual(names, ['cancel_job', 'delete_snapshot', 'fork_session', 'job_status', 'list_files', 'list_sessions', 'list_snapshots', 'read_file', 'reset_session', 'restore_session', 'run_python', 'snapshot_session', 'write_file']);
    const py = tools.find((t) => t.name === 'run_python');
    assert.match(py.description, /no run_shell tool/);
    assert.match(py.description, /standard library/);
  });

  it('sum(range(10))', async () => {
    const t = ok(await call(kiln.client, 'run_python', { code: 'sum(range(10))' }));
    assert.match(t, /Out: 45/);
  });

  it('a stdlib computation', async () => {
    const code = 'import statistics, hashlib, json\n' +
      'd = {"mean": statistics.mean([1, 2, 3, 4]), "sha": hashlib.sha256(b"kiln").hexdigest()[:12]}\n' +
      'print(json.dumps(d, sort_keys=True))';
    const t = ok(await call(kiln.client, 'run_python', { code }));
    assert.match(t, /\{"mean": 2\.5, "sha": "[0-9a-f]{12}"\}/);
  });

  it('files written by a tool are seen by Python', async () => {
    ok(await call(kiln.client, 'write_file', { path: 'in/data.txt', content: 'from the client' }));
    const t = ok(await call(kiln.client, 'run_python', { code: 'open("in/data.txt").read().upper()' }));
    assert.match(t, /FROM THE CLIENT/);
  });

  it('an escape attempt fails', async () => {
    const res = await call(kiln.client, 'run_python', {
      code: 'import js\nprint(js.Deno.readTextFileSync("/etc/passwd"))',
    });
    assert.equal(res.isError, true, text(res));
    assert.match(text(res), /NotCapable|Requires read access/);
    assert.doesNotMatch(text(res), /root:x:0:0/);
    const env = await call(kiln.client, 'run_python', { code: 'import js\njs.Deno.env.toObject()' });
    assert.equal(env.isError, true, text(env));
    assert.ok(!text(env).includes(CANARY), 'the server environment reached the box');
  });
});
