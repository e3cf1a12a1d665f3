"""Runtime: device planning (one training mesh and N generation meshes from one config)."""
