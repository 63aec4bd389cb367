"""The RAM tier: snapshot slots in host RAM or node-local shared memory, and replicas."""
