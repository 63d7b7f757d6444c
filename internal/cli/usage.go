package cli

import (
	"flag"
	"fmt"
	"strings"
)

// groupUsage makes fs's help (-h) show the command's own flags first, then
// each backend's flags under its name, so a reader sees which flags apply
// to which backend; with --backend NAME before -h, only that backend's.
// A backend not in this build says how to get it instead.
func groupUsage(fs *flag.FlagSet) {
	fs.Usage = func() {
		w := fs.Output()
		fmt.Fprintf(w, "Usage of %s:\n", fs.Name())
		owner := map[string]string{}
		groups := map[string][]string{}
		for _, e := range registry {
			if e.flags == nil {
				continue
			}
			tmp := flag.NewFlagSet(e.name, flag.ContinueOnError)
			e.flags(tmp)
			tmp.VisitAll(func(f *flag.Flag) {
				owner[f.Name] = e.name
				groups[e.name] = append(groups[e.name], f.Name)
			})
		}
		var own []string
		fs.VisitAll(func(f *flag.Flag) {
			if _, ok := owner[f.Name]; !ok {
				own = append(own, f.Name)
			}
		})
		printFlags(fs, own)
		only := ""
		if b := fs.Lookup("backend"); b != nil && b.Value.String() != b.DefValue {
			only = b.Value.String()
		}
		for _, e := range registry {
			if only != "" && e.name != only {
				continue
			}
			fmt.Fprintf(w, "\nFlags of the %s backend (--backend %s):\n", e.name, e.name)
			if e.absent != nil {
				fmt.Fprintf(w, "  %s\n", e.absent)
				continue
			}
			printFlags(fs, groups[e.name])
		}
	}
}

// printFlags prints the named flags of fs as flag.PrintDefaults does.
func printFlags(fs *flag.FlagSet, names []string) {
	sub := flag.NewFlagSet(fs.Name(), flag.ContinueOnError)
	sub.SetOutput(fs.Output())
	for _, n := range names {
		f := fs.Lookup(n)
		if f == nil {
			continue
		}
		sub.Var(f.Value, f.Name, f.Usage)
		sub.Lookup(n).DefValue = f.DefValue
	}
	var b strings.Builder
	sub.SetOutput(&b)
	sub.PrintDefaults()
	fmt.Fprint(fs.Output(), b.String())
}
