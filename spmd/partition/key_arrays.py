"""PRNG key arrays in the partitioner's own collectives and padding: JAX sums, pads and fills no
key type, and its untiled all_gather of one fails to lower, so these run on the keys' data (its
trailing dims, which no sharding splits) and wrap it again. Rows a key array is padded with are
never read."""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax


def over_key_data(f: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """``f(x, ...)`` that runs on a key array ``x``'s data and returns keys again (other arrays
  as they are)."""
  @functools.wraps(f)
  def wrapped(x: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
    if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return f(x, *args, **kwargs)
    return jax.random.wrap_key_data(f(jax.random.key_data(x), *args, **kwargs),
                                    impl=jax.random.key_impl(x))
  return wrapped
