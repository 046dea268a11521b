"""Image models for spatial partitioning: a ResNet-style classifier and a U-Net-style
image-to-image model, whose params and activations name logical axes.

Images are NHWC. Every conv is followed by group norm and ReLU; group norm (statistics per image
and group of channels) keeps the training step a pure function of params and batch, where batch
norm's running statistics would be a mutable collection threaded through the step, and its
statistics do not depend on how the batch is split. ``ResNet``: a stem conv, residual blocks
(the later ones strided, with a strided 1x1 projection on the skip), global average pooling and
a dense classifier. ``UNet``: a conv block, 2x2 max pooling, a conv block at half resolution, a
2x2 stride-2 transposed conv back up, the skip concatenated along channels, a conv block and a
1x1 output conv. Heights and widths need not divide the mesh (the U-Net's must be even).

Written in flax linen like ``transformer``: ``nn.with_logical_partitioning`` gives a plain
pytree of params with ``nn.get_partition_spec`` names for a functional step and a sharded init.

Logical axes. Params: "conv_in", "conv_out" (a kernel's spatial dims are unnamed), "classes".
Activations: "act_batch", "act_height", "act_width", "act_channels", "act_classes". ``RULES``
maps them to a ("data", "model") mesh for each strategy; every param is replicated in each.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from spmd.logical import rule_set

Array = jax.Array

PARAM_AXES = ("conv_in", "conv_out", "classes")
ACTIVATION_AXES = ("act_batch", "act_height", "act_width", "act_channels", "act_classes")
IMAGE = ("act_batch", "act_height", "act_width", "act_channels")


_rules = functools.partial(rule_set, PARAM_AXES + ACTIVATION_AXES)


# Rule sets over a mesh with axes ("data", "model"), in flax's logical_axis_rules format.
RULES: dict[str, tuple[tuple[str, Any], ...]] = {
    # Every device holds every param and a slice of the batch.
    "dp": _rules(("act_batch", ("data", "model"))),
    # Rows of every image split over "model" (halo exchanges), the batch over "data".
    "spatial": _rules(("act_batch", "data"), ("act_height", "model")),
    # Rows over "model" and columns over "data": each device holds a tile of every image.
    "spatial_2d": _rules(("act_height", "model"), ("act_width", "data")),
}


@dataclasses.dataclass(frozen=True)
class Config:
  channels: int = 16      # of the first stage; doubled by each later one
  groups: int = 4         # group norm's groups
  blocks: int = 2         # ResNet: residual blocks, all but the first strided
  classes: int = 10       # ResNet
  out_channels: int = 3   # U-Net
  activation: Callable[[Array], Array] = nn.relu  # after each norm (flax's examples' ``act``)


def _init(initializer: Callable, names: tuple[str | None, ...]) -> Callable:
  return nn.with_logical_partitioning(initializer, names)


_KERNEL = _init(nn.initializers.lecun_normal(), (None, None, "conv_in", "conv_out"))
_BIAS = _init(nn.initializers.zeros, ("conv_out",))


def _conv(features: int, kernel: int, stride: int = 1, name: str | None = None) -> nn.Conv:
  return nn.Conv(features, (kernel, kernel), (stride, stride), padding="SAME", name=name,
                 kernel_init=_KERNEL, bias_init=_BIAS)


def _norm(config: Config, name: str | None = None) -> nn.GroupNorm:
  return nn.GroupNorm(config.groups, name=name,
                      scale_init=_init(nn.initializers.ones, ("conv_out",)),
                      bias_init=_init(nn.initializers.zeros, ("conv_out",)))


def _image(x: Array) -> Array:
  return nn.with_logical_constraint(x, IMAGE)


class ConvBlock(nn.Module):
  """Two 3x3 convs, each followed by group norm and the activation."""

  config: Config
  features: int

  @nn.compact
  def __call__(self, x: Array) -> Array:
    for i in range(2):
      x = _image(self.config.activation(
          _norm(self.config)(_conv(self.features, 3, name=f"conv_{i}")(x))))
    return x


class ResidualBlock(nn.Module):
  """act(x' + norm(conv(act(norm(conv(x)))))), the first conv strided by ``stride`` and x'
  a strided 1x1 projection of x where the shape changes."""

  config: Config
  features: int
  stride: int = 1

  @nn.compact
  def __call__(self, x: Array) -> Array:
    c = self.config
    h = _image(c.activation(_norm(c)(_conv(self.features, 3, self.stride)(x))))
    h = _norm(c)(_conv(self.features, 3)(h))
    if self.stride != 1 or x.shape[-1] != self.features:
      x = _norm(c, "skip_norm")(_conv(self.features, 1, self.stride, "skip")(x))
    return _image(c.activation(x + h))


class ResNet(nn.Module):
  """Images [batch, height, width, channels] -> logits [batch, classes]."""

  config: Config

  @nn.compact
  def __call__(self, images: Array) -> Array:
    c = self.config
    x = _image(c.activation(_norm(c)(_conv(c.channels, 3)(_image(images)))))
    for i in range(c.blocks):
      x = ResidualBlock(c, c.channels * 2 ** i, 1 if i == 0 else 2)(x)
    logits = nn.Dense(c.classes, kernel_init=_init(nn.initializers.lecun_normal(),
                                                   ("conv_out", "classes")),
                      bias_init=_init(nn.initializers.zeros, ("classes",)))(x.mean(axis=(1, 2)))
    return nn.with_logical_constraint(logits, ("act_batch", "act_classes"))


class UNet(nn.Module):
  """Images [batch, height, width, channels] -> [batch, height, width, out_channels]; height and
  width even."""

  config: Config

  @nn.compact
  def __call__(self, images: Array) -> Array:
    c = self.config
    skip = ConvBlock(c, c.channels, name="down")(_image(images))
    x = _image(nn.max_pool(skip, (2, 2), strides=(2, 2)))
    x = ConvBlock(c, 2 * c.channels, name="bottom")(x)
    x = nn.ConvTranspose(c.channels, (2, 2), (2, 2), kernel_init=_KERNEL, bias_init=_BIAS,
                         name="upsample")(x)
    x = ConvBlock(c, c.channels, name="up")(_image(jnp.concatenate([_image(x), skip], -1)))
    return _image(_conv(c.out_channels, 1, name="out")(x))


def classification_loss(model: ResNet, params: Any, batch: tuple[Array, Array]) -> Array:
  """Mean cross entropy of ``model``'s logits for ``batch = (images, labels)``."""
  images, labels = batch
  logits = model.apply({"params": params}, images)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def reconstruction_loss(model: UNet, params: Any, batch: tuple[Array, Array]) -> Array:
  """Mean squared error of ``model``'s output for ``batch = (images, targets)``."""
  images, targets = batch
  return jnp.mean((model.apply({"params": params}, images) - targets) ** 2)
