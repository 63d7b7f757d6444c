// The cluster backend through a real client: two `kiln node` daemons on
// this host make the boxes, `kiln mcp --backend cluster` places them and
// relays every call. The whole shared behaviour suite runs through it
// (charts, errors, timeouts, hostile payloads), then a node is killed
// with SIGKILL under a live session, which resumes on the other node from
// its last checkpoint and says what was lost, and a front is killed with
// SIGKILL under a live session, which another front goes on with in the
// same box, and so does a third after the second stops with SIGTERM.
// With fronts that share a bucket (--saves-bucket, on a real S3 server:
// versitygw, make s3-server), a node and the front that placed a session
// there are killed together, and a third front resumes it from the bucket.
//
// Both nodes run on one host, kept apart as two processes with their own
// listeners and boxes; two machines are not to be had here.
import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { existsSync, mkdtempSync, mkdirSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import os from 'node:os';
import path from 'node:path';

import { behaviourSuite } from './suite.mjs';
import { KILN, CANARY, call, ok, text, connectStdio, startHTTP, connectHTTP, freePort, sleep, skip } from './helpers.mjs';

// startNode runs `kiln node` on a free loopback port and waits until it
// says it serves.
async function startNode(certs) {
  const port = await freePort();
  const addr = `127.0.0.1:${port}`;
  const proc = spawn(KILN, ['node', '--tls', certs, '--listen', addr, '--max-boxes', '8', '--preload', 'matplotlib', '-v'], {
    env: { ...process.env, KILN_E2E_CANARY: CANARY },
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  const log = [];
  proc.stderr.on('data', (d) => log.push(d));
  const exited = new Promise((resolve) => proc.on('exit', () => resolve()));
  const deadline = Date.now() + 30_000;
  while (!Buffer.concat(log).toString().includes('kiln node serving boxes')) {
    if (proc.exitCode !== null) throw new Error(`kiln node exited with ${proc.exitCode}:\n${Buffer.concat(log)}`);
    if (Date.now() > deadline) {
      proc.kill('SIGKILL');
      throw new Error(`kiln node did not start in 30s:\n${Buffer.concat(log)}`);
    }
    await sleep(50);
  }
  return {
    addr,
    proc,
    log: () => Buffer.concat(log).toString(),
    boxesMade: () => (Buffer.concat(log).toString().match(/made a box for a front/g) || []).length,
    boxesDestroyed: () => (Buffer.concat(log).toString().match(/destroyed a front's box/g) || []).length,
    async stop(signal = 'SIGTERM') {
      if (proc.exitCode === null && proc.signalCode === null) {
        proc.kill(signal);
        await exited;
      }
    },
  };
}

function cluster(tag) {
  const dir = mkdtempSync(path.join(os.tmpdir(), `kiln-e2e-${tag}-`));
  const certs = path.join(dir, 'certs');
  execFileSync(KILN, ['node', 'certs', '--dir', certs]);
  const c = { dir, certs, nodes: [] };
  c.start = async () => {
    c.nodes = [await startNode(certs), await startNode(certs)];
  };
  c.flags = () => ['--backend', 'cluster', '--cluster-tls', certs, '--cluster-nodes', c.nodes.map((n) => n.addr).join(',')];
  c.stop = async () => {
    await Promise.all(c.nodes.map((n) => n.stop()));
    rmSync(dir, { recursive: true, force: true });
  };
  return c;
}

describe('cluster: the shared behaviour through two kiln nodes', { skip }, () => {
  const c = cluster('cluster');
  before(c.start);
  after(c.stop);
  behaviourSuite('cluster (stdio front)', () => connectStdio([...c.flags(), '--preload', '']));
});

describe('cluster: a node killed under a live session', { skip }, () => {
  const c = cluster('cluster-kill');
  before(c.start);
  after(c.stop);

  it('resumes the session on the other node from its last checkpoint, saying what was lost', async () => {
    const state = path.join(c.dir, 'state');
    const front = await connectStdio([...c.flags(), '--pool', '0', '--state-dir', state, '--checkpoint-every', '1ms']);
    try {
      ok(await call(front.client, 'run_python', { session: 'k', code: 'x = 41' }));
      ok(await call(front.client, 'run_python', { session: 'k', code: 'x = x' })); // saved after this call
      const made = c.nodes.map((n) => n.boxesMade());
      assert.deepEqual(made.slice().sort(), [0, 1], `boxes made by node: ${made}`);
      const victim = c.nodes[made.indexOf(1)];
      // Wait for the checkpoint before the kill.
      for (let i = 0; ; i++) {
        const list = text(await call(front.client, 'list_sessions', {}));
        if (/^k\tlive.*, saved \d+s ago/m.test(list) && !/changed since|not saved/.test(list)) break;
        assert.ok(i < 100, `no checkpoint of k:\n${list}`);
        await sleep(100);
      }
      await victim.stop('SIGKILL');
      const res = await call(front.client, 'run_python', { session: 'k', code: 'print(x + 1)' });
      assert.notEqual(res.isError, true, `${text(res)}\nthe front's log:\n${front.stderr()}`);
      const t = ok(res);
      assert.match(t, /^42$/m, t);
      assert.match(t, /the kiln node at 127\.0\.0\.1:\d+ that ran the sandbox was lost/, t);
      assert.match(t, /resumed this session from its last save in/, t);
      const other = c.nodes.find((n) => n !== victim);
      assert.equal(other.boxesMade(), 1, 'the session resumed on the other node');
    } finally {
      await front.close();
    }
  });
});

describe('cluster: a front replica killed under a live session', { skip }, () => {
  const c = cluster('cluster-front');
  before(c.start);
  after(c.stop);

  it('leaves the session\'s box on its node, and another front goes on with it in the same kernel', async () => {
    const tokenFile = path.join(c.dir, 'tokens');
    writeFileSync(tokenFile, 'alice:cluster-token-of-alice\nbob:cluster-token-of-bob\n', { mode: 0o600 });
    // No state directory on either front: the session can only go on in
    // its box, never from a save.
    const flags = [...c.flags(), '--pool', '0', '--token-file', tokenFile];
    const made = () => c.nodes.reduce((n, node) => n + node.boxesMade(), 0);
    const destroyed = () => c.nodes.reduce((n, node) => n + node.boxesDestroyed(), 0);
    const logs = () => c.nodes.map((n) => n.log()).join('');
    const first = await startHTTP({ flags });
    try {
      const conn = await connectHTTP(first.url, 'cluster-token-of-alice');
      ok(await call(conn.client, 'run_python', { session: 'f', code: 'x = 41' }));
      ok(await call(conn.client, 'run_shell', { session: 'f', command: 'echo kept > note.txt' }));
      assert.equal(made() - destroyed(), 1, 'one live box on the nodes');
      first.proc.kill('SIGKILL');
      for (let i = 0; !/kept a session's box whose front went/.test(logs()); i++) {
        assert.ok(i < 200, `no node kept the killed front's session box:\n${logs()}`);
        await sleep(50);
      }
      assert.equal(made() - destroyed(), 1, 'the session\'s box is still on its node');
    } finally {
      await first.stop();
    }
    const second = await startHTTP({ flags });
    try {
      const conn = await connectHTTP(second.url, 'cluster-token-of-alice');
      const t = ok(await call(conn.client, 'run_python', { session: 'f', code: 'print(x + 1, open("note.txt").read().strip())' }));
      assert.match(t, /^42 kept$/m, `${t}\nthe second front's log:\n${second.log()}`);
      assert.doesNotMatch(t, /resumed|new sandbox|restarted/i, t);
      assert.match(logs(), /a front adopted a session's box/);
      // Another principal's session of the same name is its own.
      const bob = await connectHTTP(second.url, 'cluster-token-of-bob');
      const b = ok(await call(bob.client, 'run_python', { session: 'f', code: 'print(globals().get("x"))' }));
      assert.match(b, /^None$/m, b);
      await bob.close();
      await conn.close();
    } finally {
      // SIGTERM, as a rolling update stops a replica.
      await second.stop();
    }
    // A front that stops the ordinary way leaves its sessions' boxes for
    // the next (bob's too), and destroys the rest.
    const kept = () => (logs().match(/kept a session's box whose front went/g) || []).length;
    for (let i = 0; kept() < 3; i++) {
      assert.ok(i < 200, `the nodes kept ${kept() - 1} of the stopped front's 2 session boxes:\n${logs()}`);
      await sleep(50);
    }
    assert.equal(made() - destroyed(), 2, 'the two sessions\' boxes are still on their nodes');
    const third = await startHTTP({ flags });
    try {
      const conn = await connectHTTP(third.url, 'cluster-token-of-alice');
      const t = ok(await call(conn.client, 'run_python', { session: 'f', code: 'print(x + 2)' }));
      assert.match(t, /^43$/m, `${t}\nthe third front's log:\n${third.log()}`);
      // A session reset on purpose is destroyed at once.
      ok(await call(conn.client, 'reset_session', { session: 'f' }));
      await conn.close();
    } finally {
      await third.stop();
    }
    for (let i = 0; made() - destroyed() !== 1; i++) {
      assert.ok(i < 200, `the nodes hold ${made() - destroyed()} box(es), want 1 (bob's, till its grace)`);
      await sleep(50);
    }
  });
});

// versitygw finds the tests' S3 server: $KILN_VERSITYGW, else kiln's
// cache, where `make s3-server` builds it.
function versitygw() {
  if (process.env.KILN_VERSITYGW) return process.env.KILN_VERSITYGW;
  const p = path.join(os.homedir(), '.cache', 'kiln', 'tools', 'versitygw-v1.8.0', 'versitygw');
  return existsSync(p) ? p : null;
}
const bucketSkip = skip || (!versitygw() && process.env.KILN_TEST_S3 !== '1' && 'shared saves: no versitygw (run make s3-server)');

// startS3 runs versitygw on a directory of dir with one bucket, its keys
// by the environment, and makes the bucket with curl (SigV4).
async function startS3(dir) {
  const bin = versitygw();
  assert.ok(bin, 'no versitygw: run make s3-server (KILN_TEST_S3=1 says it must be there)');
  const data = path.join(dir, 's3-data');
  const meta = path.join(dir, 's3-meta');
  mkdirSync(data);
  mkdirSync(meta);
  const keys = { AWS_ACCESS_KEY_ID: `kiln${randomBytes(4).toString('hex')}`, AWS_SECRET_ACCESS_KEY: randomBytes(16).toString('hex') };
  const port = await freePort();
  const proc = spawn(bin, ['--quiet', '--port', `127.0.0.1:${port}`, 'posix', '--sidecar', meta, data], {
    env: { ...process.env, ROOT_ACCESS_KEY_ID: keys.AWS_ACCESS_KEY_ID, ROOT_SECRET_ACCESS_KEY: keys.AWS_SECRET_ACCESS_KEY },
    stdio: ['ignore', 'ignore', 'inherit'],
  });
  const endpoint = `http://127.0.0.1:${port}`;
  for (let i = 0; ; i++) {
    try {
      const code = execFileSync('curl', ['-s', '-o', '/dev/null', '-w', '%{http_code}', '--aws-sigv4', 'aws:amz:us-east-1:s3',
        '--user', `${keys.AWS_ACCESS_KEY_ID}:${keys.AWS_SECRET_ACCESS_KEY}`, '-H', 'x-amz-content-sha256: UNSIGNED-PAYLOAD',
        '-X', 'PUT', `${endpoint}/kiln-saves`]).toString();
      if (code === '200') break;
    } catch {
      // not listening yet
    }
    assert.ok(i < 100, 'versitygw never made its bucket');
    await sleep(100);
  }
  return { endpoint, keys, objects: () => { try { return readdirSync(path.join(data, 'kiln-saves', 'e2e')); } catch { return []; } }, stop: () => proc.kill('SIGKILL') };
}

describe('cluster: a node and its front killed together, the fronts sharing a bucket', { skip: bucketSkip }, () => {
  const c = cluster('cluster-bucket');
  let s3;
  before(async () => {
    await c.start();
    s3 = await startS3(c.dir);
  });
  after(async () => {
    s3?.stop();
    await c.stop();
  });

  it('resumes the session on the node left, through a third front, from the last save in the bucket', async () => {
    const tokenFile = path.join(c.dir, 'tokens');
    writeFileSync(tokenFile, 'alice:bucket-token-of-alice\n', { mode: 0o600 });
    const flags = (tag, bucket) => [...c.flags(), '--pool', '0', '--token-file', tokenFile, '--checkpoint-every', '1ms',
      '--state-dir', path.join(c.dir, `state-${tag}`), ...(bucket ? ['--saves-bucket', 's3://kiln-saves/e2e', '--saves-endpoint', s3.endpoint] : [])];
    const first = await startHTTP({ flags: flags('first', true), env: s3.keys });
    let victim;
    try {
      const conn = await connectHTTP(first.url, 'bucket-token-of-alice');
      ok(await call(conn.client, 'run_python', { session: 'b', code: 'x = 41' }));
      ok(await call(conn.client, 'run_shell', { session: 'b', command: 'echo kept > note.txt' }));
      ok(await call(conn.client, 'run_python', { session: 'b', code: 'x = x' })); // saved after this call
      const made = c.nodes.map((n) => n.boxesMade());
      assert.deepEqual(made.slice().sort(), [0, 1], `boxes made by node: ${made}`);
      victim = c.nodes[made.indexOf(1)];
      for (let i = 0; ; i++) {
        const list = text(await call(conn.client, 'list_sessions', {}));
        if (/^b\tlive.*, saved \d+s ago/m.test(list) && !/changed since|not saved/.test(list) && s3.objects().length === 1) break;
        assert.ok(i < 100, `no save of b in the bucket (objects ${s3.objects()}):\n${list}\n${first.log()}`);
        await sleep(100);
      }
      // The node and the front, at once.
      victim.proc.kill('SIGKILL');
      first.proc.kill('SIGKILL');
    } finally {
      await first.stop();
      await victim?.stop('SIGKILL');
    }
    // The control: a front without the bucket finds nothing of b.
    const control = await startHTTP({ flags: flags('control', false) });
    try {
      const conn = await connectHTTP(control.url, 'bucket-token-of-alice');
      const t = ok(await call(conn.client, 'run_python', { session: 'b', code: 'print(globals().get("x"))' }));
      assert.match(t, /^None$/m, t);
      // Its fresh box would be adopted by the next front: reset it.
      ok(await call(conn.client, 'reset_session', { session: 'b' }));
      await conn.close();
    } finally {
      await control.stop();
    }
    const third = await startHTTP({ flags: flags('third', true), env: s3.keys });
    try {
      const conn = await connectHTTP(third.url, 'bucket-token-of-alice');
      const t = ok(await call(conn.client, 'run_python', { session: 'b', code: 'print(x + 1, open("note.txt").read().strip())' }));
      assert.match(t, /^42 kept$/m, `${t}\nthe third front's log:\n${third.log()}`);
      assert.match(t, /resumed this session from its last save in shared storage/, t);
      const left = c.nodes.find((n) => n !== victim);
      assert.ok(left.boxesMade() >= 2, 'the session resumed on the node left');
      // A reset deletes the save from the bucket too.
      ok(await call(conn.client, 'reset_session', { session: 'b' }));
      assert.deepEqual(s3.objects(), [], 'the bucket after a reset');
      await conn.close();
    } finally {
      await third.stop();
    }
  });
});

// The per-principal session quota held across fronts (--cluster-quotas):
// two fronts on the same nodes and the same namespace of the test cluster
// (make k8s-cluster), each its own process with its own state directory,
// count one principal's live sessions together through Leases there.
const quotaSkip = skip || (process.env.KILN_TEST_K8S !== '1' && 'cluster quotas: needs a cluster: set KILN_TEST_K8S=1 and the variables of `contrib/k8s/cluster/cluster.sh env` (make k8s-cluster)');

describe('cluster: one principal\'s session quota across two fronts (--cluster-quotas)', { skip: quotaSkip }, () => {
  const c = cluster('cluster-quota');
  const kubectl = process.env.KILN_K8S_KUBECTL || 'kubectl';
  const ns = `kiln-e2e-quota-${process.pid}`;
  before(async () => {
    await c.start();
    execFileSync(kubectl, ['create', 'namespace', ns], { stdio: ['ignore', 'ignore', 'inherit'] });
  });
  after(async () => {
    execFileSync(kubectl, ['delete', 'namespace', ns, '--wait=false'], { stdio: ['ignore', 'ignore', 'inherit'] });
    await c.stop();
  });

  it('refuses a second session of one principal on the other front, and frees its place on reset', async () => {
    const tokenFile = path.join(c.dir, 'tokens');
    writeFileSync(tokenFile, 'alice:quota-token-of-alice\nbob:quota-token-of-bob\n', { mode: 0o600 });
    const flags = (tag) => [...c.flags(), '--pool', '0', '--state-dir', path.join(c.dir, `state-${tag}`), '--token-file', tokenFile,
      '--cluster-quotas', ns, '--max-sessions-per-principal', '1'];
    const a = await startHTTP({ flags: flags('a') });
    const b = await startHTTP({ flags: flags('b') });
    try {
      const aliceA = await connectHTTP(a.url, 'quota-token-of-alice');
      const aliceB = await connectHTTP(b.url, 'quota-token-of-alice');
      const bobB = await connectHTTP(b.url, 'quota-token-of-bob');
      ok(await call(aliceA.client, 'run_python', { session: 'one', code: 'x = 1' }));
      // The control: each front alone would admit this one.
      const refused = await call(aliceB.client, 'run_python', { session: 'two', code: 'x = 2' });
      assert.equal(refused.isError, true, `the second front admitted a second session of alice:\n${text(refused)}\n${b.log()}`);
      assert.match(text(refused), /you already have 1 live session across this kiln cluster's servers/, text(refused));
      // Another principal's count is its own.
      ok(await call(bobB.client, 'run_python', { session: 'two', code: 'x = 2' }));
      // The session on the first front goes; its place is free on the
      // second once the first has written its count down.
      assert.match(text(await call(aliceA.client, 'reset_session', { session: 'one' })), /reset/);
      for (let i = 0; ; i++) {
        const res = await call(aliceB.client, 'run_python', { session: 'two', code: 'print(2)' });
        if (res.isError !== true) {
          assert.match(text(res), /^2$/m, text(res));
          break;
        }
        assert.ok(i < 100, `alice's reset session still counts on the other front:\n${text(res)}`);
        await sleep(100);
      }
      await Promise.all([aliceA.close(), aliceB.close(), bobB.close()]);
    } finally {
      await Promise.all([a.stop(), b.stop()]);
    }
  });
});
