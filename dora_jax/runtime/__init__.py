"""Runtime: device planning (one training mesh and N generation meshes from one config),
weight transfer between those meshes, and generation hosts (an instance's engine in a process of
its own)."""
