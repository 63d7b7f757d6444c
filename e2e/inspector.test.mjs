// A second real client: @modelcontextprotocol/inspector-cli, the way a
// person would poke kiln from a terminal, over stdio and over HTTP.

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { createRequire } from 'node:module';
import path from 'node:path';
import { promisify } from 'node:util';

import { KILN, BASE_FLAGS, PNG_MAGIC, startHTTP, skip } from './helpers.mjs';

const run = promisify(execFile);
const require = createRequire(import.meta.url);
const cliDir = path.dirname(require.resolve('@modelcontextprotocol/inspector-cli/package.json'));
const cli = path.join(cliDir, 'build', 'index.js');

// inspector runs the CLI and parses the JSON it prints. inspector-cli
// 1.0.3 looks for its own package.json relative to the working directory,
// so it runs from its build folder.
async function inspector(args) {
  const { stdout } = await run(process.execPath, [cli, ...args], {
    cwd: path.join(cliDir, 'build'),
    timeout: 60_000,
    maxBuffer: 16 << 20,
  });
  return JSON.parse(stdout);
}

const stdioTarget = [KILN, 'mcp', ...BASE_FLAGS, '--preload', ''];

describe('inspector-cli', { skip }, () => {
  it('lists the tools over stdio', async () => {
    const res = await inspector([...stdioTarget, '--method', 'tools/list']);
    assert.deepEqual(res.tools.map((t) => t.name).sort(), ['cancel_job', 'delete_snapshot', 'fork_session', 'job_status', 'list_files', 'list_sessions', 'list_snapshots', 'read_file', 'reset_session', 'restore_session', 'run_python', 'run_shell', 'snapshot_session', 'write_file']);
    for (const t of res.tools) assert.equal(t.outputSchema, undefined);
  });

  it('gets a chart as an image/png block over stdio', async () => {
    const code = 'import matplotlib.pyplot as plt\nplt.bar(["a", "b", "c"], [3, 1, 2])\nplt.show()';
    const res = await inspector([...stdioTarget, '--method', 'tools/call', '--tool-name', 'run_python', '--tool-arg', `code=${code}`]);
    assert.notEqual(res.isError, true, JSON.stringify(res).slice(0, 400));
    assert.match(res.content[0].text, /^\[session: /);
    const img = res.content.find((b) => b.type === 'image');
    assert.ok(img, 'no image block');
    assert.equal(img.mimeType, 'image/png');
    assert.deepEqual(Buffer.from(img.data, 'base64').subarray(0, 8), PNG_MAGIC);
  });

  describe('over HTTP', () => {
    const token = `inspector-token-${process.pid}-${Date.now()}`;
    let srv;
    before(async () => {
      srv = await startHTTP({ flags: ['--preload', ''], env: { KILN_TOKEN: token } });
    });
    after(async () => {
      await srv?.stop();
    });

    const auth = () => [srv.url, '--transport', 'http', '--header', `Authorization: Bearer ${token}`];

    it('lists the tools over HTTP', async () => {
      const res = await inspector([...auth(), '--method', 'tools/list']);
      assert.deepEqual(res.tools.map((t) => t.name).sort(), ['cancel_job', 'delete_snapshot', 'fork_session', 'job_status', 'list_files', 'list_sessions', 'list_snapshots', 'read_file', 'reset_session', 'restore_session', 'run_python', 'run_shell', 'snapshot_session', 'write_file']);
      for (const t of res.tools) assert.equal(t.outputSchema, undefined);
    });

    it('runs run_python over HTTP', async () => {
      const code = 'import sys\nprint("sum", sum(range(10)), "python", sys.version_info[0])';
      const res = await inspector([...auth(), '--method', 'tools/call', '--tool-name', 'run_python', '--tool-arg', `code=${code}`]);
      assert.notEqual(res.isError, true, JSON.stringify(res).slice(0, 400));
      assert.match(res.content[0].text, /^\[session: /);
      assert.match(res.content[0].text, /sum 45 python 3/);
    });

    it('runs code with the bearer token and is refused without it', async () => {
      const res = await inspector([srv.url, '--transport', 'http', '--header', `Authorization: Bearer ${token}`, '--method', 'tools/call', '--tool-name', 'run_shell', '--tool-arg', 'command=echo inspected; uname -n']);
      assert.notEqual(res.isError, true, JSON.stringify(res).slice(0, 400));
      assert.match(res.content[0].text, /inspected/);
      await assert.rejects(inspector([srv.url, '--transport', 'http', '--method', 'tools/list']), /401|[Uu]nauthori[sz]ed|bearer|token/);
    });
  });
});
