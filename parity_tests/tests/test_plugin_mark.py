"""``parity_tests.protocol.plugin_mark``: the plugin base both sides' decorators extend, read back one way."""

from __future__ import annotations

import pytest

from parity_tests.protocol.plugin_mark import (
    PluginDeclarationError,
    PluginMark,
    PluginRaised,
    describe,
    when_raised,
)


def test_both_sides_mark_with_the_one_base_and_the_tool_reads_it_back():
    import tfpar.plugin
    import torchref.plugin

    @tfpar.plugin.tensorflow(dtypes=("float32", "float64"), keras=True)
    def tf_side(run):
        pass

    @torchref.plugin.single(deterministic=False)
    def torch_side(run):
        pass

    assert type(tf_side.__tfpar_plugin__) is type(torch_side.__tfpar_plugin__) is PluginMark
    assert describe(tf_side)["mark"] == {"kind": "tensorflow", "dtypes": ("float32", "float64"), "keras": True,
                                         "deterministic": True}
    assert describe(torch_side)["mark"] == {"kind": "single", "dtypes": ("float32",), "keras": False,
                                            "deterministic": False}
    assert describe(lambda run: None)["mark"] is None and describe(None)["found"] is False
    assert issubclass(tfpar.plugin.PluginRaised, PluginRaised) and issubclass(torchref.plugin.PluginRaised, PluginRaised)
    with pytest.raises(PluginDeclarationError, match=r"^torchref.plugin.distributed\(deterministic=...\) takes True or"
                                                     r" False, got 'no'$"):
        torchref.plugin.distributed(deterministic="no")
    with pytest.raises(PluginDeclarationError, match=r"^tfpar.plugin.tensorflow\(keras=...\) takes True or False"):
        tfpar.plugin.tensorflow(keras=1)


def test_when_a_plugin_raised_is_worded_from_what_it_recorded():
    assert when_raised(False, 0, 5) == (0, "before step 1")
    assert when_raised(True, 0, 5) == (1, "at step 1")
    assert when_raised(True, 2, 5) == (3, "at step 3")
    assert when_raised(True, 5, 5) == (6, "after step 5")
