"""Strategies other than the featured cache. Each is a plugin that uses only embbench's
public interface (embbench.strategy, embbench.embedding), as a third party's would."""
