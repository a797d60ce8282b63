"""verinfer's version, the one place it is written besides pyproject.toml's static `version`
(tests/test_architecture.py checks they agree). Every module reads it from here, never from the
package root (`verinfer/__init__.py` re-exports it), so no import runs up the layers."""

__version__ = "0.1.0"
