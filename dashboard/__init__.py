"""ddtop.dashboard: the terminal dashboard. Never imports torch."""
