"""Conformance suites for infer plugins (shipped in the wheel; needs ``infer[testing]``)."""
