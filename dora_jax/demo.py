"""Foundation demo behind `make train` until the RL loop lands: build the policy on a mesh,
export it as a Hugging Face checkpoint, re-import it and check the logits agree."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from dora_jax import models
from dora_jax.models import sharding_lib


def model_round_trip(config: ml_collections.ConfigDict, workdir: str) -> float:
    """Returns the max |logit difference| between the sharded model and its re-import."""
    model_config = models.ModelConfig(
        **{k: v for k, v in config.model.items() if k != "checkpoint"}
    )
    devices = jax.devices()
    mesh = sharding_lib.make_mesh(devices, fsdp=len(devices) // 2 or 1, tp=min(2, len(devices)))
    model = sharding_lib.shard_model(models.create(model_config, seed=config.seed), mesh)
    path = os.path.join(workdir, "hf_checkpoint")
    models.save_pretrained(model, path)
    reloaded = models.from_pretrained(path)
    ids = jnp.asarray(
        np.random.RandomState(config.seed).randint(0, model_config.vocab_size, (4, 32)), jnp.int32
    )
    diff = float(np.abs(np.asarray(jax.jit(lambda m, x: m(x))(model, ids)) - reloaded(ids)).max())
    print(f"{len(devices)} devices, mesh {dict(mesh.shape)}; checkpoint at {path}")
    print(f"max |logits(sharded) - logits(re-imported)| = {diff:.2e}")
    return diff
