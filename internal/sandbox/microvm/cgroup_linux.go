package microvm

import (
	"fmt"

	"kiln/internal/sandbox/boxkit"
)

// newCgroup creates the cgroup parent/id of one VM's VMM process, with
// limits: guest RAM plus the VMM's own overhead, its threads, CPU
// bandwidth.
func newCgroup(parent, id string, l boxkit.CgroupLimits) (*boxkit.CgroupGroup, error) {
	cgroups := boxkit.HostCgroups()
	if _, err := cgroups.CreateParent(parent); err != nil {
		return nil, err
	}
	g, err := cgroups.Create(parent+"/"+id, l)
	if err != nil {
		return nil, fmt.Errorf("creating vm cgroup: %w", err)
	}
	return g, nil
}

// removeOrphanCgroups removes the empty VM cgroups under parent that
// servers which died without Close left. (Their VMM processes died with
// them: Pdeathsig. A group still in use, another server's, stays.)
func removeOrphanCgroups(parent string) {
	cgroups := boxkit.HostCgroups()
	for _, name := range cgroups.Children(parent) {
		cgroups.Group(parent + "/" + name).RemoveIfEmpty()
	}
}
