"""The mutation corpus of the judge on user code (issue 9, point 6).

``tf_towers.py`` and ``torch_ddp.py`` hold plugins: a correct TensorFlow tower
loop and a correct DDP loop, each with classic bugs (mutants) and equivalent
rewrites (controls). :mod:`.table` says which case each one runs on, against
which reference, and what the judge must report; ``test_mutants.py`` asserts
it and ``benchmarks/bench_mutants.py`` prints it (``docs/mutants.md``).
"""
