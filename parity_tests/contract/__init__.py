"""The case contract (``parity-case/1``, docs/case-format.md): what a case and a trajectory are.

``case`` loads and validates a case (``model``, ``optimizer``, ``parallel``
sections in their own modules); ``specs`` derives parameter names and shapes
from a layer list; ``generators`` draws data and weights in numpy. What
crosses to the engines (trajectory files, rows, errors) is in
:mod:`parity_tests.protocol`. Nothing here imports TensorFlow or torch.
"""
