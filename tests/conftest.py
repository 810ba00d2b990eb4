"""Shared fixtures for the kvbank test suite."""
