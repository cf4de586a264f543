"""The one compiled part: the router's placement core (services/router/_placement.c).

Optional: where no C compiler is at hand the build goes on without it, and the
router runs the same code in Python (keystore.py, registry.py, placement.py).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("services.router._placement", ["services/router/_placement.c"],
                             extra_compile_args=["-O2"], optional=True)])
