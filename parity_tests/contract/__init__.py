"""The case contract (``parity-case/1``, docs/case-format.md): what a case and a trajectory are.

``case`` loads and validates a case (``model``, ``optimizer``, ``parallel``
sections in their own modules); ``generators`` draws data and weights in numpy.
What crosses to the engines (parameter names and shapes, layouts, trajectory
files, rows, errors) is in :mod:`parity_tests.protocol`; ``specs`` and
``layouts`` here re-export its ``specs`` and ``layouts`` for the judge's side.
Nothing here imports TensorFlow or torch.
"""
