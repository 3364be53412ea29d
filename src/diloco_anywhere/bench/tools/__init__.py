"""What benchmarks are built from: worker processes, memory sampling, the plain loop, slowed
tasks, a shaped WAN."""
