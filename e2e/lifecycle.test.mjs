// No process started by sandboxed code outlives its session: not after
// reset_session, not after the server exits (stdio client closes, HTTP
// server gets SIGTERM). Sandbox processes are found from the host by a
// marker in their command line.

import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { readdirSync, readFileSync } from 'node:fs';

import { call, ok, connectStdio, connectHTTP, startHTTP, sleep, skip } from './helpers.mjs';

// pidsWith lists host pids running `sleep MARKER…`.
function pidsWith(marker) {
  const found = [];
  for (const d of readdirSync('/proc')) {
    if (!/^\d+$/.test(d) || Number(d) === process.pid) continue;
    try {
      const argv = readFileSync(`/proc/${d}/cmdline`, 'utf8').split('\0');
      if (argv[0].endsWith('sleep') && (argv[1] || '').startsWith(marker)) found.push(Number(d));
    } catch {
      // gone meanwhile
    }
  }
  return found;
}

async function waitGone(marker, ms) {
  const deadline = Date.now() + ms;
  while (Date.now() < deadline) {
    if (pidsWith(marker).length === 0) return [];
    await sleep(100);
  }
  return pidsWith(marker);
}

// plant starts escapees in a session: a detached shell job, a Python
// child in its own session, and a double fork. Each sleeps long with a
// marker argument (sleep accepts a fractional duration).
async function plant(client, session, marker) {
  ok(await call(client, 'run_shell', { command: `nohup sleep 900.${marker}1 >/dev/null 2>&1 & disown; setsid sleep 900.${marker}2 >/dev/null 2>&1 &`, session }));
  ok(
    await call(client, 'run_python', {
      code: [
        'import subprocess, os',
        `subprocess.Popen(["sleep", "900.${marker}3"], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)`,
        'if os.fork() == 0:',
        '    if os.fork() == 0:',
        `        os.execvp("sleep", ["sleep", "900.${marker}4"])`,
        '    os._exit(0)',
        'os.wait()',
        'print("planted")',
      ].join('\n'),
      session,
    }),
  );
  // The shell's background jobs may still be on their way to exec.
  let pids = [];
  for (const deadline = Date.now() + 5000; Date.now() < deadline; await sleep(50)) {
    pids = pidsWith(`900.${marker}`);
    if (pids.length >= 4) break;
  }
  assert.equal(pids.length, 4, `expected 4 planted processes visible from the host, found ${pids.length}`);
}

describe('lifecycle', { skip }, () => {
  it('reset_session and the stdio server exiting leave no sandbox process behind', async () => {
    const conn = await connectStdio(['--preload', '']);
    const m1 = String(process.pid) + '1';
    const m2 = String(process.pid) + '2';
    try {
      await plant(conn.client, 'lc-reset', m1);
      ok(await call(conn.client, 'reset_session', { session: 'lc-reset' }));
      assert.deepEqual(await waitGone(`900.${m1}`, 5000), [], 'processes outlived reset_session');
      await plant(conn.client, 'lc-exit', m2);
    } finally {
      await conn.close();
    }
    assert.deepEqual(await waitGone(`900.${m2}`, 10_000), [], 'processes outlived the stdio server');
  });

  it('the HTTP server exiting on SIGTERM leaves no sandbox process behind', async () => {
    const token = `lifecycle-token-${process.pid}-${Date.now()}`;
    const srv = await startHTTP({ flags: ['--preload', ''], env: { KILN_TOKEN: token } });
    const m = String(process.pid) + '3';
    try {
      const conn = await connectHTTP(srv.url, token);
      try {
        await plant(conn.client, 'lc-http', m);
      } finally {
        await conn.close();
      }
    } finally {
      await srv.stop();
    }
    assert.notEqual(srv.proc.exitCode, null, 'kiln serve did not exit on SIGTERM');
    assert.deepEqual(await waitGone(`900.${m}`, 10_000), [], 'processes outlived the HTTP server');
  });
});
