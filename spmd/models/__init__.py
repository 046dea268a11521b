"""Models whose params and activations name logical axes, each with rule sets per strategy:
``transformer`` (decoder-only LM, linen), ``moe`` (GShard mixture of experts, linen), ``convnet``
(ResNet and U-Net for spatial partitioning, linen), ``mlp`` (deep MLP, NNX)."""
