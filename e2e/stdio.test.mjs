// The shared behaviour over stdio: the SDK's StdioClientTransport spawns
// `kiln mcp`.
import { behaviourSuite } from './suite.mjs';
import { connectStdio } from './helpers.mjs';

behaviourSuite('stdio', () => connectStdio(['--preload', '']));
