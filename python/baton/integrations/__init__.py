"""Integrations of Baton with model libraries. Each submodule imports its library lazily, so
importing ``baton.integrations.<name>`` works without the library installed."""
