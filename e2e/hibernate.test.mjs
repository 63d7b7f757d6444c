// Hibernation through a real client: a session's variables and files
// outlive the stdio server. Closing the client ends `kiln mcp` (stdin
// EOF, then SIGTERM from the SDK), which saves its live sessions to
// --state-dir; the next server resumes them at their first call, and that
// call's result says so.
import { describe, it, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, readdirSync, statSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';

import { call, ok, text, connectStdio } from './helpers.mjs';

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
    const hib = path.join(dir, 'hibernated');
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
