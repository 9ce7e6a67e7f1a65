"""Tests of the master's pure core and its server."""
