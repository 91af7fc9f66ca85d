"""Strategies other than the featured cache. Each is a plugin that imports embbench only through
its public interface, :mod:`embbench.plugin`, as a third party's would (tests/test_architecture.py)."""
