"""Conversion functions for mapping files, from torch's layouts to Flax's (they take and
return torch tensors, as every conversion does, and import nothing: safe on torch paths).

    [[param]]
    port = "conv1.kernel"
    reference = "conv1.weight"
    transform = "layerdiff.flax.layouts:conv_kernel"
"""


def conv_kernel(weight):
    """torch's convolution weight ``(out, in, *spatial)`` (OIHW) as Flax's kernel
    ``(*spatial, in, out)`` (HWIO), for 1, 2 or 3 spatial axes. A permutation: the diff pulls
    the port's kernel gradient back through it exactly."""
    return weight.permute(*range(2, weight.ndim), 1, 0).contiguous()
