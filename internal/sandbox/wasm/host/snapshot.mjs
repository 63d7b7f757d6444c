// kiln's wasm backend: makes the memory snapshot boxes start from. It loads
// Pyodide once, runs no model code, and writes Pyodide's memory to the one
// file Deno lets it write (Deno.args[1]). Boxes restore from it in a
// fraction of a cold start.
const [dir, out] = Deno.args;
const { loadPyodide } = await import(new URL("file://" + dir + "/pyodide.mjs").href);
const py = await loadPyodide({ indexURL: dir + "/", _makeSnapshot: true });
Deno.writeFileSync(out, py.makeMemorySnapshot());
