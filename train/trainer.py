"""The train step and the training loop.

    trainer = Trainer(cfg, vocab_size)           # model (atlas_jax.models.build) + optimizer + mesh
    state = trainer.init_state()                 # sharded over the mesh, float32 master weights
    state, metrics = trainer.train_step(state, trainer.put_batch(batch))   # one jitted step

`build_train_step(cfg)` returns that for benchmarks (model + optimizer + jitted step for a config).
`train(cfg)` is the whole run: data, resume from the latest complete checkpoint, the loop with
logging / evaluation / checkpoints, SIGTERM (save, wait, exit), the final plot.

The step: the batch is split into `optim.grad_accum` micro-batches (rows strided so each is spread
over every batch shard) scanned with summed float32 gradients; the loss is the token-weighted mean
over the whole batch, so k micro-batches equal one k-times larger batch. The forward runs in
`compute_dtype` (the model casts; parameters and optimizer state stay float32). A step whose loss or
gradient norm is not finite leaves parameters and optimizer state unchanged and says so in its
metrics; the host skips it or stops (`on_nonfinite`).
"""
from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from .checkpoint import Checkpointer, abstract_like
from .config import ConfigError, DistributedConfig, TrainConfig
from .data import build_dataset
from .metrics import MetricsWriter, plot_losses
from .optim import make_optimizer
from .sharding import BATCH_MESH_AXES, batch_sharding, global_batch_array, make_mesh, replicated, state_shardings

EXIT_NONFINITE = 3
# optax.tree.norm where it exists (optax >= 0.2.5 warns about the older name)
_tree_norm = optax.tree.norm if hasattr(optax, "tree") and hasattr(optax.tree, "norm") else optax.tree_utils.tree_l2_norm


class NonFiniteError(RuntimeError):
    pass


def initialize_distributed(cfg: DistributedConfig):
    """jax.distributed.initialize before anything touches the devices (multi-host runs)."""
    if not cfg.enabled:
        return
    if jax.distributed.is_initialized():
        return
    # CPU processes need a collectives implementation to talk to each other (no-op on GPU/TPU).
    jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    kwargs = {}
    if cfg.coordinator_address:
        kwargs["coordinator_address"] = cfg.coordinator_address
    if cfg.num_processes:
        kwargs["num_processes"] = cfg.num_processes
    if cfg.process_id >= 0:
        kwargs["process_id"] = cfg.process_id
    jax.distributed.initialize(**kwargs)


def model_overrides(cfg: TrainConfig, vocab_size: int, max_documents: int | None = None) -> dict:
    """What the training config fixes in the model: vocabulary, context, numerics; `model:` wins."""
    overrides = {"vocab_size": vocab_size, "context_length": cfg.seq_len, "dtype": cfg.compute_dtype,
                 "param_dtype": "float32", "remat": cfg.remat}
    if max_documents is not None:
        overrides["max_documents"] = max(1, int(max_documents))
    overrides.update(cfg.model)
    if overrides["vocab_size"] < vocab_size:
        raise ConfigError(f"config: model.vocab_size: {overrides['vocab_size']} is smaller than the "
                          f"tokenizer's vocabulary ({vocab_size}); remove it or raise it")
    return overrides


def build_model(cfg: TrainConfig, vocab_size: int, max_documents: int | None = None, *, seed: int | None = None):
    from atlas_jax import models

    try:
        return models.build(cfg.preset, cfg.size, rngs=nnx.Rngs(cfg.seed if seed is None else seed),
                            **model_overrides(cfg, vocab_size, max_documents))
    except ConfigError:
        raise
    except ValueError as err:    # the model's own config check: one line, named
        raise ConfigError(f"config: model ({cfg.preset}, {cfg.size}): {err}") from None


