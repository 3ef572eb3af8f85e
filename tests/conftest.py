"""Test-wide settings."""

from hypothesis import settings

# Tests never assert on wall-clock time: no per-example deadline (CI machines are small and shared).
settings.register_profile("kvtool", deadline=None)
settings.load_profile("kvtool")
