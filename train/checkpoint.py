"""Checkpoints: one orbax CheckpointManager per run, three named items per step.

    state   the train state pytree (step, float32 parameters, optimizer state, RNG) — StandardSave,
            restored onto the *current* mesh's shardings from an abstract tree, so a checkpoint
            written on one mesh restores onto another
    loader  the data iterator's state (grain's small dict) — JsonSave
    meta    step, config and tokenizer kind, for people and tools reading the directory — JsonSave

orbax writes each step into a temporary folder and renames it when complete: a save interrupted by
a kill is never listed by `all_steps()` and never restored. Saves may run in the background;
`close()` (and the SIGTERM path of the trainer) waits for them.
"""
from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state, loader_state: dict, meta: dict | None = None) -> bool:
        if step in self.manager.all_steps():
            return False
        return self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            loader=ocp.args.JsonSave(loader_state),
            meta=ocp.args.JsonSave(dict(meta or {}, step=int(step)))), force=True)

    def restore(self, step: int, abstract_state):
        """(state, loader_state, meta) of a complete checkpoint; abstract_state holds
        jax.ShapeDtypeStruct leaves with the shardings the restored arrays must have."""
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            loader=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore()))
        return restored["state"], restored["loader"], restored["meta"]

    def restore_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(tree, shardings):
    """ShapeDtypeStructs of tree's leaves carrying the given shardings (what restore needs)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
