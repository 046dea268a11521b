"""Eight simulated CPU devices, set before JAX is imported anywhere in the test session; and
JAX's compilation cache in a directory of this process's own, so that a program compiled again
within the session (a reference step several cases build, a training loop's first call and its
later calls when both plan the same program) is read back rather than compiled again."""
import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

assert jax.device_count() == 8, "tests need 8 simulated devices; JAX was imported too early"

if not jax.config.jax_compilation_cache_dir:  # one given (JAX_COMPILATION_CACHE_DIR) is kept
  _cache_dir = tempfile.mkdtemp(prefix="spmd-tests-compiled-")
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
  jax.config.update("jax_compilation_cache_dir", _cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)  # the large programs
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
