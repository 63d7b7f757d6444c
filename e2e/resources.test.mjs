// Results as resources (issue 15, part 3), through the official
// TypeScript SDK over HTTP with two tokens: a 20 MiB file comes back from
// read_file as a resource_link and resources/read returns it byte-exact;
// output over what a result shows is linked and readable in full; a chart
// under the inline threshold still arrives as an image block; bob cannot
// read alice's URIs.

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { mkdtempSync, writeFileSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';

import { call, ok, images, assertPNG, connectHTTP, startHTTP, skip } from './helpers.mjs';

const stamp = `${process.pid}-${Date.now()}`;
const ALICE = `alice-token-${stamp}`;
const BOB = `bob-token-${stamp}`;

function links(res) {
  return res.content.filter((b) => b.type === 'resource_link');
}

function read(client, uri) {
  return client.readResource({ uri }, { timeout: 120_000 });
}

describe('results as resources', { skip }, () => {
  let srv;
  let dir;
  let alice;
  let bob;
  before(async () => {
    dir = mkdtempSync(path.join(os.tmpdir(), 'kiln-e2e-res-'));
    const tokenFile = path.join(dir, 'tokens');
    writeFileSync(tokenFile, `alice:${ALICE}\nbob:${BOB}\n`, { mode: 0o600 });
    srv = await startHTTP({ flags: ['--preload', 'matplotlib', '--token-file', tokenFile] });
    alice = await connectHTTP(srv.url, ALICE);
    bob = await connectHTTP(srv.url, BOB);
  });
  after(async () => {
    await alice?.close();
    await bob?.close();
    await srv?.stop();
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  const big = {};

  it('returns a 20 MiB file as a link, and resources/read gives it back byte-exact', async () => {
    const gen = await call(alice.client, 'run_python', {
      session: 'res',
      code: 'import hashlib, os\ndata = os.urandom(20 << 20)\nopen("big.bin", "wb").write(data)\nprint(hashlib.sha256(data).hexdigest())',
    });
    const sum = /([0-9a-f]{64})/.exec(ok(gen))?.[1];
    assert.ok(sum, `no sha256 in ${ok(gen)}`);

    const res = await call(alice.client, 'read_file', { session: 'res', path: 'big.bin' });
    const t = ok(res);
    const [link] = links(res);
    assert.ok(link, `read_file of 20 MiB gave no resource_link: ${JSON.stringify(res).slice(0, 400)}`);
    assert.equal(link.uri, 'kiln://res/files/big.bin');
    assert.equal(link.size, 20 << 20);
    assert.ok(t.includes(link.uri), 'the text does not name the URI for clients that do not follow links');
    assert.ok(JSON.stringify(res).length < 64 << 10, 'the result inlines the file');

    const { contents } = await read(alice.client, link.uri);
    assert.equal(contents.length, 1);
    assert.equal(typeof contents[0].blob, 'string', 'a binary file comes back as a base64 blob');
    const data = Buffer.from(contents[0].blob, 'base64');
    assert.equal(data.length, 20 << 20);
    assert.equal(createHash('sha256').update(data).digest('hex'), sum);
    big.uri = link.uri;

    // A client that takes no message over 16 MiB reads it in parts.
    const part = await read(alice.client, `${link.uri}?offset=${(20 << 20) - 1000}&length=${8 << 20}`);
    assert.deepEqual(Buffer.from(part.contents[0].blob, 'base64'), data.subarray(data.length - 1000));
    assert.equal(part.contents[0]._meta?.['kiln/size'], 20 << 20);

    const { resources } = await alice.client.listResources();
    assert.ok(resources.some((r) => r.uri === link.uri), `resources/list lacks ${link.uri}`);
    const { resourceTemplates } = await alice.client.listResourceTemplates();
    assert.deepEqual(resourceTemplates.map((r) => r.uriTemplate).sort(), ['kiln://{session}/calls/{call}/{+name}', 'kiln://{session}/files/{+path}']);
  });

  it('links the rest of cut output, readable in full', async () => {
    const res = await call(alice.client, 'run_shell', { session: 'res', command: 'seq 1 100000' });
    const t = ok(res);
    const [link] = links(res);
    assert.ok(link, `no link for 588895 bytes of stdout: ${t.slice(0, 300)}`);
    assert.match(t, new RegExp(`truncated \\d+ of 588895 bytes; read the rest at ${link.uri.replace(/[/.]/g, '\\$&')}`));
    const { contents } = await read(alice.client, link.uri);
    let want = '';
    for (let i = 1; i <= 100000; i++) want += `${i}\n`;
    assert.equal(contents[0].text, want);
    big.out = link.uri;
  });

  it('still sends a chart as an image block', async () => {
    const res = await call(alice.client, 'run_python', {
      code: 'import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [2, 1, 3])\nplt.title("chart")\nplt.show()',
    });
    ok(res);
    const imgs = images(res);
    assert.equal(imgs.length, 1, `want one image block: ${JSON.stringify(res.content.map((b) => b.type))}`);
    assertPNG(imgs[0]);
    assert.equal(links(res).length, 0);
  });

  it("does not let bob read alice's URIs", async () => {
    assert.ok(big.uri && big.out, 'the tests above did not run');
    // bob has a session of the same name, with a file of the same name.
    ok(await call(bob.client, 'run_shell', { session: 'res', command: 'echo bob > big.bin' }));
    await assert.rejects(read(bob.client, big.out), /not found/i, 'bob read the stdout of a call of alice');
    let got;
    try {
      got = await read(bob.client, big.uri);
    } catch {
      got = null;
    }
    if (got) {
      const data = Buffer.from(got.contents[0].blob ?? got.contents[0].text ?? '', got.contents[0].blob ? 'base64' : 'utf8');
      assert.equal(data.toString(), 'bob\n', "bob's read of kiln://res/files/big.bin was not his own file");
    }
    const { resources } = await bob.client.listResources();
    assert.ok(!resources.some((r) => r.uri === big.uri || r.uri === big.out), "alice's resources are in bob's list");
  });
});
