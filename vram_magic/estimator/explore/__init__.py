"""explore."""