class Trainer:
    """Model, optimizer, mesh and the jitted train / eval steps of one config."""

    def __init__(self, cfg: TrainConfig, vocab_size: int, max_documents: int | None = None, *, devices=None):
        self.cfg = cfg
        self.mesh = make_mesh(cfg.mesh, devices)
        shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        micro = cfg.batch_size // cfg.optim.grad_accum
        if micro % shards:
            raise ConfigError(f"config: batch_size: {cfg.batch_size} / optim.grad_accum={cfg.optim.grad_accum} = "
                              f"{micro} rows per micro-batch do not split over data x fsdp = {shards} "
                              f"devices; use a batch_size that is a multiple of {shards * cfg.optim.grad_accum}")
        self.tx, self.schedule = make_optimizer(cfg.optim, cfg.steps)
        build = lambda: build_model(cfg, vocab_size, max_documents)
        abstract_model = nnx.eval_shape(build)
        self.graphdef, abstract_params, abstract_rest = nnx.split(abstract_model, nnx.Param, ...)
        if jax.tree.leaves(abstract_rest):
            raise NotImplementedError(f"{cfg.preset}: the model holds non-parameter state "
                                      f"({jax.tree_util.tree_structure(abstract_rest)}); the train step keeps only parameters")

        def init():
            _, params, _ = nnx.split(build(), nnx.Param, ...)
            return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": self.tx.init(params),
                    "rng": jax.random.PRNGKey(cfg.seed)}

        self._init = init
        self.abstract_state = jax.eval_shape(init)
        self.state_sharding = state_shardings(self.abstract_state, self.mesh)
        self.batch_sharding = batch_sharding(self.mesh)
        self.train_step = jax.jit(self._train_step, in_shardings=(self.state_sharding, self.batch_sharding),
                                  out_shardings=(self.state_sharding, replicated(self.mesh)), donate_argnums=0)
        self.eval_step = jax.jit(self._eval_step, in_shardings=(self.state_sharding, self.batch_sharding),
                                 out_shardings=replicated(self.mesh))
        self.tokens_per_step = cfg.batch_size * cfg.seq_len

    # -- state -----------------------------------------------------------------------------------
    def init_state(self):
        with jax.set_mesh(self.mesh):
            return jax.jit(self._init, out_shardings=self.state_sharding)()

    def abstract_sharded_state(self):
        return abstract_like(self.abstract_state, self.state_sharding)

    def model(self, state):
        """An nnx model holding the state's parameters (for generation and evaluation)."""
        return nnx.merge(self.graphdef, state["params"])

    def put_batch(self, batch: dict) -> dict:
        return global_batch_array(batch, self.mesh)

    # -- the steps -------------------------------------------------------------------------------
    def _loss_sums(self, params, batch):
        """(sum of token losses, number of target tokens) of a batch."""
        model = nnx.merge(self.graphdef, params)
        # the mesh in context while tracing: the memory kernels run per batch shard under it
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            logits = model(batch["tokens"], batch["segment_ids"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
        mask = batch["mask"].astype(jnp.float32)
        return jnp.sum(losses * mask), jnp.sum(mask)

    def _gradients(self, params, batch):
        grad_fn = jax.value_and_grad(self._loss_sums, has_aux=True)
        k = self.cfg.optim.grad_accum
        if k == 1:
            (loss_sum, count), grads = grad_fn(params, batch)
            return loss_sum, count, grads

        def micro_batches(x):
            # row r*k + j goes to micro-batch j: each micro-batch keeps rows from every batch shard
            x = x.reshape((x.shape[0] // k, k) + x.shape[1:]).swapaxes(0, 1)
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(None, BATCH_MESH_AXES)))

        def accumulate(carry, micro):
            loss_sum, count, grads = carry
            (micro_loss, micro_count), micro_grads = grad_fn(params, micro)
            grads = jax.tree.map(lambda g, m: g + m.astype(jnp.float32), grads, micro_grads)
            return (loss_sum + micro_loss, count + micro_count, grads), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        (loss_sum, count, grads), _ = jax.lax.scan(
            accumulate, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros),
            jax.tree.map(micro_batches, batch))
        return loss_sum, count, grads

    def _train_step(self, state, batch):
        params = state["params"]
        loss_sum, count, grads = self._gradients(params, batch)
        count = jnp.maximum(count, 1.0)
        loss = loss_sum / count
        grads = jax.tree.map(lambda g: g / count, grads)
        grad_norm = _tree_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, opt_state = self.tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_state = {"step": state["step"] + 1, "params": keep(new_params, params),
                     "opt_state": keep(opt_state, state["opt_state"]),
                     "rng": jax.random.split(state["rng"])[0]}
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite,
                   "learning_rate": self.schedule(state["step"]), "target_tokens": count}
        return new_state, metrics

    def _eval_step(self, state, batch):
        return self._loss_sums(state["params"], batch)

    def evaluate(self, state, batches) -> float:
        total, count = 0.0, 0.0
        for batch in batches:
            loss_sum, n = self.eval_step(state, self.put_batch(batch))
            total, count = total + float(loss_sum), count + float(n)
        return total / max(count, 1.0)


