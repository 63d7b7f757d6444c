// The operator's view of a call over HTTP: `kiln serve` with a token file,
// --audit-log and --metrics-addr. After a call by a named principal the
// audit log (owner-only) names the principal and the code's hash, never
// what the code printed, and the metrics listener's counters moved.

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { mkdtempSync, readFileSync, statSync, writeFileSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';

import { call, ok, connectHTTP, startHTTP, freePort, skip } from './helpers.mjs';

const stamp = `${process.pid}-${Date.now()}`;
const TOKEN = `carol-token-${stamp}`;

// metric returns the value of the sample whose name and labels match
// exactly, or undefined.
function metric(body, sample) {
  for (const line of body.split('\n')) {
    if (line.startsWith(sample + ' ')) return Number(line.slice(sample.length + 1));
  }
  return undefined;
}

describe('audit log and metrics of kiln serve', { skip }, () => {
  let dir;
  let srv;
  let metricsURL;
  let auditPath;
  before(async () => {
    dir = mkdtempSync(path.join(os.tmpdir(), 'kiln-e2e-obs-'));
    const tokenFile = path.join(dir, 'tokens');
    writeFileSync(tokenFile, `carol:${TOKEN}\n`, { mode: 0o600 });
    auditPath = path.join(dir, 'audit.log');
    const port = await freePort();
    metricsURL = `http://127.0.0.1:${port}`;
    srv = await startHTTP({ flags: ['--token-file', tokenFile, '--audit-log', auditPath, '--metrics-addr', `127.0.0.1:${port}`] });
  });
  after(async () => {
    await srv?.stop();
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  it('records the call in the audit log and the metrics, and never its output', async () => {
    const health = await fetch(`${metricsURL}/healthz`);
    assert.equal(health.status, 200);
    const code = "s = 'e2e-printed-' + 'secret-" + stamp + "'\nprint(s)";
    const secret = `e2e-printed-secret-${stamp}`;
    const conn = await connectHTTP(srv.url, TOKEN);
    try {
      const res = await call(conn.client, 'run_python', { code });
      assert.match(ok(res), new RegExp(secret));
    } finally {
      await conn.close();
    }

    const res = await fetch(`${metricsURL}/metrics`);
    assert.equal(res.status, 200);
    const body = await res.text();
    assert.equal(metric(body, 'kiln_executions_total{backend="jail",result="ok"}'), 1, body);
    assert.equal(metric(body, 'kiln_execution_duration_seconds_count{backend="jail"}'), 1);
    assert.ok(metric(body, 'kiln_box_create_duration_seconds_count{backend="jail"}') >= 1);
    assert.equal(metric(body, 'kiln_session_events_total{backend="jail",op="create"}'), 1);

    const st = statSync(auditPath);
    assert.equal(st.mode & 0o777, 0o600, `audit log mode ${(st.mode & 0o777).toString(8)}`);
    const raw = readFileSync(auditPath, 'utf8');
    assert.ok(!raw.includes(secret), `the audit log holds what the code printed:\n${raw}`);
    const recs = raw.trim().split('\n').map((l) => JSON.parse(l));
    const exec = recs.find((r) => r.type === 'exec');
    assert.ok(exec, `no exec record:\n${raw}`);
    assert.equal(exec.principal, 'carol');
    assert.equal(exec.result, 'ok');
    assert.equal(exec.code_sha256, createHash('sha256').update(code).digest('hex'));
    assert.equal(exec.code, undefined);
    assert.ok(recs.some((r) => r.type === 'session' && r.op === 'create' && r.principal === 'carol'));
  });
});
