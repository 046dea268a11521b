"""The ``python -m spmd demo`` job: a character-level Transformer LM (spmd.models.transformer)
trained on generated sentences, sharded by one of the model's rule sets over a ("data", "model")
mesh of every device: plan summary, the first steps checked against the unpartitioned step, a
progress bar, the loss falling, and a sample at the end."""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from jax.sharding import PartitionSpec as P

import spmd
from spmd.models import transformer
from spmd.text import CharVocab, sentences, windows
from spmd.train import create_train_state, make_train_step

MODEL_WAYS = 4  # the default "model" axis; data parallel over the rest
SIZES = {
    "tiny": dict(d_model=32, heads=4, head_dim=8, mlp=64, layers=1),
    "small": dict(d_model=64, heads=4, head_dim=16, mlp=256, layers=2),
    "base": dict(d_model=256, heads=8, head_dim=32, mlp=1024, layers=4),
}
BATCH, SEQ, LEARNING_RATE = 16, 64, 3e-3
# float32. Adam divides each gradient by its own magnitude, so reduction-order noise in a gradient
# that is zero up to rounding moves its param by a fraction of the learning rate: params are
# compared to a quarter of it, the loss (which every earlier update feeds) tightly.
RTOL, LOSS_ATOL, PARAM_ATOL = 1e-4, 1e-6, LEARNING_RATE / 4
PROMPT = "The cat "


@dataclasses.dataclass(frozen=True)
class DemoOptions:
  mesh: dict[str, int] | None = None   # None: MODEL_WAYS-way "model", "data" over the rest
  strategy: str = "2d"
  size: str = "small"
  steps: int = 300
  check_steps: int = 2
  sample_chars: int = 120
  seed: int = 0


