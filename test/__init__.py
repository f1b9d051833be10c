"""
Process-level end-to-end tests: real `twist` subprocesses over real sockets.

Run from the checkout root with `python -m twisted.trial loopd test`, so that this package
(and not the standard library's `test` package) is the one imported.
"""

import loopd.test  # noqa: F401  (loads the deterministic hypothesis profile)
