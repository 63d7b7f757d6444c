// Hibernation through a real client: a session's variables and files
// outlive the stdio server. Closing the client ends `kiln mcp` (stdin
// EOF, then SIGTERM from the SDK), which saves its live sessions to
// --state-dir; the next server resumes them at their first call, and that
// call's result says so.
import { describe, it, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, readdirSync, statSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';

import { call, ok, text, connectStdio, startHTTP, connectHTTP, sleep } from './helpers.mjs';

describe('hibernate (stdio, --state-dir)', () => {
  const dir = mkdtempSync(path.join(os.tmpdir(), 'kiln-e2e-hib-'));
  after(() => rmSync(dir, { recursive: true, force: true }));
  const flags = ['--state-dir', dir, '--preload', 'pandas'];

  it('a DataFrame, a variable and a file survive the server stopping and starting again', async () => {
    const first = await connectStdio(flags);
    try {
      ok(await call(first.client, 'run_python', { session: 'hib', code: 'import pandas as pd\nx = 41\ndf = pd.DataFrame({"a": range(100)})' }));
      ok(await call(first.client, 'run_shell', { session: 'hib', command: 'echo kept > notes.txt' }));
    } finally {
      await first.close();
    }
    assert.match(first.stderr(), /hibernated sessions at shutdown.*saved=1/, `the first server did not save the session:\n${first.stderr()}`);
    const hib = path.join(dir, 'snapshots'); // the one snapshot store
    for (const d of [dir, hib]) {
      assert.equal(statSync(d).mode & 0o077, 0, `${d} is reachable by others`);
    }
    assert.equal(readdirSync(hib).length, 1, 'one principal directory');

    const second = await connectStdio(flags);
    try {
      const list = text(await call(second.client, 'list_sessions', {})).split('\n');
      assert.ok(list.some((l) => /^hib\thibernated, saved .* ago \(\d+ bytes\)$/.test(l)), `list_sessions:\n${list.join('\n')}`);

      const res = await call(second.client, 'run_python', { session: 'hib', code: 'print(x + 1, int(df.a.sum()), open("notes.txt").read().strip())' });
      const t = ok(res);
      assert.match(t, /^42 4950 kept$/m, t);
      assert.match(t, /\[kiln: resumed this session from hibernation in \d+(\.\d+)?m?s \(saved \d+s ago\)/, t);
      assert.doesNotMatch(t, /new sandbox/, t);

      const again = ok(await call(second.client, 'run_python', { session: 'hib', code: 'x' }));
      assert.doesNotMatch(again, /resumed/, again);
      const live = text(await call(second.client, 'list_sessions', {}));
      assert.match(live, /^hib\tlive/m, live);
    } finally {
      await second.close();
    }
  });

  it('reset_session forgets a hibernated session', async () => {
    const first = await connectStdio(flags);
    try {
      ok(await call(first.client, 'run_python', { session: 'gone', code: 'y = 1' }));
    } finally {
      await first.close();
    }
    const second = await connectStdio(flags);
    try {
      assert.match(text(await call(second.client, 'reset_session', { session: 'gone' })), /reset/);
      const t = ok(await call(second.client, 'run_python', { session: 'gone', code: "print('y' in globals())" }));
      assert.match(t, /^False$/m, t);
      assert.doesNotMatch(t, /resumed/, t);
    } finally {
      await second.close();
    }
  });
});

// Over HTTP: SIGTERM saves the sessions, each resumes only for the token's
// principal, and after kill -9 a session comes back as of its last
// checkpoint.
describe('hibernate (HTTP, SIGTERM and kill -9, two principals)', () => {
  const dir = mkdtempSync(path.join(os.tmpdir(), 'kiln-e2e-hib-'));
  const tokens = mkdtempSync(path.join(os.tmpdir(), 'kiln-e2e-tok-'));
  const tokenFile = path.join(tokens, 'tokens');
  writeFileSync(tokenFile, 'alice:hibernate-token-of-alice\nbob:hibernate-token-of-bob\n', { mode: 0o600 });
  after(() => {
    rmSync(dir, { recursive: true, force: true });
    rmSync(tokens, { recursive: true, force: true });
  });
  const flags = ['--state-dir', dir, '--token-file', tokenFile, '--preload', ''];

  it('SIGTERM saves a session that only its principal resumes', async () => {
    let srv = await startHTTP({ flags });
    try {
      const alice = await connectHTTP(srv.url, 'hibernate-token-of-alice');
      ok(await call(alice.client, 'run_python', { session: 'mine', code: 'secret = 41' }));
      await alice.close();
    } finally {
      await srv.stop();
    }
    assert.match(srv.log(), /hibernated sessions at shutdown.*saved=1/, srv.log());

    srv = await startHTTP({ flags });
    try {
      const bob = await connectHTTP(srv.url, 'hibernate-token-of-bob');
      const theirs = text(await call(bob.client, 'list_sessions', {}));
      assert.match(theirs, /^0 sessions$/, theirs);
      const t = ok(await call(bob.client, 'run_python', { session: 'mine', code: "print('secret' in globals())" }));
      assert.match(t, /^False$/m, t);
      assert.doesNotMatch(t, /resumed/, t);
      await bob.close();

      const alice = await connectHTTP(srv.url, 'hibernate-token-of-alice');
      const a = ok(await call(alice.client, 'run_python', { session: 'mine', code: 'print(secret + 1)' }));
      assert.match(a, /^42$/m, a);
      assert.match(a, /resumed this session from hibernation/, a);
      await alice.close();
    } finally {
      await srv.stop();
    }
  });

  it('a second server on the same --state-dir waits for the first, then says who holds it', async () => {
    const srv = await startHTTP({ flags });
    try {
      const alice = await connectHTTP(srv.url, 'hibernate-token-of-alice');
      ok(await call(alice.client, 'run_python', { session: 'held', code: 'x = 1' }));
      await alice.close();
      await assert.rejects(startHTTP({ flags: [...flags, '--hibernate-shutdown-time', '1s'] }),
        (err) => {
          assert.match(err.message, /waiting for another kiln to let go of the state directory/, err.message);
          assert.match(err.message, new RegExp(`state directory .* is in use by another kiln \\(pid ${srv.proc.pid} on `), err.message);
          return true;
        });
      // The first goes on serving the session it holds.
      const again = await connectHTTP(srv.url, 'hibernate-token-of-alice');
      assert.match(ok(await call(again.client, 'run_python', { session: 'held', code: 'print(x)' })), /^1$/m);
      await again.close();
    } finally {
      await srv.stop();
    }
  });

  it('after kill -9 a session comes back as of its last checkpoint', async () => {
    const ck = [...flags, '--checkpoint-every', '1ms'];
    let srv = await startHTTP({ flags: ck });
    try {
      const alice = await connectHTTP(srv.url, 'hibernate-token-of-alice');
      ok(await call(alice.client, 'run_python', { session: 'ck', code: 'x = 1' }));
      ok(await call(alice.client, 'run_python', { session: 'ck', code: 'x = 2' }));
      let list = '';
      for (const deadline = Date.now() + 30_000; Date.now() < deadline; await sleep(100)) {
        list = text(await call(alice.client, 'list_sessions', {}));
        if (/^ck\tlive, idle .*, saved .* ago \(\d+ bytes\)$/m.test(list)) break; // not "changed since"
      }
      assert.match(list, /^ck\tlive, idle .*, saved .* ago \(\d+ bytes\)$/m, list);
      await alice.close();
    } finally {
      srv.proc.kill('SIGKILL');
      await new Promise((resolve) => (srv.proc.exitCode !== null || srv.proc.signalCode !== null ? resolve() : srv.proc.once('exit', resolve)));
    }
    srv = await startHTTP({ flags: ck });
    try {
      const alice = await connectHTTP(srv.url, 'hibernate-token-of-alice');
      const t = ok(await call(alice.client, 'run_python', { session: 'ck', code: 'print(x)' }));
      assert.match(t, /^2$/m, t);
      assert.match(t, /resumed this session from hibernation/, t);
      await alice.close();
    } finally {
      await srv.stop();
    }
  });
});
