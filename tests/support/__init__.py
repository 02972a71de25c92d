"""Helpers the tests share: starting services and infrastructure, models, clients, scripts
the tests run as subprocesses. No tests here."""
