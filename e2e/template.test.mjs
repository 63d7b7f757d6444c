// Configured templates through the TypeScript SDK over stdio: kiln
// template create runs an operator's setup once; `kiln mcp --template`
// then serves every per-call box and every session from it. The setup's
// module (imported before each box is handed out) and data file are in
// every box, read-only, and the tool descriptions say where they are.

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { chmodSync, mkdtempSync, writeFileSync, readFileSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';

import { KILN, call, text, connectStdio, skip } from './helpers.mjs';

const SETUP = `set -e
mkdir -p "$KILN_TEMPLATE_FILES/python"
echo 'VALUE = "from-template"' > "$KILN_TEMPLATE_FILES/python/tmod.py"
echo "template data" > "$KILN_TEMPLATE_FILES/data.txt"
`;

const PROBE = `import sys
print("preloaded", "tmod" in sys.modules)
import tmod
print(tmod.VALUE, open("/template/data.txt").read().strip())
try:
    open("/template/data.txt", "a").write("x"); print("WROTE")
except OSError as e:
    print("write refused")
import os; print("mine before", os.path.exists("mine.txt")); open("mine.txt", "w").write("mine")
`;

describe('configured templates', { skip }, () => {
  let dir;
  const name = `e2e-${process.pid}`;

  before(() => {
    const base = mkdtempSync(path.join(os.tmpdir(), 'kiln-e2e-tpl-'));
    chmodSync(base, 0o755); // boxes' inits pass through it
    dir = path.join(base, 'templates');
    const setup = path.join(base, 'setup.sh');
    writeFileSync(setup, SETUP);
    const r = spawnSync(KILN, ['template', 'create', name, '--template-dir', dir, '--setup', setup, '--import', 'tmod'], { encoding: 'utf8' });
    assert.equal(r.status, 0, `kiln template create: ${r.stdout}${r.stderr}`);
    assert.match(r.stdout, new RegExp(`template ${name}: 2 files`));
  });

  after(() => {
    if (!dir) return;
    const r = spawnSync(KILN, ['template', 'rm', name, '--template-dir', dir], { encoding: 'utf8' });
    assert.equal(r.status, 0, `kiln template rm: ${r.stderr}`);
    rmSync(path.dirname(dir), { recursive: true, force: true });
  });

  for (const mode of ['per-call', 'session']) {
    it(`serves every ${mode} box from the template`, async () => {
      const conn = await connectStdio(['--mode', mode, '--template', name, '--template-dir', dir, '--preload', '']);
      try {
        const { tools } = await conn.client.listTools();
        const runPython = tools.find((t) => t.name === 'run_python');
        assert.match(runPython.description, /\/template, read-only/);
        for (let i = 0; i < 2; i++) {
          const res = await call(conn.client, 'run_python', { code: PROBE });
          const out = text(res);
          assert.notEqual(res.isError, true, out);
          assert.match(out, /preloaded True/);
          assert.match(out, /from-template template data/);
          assert.match(out, /write refused/);
          assert.doesNotMatch(out, /WROTE/);
          // Per-call boxes never see each other's files; a session keeps its own.
          assert.match(out, new RegExp(`mine before ${mode === 'session' && i === 1 ? 'True' : 'False'}`));
        }
      } finally {
        await conn.close();
      }
      assert.equal(readFileSync(path.join(dir, name, 'files', 'data.txt'), 'utf8'), 'template data\n');
    });
  }

  it('refuses an unknown template at start, with a clear message', () => {
    const r = spawnSync(KILN, ['mcp', '--template', 'no-such-template', '--template-dir', dir], { encoding: 'utf8', input: '' });
    assert.notEqual(r.status, 0);
    assert.match(r.stderr, /template "no-such-template": no such template/);
    assert.equal(r.stdout, '', 'something other than protocol on stdout');
  });
});
