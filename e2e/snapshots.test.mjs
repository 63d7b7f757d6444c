// Fork and rollback through a real client (issue 13): a fork takes the
// source's DataFrame and files, a destructive step in the fork leaves the
// source intact, and restore_session rolls a session back.

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';

import { call, ok, connectStdio, skip } from './helpers.mjs';

describe('snapshots: fork_session, snapshot_session, restore_session', { skip }, () => {
  let conn;
  let stateDir;
  before(async () => {
    stateDir = mkdtempSync(path.join(tmpdir(), 'kiln-e2e-state-'));
    conn = await connectStdio(['--state-dir', stateDir]);
  });
  after(async () => {
    await conn?.close();
    rmSync(stateDir, { recursive: true, force: true });
  });

  it('a fork diverges from its source without touching it', async () => {
    const { client } = conn;
    ok(
      await call(client, 'run_python', {
        session: 'orig',
        code: "import pandas as pd\ndf = pd.DataFrame({'v': range(100)})\ndf.to_csv('data.csv', index=False)\ngen = (i for i in range(3))",
      }),
    );
    const forked = ok(await call(client, 'fork_session', { session: 'orig', new_session: 'trial' }));
    assert.match(forked, /\[session: trial\] forked from session "orig" in \d+ ms/);
    assert.match(forked, /gen: cannot pickle 'generator' object/);

    // The destructive step, in the fork.
    ok(await call(client, 'run_shell', { session: 'trial', command: 'rm data.csv' }));
    ok(await call(client, 'run_python', { session: 'trial', code: 'df.drop(df.index, inplace=True)' }));
    assert.match(ok(await call(client, 'run_python', { session: 'trial', code: 'print(len(df))' })), /^0\b/m);

    const orig = ok(await call(client, 'run_python', { session: 'orig', code: "import os\nprint(int(df.v.sum()), os.path.exists('data.csv'))" }));
    assert.match(orig, /4950 True/);
  });

  it('restore_session rolls a session back', async () => {
    const { client } = conn;
    ok(await call(client, 'run_python', { session: 'rb', code: "x = 'good'\nopen('f.txt', 'w').write('v1')" }));
    assert.match(ok(await call(client, 'snapshot_session', { session: 'rb', name: 'good' })), /snapshot "good" saved in \d+ ms/);
    ok(await call(client, 'run_python', { session: 'rb', code: "x = 'broken'\nopen('f.txt', 'w').write('v2')" }));
    assert.match(ok(await call(client, 'restore_session', { session: 'rb', name: 'good' })), /rolled back to snapshot "good"/);
    assert.match(ok(await call(client, 'run_python', { session: 'rb', code: "print(x, open('f.txt').read())" })), /good v1/);
    assert.match(ok(await call(client, 'list_snapshots', { session: 'rb' })), /- good: taken/);
    // Kept under --state-dir, root only.
    assert.equal(statSync(path.join(stateDir, 'snapshots')).mode & 0o777, 0o700);
  });
});
