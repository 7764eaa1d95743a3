"""A plugin whose decorator names a dtype the tool does not know."""

import tfpar


@tfpar.plugin.tensorflow(dtypes=("float32", "float16"))
def towers(run):
    raise AssertionError("never reached")
