package microvm

// QEMUPIDs exposes the live VMs' QEMU processes to the benchmarks.
var QEMUPIDs = (*Backend).qemuPIDs

// Rotations exposes how many template replacements became current.
func Rotations(b *Backend) int { return b.rotations().Rotations }
