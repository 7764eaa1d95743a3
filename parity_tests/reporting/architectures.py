"""Real architectures as case dictionaries: ResNet (CIFAR), ViT and a GPT-style decoder.

One builder per family, at any size: the full-size configurations are the case files of
``examples/architectures/`` (written by ``examples/architectures/write_cases.py`` from these
builders, so a file and its builder cannot drift apart unnoticed: ``test_architectures`` compares
them), and small configurations of each run in ``tfpar matrix`` (``reporting.matrix``).

Every builder returns a ``model.layers`` list (``docs/case-format.md``, ``docs/layers.md``); ``case``
wraps a layer list into a whole case. The layer-by-layer mapping to the public reference each
follows is in ``examples/architectures/README.md``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["resnet_cifar_a", "resnet_cifar_b", "vit", "gpt", "case", "FULL_SIZE"]

_PAD1 = [[1, 1], [1, 1]]  # torch's symmetric padding=1 (the reference implementations'), not TensorFlow's SAME


def _conv(filters: int, kernel: int, strides: int, padding: Any) -> dict:
    return {"type": "conv2d", "filters": filters, "kernel_size": kernel, "strides": strides,
            "padding": padding, "use_bias": False}


def _bn() -> dict:
    # torch's BatchNorm2d defaults (momentum 0.1 in torch's convention is 0.9 in TensorFlow's, eps 1e-5)
    return {"type": "batch_norm", "momentum": 0.9, "epsilon": 1e-5}


def _relu() -> dict:
    return {"type": "activation", "fn": "relu"}


def _basic_block(width: int, strides: int, shortcut: list[dict]) -> dict:
    """conv3x3-BN-ReLU-conv3x3-BN, plus the shortcut, then ReLU (He et al. 2016, BasicBlock)."""
    body = [_conv(width, 3, strides, _PAD1), _bn(), _relu(), _conv(width, 3, 1, _PAD1), _bn()]
    return {"type": "residual", "body": body, "shortcut": shortcut, "activation": "relu"}


def _stages(widths: tuple[int, ...], blocks: tuple[int, ...], down) -> list[dict]:
    """The stages after the stem: stage 0 keeps the stem's width; every later stage starts with a
    stride-2 block whose shortcut is ``down(w_in, w)``, then ``repeat`` holds its identical blocks."""
    layers: list[dict] = []
    w_in = widths[0]
    for s, (n, w) in enumerate(zip(blocks, widths, strict=True)):
        rest = n
        if s > 0:
            layers.append(_basic_block(w, 2, down(w_in, w)))
            rest -= 1
        if rest > 0:
            layers.append({"type": "repeat", "count": rest, "body": [_basic_block(w, 1, [])]})
        w_in = w
    return layers


def resnet_cifar_a(blocks: int = 3, widths: tuple[int, ...] = (16, 32, 64), classes: int = 10) -> list[dict]:
    """ResNet-(6 blocks + 2) for CIFAR, "option A" shortcuts (He et al. 2016, section 4.2).

    ``blocks`` = n basic blocks per stage (n = 3: ResNet-20). A stride-2 block's shortcut takes
    every second pixel (``x[::2, ::2]``: a 1x1 pooling window with stride 2) and pads the new channels
    with zeros, half before and half after (``F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, w/4, w/4))``).
    Input ``[32, 32, 3]`` (any size the strides divide).
    """
    def down(w_in: int, w: int) -> list[dict]:
        extra = w - w_in
        return [{"type": "avg_pool2d", "pool_size": 1, "strides": 2},
                {"type": "channel_pad", "before": extra // 2, "after": extra - extra // 2}]

    return [_conv(widths[0], 3, 1, _PAD1), _bn(), _relu(), *_stages(widths, (blocks,) * len(widths), down),
            {"type": "global_avg_pool2d"}, {"type": "dense", "units": classes}]


def resnet_cifar_b(blocks: tuple[int, ...] = (2, 2, 2, 2), widths: tuple[int, ...] = (64, 128, 256, 512),
                   classes: int = 10) -> list[dict]:
    """ResNet-18 for CIFAR (3x3 stem, no max pool), projection shortcuts: 1x1 conv stride 2 + BN.

    ``blocks[s]`` basic blocks in stage s; ``(2, 2, 2, 2)`` with ``(64, 128, 256, 512)``: ResNet-18.
    The final 4x4 average pooling of the reference is ``global_avg_pool2d`` (the same on a 4x4 map).
    """
    def down(w_in: int, w: int) -> list[dict]:
        return [_conv(w, 1, 2, "valid"), _bn()]

    layers = [_conv(widths[0], 3, 1, _PAD1), _bn(), _relu(), *_stages(widths, blocks, down)]
    return [*layers, {"type": "global_avg_pool2d"}, {"type": "dense", "units": classes}]


def _mlp(width: int, hidden: int, gelu: str, epsilon: float) -> dict:
    """``x + W2 gelu(W1 LN(x))``: the transformer block's MLP half, pre-LN."""
    return {"type": "residual", "body": [
        {"type": "layer_norm", "epsilon": epsilon},
        {"type": "dense", "units": hidden, "activation": gelu},
        {"type": "dense", "units": width}]}


