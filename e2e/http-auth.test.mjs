// HTTP specifics: bearer-token auth, principals owning their sessions, the
// stateless 2026-07-28 revision (no initialize, no Mcp-Session-Id), and the
// refusal to listen beyond loopback without a token or with a token file
// that others can read.

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { chmodSync, mkdtempSync, writeFileSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';

import { KILN, BASE_FLAGS, CANARY, STATELESS, stateless, call, ok, text, sessionOf, connectHTTP, startHTTP, freePort, skip } from './helpers.mjs';

const stamp = `${process.pid}-${Date.now()}`;
const ALICE = `alice-token-${stamp}`;
const BOB = `bob-token-${stamp}`;

describe('http auth and sessions', { skip }, () => {
  let srv;
  let dir;
  before(async () => {
    dir = mkdtempSync(path.join(os.tmpdir(), 'kiln-e2e-'));
    const tokenFile = path.join(dir, 'tokens');
    writeFileSync(tokenFile, `# e2e principals\nalice:${ALICE}\nbob:${BOB}\n`, { mode: 0o600 });
    srv = await startHTTP({ flags: ['--preload', '', '--token-file', tokenFile] });
  });
  after(async () => {
    await srv?.stop();
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  const initBody = JSON.stringify({
    jsonrpc: '2.0',
    id: 1,
    method: 'initialize',
    params: { protocolVersion: '2025-06-18', capabilities: {}, clientInfo: { name: 'x', version: '0' } },
  });
  const post = (headers) =>
    fetch(srv.url, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json', Accept: 'application/json, text/event-stream', ...headers },
      body: initBody,
    });

  it('refuses a request without a token (401)', async () => {
    const res = await post({});
    assert.equal(res.status, 401);
    await res.body?.cancel();
    // Also on the stateless path, and through the SDK client.
    const sl = await fetch(srv.url, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json', Accept: 'application/json, text/event-stream', 'MCP-Protocol-Version': STATELESS, 'Mcp-Method': 'tools/list' },
      body: JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'tools/list', params: {} }),
    });
    assert.equal(sl.status, 401);
    await sl.body?.cancel();
    await assert.rejects(connectHTTP(srv.url), (e) => e.code === 401);
  });

  it('refuses a wrong token (401)', async () => {
    for (const bad of [`${ALICE}x`, ALICE.slice(0, -1), 'x'.repeat(40), `Basic ${ALICE}`]) {
      const res = await post({ Authorization: bad.startsWith('Basic') ? bad : `Bearer ${bad}` });
      assert.equal(res.status, 401, `token ${JSON.stringify(bad.slice(0, 8))}… was accepted`);
      await res.body?.cancel();
    }
    await assert.rejects(connectHTTP(srv.url, 'not-the-token-at-all'), (e) => e.code === 401);
  });

  it('gives each principal its own named sessions, and each connection its own default', async () => {
    const a1 = await connectHTTP(srv.url, ALICE);
    const a2 = await connectHTTP(srv.url, ALICE);
    const b = await connectHTTP(srv.url, BOB);
    try {
      ok(await call(a1.client, 'run_python', { code: 'owner = "alice"', session: 'shared' }));
      // Another connection of the same principal continues the named session.
      assert.match(ok(await call(a2.client, 'run_python', { code: 'print(owner)', session: 'shared' })), /alice/);
      // Another principal's session of the same name is another sandbox.
      const bres = await call(b.client, 'run_python', { code: 'print("owner" in globals())', session: 'shared' });
      assert.match(ok(bres), /False/);
      ok(await call(b.client, 'write_file', { path: 'bob.txt', content: 'bob', session: 'shared' }));
      const aread = await call(a1.client, 'read_file', { path: 'bob.txt', session: 'shared' });
      assert.equal(aread.isError, true, 'alice read bob\'s file');

      // Default sessions belong to the connection.
      ok(await call(a1.client, 'run_python', { code: 'conn = 1' }));
      const d2 = await call(a2.client, 'run_python', { code: 'print("conn" in globals())' });
      assert.match(ok(d2), /False/);
      const d1 = await call(a1.client, 'run_python', { code: 'print("conn" in globals())' });
      assert.match(ok(d1), /True/);
      assert.notEqual(sessionOf(d1), sessionOf(d2));
    } finally {
      await Promise.all([a1.close(), a2.close(), b.close()]);
    }
  });

  it('serves the stateless revision: no initialize, the result names a session that a later call continues', async () => {
    const list = await stateless(srv.url, ALICE, 1, 'tools/list');
    assert.deepEqual(list.tools.map((t) => t.name).sort(), ['cancel_job', 'delete_snapshot', 'fork_session', 'job_status', 'list_files', 'list_sessions', 'list_snapshots', 'read_file', 'reset_session', 'restore_session', 'run_python', 'run_shell', 'snapshot_session', 'write_file']);
    for (const t of list.tools) assert.equal(t.outputSchema, undefined, `${t.name} advertises an outputSchema`);

    const first = await stateless(srv.url, ALICE, 2, 'tools/call', { name: 'run_python', arguments: { code: 'memo = 6 * 7\nprint("set", memo)' } });
    assert.notEqual(first.isError, true, text(first));
    assert.match(text(first), /set 42/);
    const name = sessionOf(first);
    assert.equal(first.structuredContent?.session, name);

    const second = await stateless(srv.url, ALICE, 3, 'tools/call', { name: 'run_python', arguments: { code: 'print("memo is", memo)', session: name } });
    assert.notEqual(second.isError, true, text(second));
    assert.match(text(second), /memo is 42/);
    assert.equal(sessionOf(second), name);

    // A named session works the same way, and files persist in it.
    const w = await stateless(srv.url, ALICE, 4, 'tools/call', { name: 'write_file', arguments: { path: 'sl.txt', content: 'stateless file', session: 'sl-named' } });
    assert.equal(sessionOf(w), 'sl-named');
    const r = await stateless(srv.url, ALICE, 5, 'tools/call', { name: 'run_shell', arguments: { command: 'cat sl.txt', session: 'sl-named' } });
    assert.match(text(r), /stateless file/);

    // Bob's stateless calls do not reach alice's session of that name.
    const bob = await stateless(srv.url, BOB, 6, 'tools/call', { name: 'run_python', arguments: { code: 'print("memo" in globals())', session: name } });
    assert.match(text(bob), /False/);

    // A failure of the code is still a result, not a protocol error.
    const boom = await stateless(srv.url, ALICE, 7, 'tools/call', { name: 'run_python', arguments: { code: 'raise ValueError("stateless boom")', session: name } });
    assert.equal(boom.isError, true);
    assert.match(text(boom), /ValueError: stateless boom/);
  });

  it('refuses to listen beyond loopback without a token', async () => {
    const port = await freePort();
    const env = { ...process.env, KILN_E2E_CANARY: CANARY };
    delete env.KILN_TOKEN;
    const proc = spawn(KILN, ['serve', '--addr', `0.0.0.0:${port}`, ...BASE_FLAGS, '--preload', ''], { env, stdio: ['ignore', 'pipe', 'pipe'] });
    const out = [];
    proc.stdout.on('data', (d) => out.push(d));
    proc.stderr.on('data', (d) => out.push(d));
    const result = await Promise.race([
      new Promise((resolve) => proc.on('exit', (code) => resolve({ code }))),
      new Promise((resolve) => setTimeout(() => resolve(null), 10_000)),
    ]);
    if (result === null) proc.kill('SIGKILL');
    assert.ok(result, 'kiln serve listened on 0.0.0.0 without a token');
    assert.notEqual(result.code, 0);
    assert.match(Buffer.concat(out).toString(), /token/i);
  });

  it('refuses a token file that others can read, and says how to fix it', async () => {
    const dir = mkdtempSync(path.join(os.tmpdir(), 'kiln-e2e-'));
    const tokenFile = path.join(dir, 'tokens');
    writeFileSync(tokenFile, `alice:${ALICE}\n`, { mode: 0o600 });
    chmodSync(tokenFile, 0o644);
    const env = { ...process.env, KILN_E2E_CANARY: CANARY };
    delete env.KILN_TOKEN;
    const proc = spawn(KILN, ['serve', '--addr', `127.0.0.1:${await freePort()}`, ...BASE_FLAGS, '--preload', '', '--token-file', tokenFile], { env, stdio: ['ignore', 'pipe', 'pipe'] });
    const out = [];
    proc.stderr.on('data', (d) => out.push(d));
    const result = await Promise.race([
      new Promise((resolve) => proc.on('exit', (code) => resolve({ code }))),
      new Promise((resolve) => setTimeout(() => resolve(null), 10_000)),
    ]);
    if (result === null) proc.kill('SIGKILL');
    rmSync(dir, { recursive: true, force: true });
    assert.ok(result, 'kiln serve started with a world-readable token file');
    assert.notEqual(result.code, 0);
    assert.match(Buffer.concat(out).toString(), /chmod 600/);
  });
});
