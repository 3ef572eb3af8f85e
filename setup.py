"""The one thing pyproject.toml cannot say: the key builder's C module (connector/core/_native.c).

It is optional: where no C compiler is at hand the install goes on without it, and the connector uses
the pure-Python reference it was checked against (connector/core/native.py says which is loaded).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("connector.core._native", ["connector/core/_native.c"], optional=True, extra_compile_args=["-O2"])
    ]
)
