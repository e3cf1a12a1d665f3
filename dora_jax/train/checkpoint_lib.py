"""Checkpoints that lose nothing: one orbax step holds everything a resume needs.

Items per step: `train_state` (params and optimizer state: sharded arrays, restored onto the
caller's shardings), `data` (the grain iterator's position, through grain's own orbax handler)
and `meta` (JSON: seed, version counter, ledger byte offset, rollout state — which prompt
groups were dispatched, finished or queued, with the finished trajectories themselves).
Saving all of them in one atomic orbax step is what makes "resume from the newest checkpoint"
safe: a step directory either has every item or is not a checkpoint at all. Orbax marks a
finished step with `commit_success.txt` whatever the filesystem, but on a local one it lists any
numbered directory as a step; steps are listed here by that marker instead, so a step directory
left unfinished (an interrupted copy of a workdir, a non-atomic filesystem) is never resumed from.

In a training group (`runtime.training_hosts_lib`) the controller alone saves and restores: it
holds the train state as host arrays gathered from every process, and the other processes
never call orbax, so orbax must not wait for them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath


@dataclasses.dataclass
class Restored:
    step: int
    train_state: Any
    meta: dict[str, Any]


class Checkpointer:
    """Async orbax CheckpointManager over `directory`, keeping the newest `keep` steps."""

    def __init__(self, directory: str, keep: int = 2, async_save: bool = True):
        directory = os.path.abspath(directory)  # orbax refuses relative paths (workdirs often are)
        processes = ocp.options.MultiprocessingOptions()
        if jax.process_count() > 1:
            processes = ocp.options.MultiprocessingOptions(
                primary_host=jax.process_index(), active_processes={jax.process_index()}
            )
            epath.Path(directory).mkdir(parents=True, exist_ok=True)  # orbax won't, then
        # Only the listing checks the commit marker: saves keep orbax's default (atomic rename).
        self._names = ocp.step.standard_name_format(
            atomicity_options=ocp.options.AtomicityOptions(
                mode=ocp.options.AtomicityMode.COMMIT_FILE
            )
        )
        self._manager = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=async_save,
                create=jax.process_count() == 1,
                multiprocessing_options=processes,
                step_name_format=self._names,
            ),
        )

    def latest_step(self) -> int | None:
        """The newest finished step (one with orbax's commit marker), or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every finished step, oldest first."""
        return sorted(self._manager.all_steps())

    def save(
        self,
        step: int,
        *,
        train_state: Any,
        data_iterator: grain.DatasetIterator | None,
        meta: dict[str, Any],
    ) -> None:
        """Starts an async save; the arrays are copied to host before this returns, so the
        caller may donate their buffers right after."""
        items: dict[str, Any] = {
            "train_state": ocp.args.StandardSave(train_state),
            "meta": ocp.args.JsonSave(meta),
        }
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        self._manager.save(step, args=ocp.args.Composite(**items))

    def restore(
        self,
        step: int,
        *,
        train_state_like: Any,
        data_iterator: grain.DatasetIterator | None,
    ) -> Restored:
        """Restores `step` onto the shardings of `train_state_like`.

        `data_iterator` is advanced in place to the saved position.
        """
        items: dict[str, Any] = {
            "train_state": ocp.args.StandardRestore(_abstract(train_state_like)),
            "meta": ocp.args.JsonRestore(),
        }
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        with self._naming(step):
            out = self._manager.restore(step, args=ocp.args.Composite(**items))
        return Restored(step, out["train_state"], dict(out["meta"]))

    def restore_params(self, step: int, params_like: Any) -> Any:
        """The trainer's params of `step` alone, onto the shardings of `params_like`.

        Evaluating or exporting a policy needs nothing else: this reads neither the optimizer
        state (twice the params, with Adam) nor the reference policy, so it fits where one
        copy of the model does, whatever trainer settings saved the checkpoint.
        """
        like = {"params": _abstract(params_like)}
        args = ocp.args.PyTreeRestore(
            item=like,
            restore_args=ocp.checkpoint_utils.construct_restore_args(like),
            partial_restore=True,
        )
        with self._naming(step):
            out = self._manager.restore(step, args=ocp.args.Composite(train_state=args))
        return out["train_state"]["params"]

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON meta of `step` alone: what a caller checks before restoring any array."""
        with self._naming(step):
            out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    @contextlib.contextmanager
    def _naming(self, step: int) -> Iterator[None]:
        """Names the step directory in a failed read: orbax's own errors (a truncated JSON file,
        a missing item) say neither which checkpoint nor which workdir."""
        try:
            yield
        except Exception as e:
            path = self._manager.directory / self._names.build_name(step)
            raise ValueError(f"cannot restore checkpoint {path}: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _abstract(tree: Any) -> Any:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