def default_mesh(devices: int) -> dict[str, int]:
  """A 2-D mesh over ``devices``: up to MODEL_WAYS-way "model", "data" over the rest."""
  model = math.gcd(devices, MODEL_WAYS)
  return {"data": devices // model, "model": model}


def compare(got: Any, want: Any, atol: float) -> tuple[float, list[str]]:
  """The largest absolute difference over matching leaves, and the leaves not ``allclose``."""
  diff, bad = 0.0, []
  for (path, g), w in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    diff = max(diff, float(np.max(np.abs(g - w))))
    if not np.allclose(g, w, rtol=RTOL, atol=atol):
      bad.append(jax.tree_util.keystr(path))
  return diff, bad


def bytes_per_device(tree: Any) -> int:
  """Bytes of ``tree``'s arrays that one device holds (its first addressable shard of each)."""
  return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


def progress(step: int, steps: int, loss: float, seconds: float, tokens: int) -> str:
  done = int(30 * step / steps)
  return (f"step {step:4d}/{steps} [{'#' * done}{'.' * (30 - done)}] loss {loss:.3f}  "
          f"{seconds * 1e3:6.1f} ms/step  {tokens / seconds:9,.0f} tokens/s")


def sample(apply: Callable, params: Any, vocab: CharVocab, prompt: str, count: int,
           rng: jax.Array) -> str:
  """``count`` characters after ``prompt``, drawn at temperature 0.8 from a window of SEQ."""
  ids = list(vocab.encode(prompt))
  pad = vocab.encode("\n")[0]
  for _ in range(count):
    window = ([pad] * SEQ + ids)[-SEQ:]
    logits = apply(params, jnp.asarray([window], jnp.int32))[0, -1, :len(vocab.chars)]
    rng, key = jax.random.split(rng)
    ids.append(int(jax.random.categorical(key, logits / 0.8)))
  return vocab.decode(np.array(ids))


def run_demo(options: DemoOptions = DemoOptions()) -> int:
  """Trains for ``options.steps`` steps. Returns 0 if the first ``check_steps`` agree with the
  unpartitioned step (numpy ``allclose``) and the loss fell, 1 otherwise."""
  axes = options.mesh or default_mesh(jax.device_count())
  mesh = spmd.make_mesh(axes)
  rules = transformer.RULES[options.strategy]
  text = sentences(4000, seed=options.seed)
  vocab = CharVocab.of(text, multiple_of=axes.get("model", 1))
  ids = vocab.encode(text)
  config = transformer.Config(vocab=vocab.size, max_len=SEQ, **SIZES[options.size])
  model = transformer.Transformer(config)
  rng = np.random.default_rng(options.seed)
  batches = lambda: jnp.asarray(windows(ids, BATCH, SEQ + 1, rng))  # noqa: E731

  tx = optax.adamw(LEARNING_RATE, weight_decay=1e-2)
  init = lambda key: model.init(key, jnp.zeros((1, SEQ), jnp.int32))["params"]  # noqa: E731
  state, specs = create_train_state(init, tx, mesh, jax.random.key(options.seed), rules=rules)
  loss_fn = functools.partial(transformer.next_token_loss, model)
  train_step = make_train_step(loss_fn)
  step = spmd.partition(train_step, mesh=mesh, rules=rules, donate_argnums=0,
                        in_specs=(specs, P("act_batch", None)), out_specs=(specs, P()))
  batch = batches()
  plan = step.plan(state, batch)
  replicated = sum(x.nbytes for x in jax.tree.leaves(state))
  print(f"Transformer LM {options.size} ({sum(x.size for x in jax.tree.leaves(state.params)):,} "
        f"params, vocab {vocab.size}, seq {SEQ}, batch {BATCH}), strategy {options.strategy!r} "
        f"on {mesh.devices.size} {jax.default_backend()} devices {axes}")
  print(plan.explain())
  print(f"params + optimizer state per device: {bytes_per_device(state) / 2**20:.2f} MiB "
        f"(replicated: {replicated / 2**20:.2f} MiB)\n")

  reference = jax.jit(train_step)
  want = jax.jit(lambda key: TrainState.create(apply_fn=None, params=nn.unbox(init(key)),
                                               tx=tx))(jax.random.key(options.seed))
  losses: list[float] = []
  start = time.perf_counter()
  for i in range(options.steps):
    if i:
      batch = batches()
    tick = time.perf_counter()
    state, loss = step(state, batch)
    losses.append(float(loss))  # waits for the step
    if i < options.check_steps:
      want, want_loss = reference(want, batch)
      loss_diff, bad = compare(loss, want_loss, LOSS_ATOL)
      diff, bad_state = compare(state, want, PARAM_ATOL)
      print(f"step {i}: loss {losses[-1]:.6f}  unpartitioned {float(want_loss):.6f}  "
            f"max |diff| loss {loss_diff:.1e}, state {diff:.1e}")
      if bad or bad_state:
        print(f"FAILED: step {i} differs from the unpartitioned step (rtol={RTOL:.0e}; atol "
              f"{LOSS_ATOL:.0e} for the loss, {PARAM_ATOL:.0e} for the state) in "
              f"{', '.join(bad + bad_state) or 'the loss'}", file=sys.stderr)
        return 1
      continue
    line = progress(i + 1, options.steps, losses[-1], time.perf_counter() - tick, BATCH * SEQ)
    last = i + 1 == options.steps
    if sys.stdout.isatty():
      print("\r" + line, end="\n" if last else "", flush=True)
    elif last or (i + 1) % 50 == 0:
      print(line, flush=True)
  seconds = time.perf_counter() - start

  window = max(1, min(10, options.steps // 4))
  first, final = np.mean(losses[:window]), np.mean(losses[-window:])
  apply = jax.jit(lambda params, tokens: model.apply({"params": params}, tokens))
  text = sample(apply, state.params, vocab, PROMPT, options.sample_chars,
                jax.random.key(options.seed))
  print(f"\nsample: {text!r}\n")
  if not final < first:
    print(f"FAILED: the loss did not fall ({first:.3f} -> {final:.3f})", file=sys.stderr)
    return 1
  print(f"OK: {options.steps} partitioned training steps on {mesh.devices.size} "
        f"{jax.default_backend()} devices {axes} ({options.strategy}) in {seconds:.1f} s; the "
        f"first {options.check_steps} match the unpartitioned step; loss {first:.3f} -> "
        f"{final:.3f}")
  return 0
