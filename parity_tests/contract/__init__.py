"""The case contract (``parity-case/1``, docs/case-format.md): what a case and a trajectory are.

``case`` loads and validates a case (``model``, ``optimizer``, ``parallel``
sections in their own modules); ``specs`` derives parameter names and shapes
from a layer list; ``generators`` draws data and weights in numpy;
``trajectory`` reads and writes trajectory files. Nothing here imports
TensorFlow or torch.
"""
