"""Contract tests shipped with the package: every store and codec must pass them."""