def vit(image: int = 32, patch: int = 4, width: int = 192, depth: int = 12, heads: int = 3,
        mlp: int = 768, classes: int = 10, channels: int = 3) -> list[dict]:
    """A pre-LN Vision Transformer (Dosovitskiy et al. 2021; ViT-Tiny / DeiT-Ti widths by default).

    Patch embedding = conv ``patch x patch`` stride ``patch``, flattened to ``[(image/patch)^2, width]``;
    class token, learned position embedding, ``depth`` blocks ``x + attn(LN(x))``, ``x + MLP(LN(x))``
    (GELU, erf), a final LN, the class token's features, a dense head. LayerNorm epsilon 1e-6 (timm's).
    """
    tokens = (image // patch) ** 2
    block = [{"type": "residual", "body": [
                 {"type": "layer_norm", "epsilon": 1e-6},
                 {"type": "attention", "num_heads": heads, "key_dim": width // heads}]},
             _mlp(width, mlp, "gelu", 1e-6)]
    return [
        {"type": "conv2d", "filters": width, "kernel_size": patch, "strides": patch, "padding": "valid"},
        {"type": "reshape", "shape": [tokens, width]},
        {"type": "class_token"},
        {"type": "position_embedding", "length": tokens + 1},
        {"type": "repeat", "count": depth, "body": block},
        {"type": "layer_norm", "epsilon": 1e-6},
        {"type": "take_token", "index": 0},
        {"type": "dense", "units": classes},
    ]


def gpt(vocab: int = 8192, context: int = 256, width: int = 512, depth: int = 8, heads: int = 8,
        gelu: str = "gelu") -> list[dict]:
    """A GPT-style decoder: pre-LN blocks, causal self-attention, tied input/output embeddings.

    Token embedding ``[vocab, width]`` + learned positions ``[context, width]``; ``depth`` blocks
    ``x + attn(LN(x))`` (causal, ``heads`` heads of ``width/heads``), ``x + MLP(LN(x))`` (4x width);
    a final LN and logits ``h @ embeddings.T`` (``tied_logits``). LayerNorm epsilon 1e-5 (torch's,
    nanoGPT's and GPT-2's). ``gelu``: ``gelu`` (nanoGPT's ``nn.GELU()``) or ``gelu_tanh`` (GPT-2's).
    """
    block = [{"type": "residual", "body": [
                 {"type": "layer_norm", "epsilon": 1e-5},
                 {"type": "attention", "num_heads": heads, "key_dim": width // heads, "causal": True}]},
             _mlp(width, 4 * width, gelu, 1e-5)]
    return [
        {"type": "embedding", "input_dim": vocab, "output_dim": width},
        {"type": "position_embedding", "length": context},
        {"type": "repeat", "count": depth, "body": block},
        {"type": "layer_norm", "epsilon": 1e-5},
        {"type": "tied_logits", "embedding": "0"},
    ]


def case(name: str, input_shape: list[int], layers: list[dict], data: dict, optimizer: dict, *,
         dtype: str = "float32", devices: int = 2, steps: int = 3, seed: int = 1,
         init: dict | None = None) -> dict[str, Any]:
    """A whole case around ``layers`` (``softmax_ce``, mean reduction, ``grad_mean``, contiguous shards)."""
    return {
        "schema": "parity-case/1", "name": name, "dtype": dtype, "seed": seed,
        "model": {"input_shape": input_shape, "layers": layers, "loss": "softmax_ce", "reduction": "mean"},
        "init": init or {"seed": seed + 1, "kind": "glorot_uniform"},
        "data": data,
        "optimizer": optimizer,
        "parallel": {"devices": devices, "combine": "grad_mean", "shard": "contiguous", "weighting": "equal"},
        "steps": steps,
    }


_IMAGES = {"generator": "images", "seed": 3, "global_batch": 8}
_SGD = {"name": "momentum", "lr": 0.1, "momentum": 0.9, "semantics": "torch"}
_ADAM = {"name": "adam", "lr": 1e-3, "semantics": "native"}


def _tokens(context: int) -> dict:
    return {"generator": "tokens", "seed": 3, "global_batch": 4}


#: the full-size configurations: folder name under examples/architectures -> case dict
FULL_SIZE: dict[str, dict[str, Any]] = {
    "resnet20": case("resnet20", [32, 32, 3], resnet_cifar_a(3), _IMAGES, _SGD),
    "resnet18": case("resnet18", [32, 32, 3], resnet_cifar_b(), _IMAGES, _SGD),
    "vit-tiny": case("vit-tiny", [32, 32, 3], vit(), _IMAGES, _ADAM),
    "gpt-29m": case("gpt-29m", [256], gpt(), _tokens(256), _ADAM),
    "gpt2-small": case("gpt2-small", [1024], gpt(50257, 1024, 768, 12, 12, "gelu_tanh"), _tokens(1024), _ADAM),
}
