"""Fixture for the loopback S3-compatible server."""
