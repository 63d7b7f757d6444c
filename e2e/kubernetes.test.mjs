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
// RuntimeClass, the Deployment and its Service as a server-side dry run),
// these replicas run on the node with the ServiceAccount's token and with
// the Deployment's own arguments, and the box image is built and pushed by
// `kiln image build --oci` to the cluster's registry.
//
// A second suite runs the Deployment itself, two kiln Pods in the cluster:
// a chart through one, the session continued through the other, and back
// through the first after SIGKILL to the kiln of the second.
//
// Runs with KILN_TEST_K8S=1 and the variables of `contrib/k8s/cluster/
// cluster.sh env` (KUBECONFIG, KILN_K8S_KUBECTL, KILN_K8S_REGISTRY,
// KILN_K8S_SECCOMP_DIR); KILN_K8S_IMAGE skips the image build.

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import http from 'node:http';
import net from 'node:net';
import { mkdirSync, mkdtempSync, readdirSync, readFileSync, renameSync, rmSync, writeFileSync } from 'node:fs';
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

// boxImage is the box image, built and pushed by kiln itself once for
// this file (or KILN_K8S_IMAGE).
let boxImageP;
function boxImage() {
  boxImageP ??= (async () => {
    if (process.env.KILN_K8S_IMAGE) return process.env.KILN_K8S_IMAGE;
    const reg = process.env.KILN_K8S_REGISTRY;
    assert.ok(reg, 'set KILN_K8S_IMAGE, or KILN_K8S_REGISTRY to build and push the box image');
    const { stdout } = await run(KILN, ['image', 'build', '--oci', `${reg}/kiln/box:e2e`, '--insecure'], { timeout: 30 * 60_000 });
    const ref = stdout.trim().split('\n').pop();
    assert.match(ref, /@sha256:[0-9a-f]{64}$/, `kiln image build --oci printed ${JSON.stringify(stdout)}`);
    return ref;
  })();
  return boxImageP;
}

// prepare puts kiln's seccomp profile where the kubelet finds it (as the
// Deployment's comment says to do on every node), applies the operator's
// manifests to ns, and returns the Deployment and its Service as the API
// server admits them there (a server-side dry run, which must draw no Pod
// Security warning), with the box image and kilnImage in place.
async function prepare(ns, kilnImage) {
  assert.ok(process.env.KUBECONFIG, 'KILN_TEST_K8S=1 but KUBECONFIG is not set (contrib/k8s/cluster/cluster.sh env)');
  const image = await boxImage();
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
  for (const m of ['namespace.yaml', 'rbac.yaml', 'networkpolicy.yaml']) {
    await kubectl(['apply', '-f', '-'], { input: manifest(m, ns) });
  }
  await kubectl(['apply', '--dry-run=server', '-f', path.join(MANIFESTS, 'runtimeclass.yaml')]);
  const dep = manifest('deployment.yaml', ns).replace(/KILN_BOX_IMAGE/g, image).replace(/KILN_IMAGE/g, kilnImage);
  const dry = await kubectl(['apply', '--dry-run=server', '-o', 'json', '-f', '-'], { input: dep });
  assert.doesNotMatch(dry.stderr, /PodSecurity|[Ww]arning/, `the Deployment draws warnings:\n${dry.stderr}`);
  const objs = JSON.parse(dry.stdout);
  const items = objs.kind === 'List' ? objs.items : [objs];
  const deployment = items.find((o) => o.kind === 'Deployment');
  const service = items.find((o) => o.kind === 'Service');
  assert.ok(deployment && service, `no Deployment and Service in the dry run: ${dry.stdout.slice(0, 300)}`);
  assert.equal(service.spec.sessionAffinity, 'ClientIP', 'the Service does not keep a client on one replica');
  const ctr = deployment.spec.template.spec.containers.find((c) => c.name === 'kiln');
  assert.ok(ctr.env.some((e) => e.name === 'KILN_TOKEN'), 'the Deployment passes no KILN_TOKEN');
  assert.equal(ctr.args[0], 'serve');
  assert.ok(ctr.args.includes('--backend=kubernetes'), `args: ${ctr.args}`);
  return { image, deployment, service, ctr, seccompDir };
}

