"""RL trainer: advantage estimators and policy losses (registries), sharded updates, publication."""

from dora_jax.train.advantage_lib import register_advantage
from dora_jax.train.config_lib import TrainConfig
from dora_jax.train.loss_lib import register_loss
from dora_jax.train.trainer_lib import Published, Trainer

__all__ = ["Published", "TrainConfig", "Trainer", "register_advantage", "register_loss"]
