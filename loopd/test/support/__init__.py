"""
Test support shared by the unit tests (loopd/test) and the process-level tests (test/).
"""
