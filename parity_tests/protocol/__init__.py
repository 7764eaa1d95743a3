"""The boundary between the judge and the engines: the one part of ``parity_tests`` that
``tfpar`` and ``torchref`` import.

numpy and the standard library only, no import-time effects, nothing above it imported:

* ``errors``: :class:`TfparError`, the root of every exception class of the three packages, and
  :class:`CaseError`, the one error bad input is answered with;
* ``settings``: every ``TFPAR_*`` environment variable (``docs/settings.md``);
* ``rows``: trajectory arrays recorded row by row, spilled to files past a threshold;
* ``trajectory``: the trajectory's keys, files and :class:`Trajectory` (arrays + findings);
* ``payload``: what an engine is handed (the case as plain data, the run options);
* ``engine``: :class:`EngineSpec`, what each engine declares it runs;
* ``specs``: parameter names and shapes of a layer list, the walks over nested layers
  (``param_specs``, ``nested_inputs``, ``nested_layers``);
* ``layouts``: canonical parameters in torch's layouts, by name (``NamedLayouts``, ``LayoutError``);
* ``shards``: shard sizes and rows, weights (numpy);
* ``optimizer_state``: the optimizers the built-ins know and the ``opt/<slot>/<name>`` layout;
* ``hyper``: hyperparameters as Keras holds them, the learning rate of a step;
* ``frames``, ``relay``: a plugin's own traceback and output passed on;
* ``plugin_mark``: the plugin base both sides' decorators extend: what a decorator declares
  (``MARK``, ``PluginMark``, ``check_dtypes``), reading it back (``describe``), ``PluginRaised``;
* ``user_code``: the one importer of users' code (``FILE.py:FUNCTION``, ``module:FUNCTION``), in any process;
* ``atomic``: files written whole or not at all.
"""

from parity_tests.protocol.errors import CaseError, TfparError

__all__ = ["TfparError", "CaseError"]
