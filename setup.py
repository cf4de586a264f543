"""The one compiled part: the router's prefix index (services/router/_keystore.c).

Optional: where no C compiler is at hand the build goes on without it, and the
router runs the same index in Python (services/router/keystore.py).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("services.router._keystore", ["services/router/_keystore.c"],
                             extra_compile_args=["-O2"], optional=True)])
