"""Shared pytest setup.

The repository root is on ``sys.path`` through ``pythonpath = ["."]`` in pyproject.toml, so
tests can import ``benchmarks`` modules as well as the installed packages.
The default per-test timeout (300 s) is set there too; mark slower tests with
``@pytest.mark.timeout(N)``.
"""
