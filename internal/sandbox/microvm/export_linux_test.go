package microvm

// QEMUPIDs exposes the live VMs' QEMU processes to the benchmarks.
var QEMUPIDs = (*Backend).qemuPIDs
