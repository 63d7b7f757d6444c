// The stdio server's stdout carries nothing but JSON-RPC frames, whatever
// the sandboxed code prints. kiln mcp is spawned raw (no SDK) so that every
// byte of its stdout is seen.

import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';

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
