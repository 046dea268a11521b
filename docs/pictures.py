"""Renders the pictures under docs/ from spmd's own plans: ``python docs/pictures.py``."""
import pathlib

from spmd.__main__ import setup_devices

setup_devices(8)  # before JAX starts: 8 simulated CPU devices

import jax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import spmd  # noqa: E402
import spmd.visual  # noqa: E402

HERE = pathlib.Path(__file__).parent
NHWC = ("NHWC", "HWIO", "NHWC")


def convnet(x, w1, w2):
  """Two 3x3 convolutions over an image whose height is sharded, a mean at the end."""
  h = jax.nn.relu(lax.conv_general_dilated(x, w1, (1, 1), "SAME", dimension_numbers=NHWC))
  h = spmd.annotate(h, P("data", "height", None, None))
  return lax.conv_general_dilated(h, w2, (1, 1), "SAME", dimension_numbers=NHWC).mean()


def main() -> None:
  mesh = spmd.make_mesh({"data": 2, "height": 4})
  image = jax.ShapeDtypeStruct((4, 30, 32, 3), "float32")     # 30 rows: blocks of 8, padded
  weights = jax.ShapeDtypeStruct((3, 3, 3, 16), "float32"), jax.ShapeDtypeStruct((3, 3, 16, 16),
                                                                                  "float32")
  f = spmd.partition(convnet, mesh=mesh, in_specs=(P("data", "height", None, None), P(), P()))
  spmd.visual.program(f.plan(image, *weights)).save(HERE / "halo_program.svg")
  spmd.visual.layout(image.shape, P("data", "height", None, None), mesh).save(
      HERE / "uneven_layout.svg")


if __name__ == "__main__":
  main()
