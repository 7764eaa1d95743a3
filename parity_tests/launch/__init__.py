"""Cluster launchers: the command-line entry points that run one case on several machines.

``python -m parity_tests.launch.tf CASE --impl tf.multiworker --out run.npz`` (one
TensorFlow worker per process, ``TF_CONFIG``; ``docs/multiworker.md``) and
``torchrun ... -m parity_tests.launch.torch CASE --impl torch.ddp --out run.npz``
(the torch reference on torchrun's ranks; ``docs/cluster.md``). Like ``cli.py``
they sit at the top of the layers: they load the case (``contract``), run an
engine (``tfpar`` or ``torchref``) and write the trajectory and its manifest
(``running.manifest``). Each imports one framework only.
"""
