package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"

	"kiln/internal/sandbox/wasm"
)

const wasmUsage = `Usage: kiln wasm install [--wasm-dir DIR]

Installs the wasm backend's runtime into kiln's cache: Deno ` + wasm.DenoVersion + ` and Pyodide ` + wasm.PyodideVersion + `,
fetched with npm from its configured registry and checked against pinned sha512 hashes.
`

// runWasm is "kiln wasm": the wasm backend's setup.
func runWasm(args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] != "install" {
		fmt.Fprint(stderr, wasmUsage)
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help" || args[0] == "help") {
			return flag.ErrHelp
		}
		return errors.New("kiln wasm: expected the install subcommand")
	}
	fs := flag.NewFlagSet("kiln wasm install", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("wasm-dir", "", "install here instead of kiln's cache")
	if err := fs.Parse(args[1:]); err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	ctx, cancel := signalContext()
	defer cancel()
	rt, err := wasm.Install(ctx, *dir, log)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "deno    %s\npyodide %s\n", rt.Deno, rt.Pyodide)
	return nil
}
