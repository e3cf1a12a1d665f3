"""Runtime: device planning (one training mesh and N generation meshes from one config) and
weight transfer between those meshes."""
