"""The RL trainer: batches of finished trajectories in, new policy versions out.

One `step` consumes exactly TBS samples (complete groups): advantages over the groups, then
`epochs` passes over them, each of `mini_batches` optimizer steps, each accumulating gradients
over length-bucketed micro-batches. Every pass weighs a sample against its behaviour log-probs,
so the ratios of later passes measure how far the earlier ones moved the policy (PPO's epochs).
Params and optimizer state live sharded on the training mesh (FSDP + TP by `sharding_lib`'s
rules); the jitted micro-step donates the gradient accumulator and the update donates params
and optimizer state, so memory holds one copy of each. A non-finite loss or gradient norm keeps
the old params and optimizer state bit for bit (a `where` on every leaf) and is counted.

`publish` ends an iteration: the version becomes v + 1 and a copy of the params is placed on
the generation mesh's shardings (`runtime.transfer_lib`). The trainer's own buffers are never
donated to the copy: the next step needs them.

`MirroredTrainer` is the same interface over a training mesh that spans processes
(`runtime.training_hosts_lib`): every call runs on every process, and params leave as host
arrays.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dora_jax.models import Functional, Transformer, lora_lib, sharding_lib
from dora_jax.rollout.trajectory_lib import Trajectory
from dora_jax.runtime import transfer_lib
from dora_jax.train import advantage_lib, batch_lib, loss_lib, optimizer_lib
from dora_jax.train.config_lib import TrainConfig


class Published(NamedTuple):
    params: Any  # the new version's params, on the target shardings
    version: int
    metrics: dict[str, float]  # publish_seconds, publish_bytes


class TrainerLike(Protocol):
    """What the rollout and the app need of a trainer: a `Trainer` in this process, one in a
    process of its own on cores of its own (`runtime.trainer_process_lib.TrainerProcess`), or
    one mirrored on every process of a training group (`MirroredTrainer`)."""

    @property
    def version(self) -> int: ...

    @property
    def params(self) -> Any: ...

    @property
    def state(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any]) -> None: ...

    def step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]: ...

    def publish(
        self, target_shardings: Any | None = None, dtype: Any = None, base: Any | None = None
    ) -> Published: ...


def moe_load_metrics(expert_load: np.ndarray) -> dict[str, float]:
    """How evenly a step's tokens were routed ([moe_layers, num_experts] counts; dense models
    have none): each layer's busiest and idlest expert against its mean, averaged over layers.
    A router collapsing onto few experts shows as a rising max and a min falling to 0."""
    if expert_load.size == 0 or not expert_load.sum():
        return {}
    mean = expert_load.mean(axis=1, keepdims=True)
    ratio = expert_load / np.maximum(mean, 1e-12)
    return {
        "moe/load_max_over_mean": float(ratio.max(axis=1).mean()),
        "moe/load_min_over_mean": float(ratio.min(axis=1).mean()),
    }


def publish_from_host(
    publish: Callable[[], tuple[Any, int, dict[str, float]]],
    target_shardings: Any | None,
    dtype: Any = None,
    base: Any | None = None,
) -> Published:
    """A version published by a trainer in another process, which hands back host arrays:
    placed on `target_shardings` when given (else left on host), cast to `dtype`, its
    `publish_seconds` the whole trip (the other side's copy, the pipe, the placing). With a
    LoRA `base` already on the target (`Trainer.publish`), only the adapters are placed."""
    start = time.perf_counter()
    params, version, metrics = publish()
    if target_shardings is not None and base is not None:
        params = transfer_lib.put_onto_base(params, target_shardings, base, dtype=dtype).tree
    elif target_shardings is not None:
        params = transfer_lib.put(params, target_shardings, dtype=dtype).tree
    else:
        params = transfer_lib.cast(params, dtype)
    return Published(params, version, {**metrics, "publish_seconds": time.perf_counter() - start})


class Trainer:
    """Holds the policy's params and optimizer state on `mesh` and updates them.

    `reference_model` is the KL penalty's policy (`kl_coef` > 0): of the policy's architecture
    and, for a LoRA policy, on its base (only its adapters are kept; the policy's base arrays
    stand in). It computes with its own graph (its dtype, its LoRA scale).
    """

    def __init__(
        self,
        model: Transformer,
        config: TrainConfig,
        mesh: Mesh,
        reference_model: Transformer | None = None,
    ):
        if config.kl_coef > 0 and reference_model is None:
            raise ValueError(f"train.kl_coef: {config.kl_coef} needs a reference_model")
        self.config = config
        self.mesh = mesh
        self._fn, params = Functional.of(model)
        self._shardings = sharding_lib.param_shardings(params, mesh)
        # The params in two parts: `_train`, what the optimizer updates (a LoRA model's
        # adapters, else every param), and `_base`, the rest (empty without LoRA), which stays
        # bit for bit as loaded. Gradients and optimizer state exist for `_train` alone.
        self._trainable = lora_lib.trainable_filter(model)
        self._train, self._base = self._split(
            transfer_lib.put(params, self._shardings, copy=True).tree
        )
        trainable_shardings = nnx.filter_state(self._shardings, self._trainable)
        self._trainable_shardings = trainable_shardings
        self._tx = optimizer_lib.make(config)
        self._schedule = optimizer_lib.schedule(config)
        replicated = NamedSharding(mesh, PartitionSpec())
        self._opt_shardings = optax.tree_map_params(
            self._tx,
            lambda _, sharding: sharding,
            jax.eval_shape(self._tx.init, self._train),
            trainable_shardings,
            transform_non_params=lambda _: replicated,
        )
        self._opt_state = jax.jit(self._tx.init, out_shardings=self._opt_shardings)(self._train)
        self._flat_shardings = tuple(jax.tree.leaves(trainable_shardings))
        self._flat_opt_shardings = tuple(jax.tree.leaves(self._opt_shardings))
        # The KL penalty's frozen policy and TIS's past versions copy their trainable part
        # alone: a LoRA model's base never changes, so they share the policy's arrays (no
        # copy of the base per reference or past version; `_on_base`).
        self._reference: Any | None = None
        if reference_model is not None and config.kl_coef > 0:
            self._reference_fn, reference = Functional.of(reference_model)
            self._reference = self._on_base(_same_base(params, reference, self._trainable))
        self._version = 0
        self._skipped = 0
        self._skipped_in_a_row = 0  # steps in a row whose every update was skipped
        self._optimizer_steps = 0  # applied (not skipped) optimizer steps
        # Past versions' params, for the training-side behaviour log-probs of TIS.
        self._history: dict[int, Any] = {}
        if config.tis_cap is not None:
            self._history[0] = self._on_base(self._train)
        self._cast_bases: dict[Any, Any] = {}  # `_base` in an engine's dtype (`_base_in`)

    # -- public API -------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The version of the params the trainer holds (0 at start, +1 per publish)."""
        return self._version

    @property
    def params(self) -> Any:
        """The current params; valid until the next `step` (its buffers are donated)."""
        return nnx.merge_state(self._base, self._train)

    @property
    def state(self) -> dict[str, Any]:
        """Everything a checkpoint needs (a plain pytree for orbax). With a KL penalty that
        includes the reference policy's params: a resumed run must keep the reference it
        started with, which may not be recomputable (it is often the policy after a warm-up).
        The reference and TIS's past versions are saved as their trainable part: a LoRA
        model's adapters (the base is the policy's), else all the params."""
        state = {
            "params": self.params,
            "opt_state": self._opt_state,
            "version": self._version,
            "skipped_updates": self._skipped,
            "skipped_in_a_row": self._skipped_in_a_row,
            "optimizer_steps": self._optimizer_steps,
        }
        if self._reference is not None:
            state["reference"] = self._split(self._reference)[0]
        if self.config.tis_cap is not None:
            # TIS recomputes behaviour log-probs under each sample's own version, and a resumed
            # run's queue holds samples up to max_staleness versions old, so their params are
            # saved too: versions v - K .. v - 1 as a fixed-length tuple (orbax restores onto
            # the structure a fresh trainer gives), bit i of `tis_kept` saying whether entry i
            # holds its version (none before version 0; the current params stand in).
            old = self._tis_versions()
            kept = [self._split(self._history[v])[0] if v in self._history else self._train
                    for v in old]  # fmt: skip
            state["tis_history"] = tuple(kept)
            state["tis_kept"] = sum(1 << i for i, v in enumerate(old) if v in self._history)
        return state

    def restore(self, state: dict[str, Any]) -> None:
        """Loads a `state` (e.g. from orbax) onto the training mesh's shardings."""
        if self._reference is not None and "reference" not in state:
            raise ValueError("train.kl_coef > 0, but the state to restore has no reference")
        params = transfer_lib.put(state["params"], self._shardings, copy=True).tree
        self._train, self._base = self._split(params)
        self._cast_bases = {}
        self._opt_state = transfer_lib.put(state["opt_state"], self._opt_shardings, copy=True).tree
        if self._reference is not None:
            self._reference = self._on_base(state["reference"])
        self._version = int(state["version"])
        self._skipped = int(state["skipped_updates"])
        self._skipped_in_a_row = int(state.get("skipped_in_a_row", 0))
        self._optimizer_steps = int(state["optimizer_steps"])
        if self.config.tis_cap is not None:
            self._history = {self._version: self._on_base(self._train)}
            kept = int(state.get("tis_kept", 0))
            for i, (v, params) in enumerate(
                zip(self._tis_versions(), state.get("tis_history", ()), strict=False)
            ):
                if kept >> i & 1:
                    self._history[v] = self._on_base(params)

    def _tis_versions(self) -> list[int]:
        """The past versions whose params TIS keeps: v - max_staleness .. v - 1."""
        k = self.config.max_staleness
        return [self._version - k + i for i in range(k)]

    def logprobs(self, trajectories: Sequence[Trajectory]) -> list[np.ndarray]:
        """The current policy's log-prob of each response token, one array per trajectory."""
        n = len(trajectories)
        (mb,) = batch_lib.micro_batches(
            trajectories, np.arange(n), self.config.length_buckets, False, size=n
        )
        (placed,) = self._place([mb], [()])
        logp = np.asarray(_logprobs(self._fn, self.config.temperature, self.params, *placed[:3]))
        out = [np.empty(0, np.float32)] * n
        for i, r in enumerate(mb.rows):
            p, t = len(trajectories[r].prompt_tokens), len(trajectories[r].response_tokens)
            out[r] = logp[i, p - 1 : p - 1 + t].copy()
        return out

    def step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One iteration on exactly `tbs` samples; returns its metrics."""
        cfg = self.config
        start = time.perf_counter()
        samples = batch_lib.group_batch(trajectories, cfg.tbs, cfg.group_size)
        staleness = np.asarray([self._version - t.version for t in samples])
        if (staleness < 0).any():
            raise ValueError(
                f"a sample has version {max(t.version for t in samples)} > trainer version "
                f"{self._version}"
            )
        if cfg.max_staleness is not None and staleness.max() > cfg.max_staleness:
            raise ValueError(
                f"C3 violated: staleness {staleness.max()} > max_staleness={cfg.max_staleness}"
            )
        rewards = np.asarray([t.reward for t in samples], np.float32)
        adv = np.asarray(advantage_lib.compute(rewards.reshape(-1, cfg.group_size), cfg))
        adv = adv.reshape(-1)
        lengths = batch_lib.loss_lengths(samples, cfg.mask_truncated)
        # Each mini-batch's micro-batches, on the mesh with their inputs, for every pass: what
        # an input holds (weights, reference and TIS log-probs) does not change with the params.
        minis = []
        padded = 0
        for m in range(cfg.mini_batches):
            rows = np.arange(m * cfg.mini_batch_size, (m + 1) * cfg.mini_batch_size)
            weights = np.zeros(len(samples), np.float32)
            weights[rows] = loss_lib.sample_weights(lengths[rows], cfg.aggregation, cfg.t_max)
            micro_batches = batch_lib.micro_batches(
                samples,
                rows,
                cfg.length_buckets,
                cfg.mask_truncated,
                min_rows=self.mesh.shape["fsdp"],
                **cfg.micro_batching,
            )
            # The weights are built on the host, so the mini-batch goes over in one transfer
            # and no small eager op runs per micro-batch.
            placed = self._place(
                micro_batches,
                [
                    (adv[mb.samples].astype(np.float32), mb.mask * weights[mb.samples][:, None])
                    for mb in micro_batches
                ],
            )
            padded += sum(mb.tokens.size for mb in micro_batches)
            minis.append(
                [
                    self._inputs(mb, arrays, samples)
                    for mb, arrays in zip(micro_batches, placed, strict=True)
                ]
            )
        micro_sums, losses, grad_norms, oks = [], [], [], []
        frozen_leaves, frozen_def = jax.tree.flatten(self._base)
        for _ in range(cfg.epochs):
            for inputs_of_mini in minis:
                # Params and the gradient go into the micro-steps as flat tuples of leaves: a
                # tuple flattens in C++, the params' nnx.State in Python (~0.1 ms a call).
                leaves, treedef = jax.tree.flatten(self._train)
                param_leaves = tuple(leaves)
                grads, mini_loss = _zero_grads(self._flat_shardings, param_leaves)
                for inputs in inputs_of_mini:
                    grads, mini_loss, micro = _accumulate(
                        self._fn,
                        cfg,
                        self._flat_shardings,
                        (treedef, frozen_def),
                        param_leaves,
                        tuple(frozen_leaves),
                        grads,
                        mini_loss,
                        inputs,
                    )
                    micro_sums.append(micro)
                self._train, self._opt_state, loss, grad_norm, ok = _apply(
                    cfg,
                    self._flat_shardings,
                    self._flat_opt_shardings,
                    self._train,
                    self._opt_state,
                    jax.tree.unflatten(treedef, grads),
                    mini_loss,
                )
                losses.append(loss)
                grad_norms.append(grad_norm)
                oks.append(ok)
        # Every figure of the step comes back in one device-to-host copy; no small eager op
        # runs between the micro-batches.
        micro_sums, losses, grad_norms, ok_host = jax.device_get(
            (micro_sums, losses, grad_norms, oks)
        )
        ok_host = np.asarray(ok_host)
        self._skipped += int((~ok_host).sum())
        self._optimizer_steps += int(ok_host.sum())
        self._skipped_in_a_row = 0 if ok_host.any() else self._skipped_in_a_row + 1
        limit = cfg.max_skipped_steps
        if limit is not None and self._skipped_in_a_row >= limit:
            raise FloatingPointError(
                f"{self._skipped_in_a_row} training steps in a row had a non-finite loss or "
                f"gradient in every update, so none changed the policy: stopping "
                f"(train.max_skipped_steps={limit}; {self._skipped} updates skipped in all)"
            )
        ratio_max = max(float(m.pop("ratio_max")) for m in micro_sums)
        expert_load = sum(np.asarray(m.pop("expert_load"), np.float64) for m in micro_sums)
        sums = {k: float(sum(m[k] for m in micro_sums)) for k in micro_sums[0]}
        # Token sums run over every pass: the per-token means below average the passes.
        tokens = max(sums.pop("tokens"), 1.0)
        metrics = {
            "loss": float(np.mean(losses)),
            "grad_norm": float(np.mean(grad_norms)),
            "ratio_mean": sums.pop("ratio_sum") / tokens,
            "ratio_max": ratio_max,
            "entropy": sums.pop("entropy_sum") / tokens,
            "tokens": tokens / cfg.epochs,
            "pad_fraction": 1.0
            - sum(len(t.prompt_tokens) + len(t.response_tokens) for t in samples) / padded,
            "reward_mean": float(rewards.mean()),
            # Groups whose samples all scored the same: advantage 0, no gradient (what DAPO's
            # dynamic sampling filters out). Near 1, the task is too easy or too hard.
            "uniform_reward_groups": float(
                (np.ptp(rewards.reshape(-1, cfg.group_size), axis=1) == 0).mean()
            ),
            "response_length_mean": float(np.mean([len(t.response_tokens) for t in samples])),
            # verl's response_length/clip_ratio: samples cut off by the length limit.
            "truncated_fraction": float(np.mean([t.truncated for t in samples])),
            "masked_truncated": float(
                sum(t.truncated for t in samples) if cfg.mask_truncated else 0
            ),
            "skipped_updates": float(self._skipped),
            "skipped_this_step": float((~ok_host).sum()),
            # The rate of the last update applied (update n uses schedule(n), counting from 0).
            "learning_rate": float(self._schedule(max(self._optimizer_steps - 1, 0))),
            "staleness_mean": float(staleness.mean()),
            "staleness_max": float(staleness.max()),
            "version": float(self._version),
        }
        if "kl_sum" in sums:
            metrics["kl"] = sums.pop("kl_sum") / tokens
        if "tis_capped" in sums:
            metrics["tis_fraction"] = sums.pop("tis_capped") / tokens
        metrics.update({f"clip_fraction/{name}": v / tokens for name, v in sums.items()})
        metrics.update(moe_load_metrics(expert_load))
        metrics.update({f"staleness/{k}": float(n) for k, n in sorted(Counter(staleness).items())})
        metrics["step_seconds"] = time.perf_counter() - start
        return metrics

    def publish(
        self,
        target_shardings: Any | None = None,
        dtype: Any = None,
        base: Any | None = None,
        adapters_only: bool = False,
    ) -> Published:
        """Ends the iteration: version v -> v + 1; returns a copy of the params placed on
        `target_shardings` (e.g. `sharding_lib.param_shardings(trainer.params, gen_mesh)`),
        or on the training mesh when None, in `dtype` (None: float32, as trained; a bfloat16
        engine's copy is cast here, before it moves).

        `base`: a LoRA policy's frozen params, already on the target in `dtype` (a rollout
        instance's, `RolloutInstance.base`): only the adapters are copied, onto it. A LoRA
        version published on the training mesh goes onto the trainer's own base (cast to
        `dtype` once, not per version). `adapters_only`: the copy holds a LoRA version's
        adapters alone (what a training group gathers once the controller holds the base)."""
        target = self._shardings if target_shardings is None else target_shardings
        lora = bool(jax.tree.leaves(self._base))
        if adapters_only:
            if not lora:
                raise ValueError("adapters_only publishes a LoRA policy's adapters; it has none")
            self._cast_bases.clear()  # published for a holder of the base: none needed here
            adapters = nnx.filter_state(self.params, nnx.LoRAParam)
            moved = transfer_lib.put(
                adapters, nnx.filter_state(target, nnx.LoRAParam), copy=True, dtype=dtype
            )
        else:
            if base is None and target_shardings is None and lora:
                base = self._base_in(dtype)
            if base is None:
                moved = transfer_lib.put(self.params, target, copy=True, dtype=dtype)
            else:
                moved = transfer_lib.put_onto_base(
                    self.params, target, base, copy=True, dtype=dtype
                )
        self._version += 1
        if self.config.tis_cap is not None:
            self._history[self._version] = self._on_base(self._train)
            oldest = self._version - self.config.max_staleness
            self._history = {v: p for v, p in self._history.items() if v >= oldest}
        return Published(
            moved.tree,
            self._version,
            {"publish_seconds": moved.seconds, "publish_bytes": float(moved.nbytes)},
        )

    # -- internals --------------------------------------------------------------------------

    def _base_in(self, dtype: Any) -> Any:
        """The frozen base on the training mesh in `dtype` (None: as trained). No update
        donates it, so published versions may share its arrays."""
        key = _dtype_key(dtype)
        if key not in self._cast_bases:
            self._cast_bases[key] = transfer_lib.cast(self._base, dtype)
        return self._cast_bases[key]

    def _on_base(self, trainable: Any) -> Any:
        """Whole params: a copy of `trainable` (the reference's, a past version's) on the
        mesh, where no update's donation reaches it, on the policy's frozen base."""
        copied = transfer_lib.put(trainable, self._trainable_shardings, copy=True).tree
        return nnx.merge_state(self._base, copied)

    def _split(self, params: Any) -> tuple[Any, Any]:
        """`params` as (trainable, frozen) states; frozen is empty without adapters."""
        return nnx.split_state(params, self._trainable, ...)

    def _place(
        self, mbs: Sequence[batch_lib.MicroBatch], extras: Sequence[tuple[np.ndarray, ...]]
    ) -> list[tuple[jax.Array, ...]]:
        """Puts micro-batches' arrays (each with its `extras`, more per-row arrays) on the mesh
        in one transfer, rows split over `fsdp` when they divide. One call for all: each
        device_put call has a fixed host cost, which made a 16-micro-batch step's transfers
        cost more host time than its dispatches (measured)."""
        arrays, shardings = [], []
        for mb, extra in zip(mbs, extras, strict=True):
            arrays.append((mb.tokens, mb.positions, mb.targets, mb.mask, mb.behaviour_logp, *extra))
            shardings.append(
                (sharding_lib.row_sharding(self.mesh, len(mb.rows)),) * len(arrays[-1])
            )
        return jax.device_put(arrays, shardings)

    def _inputs(
        self,
        mb: batch_lib.MicroBatch,
        placed: tuple[jax.Array, ...],
        samples: Sequence[Trajectory],
    ) -> dict[str, Any]:
        tokens, positions, targets, mask, behaviour, advantages, weights = placed
        inputs: dict[str, Any] = {
            "tokens": tokens,
            "positions": positions,
            "targets": targets,
            "mask": mask,
            "behaviour_logp": behaviour,
            "advantages": advantages,
            "weights": weights,
            "ref_logp": None,
            "train_behaviour_logp": None,
        }
        if self._reference is not None:
            inputs["ref_logp"] = _logprobs(
                self._reference_fn,
                self.config.temperature,
                self._reference,
                tokens,
                positions,
                targets,
            )
        if self.config.tis_cap is not None:
            # Each token against the params of the version that sampled it: a `partial`
            # trajectory's tokens come from several (`Trajectory.token_versions`).
            versions = batch_lib.token_versions(mb, samples)
            train_logp = jnp.zeros(mask.shape, jnp.float32)
            for v in np.unique(versions):
                if int(v) not in self._history:
                    raise ValueError(f"no params kept for version {v} (TIS keeps max_staleness)")
                logp_v = _logprobs(
                    self._fn,
                    self.config.temperature,
                    self._history[int(v)],
                    tokens,
                    positions,
                    targets,
                )
                train_logp = jnp.where(jnp.asarray(versions == v), logp_v, train_logp)
            inputs["train_behaviour_logp"] = train_logp
        return inputs


def _same_base(params: Any, reference: Any, trainable_filter: Any) -> Any:
    """The trainable part of the KL `reference`, which must have the policy's structure and,
    with LoRA, its base (its adapters alone are kept; the policy's base stands in)."""
    if jax.tree.structure(reference) != jax.tree.structure(params):
        raise ValueError("reference_model must have the policy's architecture and adapters")
    (_, base), (ref_trainable, ref_base) = (
        nnx.split_state(p, trainable_filter, ...) for p in (params, reference)
    )
    for ours, theirs in zip(jax.tree.leaves(base), jax.tree.leaves(ref_base), strict=True):
        if ours is not theirs and not np.array_equal(*jax.device_get((ours, theirs))):
            raise ValueError("a LoRA policy's reference_model must share its base weights")
    return ref_trainable


# The jitted functions are module-level with the model's graph, the (frozen) config and the
# shardings (a tuple of NamedShardings, in tree order) as static arguments, so every Trainer with
# the same model, config and mesh shares one compilation. The outputs are pinned to those
# shardings: left to propagation, a replicated norm weight can come back sharded.


def _constrain(tree: Any, shardings: tuple[NamedSharding, ...]) -> Any:
    return jax.lax.with_sharding_constraint(
        tree, jax.tree.unflatten(jax.tree.structure(tree), shardings)
    )


@functools.partial(jax.jit, static_argnums=0)
def _zero_grads(shardings: tuple[NamedSharding, ...], leaves: tuple[jax.Array, ...]) -> Any:
    """A zero gradient per param leaf, on its sharding, and a zero loss: the accumulators of a
    mini-batch (one call, not one op per leaf)."""
    return _constrain(tuple(jnp.zeros_like(x) for x in leaves), shardings), jnp.zeros(())


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(6, 7))
def _accumulate(
    fn: Functional,
    config: TrainConfig,
    shardings: tuple[NamedSharding, ...],
    treedefs: tuple[Any, Any],
    param_leaves: tuple[jax.Array, ...],
    frozen_leaves: tuple[jax.Array, ...],
    acc: tuple[jax.Array, ...],
    loss_acc: jax.Array,
    inputs: dict[str, Any],
) -> tuple[Any, jax.Array, dict[str, jax.Array]]:
    """acc + the gradient of one micro-batch's (pre-weighted) loss, loss_acc + that loss, and
    its metric sums. The trainable params and their gradients are flat leaves of `treedefs[0]`,
    the frozen params (a LoRA model's base) of `treedefs[1]`. The loss is summed here, not in
    `_apply`, so that a mini-batch's number of micro-batches (which a token budget varies) is
    no argument of a compiled program."""
    trainable_def, frozen_def = treedefs
    frozen = jax.tree.unflatten(frozen_def, frozen_leaves)

    def loss_fn(trainable):
        params = nnx.merge_state(frozen, trainable)
        # Expert load over the positions the loss trains on (not padding, not prompts).
        out = fn.forward(
            params,
            inputs["tokens"],
            inputs["positions"],
            remat=config.remat,
            load_weights=inputs["mask"] > 0,
        )
        logp, entropy = loss_lib.token_logprobs(out.logits, inputs["targets"], config.temperature)
        loss, sums = loss_lib.policy_loss(
            logp,
            inputs["behaviour_logp"],
            inputs["advantages"],
            inputs["mask"],
            inputs["weights"],
            config,
            train_behaviour_logp=inputs["train_behaviour_logp"],
            ref_logp=inputs["ref_logp"],
            entropy=entropy,
        )
        sums["entropy_sum"] = jnp.where(inputs["mask"] > 0, entropy, 0.0).sum()
        sums["expert_load"] = out.expert_load
        return loss, sums

    trainable = jax.tree.unflatten(trainable_def, param_leaves)
    (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
    summed = tuple(map(jnp.add, acc, jax.tree.leaves(grads)))
    return _constrain(summed, shardings), loss_acc + loss, sums


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(3, 4))
def _apply(
    config: TrainConfig,
    shardings: tuple[NamedSharding, ...],
    opt_shardings: tuple[NamedSharding, ...],
    params: Any,
    opt_state: Any,
    grads: Any,
    loss: jax.Array,
):
    """One optimizer step, or none (bit-identical state) if the loss or gradient is not finite.
    `loss` is the mini-batch's (the sum of its micro-batches' pre-weighted losses). Returns the
    new params and optimizer state, the loss, its gradient norm and whether the step was
    applied."""
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
    updates, new_opt_state = optimizer_lib.make(config).update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jnp.where(ok, new, old)
    return (
        _constrain(jax.tree.map(keep, new_params, params), shardings),
        _constrain(jax.tree.map(keep, new_opt_state, opt_state), opt_shardings),
        loss,
        grad_norm,
        ok,
    )


def _dtype_key(dtype: Any) -> Any:
    """One key per dtype however it is spelled (`jnp.bfloat16` and `np.dtype("bfloat16")` are
    equal but hash apart)."""
    return None if dtype is None else np.dtype(dtype)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _logprobs(
    fn: Functional, temperature: float, params: Any, tokens, positions, targets
) -> jax.Array:
    logits = fn.forward(params, tokens, positions).logits
    return loss_lib.token_logprobs(logits, targets, temperature)[0]


class MirroredTrainer:
    """A `Trainer` built on every process of a training group (`training_hosts_lib.Group`),
    with the `Trainer`'s interface for the controller: `params`, `state` and published versions
    come back as host arrays gathered from every process, so the generation hosts and the
    checkpoints never see an array that spans processes."""

    def __init__(self, trainer: Any):  # a training_hosts_lib.Mirrored of a Trainer
        self._trainer = trainer
        # A LoRA policy's frozen base as host arrays, per published dtype, once gathered.
        self._host_bases: dict[Any, Any] = {}

    @property
    def version(self) -> int:
        return self._trainer.local.version

    @property
    def params(self) -> Any:
        return self._trainer.get("params")

    @property
    def state(self) -> dict[str, Any]:
        return self._trainer.get("state")

    def restore(self, state: dict[str, Any]) -> None:
        self._trainer.call("restore", jax.device_get(state))
        self._host_bases = {}

    def step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        return self._trainer.call("step", list(trajectories))

    def publish(
        self, target_shardings: Any | None = None, dtype: Any = None, base: Any | None = None
    ) -> Published:
        """As `Trainer.publish`; with `target_shardings` None the version stays on host. Each
        process casts its part to `dtype` before it is gathered. A LoRA policy's base is
        gathered with its first version only: later versions gather their adapters, which go
        onto that host copy here."""

        def publish() -> tuple[Any, int, dict[str, float]]:
            host_base = self._host_bases.get(_dtype_key(dtype))
            if host_base is None:
                params, version, metrics = self._trainer.call("publish", None, dtype)
                frozen = lora_lib.frozen_base(params)
                if frozen is not None:
                    self._host_bases[_dtype_key(dtype)] = frozen
                # What the group gathered: the whole version (the trainer copied adapters).
                metrics = {**metrics, "publish_bytes": float(transfer_lib.tree_nbytes(params))}
                return params, version, metrics
            adapters, version, metrics = self._trainer.call("publish", None, dtype, None, True)
            return nnx.merge_state(host_base, adapters), version, metrics

        return publish_from_host(publish, target_shardings, dtype, base)
