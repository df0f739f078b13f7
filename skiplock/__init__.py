"""skiplock: load-testing and correctness verification for PostgreSQL SKIP LOCKED job queues.

The package's parts live in the repository's top-level folders (`queue_impl`, `scenarios`,
`chaos`, `reports`, `plumbing`); this folder links each of them in, so they import, install
and type-check as `skiplock.<part>`.
"""

# The one place the version is declared: pyproject reads it for the build, `skiplock
# --version` prints it, and every spec.json and summary.json records it.
__version__ = "0.2.0"
