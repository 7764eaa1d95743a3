"""The words of a case that the contract validates and the engines declare against: one list of each.

``parity_tests.contract`` accepts these values (docs/case-format.md); each engine's
``EngineSpec`` (``tfpar.engines``, ``torchref.engines``) names the ones it runs.
"""

from __future__ import annotations

__all__ = ["COMBINES", "LOCAL_COMBINES", "ALL_COMBINES", "ORDERS", "ARCHITECTURE_TYPES", "LAYER_TYPES"]

# the synchronous rules: one combined gradient per step (what the strategies draw by default)
COMBINES = ("grad_mean", "loss_mean")
# every device applies its own updates (docs/combine-rules.md): param_mean (local SGD,
# parameters averaged every `period` steps) and async (a seeded order of applications)
LOCAL_COMBINES = ("param_mean", "async")
ALL_COMBINES = COMBINES + LOCAL_COMBINES
# data.order: split (the global batch split as parallel.shard says) or distributed_sampler
# (torch's DistributedSampler + DataLoader order, padding included; docs/data-pipeline.md)
ORDERS = ("split", "distributed_sampler")
#: the architecture layers (docs/layers.md) added to the first vocabulary (mixed_bfloat16 refuses them)
ARCHITECTURE_TYPES = ("activation", "layer_norm", "rms_norm", "residual", "repeat", "avg_pool2d",
                      "global_avg_pool2d", "channel_pad", "reshape", "position_embedding", "class_token", "take_token",
                      "depthwise_conv2d", "attention", "embedding", "tied_logits")
LAYER_TYPES = ("dense", "poly", "conv2d", "max_pool2d", "flatten", "batch_norm", "dropout", *ARCHITECTURE_TYPES)
