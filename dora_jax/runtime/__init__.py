"""Runtime: device planning (one training mesh and N generation meshes from one config),
weight transfer between those meshes, generation hosts (an instance's engine in a process of
its own) and training hosts (the training mesh across processes, `jax.distributed`)."""
