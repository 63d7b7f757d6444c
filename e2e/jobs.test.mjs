// Background jobs through the TypeScript SDK over HTTP: a client that
// gives up on any single request after 60 s still gets a 5-minute
// computation's result through job_status, polling from a new connection
// each time; a job's session refuses other calls while it runs; another
// principal cannot see the job; cancel_job stops a job.

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, writeFileSync, rmSync, readdirSync, readFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';

import { text, images, assertPNG, connectHTTP, connectStdio, startHTTP, sleep, skip } from './helpers.mjs';

const stamp = `${process.pid}-${Date.now()}`;
const ALICE = `alice-jobs-${stamp}`;
const BOB = `bob-jobs-${stamp}`;

// Every request of these clients gives up after 60 s, the SDK's default.
const REQUEST = { timeout: 60_000 };

// once connects, makes one call and disconnects: every poll is a new
// client, as after a client restart.
async function once(url, token, name, args) {
  const conn = await connectHTTP(url, token);
  try {
    return await conn.client.callTool({ name, arguments: args }, undefined, REQUEST);
  } finally {
    await conn.close();
  }
}

// sleepers lists host pids running `sleep MARKER…`.
function sleepers(marker) {
  const found = [];
  for (const d of readdirSync('/proc')) {
    if (!/^\d+$/.test(d)) continue;
    try {
      const argv = readFileSync(`/proc/${d}/cmdline`, 'utf8').split('\0');
      if (argv[0].endsWith('sleep') && (argv[1] || '').startsWith(marker)) found.push(Number(d));
    } catch {
      // gone meanwhile
    }
  }
  return found;
}

function jobOf(res) {
  assert.notEqual(res.isError, true, text(res));
  const id = res.structuredContent?.job;
  assert.match(id ?? '', /^job-[0-9a-f]+$/, `no job handle: ${text(res)}`);
  assert.ok(text(res).startsWith(`[job: ${id}`), text(res));
  return id;
}

describe('background jobs', { skip }, () => {
  let srv;
  let dir;
  before(async () => {
    dir = mkdtempSync(path.join(os.tmpdir(), 'kiln-e2e-jobs-'));
    const tokenFile = path.join(dir, 'tokens');
    writeFileSync(tokenFile, `alice:${ALICE}\nbob:${BOB}\n`, { mode: 0o600 });
    srv = await startHTTP({ flags: ['--preload', 'matplotlib', '--token-file', tokenFile] });
  });
  after(async () => {
    await srv?.stop();
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  it('polls a 5-minute job to its result across reconnects, with 60 s request timeouts', { timeout: 9 * 60_000 }, async () => {
    const start = Date.now();
    const started = await once(srv.url, ALICE, 'run_python', {
      session: 'long',
      background: true,
      code: [
        'import time',
        'for i in range(300):',
        '    print(i)',
        '    time.sleep(1)',
        'import matplotlib.pyplot as plt',
        'plt.plot(range(10))',
        'plt.show()',
        '"all 300 done"',
      ].join('\n'),
    });
    const id = jobOf(started);
    assert.equal(started.structuredContent.session, 'long');
    assert.ok(Date.now() - start < 30_000, 'the background start did not return at once');

    // The session is busy, and says with what; another principal cannot
    // see the job, and its own session of that name is free.
    const busy = await once(srv.url, ALICE, 'run_python', { session: 'long', code: '1' });
    assert.equal(busy.isError, true, text(busy));
    assert.match(text(busy), new RegExp(`busy running background job ${id}`));
    assert.match(text(busy), /job_status/);
    for (const tool of ['job_status', 'cancel_job']) {
      const res = await once(srv.url, BOB, tool, { job: id });
      assert.equal(res.isError, true, `bob's ${tool}: ${text(res)}`);
      assert.match(text(res), /no job/);
    }
    const bobs = await once(srv.url, BOB, 'run_shell', { session: 'long', command: 'echo bob-runs' });
    assert.match(text(bobs), /bob-runs/);

    let live = '';
    let polls = 0;
    let final;
    while (Date.now() - start < 8 * 60_000) {
      const res = await once(srv.url, ALICE, 'job_status', { job: id, wait_s: 50 });
      polls++;
      if (res.structuredContent?.state === 'done') {
        final = res;
        break;
      }
      assert.equal(res.structuredContent?.state, 'running', text(res));
      assert.notEqual(res.isError, true, text(res));
      live += res.structuredContent.output;
    }
    assert.ok(final, `no result after ${polls} polls`);
    const elapsed = (Date.now() - start) / 1000;
    assert.ok(elapsed > 295, `the job ended after ${elapsed} s`);
    assert.ok(polls >= 6, `only ${polls} polls for a 5-minute job`);

    // The output came while it ran, with nothing lost between polls.
    const lines = live.split('\n').filter(Boolean).map(Number);
    assert.ok(lines.length >= 240, `the polls returned only ${lines.length} lines while the job ran`);
    assert.deepEqual(lines, lines.map((_, i) => i), 'the polls lost or repeated output');

    // The result is what run_python would have returned: all the output,
    // the value, the chart as an image block.
    const t = text(final);
    assert.notEqual(final.isError, true, t);
    assert.ok(t.startsWith(`[job: ${id}, session: long, ended after`), t.slice(0, 200));
    assert.match(t, /\n0\n1\n2\n/);
    assert.match(t, /\n299\n/);
    assert.match(t, /Out: 'all 300 done'/);
    assert.equal(images(final).length, 1);
    assertPNG(images(final)[0]);
    assert.equal(final.structuredContent.job, id);

    // The session is free again and kept its state.
    const after = await once(srv.url, ALICE, 'run_python', { session: 'long', code: 'i' });
    assert.match(text(after), /Out: 299/);
  });

  it('cancel_job interrupts a job, the result says so, and the session lives on', async () => {
    const id = jobOf(await once(srv.url, ALICE, 'run_shell', { session: 'cancel', background: true, command: 'echo begun; touch kept.txt; sleep 600' }));
    // Wait until it has begun.
    for (let i = 0; i < 20; i++) {
      const res = await once(srv.url, ALICE, 'job_status', { job: id, wait_s: 1 });
      if (/begun/.test(res.structuredContent?.output ?? '')) break;
    }
    const res = await once(srv.url, ALICE, 'cancel_job', { job: id });
    assert.equal(res.isError, true);
    assert.match(text(res), /the job was cancelled \(cancel_job\)/);
    assert.match(text(res), /begun/);
    assert.equal(res.structuredContent.state, 'done');
    const again = await once(srv.url, ALICE, 'job_status', { job: id });
    assert.equal(text(again), text(res));
    const ls = await once(srv.url, ALICE, 'run_shell', { session: 'cancel', command: 'ls' });
    assert.match(text(ls), /kept\.txt/);
  });

  it('the server exiting cancels a running job and destroys its sandbox', async () => {
    const conn = await connectStdio(['--preload', '']);
    const marker = `900.${process.pid}7`;
    try {
      const res = await conn.client.callTool({ name: 'run_shell', arguments: { background: true, command: `sleep ${marker}` } }, undefined, REQUEST);
      jobOf(res);
      for (const deadline = Date.now() + 10_000; Date.now() < deadline && sleepers(marker).length === 0; ) await sleep(50);
      assert.equal(sleepers(marker).length, 1, 'the job\'s process is not visible from the host');
    } finally {
      await conn.close();
    }
    for (const deadline = Date.now() + 15_000; Date.now() < deadline && sleepers(marker).length > 0; ) await sleep(100);
    assert.deepEqual(sleepers(marker), [], 'the job outlived the server');
  });
});
