"""The compiled parts: the router's placement core (services/router/_placement.c)
and the edge's byte-level detokenizer (services/edge/_bytetext.c).

Optional: where no C compiler is at hand the build goes on without them, and the
router runs the same code in Python (keystore.py, registry.py, placement.py),
the edge the tokenizer's own DecodeStream (detokenizer.py). pdserve/native.py
chooses (PDSERVE_NATIVE=auto|python|require).
"""
from setuptools import Extension, setup

setup(ext_modules=[
    Extension("services.router._placement", ["services/router/_placement.c"],
              extra_compile_args=["-O2"], optional=True),
    Extension("services.edge._bytetext", ["services/edge/_bytetext.c"],
              extra_compile_args=["-O2"], optional=True),
])
