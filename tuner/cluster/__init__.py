"""Many workers on one study: Slurm fan-out, heartbeats and reaping dead workers."""
