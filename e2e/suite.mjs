// The behaviour every transport must show, written once and run over stdio
// (stdio.test.mjs) and over streamable HTTP (http.test.mjs) through the
// official TypeScript SDK client.

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync, writeFileSync, rmSync } from 'node:fs';

import { CANARY, call, text, ok, sessionOf, images, assertPNG, skip } from './helpers.mjs';

const TOOLS = ['cancel_job', 'delete_snapshot', 'fork_session', 'job_status', 'list_files', 'list_sessions', 'list_snapshots', 'read_file', 'reset_session', 'restore_session', 'run_python', 'run_shell', 'snapshot_session', 'write_file'];

// behaviourSuite registers the shared tests. connect returns
// { client, close, secrets: [strings no sandbox may print] }.
export function behaviourSuite(name, connect) {
  describe(name, { skip }, () => {
    let conn;
    let client;
    before(async () => {
      conn = await connect();
      client = conn.client;
    });
    after(async () => {
      await conn?.close();
    });

    it('lists exactly the six tools, without an outputSchema', async () => {
      const { tools } = await client.listTools();
      assert.deepEqual(tools.map((t) => t.name).sort(), TOOLS);
      for (const t of tools) {
        assert.equal(t.outputSchema, undefined, `${t.name} advertises an outputSchema (clients would drop image blocks)`);
        assert.equal(t.inputSchema?.type, 'object', `${t.name} has no object inputSchema`);
        assert.ok(t.description && t.description.length > 20, `${t.name} has no real description`);
      }
      const py = tools.find((t) => t.name === 'run_python');
      assert.deepEqual(py.inputSchema.required, ['code']);
      for (const arg of ['code', 'session', 'timeout_s']) {
        assert.ok(arg in py.inputSchema.properties, `run_python lacks argument ${arg}`);
      }
      const sh = tools.find((t) => t.name === 'run_shell');
      assert.deepEqual(sh.inputSchema.required, ['command']);
      const wf = tools.find((t) => t.name === 'write_file');
      for (const arg of ['path', 'content', 'encoding']) {
        assert.ok(arg in wf.inputSchema.properties, `write_file lacks argument ${arg}`);
      }
    });

    it('prints, and the result names its session', async () => {
      const res = await call(client, 'run_python', { code: 'print("hello from kiln", 6 * 7)' });
      const t = ok(res);
      assert.match(t, /^\[session: [^\]]+\]/);
      assert.match(t, /hello from kiln 42/);
      assert.equal(res.structuredContent.stdout, 'hello from kiln 42\n');
      assert.equal(res.structuredContent.session, sessionOf(res));
    });

    it('streams live output as progress notifications when the call sends a token', async () => {
      // A 10 s cell that prints every second.
      const code = 'for i in 0 1 2 3 4 5 6 7 8 9; do echo tick $i; sleep 1; done';
      const progress = [];
      const res = await client.callTool({ name: 'run_shell', arguments: { command: code } }, undefined, {
        timeout: 120_000,
        onprogress: (p) => progress.push(p),
      });
      assert.match(ok(res), /tick 9/);
      const ticks = progress.filter((p) => /tick \d/.test(p.message || ''));
      assert.ok(ticks.length >= 5, `${ticks.length} progress notifications with output over a 10 s call: ${JSON.stringify(progress)}`);
      for (let i = 1; i < progress.length; i++) {
        assert.ok(progress[i].progress > progress[i - 1].progress, `progress went from ${progress[i - 1].progress} to ${progress[i].progress}`);
      }
      // Without a token the result is the same (but for its first line).
      const quiet = await call(client, 'run_shell', { command: code });
      assert.equal(text(quiet).replace(/^.*\n/, ''), text(res).replace(/^.*\n/, ''));
    });

    it('keeps state across calls and shows the last expression', async () => {
      const a = await call(client, 'run_python', { code: 'import math\nx = 6 * 7\nfacts = [math.factorial(n) for n in range(6)]' });
      ok(a);
      const b = await call(client, 'run_python', { code: 'x + 1, facts[-1]' });
      const t = ok(b);
      assert.match(t, /\(43, 120\)/);
      assert.equal(sessionOf(b), sessionOf(a));
      assert.equal(b.structuredContent.result?.['text/plain'], '(43, 120)');
    });

    it('keeps named sessions apart from the default one', async () => {
      const a = await call(client, 'run_python', { code: 'only_here = "named"', session: 'e2e-named' });
      ok(a);
      assert.equal(sessionOf(a), 'e2e-named');
      const b = await call(client, 'run_python', { code: 'print(only_here)', session: 'e2e-named' });
      assert.match(ok(b), /named/);
      const c = await call(client, 'run_python', { code: 'only_here' });
      assert.equal(c.isError, true, 'the default session sees a named session\'s variable');
      assert.match(text(c), /NameError/);
      assert.notEqual(sessionOf(c), 'e2e-named');
    });

    it('returns a matplotlib chart as an image/png block, and read_file of the PNG as an image', async () => {
      const code = [
        'import matplotlib.pyplot as plt',
        'p = [n for n in range(2, 80) if all(n % d for d in range(2, n))][:20]',
        'fig = plt.figure()',
        'plt.plot([b - a for a, b in zip(p, p[1:])], marker="o")',
        'plt.title("gaps between the first 20 primes")',
        'fig.savefig("chart.png")',
        'print(p)',
        'plt.show()',
      ].join('\n');
      const res = await call(client, 'run_python', { code, timeout_s: 60 });
      const t = ok(res);
      assert.match(t, /\[2, 3, 5, 7, 11/);
      const imgs = images(res);
      assert.equal(imgs.length, 1, `expected one image block, got ${imgs.length}: ${t}`);
      assertPNG(imgs[0]);

      const file = await call(client, 'read_file', { path: 'chart.png' });
      assert.match(ok(file), /chart\.png/);
      const fimgs = images(file);
      assert.equal(fimgs.length, 1, 'read_file of a PNG did not return an image block');
      assertPNG(fimgs[0]);
    });

    it('reports an exception as isError with a traceback naming the cell line', async () => {
      const code = 'def ratio(a, b):\n    return a / b\n\nratio(1, 0)\n';
      const res = await call(client, 'run_python', { code });
      assert.equal(res.isError, true);
      const t = text(res);
      assert.match(t, /Traceback/);
      assert.match(t, /File "<cell \d+>", line 4/);
      assert.match(t, /File "<cell \d+>", line 2, in ratio/);
      assert.match(t, /return a \/ b/);
      assert.match(t, /ZeroDivisionError: division by zero/);
      assert.equal(res.structuredContent.error?.ename, 'ZeroDivisionError');
      // The session survives its code's exceptions.
      assert.match(ok(await call(client, 'run_python', { code: 'print("still here")' })), /still here/);
    });

    it('stops a runaway loop at timeout_s, keeping the session usable', async () => {
      const session = 'e2e-runaway';
      ok(await call(client, 'run_python', { code: 'kept = "before the loop"', session }));
      const started = Date.now();
      const res = await call(client, 'run_python', { code: 'n = 0\nwhile True:\n    n += 1', session, timeout_s: 2 });
      const took = Date.now() - started;
      assert.equal(res.isError, true);
      assert.equal(res.structuredContent.timed_out, true);
      assert.notEqual(res.structuredContent.restarted, true, 'an interruptible loop should not cost the session');
      assert.match(text(res), /KeyboardInterrupt/);
      assert.match(text(res), /time limit of 2 s/, 'the note names the limit and its value');
      assert.ok(took < 15_000, `the 2 s timeout took ${took} ms`);
      const after = await call(client, 'run_python', { code: 'print(kept, n > 0)', session });
      assert.match(ok(after), /before the loop True/);
    });

    it('destroys a sandbox whose code ignores the interrupt; the next call gets a fresh one', async () => {
      const session = 'e2e-stubborn';
      ok(await call(client, 'run_python', { code: 'lost = 1', session }));
      const code = 'import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass';
      const started = Date.now();
      const res = await call(client, 'run_python', { code, session, timeout_s: 2 });
      const took = Date.now() - started;
      assert.equal(res.isError, true);
      assert.equal(res.structuredContent.timed_out, true);
      assert.equal(res.structuredContent.restarted, true);
      assert.match(text(res), /restarted/);
      assert.ok(took < 20_000, `the 2 s timeout took ${took} ms`);
      const next = await call(client, 'run_python', { code: 'print("fresh", "lost" in globals())', session });
      const t = ok(next);
      assert.match(t, /fresh False/);
      assert.match(t, /new sandbox/);
      assert.equal(sessionOf(next), session);
    });

    it('truncates an output flood with a note, keeping head and tail', async () => {
      const code = [
        'import sys',
        'print("HEAD-MARK")',
        'for i in range(20000):',
        '    print("flood line %05d" % i)',
        'print("TAIL-MARK")',
        'sys.stderr.write("E" * 100000)',
      ].join('\n');
      const res = await call(client, 'run_python', { code });
      const t = ok(res);
      const notes = [...t.matchAll(/truncated (\d+) of (\d+) (bytes|chars)/g)];
      assert.equal(notes.length, 2, `expected a truncation note for stdout and for stderr:\n${t.slice(0, 500)}`);
      const total = 'HEAD-MARK\n'.length + 20000 * 'flood line 00000\n'.length + 'TAIL-MARK\n'.length;
      assert.equal(Number(notes[0][2]), total);
      assert.equal(Number(notes[1][2]), 100000);
      assert.match(t, /HEAD-MARK/);
      assert.match(t, /TAIL-MARK/);
      assert.ok(t.length < 2 * 20000 + 2000, `text block is ${t.length} chars; the cap is 20000 per stream`);
      assert.ok(res.structuredContent.stdout.length <= 20000 + 200);
    });

    it('shares files between write_file, run_python, run_shell, list_files and read_file', async () => {
      ok(await call(client, 'write_file', { path: 'data/in/notes.txt', content: 'alpha\nbeta\ngamma\n' }));
      const bin = Buffer.from([0, 1, 2, 250, 251, 252, 253, 254, 255]);
      ok(await call(client, 'write_file', { path: 'data/blob.bin', content: bin.toString('base64'), encoding: 'base64' }));

      const py = await call(client, 'run_python', {
        code: 'lines = open("data/in/notes.txt").read().split()\nprint(lines, list(open("data/blob.bin", "rb").read()))',
      });
      assert.match(ok(py), /\['alpha', 'beta', 'gamma'\] \[0, 1, 2, 250, 251, 252, 253, 254, 255\]/);

      const sh = await call(client, 'run_shell', { command: 'wc -l < data/in/notes.txt; tail -n1 data/in/notes.txt; pwd; echo made-by-shell > data/out.txt' });
      const st = ok(sh);
      assert.match(st, /^3$/m);
      assert.match(st, /^gamma$/m);

      const back = await call(client, 'run_python', { code: 'print(open("data/out.txt").read().strip())' });
      assert.match(ok(back), /made-by-shell/);

      const ls = await call(client, 'list_files', { path: 'data' });
      const lt = ok(ls);
      for (const f of ['notes.txt', 'blob.bin', 'out.txt']) assert.match(lt, new RegExp(f.replace('.', '\\.')));

      const rf = await call(client, 'read_file', { path: 'data/in/notes.txt' });
      assert.match(ok(rf), /alpha\nbeta\ngamma/);
    });

    it('reports a failing shell command as isError with its exit status', async () => {
      const res = await call(client, 'run_shell', { command: 'echo to-stderr >&2; exit 3' });
      assert.equal(res.isError, true);
      assert.equal(res.structuredContent.exit_code, 3);
      assert.match(text(res), /to-stderr/);
      assert.match(text(res), /exit status 3/);
    });

    it('reset_session throws the sandbox away', async () => {
      const session = 'e2e-reset';
      ok(await call(client, 'run_python', { code: 'doomed = 1', session }));
      ok(await call(client, 'write_file', { path: 'doomed.txt', content: 'x', session }));
      assert.match(ok(await call(client, 'reset_session', { session })), /reset/);
      const res = await call(client, 'run_python', { code: 'import os\nprint("doomed" in globals(), os.path.exists("doomed.txt"))', session });
      assert.match(ok(res), /False False/);
    });

    it('turns a dying kernel (exit, segfault, memory bomb) into a result and carries on', async () => {
      const session = 'e2e-crash';
      const cases = [
        ['import os\nos._exit(7)', /KernelDied.*status 7/],
        ['import ctypes\nctypes.string_at(0)', /KernelDied.*SIGSEGV/],
        ['hog = bytearray(4 * 1024 ** 3)', /KernelDied|MemoryError/],
      ];
      for (const [code, want] of cases) {
        ok(await call(client, 'run_python', { code: 'before = 1', session }));
        const res = await call(client, 'run_python', { code, session, timeout_s: 20 });
        assert.equal(res.isError, true, `${code}: not an error result: ${text(res)}`);
        assert.match(text(res), want);
        assert.equal(sessionOf(res), session);
        const next = await call(client, 'run_python', { code: 'print("alive", 6 * 7)', session });
        assert.match(ok(next), /alive 42/);
      }
    });

    it('names the memory limit when a cell runs out of memory, and says what survived', async () => {
      const session = 'e2e-oom';
      ok(await call(client, 'run_python', { code: 'before = 1', session }));
      // Grown in touched steps, so the cgroup's limit kills rather than one
      // allocation being refused.
      const res = await call(client, 'run_python', { code: 'chunks = []\nwhile True: chunks.append(b"x" * (32 << 20))', session, timeout_s: 60 });
      assert.equal(res.isError, true, text(res));
      assert.match(text(res), /ran out of memory \(limit \d+ MiB\)/);
      assert.match(text(res), /the session restarted/);
      assert.match(ok(await call(client, 'run_python', { code: 'print("alive", "before" in dir())', session })), /alive False/);
    });

    it('answers hostile payloads harmlessly and keeps serving', async () => {
      const secrets = [CANARY, ...(conn.secrets || [])];
      // Host files that must not show: a canary in the host's /tmp, and the
      // password hashes of the host's /etc/shadow.
      const hostTmp = `/tmp/kiln-e2e-host-${process.pid}`;
      const tmpSecret = `host-tmp-content-${CANARY}`;
      writeFileSync(hostTmp, tmpSecret);
      let shadowHashes = [];
      try {
        shadowHashes = readFileSync('/etc/shadow', 'utf8')
          .split('\n')
          .map((l) => l.split(':')[1])
          .filter((h) => h && h.length > 3);
      } catch {
        // no shadow file on this host
      }
      try {
        const code = [
          'import os, glob',
          'out = []',
          'for p in ["/etc/shadow", "/root", "/home", "/proc/1/environ"]:',
          '    try:',
          '        if os.path.isdir(p):',
          '            out.append((p, os.listdir(p)))',
          '        else:',
          '            out.append((p, open(p, "rb").read().decode(errors="replace")))',
          '    except Exception as e:',
          '        out.append((p, type(e).__name__))',
          'out.append(("env", dict(os.environ)))',
          'out.append(("tmp", os.listdir("/tmp")))',
          'out.append(("uid", os.getuid(), os.geteuid()))',
          'print(out)',
        ].join('\n');
        const py = await call(client, 'run_python', { code, session: 'e2e-hostile' });
        const pt = text(py);
        const sh = await call(client, 'run_shell', {
          command: 'cat /etc/shadow; env; cat /proc/*/environ | tr "\\0" "\\n"; ls -la /tmp /root /home; id; cat /proc/self/status | grep -i cap',
          session: 'e2e-hostile',
        });
        const st = text(sh);
        for (const out of [pt, st]) {
          for (const s of secrets) assert.ok(!out.includes(s), `a sandbox saw a secret of the host: ${s.slice(0, 12)}…`);
          for (const h of shadowHashes) assert.ok(!out.includes(h), 'a sandbox read the host\'s /etc/shadow');
          assert.ok(!out.includes(hostTmp.slice(5)) && !out.includes(tmpSecret), 'a sandbox saw the host\'s /tmp');
        }
        assert.doesNotMatch(pt, /\('uid', 0, 0\)/, 'sandbox code runs as uid 0');
        assert.match(st, /CapEff:\s+0+$/m, 'sandbox has effective capabilities');

        // The file tools cannot leave the workspace.
        for (const p of ['/etc/shadow', '../../../../etc/shadow', '../../../../etc/passwd', `../../../..${hostTmp}`]) {
          const rf = await call(client, 'read_file', { path: p, session: 'e2e-hostile' });
          const rt = rf.content.map((b) => b.text || '').join('\n');
          assert.ok(!rt.includes(tmpSecret), `read_file ${p} reached the host's /tmp`);
          for (const h of shadowHashes) assert.ok(!rt.includes(h), `read_file ${p} read the host's /etc/shadow`);
          assert.equal(rf.isError, true, `read_file ${p} did not refuse: ${rt.slice(0, 200)}`);
        }
        const wf = await call(client, 'write_file', { path: '../../../../tmp/escaped-' + process.pid, content: 'x', session: 'e2e-hostile' });
        assert.equal(wf.isError, true, 'write_file escaped the workspace with ../');

        // And the server still answers.
        assert.match(ok(await call(client, 'run_python', { code: 'print(2 + 2)' })), /\b4\b/);
      } finally {
        rmSync(hostTmp, { force: true });
        rmSync('/tmp/escaped-' + process.pid, { force: true });
      }
    });
  });
}
