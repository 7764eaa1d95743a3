"""For users' own tests: hypothesis strategies and profiles, replayable failures, ``assert_parity``, the pytest plugin."""
