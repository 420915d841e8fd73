"""Build hook for the optional native code ``dtr_ext`` (everything else is in pyproject.toml).

``dtr_ext._planner`` speeds up ``dtr.planner``'s DPs; the pure-Python planner gives the same plans.
``dtr_ext._collector`` keeps the engine's records out of Python's cyclic collector; without it the
engine behaves the same, with more collector work per op. ``dtr_ext._hotpath`` runs the eager
driver's per-op path in one native call; without it the Python path makes the same decisions.
If no C compiler is found or a build fails, installation goes on without it and says so here; at run time ``dtr.planner.HAS_NATIVE``
(one warning says why), ``dtr.core.collector.NATIVE`` and ``dtr.eager.native.NATIVE`` tell.
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that turns any failure into a warning: the pure-Python code is the fallback."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler, missing headers: anything the platform throws
            self._fallback(exc)

    def build_extension(self, ext):
        # The native and Python DPs must round alike: no fused multiply-add contraction.
        if self.compiler.compiler_type == "msvc":
            ext.extra_compile_args = ["/O2", "/fp:precise"]
        else:
            ext.extra_compile_args = ["-O2", "-ffp-contract=off"]
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._fallback(exc)

    def _fallback(self, exc):
        self.warn(f"dtr: building the native code dtr_ext failed ({exc}); installing without it. "
                  "dtr uses its pure-Python fallbacks (same results, slower).")


extensions = [] if os.environ.get("DTR_PUREPYTHON") == "1" else [
    Extension("dtr_ext._planner", sources=["dtr_ext/planner.c"]),
    Extension("dtr_ext._collector", sources=["dtr_ext/collector.c"]),
    Extension("dtr_ext._hotpath", sources=["dtr_ext/hotpath.c"]),
]

setup(ext_modules=extensions, cmdclass={"build_ext": OptionalBuildExt})
