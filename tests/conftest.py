"""Eight simulated CPU devices, set before JAX is imported anywhere in the test session."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

assert jax.device_count() == 8, "tests need 8 simulated devices; JAX was imported too early"
