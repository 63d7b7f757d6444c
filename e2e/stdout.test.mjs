// The stdio server's stdout carries nothing but JSON-RPC frames, whatever
// the sandboxed code prints. kiln mcp is spawned raw (no SDK) so that every
// byte of its stdout is seen.

import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import { KILN, BASE_FLAGS, skip } from './helpers.mjs';

describe('stdio framing', { skip }, () => {
  it('puts only JSON-RPC frames on stdout while code floods stdout and stderr', async () => {
    const proc = spawn(KILN, ['mcp', ...BASE_FLAGS, '--preload', ''], { stdio: ['pipe', 'pipe', 'pipe'] });
    const stdout = [];
    const stderr = [];
    proc.stderr.on('data', (d) => stderr.push(d));
    const exited = new Promise((resolve) => proc.on('exit', (code, signal) => resolve({ code, signal })));

    // Answers by id, resolved as frames arrive.
    const waiting = new Map();
    let buf = '';
    proc.stdout.on('data', (d) => {
      stdout.push(d);
      buf += d.toString();
      let i;
      while ((i = buf.indexOf('\n')) >= 0) {
        const line = buf.slice(0, i);
        buf = buf.slice(i + 1);
        let msg;
        try {
          msg = JSON.parse(line);
        } catch {
          continue; // reported by the check over all of stdout below
        }
        if (msg && msg.id !== undefined && waiting.has(msg.id)) waiting.get(msg.id)(msg);
      }
    });
    const send = (msg) => proc.stdin.write(JSON.stringify(msg) + '\n');
    const request = (id, method, params) => {
      const p = new Promise((resolve, reject) => {
        const t = setTimeout(() => reject(new Error(`no answer to ${method} (id ${id}) in 60s; stderr:\n${Buffer.concat(stderr)}`)), 60_000);
        waiting.set(id, (m) => {
          clearTimeout(t);
          resolve(m);
        });
      });
      send({ jsonrpc: '2.0', id, method, params });
      return p;
    };

    try {
      const init = await request(1, 'initialize', {
        protocolVersion: '2025-06-18',
        capabilities: {},
        clientInfo: { name: 'kiln-e2e-raw', version: '0.0.0' },
      });
      assert.equal(init.result?.serverInfo?.name, 'kiln');
      send({ jsonrpc: '2.0', method: 'notifications/initialized' });

      const py = await request(2, 'tools/call', {
        name: 'run_python',
        arguments: {
          code: [
            'import os, sys, subprocess',
            'for i in range(3000):',
            '    print("out line", i, "{\\"jsonrpc\\": \\"2.0\\"}")',
            '    print("err line", i, file=sys.stderr)',
            'sys.stdout.flush(); sys.stderr.flush()',
            'os.write(1, b"raw fd1 bytes\\n" * 500)',
            'os.write(2, b"raw fd2 bytes\\n" * 500)',
            'os.system("echo from-system; echo from-system-err >&2")',
            'subprocess.run(["sh", "-c", "seq 1 2000; seq 1 2000 >&2"])',
            'print("no newline at the end", end="")',
          ].join('\n'),
        },
      });
      assert.ok(py.result && py.result.isError !== true, JSON.stringify(py).slice(0, 500));
      assert.match(py.result.content[0].text, /^\[session: /);

      const sh = await request(3, 'tools/call', {
        name: 'run_shell',
        arguments: { command: 'yes shell-stdout | head -n 5000; yes shell-stderr | head -n 5000 >&2; printf "\\x00\\x01\\x02binary"' },
      });
      assert.ok(sh.result, JSON.stringify(sh).slice(0, 500));
      assert.match(sh.result.content[0].text, /shell-stdout/);

      const crash = await request(4, 'tools/call', { name: 'run_python', arguments: { code: 'import os\nos._exit(7)' } });
      assert.ok(crash.result, JSON.stringify(crash).slice(0, 500));
      const after = await request(5, 'tools/call', { name: 'run_python', arguments: { code: 'print("alive")' } });
      assert.match(after.result?.content?.[0]?.text ?? '', /alive/, JSON.stringify(after).slice(0, 500));
    } finally {
      proc.stdin.end();
      const t = setTimeout(() => proc.kill('SIGKILL'), 10_000);
      await exited;
      clearTimeout(t);
    }

    const all = Buffer.concat(stdout).toString();
    assert.ok(all.endsWith('\n'), 'stdout ends inside a frame');
    const lines = all.split('\n').slice(0, -1);
    assert.ok(lines.length >= 5, `only ${lines.length} lines on stdout`);
    for (const [n, line] of lines.entries()) {
      let msg;
      assert.doesNotThrow(() => (msg = JSON.parse(line)), `stdout line ${n + 1} is not JSON: ${JSON.stringify(line.slice(0, 120))}`);
      assert.equal(msg.jsonrpc, '2.0', `stdout line ${n + 1} is not JSON-RPC: ${line.slice(0, 120)}`);
      assert.ok('id' in msg || 'method' in msg, `stdout line ${n + 1} is neither a response nor a request/notification`);
    }
  });
});

// `make run` is what the README tells a newcomer to start: the client's
// first line must reach kiln (make reads no stdin) and kiln's frames must
// be all of stdout (make, go build and apt print on stderr, or nothing).
describe('make run', { skip }, () => {
  const repo = path.join(path.dirname(fileURLToPath(import.meta.url)), '..');

  it('puts only MCP frames on stdout, from the first byte', async () => {
    const proc = spawn('make', ['run'], { cwd: repo, stdio: ['pipe', 'pipe', 'pipe'] });
    const stdout = [];
    const stderr = [];
    proc.stderr.on('data', (d) => stderr.push(d));
    const exited = new Promise((resolve) => proc.on('exit', (code, signal) => resolve({ code, signal })));
    const answered = new Promise((resolve, reject) => {
      const t = setTimeout(() => reject(new Error(`no answer to initialize in 180s; stderr:\n${Buffer.concat(stderr)}`)), 180_000);
      proc.stdout.on('data', (d) => {
        stdout.push(d);
        if (Buffer.concat(stdout).includes('\n')) {
          clearTimeout(t);
          resolve();
        }
      });
    });
    // Sent at once, before make has built anything: a make or apt that
    // read stdin would swallow it.
    proc.stdin.write(JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'initialize', params: { protocolVersion: '2025-06-18', capabilities: {}, clientInfo: { name: 'kiln-e2e-make', version: '0.0.0' } } }) + '\n');
    try {
      await answered;
    } finally {
      proc.stdin.end();
      const t = setTimeout(() => proc.kill('SIGKILL'), 15_000);
      await exited;
      clearTimeout(t);
    }
    const all = Buffer.concat(stdout).toString();
    const first = all.split('\n')[0];
    let msg;
    assert.doesNotThrow(() => (msg = JSON.parse(first)), `stdout starts with something else than a frame: ${JSON.stringify(all.slice(0, 200))}`);
    assert.equal(msg.id, 1);
    assert.equal(msg.result?.serverInfo?.name, 'kiln', `the first frame: ${first.slice(0, 200)}; stderr:\n${Buffer.concat(stderr)}`);
    for (const line of all.split('\n').slice(0, -1)) assert.doesNotThrow(() => JSON.parse(line), `stdout line is not JSON: ${line.slice(0, 120)}`);
  });

  it('as an ordinary user with packages missing: prints the sudo line on stderr, installs nothing, stops', async (t) => {
    // The control: setpriv is what makes the ordinary user here.
    const probe = spawnSync('setpriv', ['--reuid=65534', '--regid=65534', '--clear-groups', 'id', '-u']);
    if (probe.status !== 0 || probe.stdout.toString().trim() !== '65534') {
      t.skip(`setpriv cannot make an ordinary user here: ${probe.error ?? probe.stderr}`);
      return;
    }
    const r = spawnSync('setpriv', ['--reuid=65534', '--regid=65534', '--clear-groups', 'make', '-f', path.join(repo, 'Makefile'), 'deps-runtime', 'APT_RUNTIME=python3 kiln-e2e-absent-package'], { cwd: '/', input: 'a client line\n' });
    assert.notEqual(r.status, 0, 'make went on without the package');
    assert.equal(r.stdout.toString(), '', 'make wrote to stdout');
    assert.match(r.stderr.toString(), /sudo apt-get install kiln-e2e-absent-package\n/);
  });
});