def build_train_step(cfg: TrainConfig, vocab_size: int | None = None, max_documents: int | None = None):
    """(step, state, trainer) for benchmarks: `state, metrics = step(state, batch)` with `batch` a dict
    of global numpy arrays (tokens, targets, segment_ids [B, T] int32, mask [B, T] float32), placed on
    the mesh by `trainer.put_batch` inside. The state is donated: use the returned one."""
    from atlas_jax import models

    vocab = vocab_size or models.config_for(cfg.preset, cfg.size, **cfg.model).vocab_size
    trainer = Trainer(cfg, vocab, max_documents)

    def step(state, batch):
        return trainer.train_step(state, trainer.put_batch(batch))

    return step, trainer.init_state(), trainer


# --- the run --------------------------------------------------------------------------------------

class _StopRequest:
    """SIGTERM (preemption) turns into a flag the loop checks after each step: save, wait, exit."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def install(self):
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:    # not the main thread: no handler, nothing to restore
            self._previous = None

    def _handle(self, signum, frame):
        self.requested = True

    def uninstall(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def train(cfg: TrainConfig, *, time_budget_s: float | None = None) -> dict:
    """Train (or resume) the run in cfg.run_dir. Returns a summary: steps, final losses, paths.
    `time_budget_s` (the demo's) ends the run early once this call has trained that long: the step
    reached is then logged, evaluated and checkpointed like the last one."""
    initialize_distributed(cfg.distributed)
    primary = jax.process_index() == 0
    run_dir = Path(cfg.run_dir).absolute()
    if primary:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    # Process 0 trains and saves the tokenizer first; the others then read the same one.
    dataset = _build_dataset_once(cfg, run_dir)
    max_docs = int(max(dataset.train_rows.segments.max(), dataset.eval_rows.segments.max()))
    trainer = Trainer(cfg, dataset.tokenizer.vocab_size, max_docs)
    if primary:    # what load_run rebuilds the model from
        (run_dir / "model.json").write_text(json.dumps({"preset": cfg.preset, "size": cfg.size,
                                                        "vocab_size": dataset.tokenizer.vocab_size,
                                                        "max_documents": max_docs}))
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=cfg.checkpoint.keep,
                                async_save=cfg.checkpoint.async_save)
    loader = dataset.train_iterator()
    start = checkpointer.latest_step()
    if start is not None:
        state, loader_state, _ = checkpointer.restore(start, trainer.abstract_sharded_state())
        loader.set_state(loader_state)
    else:
        start, state = 0, trainer.init_state()
    eval_batches = dataset.eval_batches(cfg.data.eval_batches)
    writer = MetricsWriter(run_dir, start_step=start, total_steps=cfg.steps, tensorboard=cfg.tensorboard,
                           progress=cfg.progress, enabled=primary)
    if start:
        writer.message(f"resumed from {checkpointer.directory / str(start)} (step {start} of {cfg.steps})")
    stop = _StopRequest()
    stop.install()
    pending, last_record, skipped, exit_reason = [], {}, 0, "done"
    step, last_step, started = start, cfg.steps, time.perf_counter()

    def fetch():
        """(the loader's state before this batch, the batch on the mesh)."""
        before = loader.get_state()
        return before, trainer.put_batch(next(loader))

    try:
        batch = fetch()[1] if step < last_step else None
        while step < last_step:
            state, metrics = trainer.train_step(state, batch)
            step += 1
            # the next batch is read and placed while this step runs on the devices; a checkpoint
            # keeps the loader's state from before it (the batches of steps 1..step consumed)
            loader_state, batch = fetch() if step < last_step else (loader.get_state(), None)
            pending.append(metrics)
            writer.advance()
            if time_budget_s is not None:
                jax.block_until_ready(metrics)    # steps dispatch asynchronously: time the finished ones
                if time.perf_counter() - started > time_budget_s and step < last_step:
                    last_step = step
                    writer.message(f"time budget of {time_budget_s:.0f}s spent: ending at step {step} of {cfg.steps}")
            evaluate = _due(step, cfg.eval_every, last_step)
            if _due(step, cfg.log_every, last_step) or evaluate or stop.requested:
                fetched = jax.device_get(pending)
                pending = []
                bad = [i for i, m in enumerate(fetched) if not bool(m["finite"])]
                skipped += len(bad)
                record = {"step": step, "loss": float(np.mean([m["loss"] for m in fetched])),
                          "grad_norm": float(fetched[-1]["grad_norm"]),
                          "learning_rate": float(fetched[-1]["learning_rate"]),
                          "tokens_per_s": writer.throughput(step, trainer.tokens_per_step),
                          "skipped_steps": skipped}
                if evaluate and not bad:
                    eval_loss = trainer.evaluate(state, eval_batches)
                    record.update(eval_loss=eval_loss, eval_perplexity=math.exp(min(eval_loss, 700.0)))
                writer.write(record)
                last_record = record
                if bad:
                    first_bad = step - len(fetched) + bad[0] + 1
                    text = (f"non-finite loss or gradient at step {first_bad} ({len(bad)} step(s) since the last "
                            f"log); those updates were not applied")
                    if cfg.on_nonfinite == "stop":
                        raise NonFiniteError(text + f"; stopping (on_nonfinite=stop). Metrics: {writer.path}")
                    writer.message("warning: " + text + " (on_nonfinite=skip)")
            if _due(step, cfg.checkpoint_every, last_step) or stop.requested:
                checkpointer.save(step, state, loader_state, {"preset": cfg.preset, "size": cfg.size})
            if stop.requested:
                exit_reason = "preempted"
                writer.message(f"SIGTERM: saved step {step} to {checkpointer.directory}; rerun the same command to resume")
                break
    except NonFiniteError as err:
        exit_reason = "nonfinite"
        writer.message(f"error: {err}")
        raise
    finally:
        checkpointer.close()    # waits for async saves: a SIGTERM'd or failing run leaves them complete
        writer.close()
        stop.uninstall()
    summary = {"run_dir": str(run_dir), "steps": step, "exit": exit_reason, "last": last_record,
               "skipped_steps": skipped, "tokenizer": getattr(dataset.tokenizer, "kind", "?")}
    if exit_reason == "done":
        # a run resumed at its last step has no fresh evaluation in the loop
        summary["eval_loss"] = (last_record["eval_loss"] if "eval_loss" in last_record
                                else trainer.evaluate(state, eval_batches))
    if exit_reason == "done" and primary:
        summary["plot"] = str(plot_losses(run_dir, run_dir / "loss.png", labels=[f"{cfg.preset} ({cfg.size})"]))
        summary["unigram_loss"] = dataset.unigram_loss(cfg.data.eval_batches)
    if jax.process_count() > 1:
        # hosts leave together: one that exits while another still plots fails the shutdown barrier
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("atlas_jax.train: run finished")
    summary["trainer"], summary["state"], summary["dataset"] = trainer, state, dataset
    return summary


def _build_dataset_once(cfg: TrainConfig, run_dir: Path):
    kwargs = dict(seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed)
    if jax.process_count() == 1:
        return build_dataset(cfg.data, run_dir=run_dir, **kwargs)
    from jax.experimental import multihost_utils

    dataset = build_dataset(cfg.data, run_dir=run_dir, **kwargs) if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices("atlas_jax.train: tokenizer saved")
    return dataset if dataset is not None else build_dataset(cfg.data, run_dir=run_dir, **kwargs)



def load_run(path):
    """(model, tokenizer, step) from a run directory (its latest complete checkpoint) or from one
    checkpoint's directory (run_dir/checkpoints/<step>): what `atlas-jax generate` needs. The model
    is rebuilt from the run's config.yml and model.json, on this machine's first device."""
    from .config import config_from_dict
    from .data import IdsTokenizer
    from .tokenizer import TOKENIZER_FILE, load_tokenizer

    path = Path(path).absolute()
    step = None
    if path.name.isdigit() and path.parent.name == "checkpoints":
        path, step = path.parent.parent, int(path.name)
    if not (path / "config.yml").is_file():
        raise ConfigError(f"checkpoint: {path} is not a run directory of atlas-jax train (no config.yml)")
    values = yaml.safe_load((path / "config.yml").read_text())
    values.update(mesh={"data": 1, "fsdp": 1, "tensor": 1}, distributed={"enabled": False})
    cfg = config_from_dict(values)
    model_info = json.loads((path / "model.json").read_text())
    tokenizer_data = json.loads((path / TOKENIZER_FILE).read_text())
    tokenizer = (IdsTokenizer(tokenizer_data["vocab_size"], tokenizer_data["eos_id"])
                 if tokenizer_data.get("atlas_jax_tokenizer") == "ids" else load_tokenizer(path))
    trainer = Trainer(cfg, model_info["vocab_size"], model_info["max_documents"], devices=jax.devices()[:1])
    checkpointer = Checkpointer(path / "checkpoints", keep=cfg.checkpoint.keep, async_save=False)
    step = checkpointer.latest_step() if step is None else step
    if step is None:
        raise ConfigError(f"checkpoint: {path / 'checkpoints'} holds no complete checkpoint")
    state, _, _ = checkpointer.restore(step, trainer.abstract_sharded_state())
    checkpointer.close()
    return trainer.model(state), tokenizer, step
