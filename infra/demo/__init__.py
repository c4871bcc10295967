"""`make demo` (`python -m infra.demo`): the stack on sample data, its results checked against the
plain-Python oracles of datagen.py, which the tests use too."""
