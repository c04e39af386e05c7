"""Test helpers: tiny-model builders, shared sweeps and the worker scripts that tests launch in subprocesses.

Imported as `helpers.<module>`: tests/ is on sys.path (pytest puts the rootdir conftest's folder there; launched
workers get it through PYTHONPATH)."""
