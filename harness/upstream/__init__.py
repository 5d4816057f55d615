"""Adapters that run installed upstream implementations behind ``harness.plan``'s interfaces."""
