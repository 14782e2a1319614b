"""What the tests share and are not tests: builders of small models and
tokenizers, servers and editors to drive, readers of the docs. Importable as
`support` because pyproject's [tool.pytest.ini_options] puts tests/ on
sys.path; no test file imports another."""
