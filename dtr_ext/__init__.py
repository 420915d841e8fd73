"""Native twins of dtr.planner's DP loops: ``dtr_ext._planner``, built from ``planner.c`` when a C
compiler is available. ``dtr/planner/_native.py`` is its only user."""