describe('kubernetes: a session through two kiln replicas on the test cluster', { skip: k8sSkip }, () => {
  const ns = `kiln-e2e-${randomBytes(4).toString('hex')}`;
  let dir;
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
    dir = mkdtempSync(path.join(os.tmpdir(), 'kiln-e2e-k8s-'));
    // The Deployment is only dry-run here: its kiln arguments are what
    // the replicas run with, on the node.
    const { ctr, seccompDir } = await prepare(ns, `${process.env.KILN_K8S_REGISTRY || 'localhost:5000'}/kiln/kiln:e2e`);
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

// kilnPid is the host pid of the kiln process of a Deployment's Pod: the
// one whose command line names the Pod as its replica.
function kilnPid(pod) {
  for (const d of readdirSync('/proc')) {
    if (!/^\d+$/.test(d)) continue;
    let cmd;
    try {
      cmd = readFileSync(`/proc/${d}/cmdline`, 'utf8').split('\0');
    } catch {
      continue;
    }
    if (cmd[1] === 'serve' && cmd.includes(`--k8s-replica=${pod}`)) return Number(d);
  }
  return 0;
}

// The Deployment itself: its Pods run kiln serve in the cluster. This
// cluster has no kube-proxy, so the Service IP the in-cluster client
// configuration names leads nowhere; the test forwards a port of the
// node's address on the Pods' bridge to the API server and points the
// Pods' KUBERNETES_SERVICE_HOST there (through a host alias on a name the
// API server's certificate carries). That, and a short Lease, are all it
// adds to deployment.yaml.
describe('kubernetes: contrib/kubernetes/deployment.yaml in the cluster', { skip: k8sSkip }, () => {
  const ns = `kiln-e2e-dep-${randomBytes(4).toString('hex')}`;
  let forward;
  let pods2; // [{name, ip}] of the two replicas
  const clients = [];
  const connect = async (pod) => {
    const c = await connectHTTP(`http://${pod.ip}:8080/mcp`, TOKEN);
    clients.push(c);
    return c;
  };

  before(async () => {
    const gw = process.env.KILN_K8S_POD_GATEWAY;
    assert.ok(gw, 'KILN_K8S_POD_GATEWAY is not set (contrib/k8s/cluster/cluster.sh env)');
    const tools = process.env.KILN_K8S_TOOLS;
    assert.ok(tools, 'KILN_K8S_TOOLS is not set (contrib/k8s/cluster/cluster.sh env)');
    // An image holding the kiln binary (static), as deployment.yaml asks.
    const reg = process.env.KILN_K8S_REGISTRY;
    const { stdout: digest } = await run(path.join(tools, 'mkimage'), ['-ref', `${reg}/kiln/kiln:e2e`, '-entrypoint', '/kiln', '-user', '65532:65532', `kiln=${KILN}`]);
    const { deployment, service } = await prepare(ns, `${reg}/kiln/kiln@${digest.trim()}`);
    await kubectl(['-n', ns, 'create', 'secret', 'generic', 'kiln-token', `--from-literal=token=${TOKEN}`]);

    const { stdout: view } = await kubectl(['config', 'view', '--raw', '--minify', '-o', 'json']);
    const api = new URL(JSON.parse(view).clusters[0].cluster.server);
    forward = net.createServer((c) => {
      const u = net.connect(Number(api.port), api.hostname);
      c.pipe(u).pipe(c);
      u.on('error', () => c.destroy());
      c.on('error', () => u.destroy());
    });
    await new Promise((resolve, reject) => forward.once('error', reject).listen(0, gw, resolve));

    for (const o of [deployment, service]) {
      delete o.status;
      for (const k of ['uid', 'resourceVersion', 'creationTimestamp', 'generation', 'managedFields']) delete o.metadata[k];
    }
    delete service.spec.clusterIP; // the dry run's, not allocated
    delete service.spec.clusterIPs;
    const spec = deployment.spec.template.spec;
    spec.hostAliases = [{ ip: gw, hostnames: ['kubernetes'] }];
    const ctr = spec.containers.find((c) => c.name === 'kiln');
    ctr.env.push({ name: 'KUBERNETES_SERVICE_HOST', value: 'kubernetes' }, { name: 'KUBERNETES_SERVICE_PORT', value: String(forward.address().port) });
    ctr.args.push('--k8s-lease-duration=2s');
    await kubectl(['create', '-f', '-'], { input: JSON.stringify({ apiVersion: 'v1', kind: 'List', items: [deployment, service] }) });

    await waitFor('the Deployment\'s two replicas do not answer', 180, async () => {
      const l = await pods(ns, 'app.kubernetes.io/name=kiln');
      const up = l.filter((p) => p.status.phase === 'Running' && p.status.podIP && !p.metadata.deletionTimestamp);
      if (up.length !== 2) return `${up.length} of 2 Running`;
      for (const p of up) {
        try {
          const r = await fetch(`http://${p.status.podIP}:8080/healthz`);
          if (!r.ok) return `${p.metadata.name}: /healthz ${r.status}`;
        } catch (e) {
          return `${p.metadata.name}: ${e.message}`;
        }
      }
      pods2 = up.map((p) => ({ name: p.metadata.name, ip: p.status.podIP })).sort((a, b) => a.name.localeCompare(b.name));
      return true;
    });
  });

  after(async () => {
    for (const c of clients) await c.close().catch(() => {});
    forward?.closeAllConnections?.();
    forward?.close();
    await kubectl(['delete', 'namespace', ns, '--wait=false']).catch(() => {});
  });

  it('serves a chart through one replica; the session goes on through the other, and back after that one is killed', async () => {
    assert.ok(pods2, 'the replicas did not come up');
    const [a, b] = pods2;
    const ca = await connect(a);
    const res = await call(ca.client, 'run_python', { session: 'in-cluster', code: 'import matplotlib.pyplot as plt\nplt.plot([0, 1], [1, 0])\nplt.show()\ny = 7' });
    const t = ok(res);
    assert.match(t, /new sandbox/, t);
    assertPNG(images(res)[0]);

    // Through the other live replica: the session's Pod moves to it.
    const cb = await connect(b);
    const tb = ok(await call(cb.client, 'run_python', { session: 'in-cluster', code: 'print(y * 6)' }));
    assert.match(tb, /^42$/m, tb);
    assert.doesNotMatch(tb, /new sandbox/, tb);
    let bound = await pods(ns, LABEL_SESSION);
    assert.deepEqual(bound.map((p) => p.metadata.labels[LABEL_REPLICA]), [b.name]);

    // SIGKILL to the kiln of the replica that holds it; back through the first.
    const pid = kilnPid(b.name);
    assert.ok(pid > 0, `no kiln process for ${b.name}`);
    process.kill(pid, 'SIGKILL');
    const ta = ok(await call(ca.client, 'run_python', { session: 'in-cluster', code: 'print(y)' }));
    assert.match(ta, /^7$/m, ta);
    assert.doesNotMatch(ta, /new sandbox/, ta);
    bound = await pods(ns, LABEL_SESSION);
    assert.deepEqual(bound.map((p) => p.metadata.labels[LABEL_REPLICA]), [a.name]);
  });
});
