// kiln serve --auth oidc, driven by the official TypeScript SDK client with
// an access token of a tiny authorization server that runs here in node:
// it serves its JWKS and signs RS256 tokens with node:crypto.

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { createServer } from 'node:http';
import { generateKeyPairSync, sign, createHash } from 'node:crypto';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';

import { call, ok, connectHTTP, startHTTP, freePort, skip } from './helpers.mjs';

// startIssuer serves one RSA key at /jwks and mints tokens with it.
async function startIssuer() {
  const { publicKey, privateKey } = generateKeyPairSync('rsa', { modulusLength: 2048 });
  const kid = `e2e-${process.pid}`;
  const jwk = { ...publicKey.export({ format: 'jwk' }), kid, alg: 'RS256', use: 'sig' };
  const server = createServer((req, res) => {
    if (req.url !== '/jwks') {
      res.writeHead(404).end();
      return;
    }
    res.writeHead(200, { 'Content-Type': 'application/json' }).end(JSON.stringify({ keys: [jwk] }));
  });
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  const url = `http://127.0.0.1:${server.address().port}`;
  const b64 = (v) => Buffer.from(typeof v === 'string' ? v : JSON.stringify(v)).toString('base64url');
  return {
    url,
    jwks: `${url}/jwks`,
    mint(claims) {
      const now = Math.floor(Date.now() / 1000);
      const input = `${b64({ alg: 'RS256', typ: 'at+jwt', kid })}.${b64({ iss: url, iat: now, exp: now + 300, ...claims })}`;
      return `${input}.${sign('sha256', Buffer.from(input), privateKey).toString('base64url')}`;
    },
    close: () => new Promise((resolve) => server.close(resolve)),
  };
}

describe('oauth resource server', { skip }, () => {
  let iss;
  let srv;
  let resource;
  let dir;
  let auditPath;
  let metricsURL;
  before(async () => {
    iss = await startIssuer();
    dir = mkdtempSync(path.join(os.tmpdir(), 'kiln-e2e-oauth-'));
    auditPath = path.join(dir, 'audit.log');
    const metricsPort = await freePort();
    metricsURL = `http://127.0.0.1:${metricsPort}/metrics`;
    const port = await freePort();
    resource = `http://127.0.0.1:${port}/mcp`;
    srv = await startHTTP({
      port,
      flags: ['--preload', '', '--auth', 'oidc', '--oidc-issuer', iss.url, '--oidc-jwks-url', iss.jwks, '--public-url', `http://127.0.0.1:${port}`,
        '--audit-log', auditPath, '--metrics-addr', `127.0.0.1:${metricsPort}`],
      env: { KILN_TOKEN: '' },
    });
  });
  after(async () => {
    await srv?.stop();
    await iss?.close();
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  // The "done means": a token from a local issuer runs code, and
  // the audit log and the metrics show that call.
  it('runs code for a token of the issuer with kiln:run; the audit log and the metrics show the call', async () => {
    const token = iss.mint({ sub: 'e2e-alice', aud: resource, scope: 'kiln:run' });
    const code = 'print(6 * 7)';
    const c = await connectHTTP(srv.url, token);
    try {
      assert.match(ok(await call(c.client, 'run_python', { code })), /42/);
    } finally {
      await c.close();
    }
    const recs = readFileSync(auditPath, 'utf8').trim().split('\n').map((l) => JSON.parse(l));
    const exec = recs.find((r) => r.type === 'exec');
    assert.ok(exec, `no exec record: ${JSON.stringify(recs)}`);
    assert.equal(exec.principal, `oidc:${iss.url}#e2e-alice`);
    assert.equal(exec.result, 'ok');
    assert.equal(exec.code_sha256, createHash('sha256').update(code).digest('hex'));
    const body = await (await fetch(metricsURL)).text();
    assert.match(body, /^kiln_executions_total\{backend="jail",result="ok"\} 1$/m, body);
  });

  it('answers 401 with a challenge naming the metadata, and serves the metadata', async () => {
    const res = await fetch(srv.url, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: '{}' });
    assert.equal(res.status, 401);
    await res.body?.cancel();
    const challenge = res.headers.get('www-authenticate');
    const meta = `http://127.0.0.1:${srv.port}/.well-known/oauth-protected-resource/mcp`;
    assert.match(challenge, /^Bearer /);
    assert.ok(challenge.includes(`resource_metadata="${meta}"`), challenge);
    assert.ok(challenge.includes('scope="kiln:run"'), challenge);
    const doc = await (await fetch(meta)).json();
    assert.deepEqual(doc.authorization_servers, [iss.url]);
    assert.equal(doc.resource, resource);
    assert.deepEqual(doc.scopes_supported, ['kiln:run', 'kiln:net']);
  });

  it('refuses a token for another resource (401 invalid_token) and one without kiln:run (403)', async () => {
    const wrongAud = iss.mint({ sub: 'e2e-alice', aud: 'https://elsewhere.example/mcp', scope: 'kiln:run' });
    await assert.rejects(connectHTTP(srv.url, wrongAud), (e) => e.code === 401);
    const res = await fetch(srv.url, { method: 'POST', headers: { Authorization: `Bearer ${wrongAud}`, 'Content-Type': 'application/json' }, body: '{}' });
    assert.equal(res.status, 401);
    assert.match(res.headers.get('www-authenticate'), /error="invalid_token"/);
    await res.body?.cancel();

    const noScope = iss.mint({ sub: 'e2e-alice', aud: resource, scope: 'openid' });
    const r403 = await fetch(srv.url, { method: 'POST', headers: { Authorization: `Bearer ${noScope}`, 'Content-Type': 'application/json' }, body: '{}' });
    assert.equal(r403.status, 403);
    assert.match(r403.headers.get('www-authenticate'), /error="insufficient_scope"/);
    await r403.body?.cancel();
  });
});
