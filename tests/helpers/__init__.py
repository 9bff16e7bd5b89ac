"""Helpers the tests import as ``from tests.helpers.<module> import ...``; some also run as scripts."""
