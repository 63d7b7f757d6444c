// kiln on Kubernetes through a real client: two `kiln serve` replicas on
// the test cluster (make k8s-cluster), each with its own --k8s-replica, one
// namespace, one principal, behind one URL (a load balancer in this test
// that sends a client to the first live replica, as a Service with ClientIP
// affinity does). Through the first, a session draws a matplotlib chart (a
// real image/png block) and keeps a variable and a file; the first replica
// is killed with SIGKILL; the client's transport session dies with it
// (404), and after a new initialize, through the second replica, the same
// session goes on in the same Pod with its state, over the SDK's sessionful
// transport and over the stateless 2026-07-28 wire; the dead replica's
// Lease and Pods are collected; the second replica's SIGTERM leaves no Pod
// behind.
//
// The namespace, ServiceAccount, Role, RoleBinding and NetworkPolicy are
// contrib/kubernetes/*.yaml applied into a fresh namespace (the
// RuntimeClass, the Deployment and its Service as a server-side dry run:
// this cluster runs no kube-proxy, so a kiln Pod could not reach the API
// through its Service IP), the replicas run on the node with the
// ServiceAccount's token and with the Deployment's own arguments, and the
// box image is built and pushed by `kiln image build --oci` to the
// cluster's registry.
//
// Runs with KILN_TEST_K8S=1 and the variables of `contrib/k8s/cluster/
// cluster.sh env` (KUBECONFIG, KILN_K8S_KUBECTL, KILN_K8S_REGISTRY,
// KILN_K8S_SECCOMP_DIR); KILN_K8S_IMAGE skips the image build.

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import http from 'node:http';
import { mkdirSync, mkdtempSync, readFileSync, renameSync, rmSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { randomBytes } from 'node:crypto';

import { KILN, call, ok, text, sessionOf, images, assertPNG, connectHTTP, startHTTP, stateless, sleep, skip } from './helpers.mjs';

const here = path.dirname(fileURLToPath(import.meta.url));
const MANIFESTS = path.join(here, '..', 'contrib', 'kubernetes');

const k8sSkip = (() => {
  if (skip) return skip;
  if (process.env.KILN_TEST_K8S !== '1') {
    return 'kiln e2e kubernetes: needs a cluster: set KILN_TEST_K8S=1 and the variables of `contrib/k8s/cluster/cluster.sh env` (make k8s-cluster)';
  }
  return false;
})();

const KUBECTL = process.env.KILN_K8S_KUBECTL || 'kubectl';
const TOKEN = `k8s-e2e-token-${process.pid}-${Date.now()}`;
const LABEL_REPLICA = 'kiln.dev/replica';
const LABEL_SESSION = 'kiln.dev/session';

// run runs a command to its end and returns its stdout; a non-zero exit
// throws with its stderr. stderr is also returned, for warnings.
function run(cmd, args, { input, env, timeout = 120_000 } = {}) {
  return new Promise((resolve, reject) => {
    const p = spawn(cmd, args, { env: { ...process.env, ...env }, stdio: ['pipe', 'pipe', 'pipe'] });
    const out = [];
    const err = [];
    p.stdout.on('data', (d) => out.push(d));
    p.stderr.on('data', (d) => err.push(d));
    const t = setTimeout(() => p.kill('SIGKILL'), timeout);
    p.on('error', (e) => {
      clearTimeout(t);
      reject(e);
    });
    p.on('close', (code, signal) => {
      clearTimeout(t);
      const stdout = Buffer.concat(out).toString();
      const stderr = Buffer.concat(err).toString();
      if (code !== 0) {
        reject(new Error(`${path.basename(cmd)} ${args.join(' ')}: exit ${code ?? signal}\n${stderr}`));
        return;
      }
      resolve({ stdout, stderr });
    });
    p.stdin.end(input ?? '');
  });
}

const kubectl = (args, opts) => run(KUBECTL, args, opts);

// manifest is contrib/kubernetes/name with its namespace kiln replaced by
// ns (and, in namespace.yaml, the Namespace's own name).
function manifest(name, ns) {
  let s = readFileSync(path.join(MANIFESTS, name), 'utf8');
  const before = s;
  s = s.replace(/^(\s*)namespace: kiln\s*$/gm, `$1namespace: ${ns}`);
  if (name === 'namespace.yaml') s = s.replace(/^(\s*)name: kiln\s*$/m, `$1name: ${ns}`);
  assert.notEqual(s, before, `${name} names no namespace kiln to replace`);
  return s;
}

// podsOf lists the box Pods in ns that match a label selector.
async function pods(ns, selector) {
  const { stdout } = await kubectl(['-n', ns, 'get', 'pods', '-l', selector, '-o', 'json']);
  return JSON.parse(stdout).items;
}

// front is the load balancer in front of the replicas, as a Service with
// ClientIP affinity behaves for one client: every request goes to the
// first replica that takes the connection (a dead one refuses it and the
// next is tried). Request bodies are small MCP messages, held to be sent
// again; answers, SSE streams included, are piped through.
async function front(ports) {
  const srv = http.createServer(async (req, res) => {
    const chunks = [];
    for await (const c of req) chunks.push(c);
    const body = Buffer.concat(chunks);
    const tryAt = (i) => {
      const all = ports();
      if (i >= all.length) {
        res.writeHead(502).end('no replica answers');
        return;
      }
      const up = http.request({ host: '127.0.0.1', port: all[i], method: req.method, path: req.url, headers: req.headers }, (r) => {
        res.writeHead(r.statusCode, r.headers);
        r.pipe(res);
      });
      up.on('error', (e) => {
        if (e.code === 'ECONNREFUSED' && !res.headersSent) tryAt(i + 1);
        else res.destroy();
      });
      up.end(body);
    };
    tryAt(0);
  });
  await new Promise((resolve) => srv.listen(0, '127.0.0.1', resolve));
  return {
    url: `http://127.0.0.1:${srv.address().port}/mcp`,
    close() {
      srv.closeAllConnections();
      return new Promise((resolve) => srv.close(resolve));
    },
  };
}

async function waitFor(what, secs, fn) {
  const deadline = Date.now() + secs * 1000;
  let last;
  for (;;) {
    last = await fn();
    if (last === true) return;
    if (Date.now() > deadline) assert.fail(`${what} after ${secs}s: ${last}`);
    await sleep(500);
  }
}

describe('kubernetes: a session through two kiln replicas on the test cluster', { skip: k8sSkip }, () => {
  const ns = `kiln-e2e-${randomBytes(4).toString('hex')}`;
  let dir;
  let image;
  let replicaFlags; // (name) => flags of `kiln serve` for replica name
  let saKubeconfig;
  let one;
  let two;
  let c1;
  let c2;
  let session; // the name the first result gave
  let sessionPod;
  let lb; // the load balancer the client talks to

  before(async () => {
    assert.ok(process.env.KUBECONFIG, 'KILN_TEST_K8S=1 but KUBECONFIG is not set (contrib/k8s/cluster/cluster.sh env)');
    dir = mkdtempSync(path.join(os.tmpdir(), 'kiln-e2e-k8s-'));

    // The box image, built and pushed by kiln itself.
    image = process.env.KILN_K8S_IMAGE;
    if (!image) {
      const reg = process.env.KILN_K8S_REGISTRY;
      assert.ok(reg, 'set KILN_K8S_IMAGE, or KILN_K8S_REGISTRY to build and push the box image');
      const { stdout } = await run(KILN, ['image', 'build', '--oci', `${reg}/kiln/box:e2e`, '--insecure'], { timeout: 30 * 60_000 });
      image = stdout.trim().split('\n').pop();
      assert.match(image, /@sha256:[0-9a-f]{64}$/, `kiln image build --oci printed ${JSON.stringify(stdout)}`);
    }

    // kiln's seccomp profile where the kubelet finds it, as the
    // Deployment's comment says to do on every node.
    const seccompDir = process.env.KILN_K8S_SECCOMP_DIR;
    if (seccompDir) {
      const { stdout } = await run(KILN, ['k8s', 'seccomp-profile']);
      // Written aside and renamed: the kubelet may be reading it for
      // another test's Pod.
      const p = path.join(seccompDir, 'kiln', 'box.json');
      mkdirSync(path.dirname(p), { recursive: true });
      writeFileSync(`${p}.${process.pid}`, stdout);
      renameSync(`${p}.${process.pid}`, p);
    }

    // The operator's manifests, in a namespace of this test's own.
    for (const m of ['namespace.yaml', 'rbac.yaml', 'networkpolicy.yaml']) {
      await kubectl(['apply', '-f', '-'], { input: manifest(m, ns) });
    }

    // The Deployment, as the API server would admit it here (a dry run:
    // this cluster runs no kube-proxy, so a kiln Pod could not reach the
    // API through its Service IP); Pod Security of the namespace has
    // nothing to say about it. Its kiln arguments are what the replicas
    // run with.
    const dep = manifest('deployment.yaml', ns).replace(/KILN_BOX_IMAGE/g, image).replace(/KILN_IMAGE/g, `${process.env.KILN_K8S_REGISTRY || 'localhost:5000'}/kiln/kiln:e2e`);
    await kubectl(['apply', '--dry-run=server', '-f', path.join(MANIFESTS, 'runtimeclass.yaml')]);
    const dry = await kubectl(['apply', '--dry-run=server', '-o', 'json', '-f', '-'], { input: dep });
    assert.doesNotMatch(dry.stderr, /PodSecurity|[Ww]arning/, `the Deployment draws warnings:\n${dry.stderr}`);
    const objs = JSON.parse(dry.stdout);
    const deployment = (objs.kind === 'List' ? objs.items : [objs]).find((o) => o.kind === 'Deployment');
    assert.ok(deployment, `no Deployment in the dry run: ${dry.stdout.slice(0, 300)}`);
    const service = (objs.kind === 'List' ? objs.items : [objs]).find((o) => o.kind === 'Service');
    assert.equal(service?.spec.sessionAffinity, 'ClientIP', 'the Service does not keep a client on one replica');
    const ctr = deployment.spec.template.spec.containers.find((c) => c.name === 'kiln');
    assert.ok(ctr.env.some((e) => e.name === 'KILN_TOKEN'), 'the Deployment passes no KILN_TOKEN');
    assert.equal(ctr.args[0], 'serve');
    assert.ok(ctr.args.includes('--backend=kubernetes'), `args: ${ctr.args}`);
    replicaFlags = (name) => [
      ...ctr.args
        .slice(1)
        .filter((a) => !a.startsWith('--addr'))
        .filter((a) => seccompDir || !a.startsWith('--k8s-seccomp-profile'))
        .map((a) => a.replace('$(POD_NAME)', name)),
      // What a Pod of the Deployment gets from its environment.
      `--k8s-namespace=${ns}`,
      `--k8s-kubeconfig=${saKubeconfig}`,
      // A dead replica is found within seconds (the default is 30 s).
      '--k8s-lease-duration=2s',
    ];

    // The ServiceAccount's own token: the Role must be enough.
    const { stdout: token } = await kubectl(['-n', ns, 'create', 'token', 'kiln', '--duration=1h']);
    const { stdout: view } = await kubectl(['config', 'view', '--raw', '--minify', '--flatten', '-o', 'json']);
    const cluster = JSON.parse(view).clusters[0].cluster;
    saKubeconfig = path.join(dir, 'kiln-sa.kubeconfig');
    writeFileSync(
      saKubeconfig,
      JSON.stringify({
        apiVersion: 'v1',
        kind: 'Config',
        clusters: [{ name: 'c', cluster: { server: cluster.server, 'certificate-authority-data': cluster['certificate-authority-data'] } }],
        users: [{ name: 'kiln', user: { token: token.trim() } }],
        contexts: [{ name: 'c', context: { cluster: 'c', user: 'kiln', namespace: ns } }],
        'current-context': 'c',
      }),
      { mode: 0o600 },
    );
  });

  after(async () => {
    await c1?.close().catch(() => {});
    await c2?.close().catch(() => {});
    await lb?.close();
    one?.proc.kill('SIGKILL');
    await two?.stop();
    await kubectl(['delete', 'namespace', ns, '--wait=false']).catch(() => {});
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  const serve = (name) => startHTTP({ flags: replicaFlags(name), env: { KILN_TOKEN: TOKEN, KUBECONFIG: saKubeconfig } });

  it('runs a chart through the first replica, in a Pod bound to the session', async () => {
    one = await serve('one');
    lb = await front(() => [one, two].filter((r) => r).map((r) => r.port));
    c1 = await connectHTTP(lb.url, TOKEN);
    // The first box may pull the image onto the node: a long first call.
    const res = await c1.client.callTool(
      {
        name: 'run_python',
        arguments: {
          code: [
            'import matplotlib.pyplot as plt',
            'plt.plot([1, 2, 3], [1, 4, 9])',
            'plt.title("kiln on kubernetes")',
            'plt.show()',
            'x = 41',
            'open("notes.txt", "w").write("kept")',
            'print("set")',
          ].join('\n'),
        },
      },
      undefined,
      { timeout: 600_000 },
    );
    const t = ok(res);
    assert.match(t, /^set$/m, t);
    assert.match(t, /new sandbox/, t);
    const imgs = images(res);
    assert.equal(imgs.length, 1, `image blocks: ${imgs.length}\n${t}`);
    assertPNG(imgs[0]);
    session = sessionOf(res);

    const bound = await pods(ns, LABEL_SESSION);
    assert.equal(bound.length, 1, `Pods bound to a session: ${bound.map((p) => p.metadata.name)}\n${one.log()}`);
    assert.equal(bound[0].metadata.labels[LABEL_REPLICA], 'one');
    assert.deepEqual(
      bound[0].metadata.ownerReferences.map((o) => `${o.kind}/${o.name}`),
      ['Lease/kiln-replica-one'],
    );
    sessionPod = bound[0].metadata.name;
  });

  it('continues the session through the second replica after the first is killed', async () => {
    assert.ok(session, 'no session from the first replica');
    two = await serve('two');
    one.proc.kill('SIGKILL'); // mid-session: its attach, its Lease and its Pods are left behind
    await new Promise((resolve) => (one.proc.exitCode !== null || one.proc.signalCode !== null ? resolve() : one.proc.on('exit', resolve)));
    assert.equal(one.proc.signalCode, 'SIGKILL');

    // The client's transport session was the dead replica's: through the
    // load balancer the second replica does not know it (404), and the
    // client initializes again there.
    await assert.rejects(call(c1.client, 'run_python', { session, code: 'x' }), (e) => e.code === 404);
    await c1.close().catch(() => {});
    c1 = undefined;
    c2 = await connectHTTP(lb.url, TOKEN);
    const res = await call(c2.client, 'run_python', {
      session,
      code: 'import matplotlib.pyplot as plt\nprint(x + 1, open("notes.txt").read())\nplt.bar(["a", "b"], [x, 1])\nplt.show()',
    });
    const t = ok(res);
    assert.equal(sessionOf(res), session);
    assert.match(t, /^42 kept$/m, `the session's state did not follow it:\n${t}\n${two.log()}`);
    assert.doesNotMatch(t, /new sandbox/, t);
    assertPNG(images(res)[0]);

    const bound = await pods(ns, LABEL_SESSION);
    assert.deepEqual(bound.map((p) => p.metadata.name), [sessionPod], 'the session moved to another Pod');
    assert.equal(bound[0].metadata.labels[LABEL_REPLICA], 'two');
    assert.deepEqual(bound[0].metadata.ownerReferences.map((o) => `${o.kind}/${o.name}`), ['Lease/kiln-replica-two']);
  });

  it('collects the dead replica: its Lease and its Pods go, the adopted session stays', async () => {
    assert.ok(two, 'no second replica');
    await waitFor('the dead replica is not collected', 120, async () => {
      const lease = await kubectl(['-n', ns, 'get', 'lease', 'kiln-replica-one', '--ignore-not-found', '-o', 'name']);
      const left = await pods(ns, `${LABEL_REPLICA}=one`);
      if (lease.stdout.trim() !== '' || left.length > 0) {
        return `lease ${JSON.stringify(lease.stdout.trim())}, pods ${left.map((p) => p.metadata.name)}`;
      }
      return true;
    });
    // The session's Pod was moved to the live replica before: still there.
    const bound = await pods(ns, LABEL_SESSION);
    assert.deepEqual(bound.map((p) => p.metadata.name), [sessionPod]);

    // And a stateless request (no initialize, no transport session) that
    // names the session lands in it.
    const res = await stateless(lb.url, TOKEN, 1, 'tools/call', { name: 'run_python', arguments: { session, code: 'x += 1\nprint("x is", x)' } });
    assert.notEqual(res.isError, true, text(res));
    assert.equal(sessionOf(res), session);
    assert.match(text(res), /^x is 42$/m, text(res));
  });

  it('leaves no Pod and no Lease after the last replica stops', async () => {
    assert.ok(two, 'no second replica');
    await c2.close().catch(() => {});
    c2 = undefined;
    await two.stop();
    assert.equal(two.proc.exitCode, 0, `kiln serve exited with ${two.proc.exitCode ?? two.proc.signalCode}:\n${two.log()}`);
    await waitFor('Pods or Leases of kiln are left', 120, async () => {
      const left = await pods(ns, 'app.kubernetes.io/managed-by=kiln');
      const leases = await kubectl(['-n', ns, 'get', 'leases', '-l', 'app.kubernetes.io/managed-by=kiln', '-o', 'name']);
      if (left.length > 0 || leases.stdout.trim() !== '') return `pods ${left.map((p) => p.metadata.name)}, ${leases.stdout.trim()}`;
      return true;
    });
  });
});
