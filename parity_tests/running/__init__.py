"""Running implementations: the registry of names, the harness, plugins, recorded runs, manifests.

``registry`` is the only place that knows which implementations exist
(built-ins, users' plugins, entry points, ``recorded:`` runs); ``harness``
runs one by name and returns its trajectory as numpy arrays.
"""
