"""The compiled parts: the router's placement core (services/router/_placement.c)
and the edge's byte-level detokenizer (services/edge/_bytetext.c).

Optional: where no C compiler is at hand the build goes on without them, and the
router runs the same code in Python (keystore.py, registry.py, placement.py),
the edge the tokenizer's own DecodeStream (detokenizer.py). pdserve/native.py
chooses (PDSERVE_NATIVE=auto|python|require).
"""
from setuptools import Extension, find_packages, setup

# One import namespace: the tree keeps services/ and transfer/ at the top, installed as
# pdserve.services and pdserve.transfer (nothing else lands at site-packages' top level).
MAPPED = {"pdserve.services": "services", "pdserve.transfer": "transfer"}
packages = find_packages(include=["pdserve", "pdserve.*"])
for name, folder in MAPPED.items():
    packages += [name] + [f"{name}.{p}" for p in find_packages(folder)]

setup(packages=packages, package_dir=MAPPED, ext_modules=[
    Extension("pdserve.services.router._placement", ["services/router/_placement.c"],
              extra_compile_args=["-O2"], optional=True),
    Extension("pdserve.services.edge._bytetext", ["services/edge/_bytetext.c"],
              extra_compile_args=["-O2"], optional=True),
])
