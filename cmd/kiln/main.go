// Command kiln is an MCP server that runs the code AI agents write in
// sandboxes that hold nothing of the host.
//
//	kiln mcp                     MCP over stdio (for Claude Desktop, Claude Code, Cursor)
//	kiln serve --addr HOST:PORT  MCP over streamable HTTP at /mcp, bearer-token auth
//	kiln run -c CODE | -f FILE   run once from the shell and print the result
//	kiln install CLIENT          print or write the client config entry
//	kiln doctor                  which backends work on this host, and why not
package main

import (
	"os"

	"kiln/internal/cli"
)

func main() {
	cli.MaybeInit() // a backend's helper (a box's init, a jailed QEMU's init), when re-executed as one; returns otherwise
	os.Exit(cli.Main(os.Args[1:], os.Stdout, os.Stderr))
}
