"""A plugin module that cannot be imported (a dependency the user forgot to install)."""

import my_missing_dependency  # noqa: F401

import tfpar


@tfpar.plugin.tensorflow
def towers(run):
    raise AssertionError("never reached")
