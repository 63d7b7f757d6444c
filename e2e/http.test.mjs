// The shared behaviour over streamable HTTP: `kiln serve` with a bearer
// token, the SDK's StreamableHTTPClientTransport (sessionful protocol).
import { behaviourSuite } from './suite.mjs';
import { connectHTTP, startHTTP } from './helpers.mjs';

const TOKEN = `e2e-token-${process.pid}-${Date.now()}`;

behaviourSuite('http', async () => {
  // matplotlib preloaded here (and not over stdio) so both paths are used.
  const srv = await startHTTP({ flags: ['--preload', 'matplotlib'], env: { KILN_TOKEN: TOKEN } });
  try {
    const conn = await connectHTTP(srv.url, TOKEN);
    return {
      ...conn,
      secrets: [TOKEN],
      async close() {
        await conn.close();
        await srv.stop();
      },
    };
  } catch (e) {
    await srv.stop();
    throw e;
  }
});
